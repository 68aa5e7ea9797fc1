"""Calibration text: reading a user's file or building the default corpus, and turning it into token chunks.

Contract:
- `read_documents(path)` reads a JSONL file of chats (one JSON object per line with a `messages` list,
  or a bare list of messages) or a plain-text file (documents separated by blank lines), with a size
  bound. A missing, empty, non-UTF-8 file or a `.jsonl` file with a line that is not a chat (or a message
  of a role the chat template does not render) is refused with one line naming the file (and the line).
- `default_documents()` is the corpus that ships with quantkit: deterministic chats in AgentWorld's
  domains (tool calls in Qwen's XML form, terminal and file-system sessions, search results, web/OS
  observations) generated from text every Python installation carries (the standard library's module
  names, docstrings and source lines), so nothing is downloaded. Rendered through the real Qwen3.5
  tokenizer it holds on the order of 10^5 tokens (the tiny test tokenizer, 768 BPE tokens, counts 265k
  on Python 3.11); `quantkit stats` prints the exact count for the model at hand and uses the first
  `max_tokens` (16384 by default).
- `tokenize_documents(docs, tokenizer, ...)` renders chats through the model's own chat template,
  concatenates documents separated by the end-of-text token and cuts the stream into `chunk_size`
  token chunks (llama.cpp's imatrix convention), at most `max_tokens` in all; fewer than
  `MIN_TOKENS` tokens is refused with the count.
"""

from __future__ import annotations

import hashlib
import json
import pkgutil
import random
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch

from quantkit.errors import QuantkitError

MAX_FILE_BYTES = 512 << 20
MIN_TOKENS = 1024
DEFAULT_CHUNK = 512
DEFAULT_MAX_TOKENS = 16384

# A chat document is a list of {"role", "content"} messages; a text document is a str.
Document = str | list[dict[str, Any]]

DOMAINS = {
    "terminal": "You simulate a Linux terminal. The user sends shell commands; answer with the exact output "
                "inside <predicted_observation></predicted_observation>.",
    "mcp": "You simulate MCP tool servers. The user sends tool calls; answer with the tool's JSON result "
           "inside <predicted_observation></predicted_observation>.",
    "search": "You simulate a web search engine. The user sends queries; answer with a ranked result page "
              "inside <predicted_observation></predicted_observation>.",
    "os": "You simulate a desktop operating system. The user sends UI actions; answer with the accessibility "
          "tree after the action inside <predicted_observation></predicted_observation>.",
    "web": "You simulate a web browser. The user sends browser actions; answer with the page text after the "
           "action inside <predicted_observation></predicted_observation>.",
}


@dataclass(frozen=True)
class TokenData:
    """Calibration tokens cut into chunks, and where they came from."""

    chunks: torch.Tensor  # int64 [n_chunks, chunk_size]
    source: str  # the file name, or "quantkit-default"
    total_tokens: int  # tokens the source gave before the cut to max_tokens

    @property
    def n_tokens(self) -> int:
        return self.chunks.numel()

    def fingerprint(self) -> str:
        return hashlib.sha256(self.chunks.numpy().tobytes()).hexdigest()


# --- reading a user's file -------------------------------------------------------------------------------

def _read_text(path: Path) -> str:
    if not path.is_file():
        raise QuantkitError(f"calibration file {path} does not exist (or is not a file); pass a JSONL or text file")
    size = path.stat().st_size
    if size == 0:
        raise QuantkitError(f"calibration file {path} is empty; pass a file with text or JSONL chats")
    if size > MAX_FILE_BYTES:
        raise QuantkitError(f"calibration file {path} is {size / 1e6:.0f} MB, over the {MAX_FILE_BYTES >> 20} MiB "
                            "bound; cut it down (a few MB of text is plenty)")
    with open(path, "rb") as fh:
        raw = fh.read(MAX_FILE_BYTES)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise QuantkitError(f"calibration file {path} is not UTF-8 text (byte {e.start}); convert it to UTF-8") from None


# the roles Qwen's chat template renders; it drops any other message without a word, so a chat of only such
# messages would give no tokens
ROLES = ("system", "user", "assistant", "tool")


def _chat_of(obj: Any) -> list[dict[str, Any]] | None:
    msgs = obj.get("messages") if isinstance(obj, dict) else obj
    if isinstance(msgs, list) and msgs and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs
    ):
        return msgs
    if isinstance(obj, dict) and isinstance(obj.get("text"), str):
        return None  # a text record, handled by the caller
    raise ValueError


def read_documents(path: str | Path) -> list[Document]:
    """The documents of a JSONL (chats, or {"text": ...} records) or plain-text calibration file."""
    p = Path(path)
    text = _read_text(p)
    if not text.strip():
        raise QuantkitError(f"calibration file {p} holds only white space; pass a file with text or JSONL chats")
    looks_jsonl = p.suffix.lower() in (".jsonl", ".json") or text.lstrip().startswith(("{", "["))
    if not looks_jsonl:
        return [d.strip() for d in text.split("\n\n") if d.strip()]
    docs: list[Document] = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            chat = _chat_of(obj)
        except (json.JSONDecodeError, ValueError, RecursionError):  # RecursionError: nested thousands deep
            raise QuantkitError(
                f"calibration file {p} line {i} is not a JSONL chat (want {{\"messages\": [{{\"role\": ..., "
                "\"content\": ...}]}} or {\"text\": ...} per line); fix the line or pass plain text"
            ) from None
        unknown = [m["role"] for m in chat or () if m["role"] not in ROLES]
        if unknown:
            raise QuantkitError(f"calibration file {p} line {i}: role {unknown[0][:40]!r} is not one the chat "
                                f"template renders ({', '.join(ROLES)}); fix the role or drop the message")
        docs.append(chat if chat is not None else obj["text"])
    return docs


# --- the default corpus ----------------------------------------------------------------------------------

def _stdlib_modules() -> list[str]:
    names = sorted(getattr(sys, "stdlib_module_names", ()) or {m.name for m in pkgutil.iter_modules()})
    return [n for n in names if not n.startswith("_") and n not in ("antigravity", "this")]


@cache
def _doc_of(name: str) -> str:
    """A module's docstring, read from its source without importing it (no side effects)."""
    try:
        import importlib.util

        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return ""
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return ""
    try:
        import ast

        src = Path(spec.origin).read_text(encoding="utf-8", errors="replace")
        return ast.get_docstring(ast.parse(src)) or ""
    except (OSError, SyntaxError, ValueError):
        return ""


@cache
def _source_lines(name: str, n: int) -> tuple[str, ...]:
    import importlib.util

    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return ()
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return ()
    try:
        return tuple(Path(spec.origin).read_text(encoding="utf-8", errors="replace").splitlines()[:n])
    except OSError:
        return ()


def _obs(text: str) -> str:
    return f"<think>\n\n</think>\n\n<predicted_observation>\n{text}\n</predicted_observation>"


def _terminal(rng: random.Random, mods: list[str]) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": DOMAINS["terminal"]}]
    pkg = rng.choice(mods)
    files = rng.sample(mods, min(8, len(mods)))
    listing = "\n".join(
        f"-rw-r--r-- 1 agent agent {rng.randint(200, 90000):>6} Mar {rng.randint(1, 28):>2} "
        f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d} {f}.py" for f in files)
    msgs += [{"role": "user", "content": f"cd ~/src/{pkg} && ls -la"},
             {"role": "assistant", "content": _obs(f"total {len(files) * 4}\n{listing}")}]
    target = rng.choice(files)
    lines = _source_lines(target, 24)
    msgs += [{"role": "user", "content": f"head -n 24 {target}.py"},
             {"role": "assistant", "content": _obs("\n".join(lines) or f"head: cannot open '{target}.py'")}]
    word = rng.choice(["import", "def", "class", "return", "raise"])
    hits = [f"{target}.py:{i + 1}:{line}" for i, line in enumerate(lines) if word in line][:6]
    msgs += [{"role": "user", "content": f"grep -n '{word}' {target}.py | head"},
             {"role": "assistant", "content": _obs("\n".join(hits))}]
    msgs += [{"role": "user", "content": f"python3 -c 'import {target}; print({target}.__name__)'"},
             {"role": "assistant", "content": _obs(target)}]
    return msgs


def _mcp(rng: random.Random, mods: list[str]) -> list[dict[str, Any]]:
    tools = [{"type": "function", "function": {"name": "read_file", "description": "Read a text file",
                                               "parameters": {"type": "object", "properties": {
                                                   "path": {"type": "string"}}, "required": ["path"]}}},
             {"type": "function", "function": {"name": "list_directory", "description": "List a folder",
                                               "parameters": {"type": "object", "properties": {
                                                   "path": {"type": "string"}}, "required": ["path"]}}}]
    sysmsg = DOMAINS["mcp"] + "\n\n<tools>\n" + "\n".join(json.dumps(t) for t in tools) + "\n</tools>"
    msgs: list[dict[str, Any]] = [{"role": "system", "content": sysmsg}]
    folder = rng.choice(mods)
    entries = [{"name": f"{m}.py", "type": "file", "size": rng.randint(100, 50000)} for m in rng.sample(mods, 6)]
    call = (f"<tool_call>\n<function=list_directory>\n<parameter=path>\n/workspace/{folder}\n</parameter>\n"
            "</function>\n</tool_call>")
    msgs += [{"role": "user", "content": call},
             {"role": "assistant", "content": _obs(json.dumps({"entries": entries}, indent=1))}]
    f = rng.choice(entries)["name"]
    doc = _doc_of(f[:-3]) or "(no description)"
    call = (f"<tool_call>\n<function=read_file>\n<parameter=path>\n/workspace/{folder}/{f}\n</parameter>\n"
            "</function>\n</tool_call>")
    msgs += [{"role": "user", "content": call},
             {"role": "assistant", "content": _obs(json.dumps({"content": doc[:1500], "truncated": len(doc) > 1500}))}]
    return msgs


def _search(rng: random.Random, mods: list[str]) -> list[dict[str, Any]]:
    picks = rng.sample(mods, 5)
    query = f"python {picks[0]} module how to use"
    results = []
    for rank, m in enumerate(picks, 1):
        doc = " ".join(_doc_of(m).split())[:280] or f"Reference for the {m} module."
        results.append(f"{rank}. {m} - Python documentation\n   https://docs.python.org/3/library/{m}.html\n   {doc}")
    return [{"role": "system", "content": DOMAINS["search"]},
            {"role": "user", "content": f"search(\"{query}\")"},
            {"role": "assistant", "content": _obs("\n".join(results))}]


def _os_web(rng: random.Random, mods: list[str], domain: str) -> list[dict[str, Any]]:
    items = rng.sample(mods, 7)
    if domain == "os":
        rows = [f"  [{10 + k}] list-item '{m}.py' selectable" for k, m in enumerate(items[1:])]
        tree = "\n".join([f"[1] window 'Files - /home/agent/{items[0]}'", *rows])
        action = f"double_click(element_id={rng.randint(10, 16)})"
    else:
        doc = " ".join(_doc_of(items[0]).split())[:600] or items[0]
        tree = f"Title: {items[0]} - Python docs\nURL: https://docs.python.org/3/library/{items[0]}.html\n\n{doc}\n\n" + \
               "Links: " + " | ".join(items[1:])
        action = f"click(link_text=\"{items[0]}\")"
    return [{"role": "system", "content": DOMAINS[domain]},
            {"role": "user", "content": action},
            {"role": "assistant", "content": _obs(tree)}]


def default_documents(n_docs: int = 400, seed: int = 0) -> Iterator[Document]:
    """The shipped calibration corpus, lazily (deterministic for a given Python version; see the module
    docstring)."""
    rng = random.Random(seed)
    mods = _stdlib_modules()
    if len(mods) < 16:
        raise QuantkitError("this Python's standard library lists too few modules to build the default "
                            "calibration corpus; pass --data FILE")
    makers = [_terminal, _mcp, _search, lambda r, m: _os_web(r, m, "os"), lambda r, m: _os_web(r, m, "web")]
    for i in range(n_docs):
        yield makers[i % len(makers)](rng, mods)


# --- tokens ----------------------------------------------------------------------------------------------

def _encode(doc: Document, tok: Any) -> list[int]:
    if isinstance(doc, str):
        return list(tok.encode(doc, add_special_tokens=False))
    ids = tok.apply_chat_template(doc, tokenize=True, add_generation_prompt=False)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def tokenize_documents(docs: Iterable[Document], tok: Any, source: str, chunk_size: int = DEFAULT_CHUNK,
                       max_tokens: int = DEFAULT_MAX_TOKENS, min_tokens: int = MIN_TOKENS) -> TokenData:
    """Chunks of `chunk_size` tokens from `docs` (see the module docstring)."""
    if chunk_size < 16:
        raise QuantkitError(f"--chunk-size {chunk_size} is too small; use 16 or more (512 is llama.cpp's default)")
    sep = tok.convert_tokens_to_ids("<|endoftext|>")
    sep = sep if isinstance(sep, int) and sep != tok.unk_token_id else tok.eos_token_id
    stream: list[int] = []
    cap = max(max_tokens, min_tokens)
    for d in docs:
        stream.extend(_encode(d, tok))
        if sep is not None:
            stream.append(int(sep))
        if len(stream) >= cap + chunk_size:
            break
    total = len(stream)
    usable = min(total, max_tokens) // chunk_size * chunk_size
    if usable < min_tokens:
        raise QuantkitError(
            f"{source}: {total} calibration tokens make {usable} in whole chunks of {chunk_size}; "
            f"at least {min_tokens} are needed: pass more text (or a smaller --chunk-size)")
    chunks = torch.tensor(stream[:usable], dtype=torch.int64).view(-1, chunk_size)
    return TokenData(chunks, source, total)


def load_tokens(data: str | Path | None, tok: Any, chunk_size: int = DEFAULT_CHUNK,
                max_tokens: int = DEFAULT_MAX_TOKENS, min_tokens: int = MIN_TOKENS) -> TokenData:
    """Tokens of `data` (a file) or of the default corpus when `data` is None."""
    if data is None:
        return tokenize_documents(default_documents(), tok, "quantkit-default", chunk_size, max_tokens, min_tokens)
    return tokenize_documents(read_documents(data), tok, Path(data).name, chunk_size, max_tokens, min_tokens)
