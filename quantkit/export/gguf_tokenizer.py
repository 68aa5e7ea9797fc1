"""The tokenizer and chat template in GGUF metadata, from a checkpoint's tokenizer.json.

llama.cpp re-implements the tokenizer from metadata: model "gpt2" (byte-level BPE), the token strings
as tokenizer.json stores them (byte-level alphabet), one type per token, the merges, the special ids
and a pre-tokenizer NAME that selects its split regex. Qwen3.5's split regex is llama.cpp's "qwen35"
(Qwen2/3's is "qwen2"); a tokenizer with another split is refused rather than tokenized differently.
Merges, special ids and the chat template come from the `gguf` package's `SpecialVocab`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from quantkit.errors import QuantkitError
from quantkit.fileio import read_json_bounded

# tokenizer.json pre-tokenizer Split regexes -> llama.cpp pre-tokenizer names (llama-vocab.cpp)
PRE_TOKENIZERS = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+": "qwen35",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+": "qwen2",
}

# gguf.TokenType values
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5


def _split_regex(pre: Any) -> str | None:
    if not isinstance(pre, dict):
        return None
    if pre.get("type") == "Split":
        pat = pre.get("pattern") or {}
        return pat.get("Regex") if isinstance(pat, dict) else None
    for sub in pre.get("pretokenizers") or []:
        r = _split_regex(sub)
        if r:
            return r
    return None


def read_vocab(folder: Path, vocab_size: int) -> tuple[list[str], list[int], str]:
    """(tokens, token types, llama.cpp pre-tokenizer name) for an embedding of `vocab_size` rows."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise QuantkitError(f"{folder}: no tokenizer.json; llama.cpp needs the tokenizer inside the GGUF "
                            "(copy the model's tokenizer files into the folder)")
    try:
        tj = read_json_bounded(path, "tokenizer")
        model = tj["model"]
    except (QuantkitError, KeyError, TypeError):
        raise QuantkitError(f"{path}: not a readable tokenizers JSON file") from None
    if model.get("type") != "BPE":
        raise QuantkitError(f"{path}: a {model.get('type')} tokenizer; the qwen35moe export takes byte-level BPE")
    regex = _split_regex(tj.get("pre_tokenizer"))
    pre = PRE_TOKENIZERS.get(regex or "")
    if pre is None:
        raise QuantkitError(f"{path}: its pre-tokenizer split is not Qwen's, so llama.cpp would split text "
                            "differently; export with the model's own tokenizer")
    tokens: list[str | None] = [None] * vocab_size
    types = [UNUSED] * vocab_size
    for tok, i in model.get("vocab", {}).items():
        if not 0 <= i < vocab_size:
            raise QuantkitError(f"{path}: token id {i} does not fit the embedding ({vocab_size} rows)")
        tokens[i], types[i] = tok, NORMAL
    for a in tj.get("added_tokens") or []:
        i, text = a["id"], a["content"]
        if not 0 <= i < vocab_size:
            raise QuantkitError(f"{path}: token id {i} does not fit the embedding ({vocab_size} rows)")
        tokens[i] = text
        looks_special = text.startswith("<|") and text.endswith("|>")
        types[i] = CONTROL if (a.get("special") or looks_special) else USER_DEFINED
    out = [t if t is not None else f"[PAD{i}]" for i, t in enumerate(tokens)]
    return out, types, pre


def add_tokenizer(writer: Any, folder: Path, vocab_size: int) -> dict[str, Any]:
    """Write the tokenizer metadata; returns what was written (for the export report)."""
    import gguf

    tokens, types, pre = read_vocab(folder, vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    sv = gguf.SpecialVocab(folder, load_merges=True, n_vocab=vocab_size)
    if not sv.merges:
        raise QuantkitError(f"{folder / 'tokenizer.json'}: no BPE merges; llama.cpp cannot tokenize without them")
    sv.add_to_gguf(writer, quiet=True)
    tc = folder / "tokenizer_config.json"
    cfg = read_json_bounded(tc, "tokenizer config") if tc.is_file() else {}
    if "bos" not in sv.special_token_ids and not cfg.get("add_bos_token"):
        writer.add_add_bos_token(False)  # Qwen has no BOS; llama.cpp would otherwise assume one
    return {"pre": pre, "tokens": len(tokens), "merges": len(sv.merges),
            "special": dict(sv.special_token_ids), "chat_template": sv.chat_template is not None}
