"""A small byte-level BPE tokenizer with Qwen3.5's special tokens and chat template, for tiny test models.

Trained with the `tokenizers` library on a corpus generated here deterministically (so every machine
gets the same vocabulary), pre-tokenized with the same split regex as Qwen's tokenizer. The special
tokens follow Qwen's order (`<|endoftext|>`, `<|im_start|>`, `<|im_end|>`, ... `<think>`, `</think>`)
right after the BPE vocabulary. The chat template renders what Qwen3.5's does: ChatML, thinking on by
default, tools in the system message inside `<tools></tools>`, XML tool calls, tool results as a user
turn inside `<tool_response>`.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

# Qwen's special tokens in vocabulary order (in Qwen3.5, <|endoftext|> is 248044 ... </think> 248069).
# special=True tokens are dropped by decode(skip_special_tokens=True); the tags stay as text.
QWEN_SPECIAL_TOKENS: list[tuple[str, bool]] = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True),
    ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False),
    ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
]

# Qwen2/3's pre-tokenizer split (digits one by one, letters runs, punctuation runs, newlines).
SPLIT_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")

BPE_VOCAB = 768
N_TOKENS = BPE_VOCAB + len(QWEN_SPECIAL_TOKENS)

CHAT_TEMPLATE = r"""{%- set enable_thinking = enable_thinking if enable_thinking is defined else true -%}
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages and messages[0].role == 'system' and messages[0].content %}
{{- messages[0].content + '\n\n' }}
{%- endif %}
{{- '# Tools\n\nYou have access to the following functions:\n\n<tools>' }}
{%- for tool in tools %}
{{- '\n' + (tool | tojson) }}
{%- endfor %}
{{- '\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n</function>\n</tool_call><|im_end|>\n' }}
{%- elif messages and messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(last_query=-1) %}
{%- for m in messages %}
{%- if m.role == 'user' and not (m.content is string and m.content.startswith('<tool_response>')) %}
{%- set ns.last_query = loop.index0 %}
{%- endif %}
{%- endfor %}
{%- for m in messages %}
{%- set content = m.content if m.content is string else '' %}
{%- if m.role == 'system' %}
{%- if not loop.first %}
{{- '<|im_start|>system\n' + content + '<|im_end|>\n' }}
{%- endif %}
{%- elif m.role == 'user' %}
{{- '<|im_start|>user\n' + content + '<|im_end|>\n' }}
{%- elif m.role == 'assistant' %}
{%- set reasoning = m.reasoning_content if m.reasoning_content is string else '' %}
{%- if not reasoning and '</think>' in content %}
{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\n') %}
{%- set content = content.split('</think>')[-1].lstrip('\n') %}
{%- endif %}
{{- '<|im_start|>assistant\n' }}
{%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}
{{- '<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' }}
{%- endif %}
{{- content }}
{%- if m.tool_calls %}
{%- for tc in m.tool_calls %}
{%- set call = tc.function if tc.function is defined else tc %}
{%- if loop.first and content %}
{{- '\n\n' }}
{%- elif not loop.first %}
{{- '\n' }}
{%- endif %}
{{- '<tool_call>\n<function=' + call.name + '>\n' }}
{%- set args = call.arguments if call.arguments is mapping else {} %}
{%- for k, v in args.items() %}
{{- '<parameter=' + k + '>\n' + (v if v is string else (v | tojson)) + '\n</parameter>\n' }}
{%- endfor %}
{{- '</function>\n</tool_call>' }}
{%- endfor %}
{%- endif %}
{{- '<|im_end|>\n' }}
{%- elif m.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
{{- '<|im_start|>user' }}
{%- endif %}
{{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
{{- '<|im_end|>\n' }}
{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking %}
{{- '<think>\n' }}
{%- else %}
{{- '<think>\n\n</think>\n\n' }}
{%- endif %}
{%- endif %}"""

_WORDS = (
    "the agent world model predicts next observation for each action user types environment state file "
    "directory terminal command output search result page web browser click scroll button form android app "
    "screen tap swipe text field operating system process memory disk network request response server client "
    "tool call function parameter value name description type string integer boolean list object error "
    "success failure retry timeout permission denied not found created updated deleted returned running "
    "stopped started finished quantized weights experts router layer attention linear hidden size tokens "
    "model checkpoint shard index config tensor shape dtype bfloat float int eight four bits group scale zero "
    "think answer question because therefore however then first second finally hello world thanks please"
).split()
_SNIPPETS = [
    "$ ls -la /home/user/project\ntotal 24\ndrwxr-xr-x 4 user user 4096 Jan 1 12:00 .\n",
    "$ git status\nOn branch main\nnothing to commit, working tree clean\n",
    "$ python -c 'print(2 + 3)'\n5\n",
    '{"name": "search", "arguments": {"query": "weather in Paris", "top_k": 3}}\n',
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i, add(i, 1))\n",
    "<predicted_observation>\nThe command finished with exit code 0.\n</predicted_observation>\n",
    "Error: file not found: config.json\nTraceback (most recent call last):\n",
    "HTTP/1.1 200 OK\nContent-Type: application/json\n\n{\"status\": \"ok\", \"items\": []}\n",
    "<tool_call>\n<function=read_file>\n<parameter=path>\n/tmp/notes.txt\n</parameter>\n</function>\n</tool_call>",
    "1234567890 3.14159 2.71828 0.5 100 256 2048 4096 65536 262144\n",
]


def tiny_corpus(n_lines: int = 3000, seed: int = 0) -> list[str]:
    """Deterministic text: word salad sentences, shell/JSON/code snippets and chat markup."""
    rng = random.Random(seed)
    lines: list[str] = []
    for i in range(n_lines):
        r = i % 5
        if r == 4:
            lines.append(_SNIPPETS[rng.randrange(len(_SNIPPETS))])
            continue
        words = [rng.choice(_WORDS) for _ in range(rng.randrange(4, 16))]
        s = " ".join(words)
        s = s[0].upper() + s[1:] + rng.choice([".", "?", "!", ":", ","]) + " " + str(rng.randrange(1000))
        lines.append(s + "\n")
    return lines


def build_tokenizer(bpe_vocab: int = BPE_VOCAB):
    """Train the tokenizer (a `tokenizers.Tokenizer`); special tokens get ids bpe_vocab.. in Qwen order."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=bpe_vocab, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(tiny_corpus(), trainer=trainer)
    if tok.get_vocab_size() != bpe_vocab:  # the corpus is built to allow this many merges
        raise RuntimeError(f"tokenizer trained to {tok.get_vocab_size()} tokens, wanted {bpe_vocab}")
    tok.add_tokens([AddedToken(t, special=s, normalized=False) for t, s in QWEN_SPECIAL_TOKENS])
    return tok


def special_ids(bpe_vocab: int) -> dict[str, int]:
    return {t: bpe_vocab + i for i, (t, _) in enumerate(QWEN_SPECIAL_TOKENS)}


def write_tokenizer(out: Path, bpe_vocab: int = BPE_VOCAB, max_length: int = 262144) -> dict[str, int]:
    """Write tokenizer.json and tokenizer_config.json into `out`; returns the special-token ids."""
    tok = build_tokenizer(bpe_vocab)
    tok.save(str(out / "tokenizer.json"))
    ids = special_ids(bpe_vocab)
    added = {
        str(ids[t]): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": s}
        for t, s in QWEN_SPECIAL_TOKENS
    }
    cfg = {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": max_length,
        "split_special_tokens": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    return ids
