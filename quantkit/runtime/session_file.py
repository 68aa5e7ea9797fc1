"""`quantkit chat --session FILE`: the conversation and its cached state in one file, so a chat resumes after a
restart without prefilling the history again (llama.cpp's --prompt-cache plays this role).

Format: safetensors (never a pickle). The tensors are one prompt-cache snapshot (quantkit.runtime.state_cache:
`L.conv`, `L.recurrent` for each Gated DeltaNet layer, `L.keys`, `L.values` for each attention layer); the
string metadata holds `quantkit_session` (format version), `identity` (JSON: hashes of the model's config,
its weights (`weights_fingerprint`), the recipe and the placement), `conversation` (the /save JSON), `ids` and `kinds` (the snapshot's tokens and
layer kinds) and `sha256` (of every tensor's bytes, in name order). The snapshot saved is the longest cached
prefix of the conversation as the next turn will render it (up to the start of the last answer).

Reading, in order: a file larger than the model's largest possible snapshot is refused (a size bound); a file
that is not a safetensors header with `quantkit_session` is refused, one line (never "ignored and
overwritten": it may be the user's); an identity that differs (another model, weights, recipe or placement:
the state would be meaningless there) is refused, one line naming the field; a conversation whose state is
damaged (truncated, checksum mismatch) or forged under a matching checksum (`check_state`: tokens that are
not the conversation's, shapes not the model's, NaN) is kept and its state ignored with a notice, so the next
turn prefills normally. A state is never loaded half-way: it reaches the prompt cache only after every check
passed. The path goes through the output guard (quantkit/outputs.py); writes are atomic (quantkit.fileio).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from quantkit.checkpoint.contract import MANIFEST_NAME
from quantkit.checkpoint.reader import find_shards
from quantkit.checkpoint.spec import parse_text_config
from quantkit.errors import QuantkitError
from quantkit.fileio import atomic_write_bytes, clean_leftovers, read_json_bounded
from quantkit.planner.budget import snapshot_bytes
from quantkit.runtime.chat import ChatSession
from quantkit.runtime.state_cache import Snapshot

SESSION_VERSION = "1"
HEADER_SLACK = 64 << 20  # metadata (the conversation's JSON) and safetensors' header on top of the tensors


SAMPLES, SAMPLE_BYTES = 16, 1 << 16  # slices of a source shard hashed into its fingerprint
_FINGERPRINTS: dict[tuple[Any, ...], str] = {}


def _shard_digest(path: Path, size: int) -> str:
    """sha256 of a shard's safetensors header and SAMPLES slices spread over its data: two checkpoints of the
    same shapes (same headers) but other weights differ here, without reading gigabytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else 0
        h.update(head + f.read(min(n, 100 << 20)))
        for i in range(SAMPLES):
            f.seek(size * i // SAMPLES)
            h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def weights_fingerprint(folder: Path) -> str:
    """What identifies the weights: a quantized folder's manifest entries (size and sha256 of every shard), or
    for a source checkpoint its shards' names, sizes, and header-and-sample digests. Memoized per file state."""
    man = folder / MANIFEST_NAME
    files = [man] if man.is_file() else find_shards(folder)
    key = tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    if key not in _FINGERPRINTS:
        if man.is_file():
            d = read_json_bounded(man, "manifest")
            obj: Any = d.get("shards") if isinstance(d, dict) else None
        else:
            obj = [[p.name, p.stat().st_size, _shard_digest(p, p.stat().st_size)] for p in files]
        _FINGERPRINTS[key] = hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]
    return _FINGERPRINTS[key]


def identity(rt: Any) -> dict[str, str]:
    """What a state is valid for: the model (config.json's text part), its weights, the recipe, the placement."""
    def h(obj: Any) -> str:
        return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]

    p = rt.placement
    recipe = rt.recipe.to_dict() if hasattr(rt.recipe, "to_dict") else str(rt.recipe)
    return {"model": h(rt.config.get("text_config", rt.config)), "weights": weights_fingerprint(rt.folder),
            "recipe": h(recipe), "placement": h([p.layer_device, p.experts, p.embedding, p.lm_head])}


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    d = hashlib.sha256()
    for name in sorted(tensors):
        d.update(name.encode())
        d.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    return d.hexdigest()


def next_prompt_ids(rt: Any, session: ChatSession) -> list[int]:
    """The conversation as the next turn renders it (its generation prompt included)."""
    if not session.messages:
        return []
    return rt.render_ids(session.conversation(), enable_thinking=session.thinking)[1]


def save_session(path: Path, rt: Any, session: ChatSession) -> int:
    """Write the conversation and the best cached state for its next turn; returns the tokens saved."""
    from safetensors.torch import save

    ids = next_prompt_ids(rt, session)
    snap = rt.prompt_cache.peek(ids) if ids else None
    tensors = snap.tensors() if snap is not None else {}
    meta = {"quantkit_session": SESSION_VERSION, "identity": json.dumps(identity(rt)),
            "conversation": session.to_json(), "ids": json.dumps(list(snap.ids) if snap else []),
            "kinds": json.dumps([k for k, _a, _b in snap.layers] if snap else []), "sha256": _digest(tensors)}
    try:
        atomic_write_bytes(path, save(tensors, metadata=meta))
    except OSError as e:
        raise QuantkitError(f"{path}: cannot write the session ({e.strerror})") from None
    return snap.length if snap is not None else 0


@dataclass
class Resumed:
    session: ChatSession | None  # None: no usable conversation (new file, or a damaged header)
    restored_tokens: int  # tokens of state put into the prompt cache
    notice: str | None  # one line to show, if something was ignored


def size_bound(rt: Any) -> int:
    return snapshot_bytes(parse_text_config(rt.config), rt.context) + HEADER_SLACK


def _metadata(path: Path, size: int) -> dict[str, str]:
    """safetensors' string metadata, read from the header alone (so a file whose tensors are cut short still
    gives back its conversation). ValueError when the header itself is damaged."""
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < n <= min(size - 8, HEADER_SLACK):
            raise ValueError("no safetensors header")
        try:
            header = json.loads(f.read(n))
        except (ValueError, RecursionError):
            raise ValueError("unreadable safetensors header") from None
    if not isinstance(header, dict):
        raise ValueError("unreadable safetensors header")
    meta = header.get("__metadata__")
    return meta if isinstance(meta, dict) else {}


def _typed_metadata(path: Path, size: int) -> dict[str, str]:
    """`_metadata`, every field text as safetensors and `save_session` write it (ValueError naming the first
    field that is not: a JSON object or number there means the file was edited or forged)."""
    meta = _metadata(path, size)
    for key, value in meta.items():
        if not isinstance(value, str):
            raise ValueError(f"its metadata field {str(key)[:40]!r} is a JSON {_json_type(value)}, not text")
    return meta


def _json_type(value: Any) -> str:
    return {dict: "object", list: "array", bool: "boolean", int: "number", float: "number",
            type(None): "null"}.get(type(value), type(value).__name__)


def is_session_file(path: Path) -> bool:
    """An `owned` test (quantkit/outputs.py): a session file quantkit chat wrote (one damaged since is still
    quantkit's: `load_session` refuses it in one line, never replaces it unread)."""
    try:
        return _metadata(path, path.stat().st_size).get("quantkit_session") is not None
    except (OSError, ValueError):
        return False


def state_shapes(rt: Any, n: int) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """(kind, shape of its first tensor, of its second) per layer of this model's state after `n` tokens."""
    c = parse_text_config(rt.config)
    conv = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
    lin = ((1, conv, c.linear_conv_kernel_dim), (1, c.linear_num_value_heads, c.linear_key_head_dim,
                                                  c.linear_value_head_dim))
    kv = (1, c.num_key_value_heads, n, c.head_dim)
    return [("linear", *lin) if t == "linear_attention" else ("kv", kv, kv) for t in c.layer_types]


def check_state(rt: Any, session: ChatSession, ids: Any, kinds: Any, tensors: dict[str, torch.Tensor]) -> None:
    """The saved state is one this model makes for this conversation (ValueError naming what is not): its tokens
    a prefix of the conversation's next prompt, one layer kind per layer, every tensor of its shape and
    finite. A checksum proves only that the file was not damaged, not that its content was not forged."""
    want = next_prompt_ids(rt, session)
    if not isinstance(ids, list) or not 0 < len(ids) < min(len(want) + 1, rt.context) or ids != want[:len(ids)]:
        raise ValueError("its tokens are not the conversation's")
    layers = state_shapes(rt, len(ids))
    if kinds != [k for k, _a, _b in layers]:
        raise ValueError("its layers are not this model's")
    names = {"linear": ("conv", "recurrent"), "kv": ("keys", "values")}
    expected = {f"{i}.{n}": shape for i, (k, *shapes) in enumerate(layers) for n, shape in zip(names[k], shapes,
                                                                                             strict=True)}
    if set(tensors) != set(expected):
        raise ValueError("its tensors are not this model's layers")
    for name, t in tensors.items():
        if tuple(t.shape) != expected[name] or not t.is_floating_point() or not bool(torch.isfinite(t).all()):
            raise ValueError(f"{name} is not a finite state of shape {list(expected[name])}")


def load_session(path: Path, rt: Any) -> Resumed:
    """Read a session file written by `save_session` for this model; see the module docstring."""
    from safetensors.torch import load

    clean_leftovers(path)  # the temporary of a save that was killed half-way
    if not path.exists():
        return Resumed(None, 0, None)
    if not path.is_file():
        raise QuantkitError(f"{path}: not a file; --session takes a file path")
    size, bound = path.stat().st_size, size_bound(rt)
    if size > bound:
        raise QuantkitError(f"{path}: {size} bytes, more than any session of this model can hold ({bound}); "
                            "not a quantkit chat session file")
    try:
        meta = _typed_metadata(path, size)
    except ValueError as e:  # never "ignored and overwritten": it may be a file the user cares about
        raise QuantkitError(f"{path}: not a quantkit chat session file or damaged ({e}); pass another --session "
                            "path") from None
    if meta.get("quantkit_session") != SESSION_VERSION:
        raise QuantkitError(f"{path}: not a quantkit chat session file (version {SESSION_VERSION}); pass another "
                            "--session path")
    try:
        theirs = json.loads(meta.get("identity", ""))
    except (ValueError, RecursionError):
        theirs = {}
    if not isinstance(theirs, dict) or not all(isinstance(v, str) for v in theirs.values()):
        raise QuantkitError(f"{path}: a damaged quantkit chat session file (its identity is not the model, weights, "
                            "recipe and placement it was written for); pass another --session path")
    mine = identity(rt)
    for key in ("model", "recipe", "placement", "weights"):
        if not isinstance(theirs, dict) or theirs.get(key) != mine[key]:
            other = "other weights" if key == "weights" else f"another {key}"
            raise QuantkitError(f"{path}: this session's state was written for {other} than {rt.folder.name} "
                                f"loaded here; resume it with the same model, weights, recipe and placement, or "
                                f"start a new --session file")
    session = ChatSession.from_json(meta.get("conversation", ""), str(path))
    try:
        ids = json.loads(meta["ids"])
        kinds = json.loads(meta["kinds"])
        if not ids:
            return Resumed(session, 0, None)
        tensors = load(path.read_bytes())
        if _digest(tensors) != meta.get("sha256"):
            raise ValueError("checksum mismatch")
        check_state(rt, session, ids, kinds, tensors)
        devices = [rt.placement.layer_device[i] for i in range(len(kinds))]
        snap = Snapshot.from_tensors(ids, kinds, tensors, devices)
    except Exception as e:  # noqa: BLE001 - any damage: keep the conversation, prefill it normally
        return Resumed(session, 0, f"{path}: saved state damaged ({str(e).splitlines()[0][:120]}); the conversation "
                                   "is kept and will be prefilled normally")
    if not rt.prompt_cache.put(snap):
        return Resumed(session, 0, f"{path}: the saved state does not fit --prompt-cache-size; prefilling normally")
    return Resumed(session, snap.length, None)
