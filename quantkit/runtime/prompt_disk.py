"""The prompt cache on disk (`--prompt-cache-dir DIR`): snapshots of conversation states (quantkit.runtime.state_cache)
kept in files, so that a restarted `serve`, `chat` or `generate` restores a prompt's longest cached prefix
instead of prefilling it again.

One snapshot per file, `qkpc-<identity hash>-<ids hash>.safetensors` (never a pickle): the tensors are the
snapshot's (`L.conv`, `L.recurrent`, `L.keys`, `L.values`, as in a session file: quantkit/runtime/session_file.py);
the string metadata holds `quantkit_prompt_cache` (the format version, quantkit's mark), `identity` (JSON: hashes
of the model's config, its weights' fingerprint, the recipe and the state layout: the placement is left out, a
state is the same wherever its layers ran), `ids` and `kinds` (the snapshot's tokens and layer kinds) and `sha256`
(of the identity, ids and kinds and of every tensor's bytes, in name order: a field edited by hand fails it).

Bound to the weights: an entry of another identity is counted and never restored (nor removed: another model's
server may share DIR). Safe to share: each file is written under a per-writer temporary name and renamed into
place (readers see a whole file or none; two writers of one entry write the same bytes); there is no shared
index file, each process indexes DIR by reading the files' headers, and looks again for new ones at each
lookup. Read with a size bound (a snapshot of that many tokens plus a header), checked (checksum, shapes of this
model's state, finite) before anything reaches the cache. A file with quantkit's name and mark that fails a
check is removed with one warning line; a file with quantkit's name but no readable mark is skipped with one
warning line and left alone; other files are not looked at.

The bound (`--prompt-cache-disk-size`) covers every entry file in DIR: before a write, the least recently used
entries (by modification time; a restore touches its file) are removed until the new one fits. A DIR that cannot
be used (a file, unwritable) or a write that fails (a full disk) turns the disk cache off with one warning;
generation goes on from memory.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from quantkit.checkpoint.spec import parse_text_config
from quantkit.errors import QuantkitError
from quantkit.fileio import clean_leftovers, fsync_dir
from quantkit.planner.budget import snapshot_bytes
from quantkit.planner.disk_cache import MIN_DISK_BYTES
from quantkit.runtime.session_file import identity, state_shapes
from quantkit.runtime.state_cache import Snapshot

MAGIC, VERSION = "quantkit_prompt_cache", "1"
NAME = re.compile(r"^qkpc-[0-9a-f]{16}-[0-9a-f]{24}\.safetensors$")
HEADER_BYTES = 1 << 20  # safetensors' header and the metadata, on top of the ids' JSON (12 bytes a token at most)
_NAMES = {"linear": ("conv", "recurrent"), "kv": ("keys", "values")}

Shapes = Callable[[int], list[tuple[str, tuple[int, ...], tuple[int, ...]]]]


def _hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def default_warn(line: str) -> None:
    print(f"warning: {line}", file=sys.stderr, flush=True)


def digest(meta: dict[str, str], tensors: dict[str, torch.Tensor]) -> str:
    """sha256 of the identity, ids and kinds fields and of every tensor's name and bytes, in name order."""
    d = hashlib.sha256()
    for key in ("identity", "ids", "kinds"):
        d.update(meta.get(key, "").encode() + b"\0")
    for name in sorted(tensors):
        d.update(name.encode())
        d.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    return d.hexdigest()


def parse_header(head: bytes, size: int, bound: int) -> dict[str, Any]:
    """The `__metadata__` of a safetensors file from its first bytes (ValueError when it is not one)."""
    n = int.from_bytes(head[:8], "little") if len(head) >= 8 else -1
    if not 0 < n <= min(size - 8, bound) or len(head) < 8 + n:
        raise ValueError("no safetensors header")
    try:
        header = json.loads(head[8:8 + n])
    except (ValueError, RecursionError):
        raise ValueError("unreadable safetensors header") from None
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict):
        raise ValueError("no metadata")
    return meta


@dataclass
class Layout:
    """What this process's states look like and where they go: the identity entries must match, the shapes of
    a state after n tokens, the largest snapshot of n tokens in bytes, each layer's device, the context."""

    identity: dict[str, str]
    shapes: Shapes
    snapshot_bytes: Callable[[int], int]
    devices: list[str]
    context: int

    def kinds(self) -> list[str]:
        return [k for k, _a, _b in self.shapes(0)]

    def file_bound(self, n: int) -> int:
        return self.snapshot_bytes(n) + 12 * n + HEADER_BYTES


@dataclass
class _File:
    size: int
    inode: int
    state: str  # "ours" | "foreign" (another identity) | "unknown" (no readable mark)
    ids: tuple[int, ...] = ()


@dataclass
class DiskStats:
    hits: int = 0
    restored_tokens: int = 0
    restore_seconds: float = 0.0
    last_restore_seconds: float = 0.0
    writes: int = 0
    evictions: int = 0
    removed_damaged: int = 0
    write_errors: int = 0


class DiskStore:
    """The entries of one identity in `folder`, up to `max_bytes` of entry files (see the module docstring)."""

    def __init__(self, folder: Path, max_bytes: int, layout: Layout, warn: Callable[[str], None] = default_warn):
        self.folder = folder
        self.max_bytes = int(max_bytes)
        self.layout = layout
        self.warn = warn
        self.writable = True
        self.stats = DiskStats()
        self._id_json = json.dumps(layout.identity, sort_keys=True)
        self._id_hash = _hash(layout.identity)[:16]
        self._files: dict[str, _File] = {}
        self._warned: set[tuple[str, int, int]] = set()
        self._lock = threading.Lock()
        for p in list(folder.glob(".qkpc-*")):  # temporaries of writers that were killed
            m = re.match(r"^\.(qkpc-.*\.safetensors)\.tmp", p.name)
            if m:
                clean_leftovers(folder / m.group(1))
        self.refresh()

    # ---- the index, rebuilt from the files' headers ----
    def refresh(self) -> None:
        """Index the entry files in the folder: new or replaced ones by their header, gone ones dropped."""
        with self._lock:
            try:
                entries = [e for e in os.scandir(self.folder) if NAME.match(e.name)]
            except OSError:
                entries = []
            seen = {}
            for e in entries:
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                if not e.is_file(follow_symlinks=False):
                    continue
                old = self._files.get(e.name)
                seen[e.name] = old if old is not None and (old.size, old.inode) == (st.st_size, st.st_ino) \
                    else self._classify(Path(e.path), st.st_size, st.st_ino)
            self._files = {k: v for k, v in seen.items() if v is not None}

    def _classify(self, path: Path, size: int, inode: int) -> _File | None:
        bound = 12 * self.layout.context + HEADER_BYTES  # the header alone: the ids' JSON and the rest
        try:
            with open(path, "rb") as f:
                head = f.read(8)
                n = int.from_bytes(head, "little") if len(head) == 8 else 0
                head += f.read(min(n, bound))
            meta = parse_header(head, size, bound)
        except (OSError, ValueError) as e:
            self._warn_once(path, size, inode, f"not a readable quantkit prompt-cache entry ({e}); skipped, left "
                                               "in place")
            return _File(size, inode, "unknown")
        if meta.get(MAGIC) != VERSION:
            self._warn_once(path, size, inode, "not a quantkit prompt-cache entry of this version; skipped, left "
                                               "in place")
            return _File(size, inode, "unknown")
        if meta.get("identity") != self._id_json:
            return _File(size, inode, "foreign")
        try:
            ids = json.loads(meta.get("ids", ""))
            kinds = json.loads(meta.get("kinds", ""))
            if not (isinstance(ids, list) and 0 < len(ids) < self.layout.context
                    and all(type(i) is int and i >= 0 for i in ids)):
                raise ValueError("its tokens are not a prompt of this context")
            if kinds != self.layout.kinds():
                raise ValueError("its layers are not this model's")
            if size > self.layout.file_bound(len(ids)):
                raise ValueError(f"{size} bytes, more than a state of {len(ids)} tokens holds")
        except (ValueError, RecursionError) as e:
            self._remove_damaged(path, str(e))
            return None
        return _File(size, inode, "ours", tuple(ids))

    def _warn_once(self, path: Path, size: int, inode: int, why: str) -> None:
        if (path.name, size, inode) not in self._warned:
            self._warned.add((path.name, size, inode))
            self.warn(f"{path}: {why}")

    def _remove_damaged(self, path: Path, why: str) -> None:
        self.warn(f"{path}: damaged prompt-cache entry ({why[:160]}); removed")
        self.stats.removed_damaged += 1
        try:
            path.unlink()
        except OSError:
            pass

    # ---- reading ----
    def lookup(self, ids: Sequence[int], longer_than: int = 0) -> Snapshot | None:
        """The longest entry of this identity whose ids are a proper prefix of `ids` and longer than
        `longer_than` tokens, restored (checked, on the layers' devices); None when there is none."""
        ids = tuple(ids)
        self.refresh()
        with self._lock:
            found = sorted(((len(f.ids), name, f.ids) for name, f in self._files.items()
                            if f.state == "ours" and longer_than < len(f.ids) < len(ids)
                            and ids[:len(f.ids)] == f.ids), reverse=True)
        for _n, name, key in found:
            t0 = time.perf_counter()
            snap = self._load(self.folder / name, key)
            if snap is not None:
                dt = time.perf_counter() - t0
                self.stats.hits += 1
                self.stats.restored_tokens += snap.length
                self.stats.restore_seconds += dt
                self.stats.last_restore_seconds = dt
                return snap
        return None

    def _load(self, path: Path, key: tuple[int, ...]) -> Snapshot | None:
        from safetensors.torch import load

        bound = self.layout.file_bound(len(key))
        try:
            with open(path, "rb") as f:
                data = f.read(bound + 1)
        except OSError:
            return None  # gone meanwhile (another process evicted it)
        try:
            if len(data) > bound:
                raise ValueError(f"more than {bound} bytes")
            meta = parse_header(data, len(data), bound)
            tensors = load(data)
            if meta.get(MAGIC) != VERSION or meta.get("identity") != self._id_json:
                raise ValueError("its header changed")
            if digest(meta, tensors) != meta.get("sha256"):
                raise ValueError("checksum mismatch")
            if tuple(json.loads(meta["ids"])) != key:
                raise ValueError("its tokens changed")
            self._check(len(key), tensors)
            snap = Snapshot.from_tensors(key, self.layout.kinds(), tensors, self.layout.devices)
        except Exception as e:  # noqa: BLE001 - any damage (safetensors raises its own errors): never restored
            self._remove_damaged(path, str(e).splitlines()[0] if str(e) else type(e).__name__)
            with self._lock:
                self._files.pop(path.name, None)
            return None
        try:
            os.utime(path)  # most recently used
        except OSError:
            pass
        return snap

    def _check(self, n: int, tensors: dict[str, torch.Tensor]) -> None:
        expected = {f"{i}.{name}": shape for i, (k, *shapes) in enumerate(self.layout.shapes(n))
                    for name, shape in zip(_NAMES[k], shapes, strict=True)}
        if set(tensors) != set(expected):
            raise ValueError("its tensors are not this model's layers")
        for name, t in tensors.items():
            if tuple(t.shape) != expected[name] or not t.is_floating_point() or not bool(torch.isfinite(t).all()):
                raise ValueError(f"{name} is not a finite state of shape {list(expected[name])}")

    # ---- writing ----
    def name(self, ids: Sequence[int]) -> str:
        return f"qkpc-{self._id_hash}-{_hash(list(ids))[:24]}.safetensors"

    def write(self, snap: Snapshot) -> bool:
        """Write `snap` as an entry (already there: only marked most recently used). False when not written."""
        from safetensors.torch import save

        if not self.writable or not 0 < snap.length < self.layout.context:
            return False
        path = self.folder / self.name(snap.ids)
        with self._lock:
            have = self._files.get(path.name)
        if have is not None and have.state == "ours" and have.ids == snap.ids and path.exists():
            try:
                os.utime(path)
            except OSError:
                pass
            return True
        tensors = snap.tensors()
        meta = {MAGIC: VERSION, "identity": self._id_json, "ids": json.dumps(list(snap.ids)),
                "kinds": json.dumps([k for k, _a, _b in snap.layers])}
        meta["sha256"] = digest(meta, tensors)
        data = save(tensors, metadata=meta)
        if len(data) > self.max_bytes:
            return False
        self._make_room(len(data), keep=path.name)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}_{threading.get_ident()}")
        try:
            _write_file(tmp, data)
            os.replace(tmp, path)
            fsync_dir(self.folder)
        except OSError as e:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            self.writable = False
            self.stats.write_errors += 1
            self.warn(f"{self.folder}: cannot write a prompt-cache entry ({e.strerror or e}); the disk prompt "
                      "cache is off for this run, generation goes on from memory")
            return False
        st = path.stat()
        with self._lock:
            self._files[path.name] = _File(st.st_size, st.st_ino, "ours", tuple(snap.ids))
        self.stats.writes += 1
        return True

    def _make_room(self, need: int, keep: str) -> None:
        """Remove the least recently used entry files (any identity: the bound is the folder's) until `need`
        more bytes fit under the bound."""
        self.refresh()
        with self._lock:
            files = [(name, f) for name, f in self._files.items() if f.state in ("ours", "foreign")]
            total = sum(f.size for f in self._files.values())
        if total + need <= self.max_bytes:
            return
        aged = []
        for name, f in files:
            try:
                aged.append((os.stat(self.folder / name).st_mtime_ns, name, f.size))
            except OSError:
                total -= f.size
        for _t, name, size in sorted(aged):
            if total + need <= self.max_bytes:
                break
            if name == keep:
                continue
            try:
                (self.folder / name).unlink()
            except FileNotFoundError:
                pass
            except OSError:
                continue
            total -= size
            self.stats.evictions += 1
            with self._lock:
                self._files.pop(name, None)

    # ---- what /health, /metrics and chat's /stats show ----
    def summary(self) -> dict[str, Any]:
        with self._lock:
            files = list(self._files.values())
        s = self.stats
        return {"dir": str(self.folder), "max_bytes": self.max_bytes, "bytes": sum(f.size for f in files),
                "entries": sum(f.state == "ours" for f in files),
                "ignored_other_weights": sum(f.state == "foreign" for f in files),
                "skipped_unknown": sum(f.state == "unknown" for f in files), "writable": self.writable,
                "hits": s.hits, "restored_tokens": s.restored_tokens,
                "restore_seconds": round(s.restore_seconds, 6),
                "last_restore_seconds": round(s.last_restore_seconds, 6), "writes": s.writes,
                "evictions": s.evictions, "removed_damaged": s.removed_damaged, "write_errors": s.write_errors}


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def layout_of(rt: Any) -> Layout:
    """The layout of `rt`'s states: its identity without the placement (a state is the same wherever its
    layers ran) plus the state layout (layer kinds and shapes, dtype)."""
    ident = {k: v for k, v in identity(rt).items() if k != "placement"}
    ident["layout"] = _hash([state_shapes(rt, 0), str(getattr(rt.model, "dtype", ""))])[:16]
    cfg = parse_text_config(rt.config)
    kinds = state_shapes(rt, 0)
    return Layout(ident, lambda n: state_shapes(rt, n), lambda n: snapshot_bytes(cfg, n),
                  [rt.placement.layer_device[i] for i in range(len(kinds))], int(rt.context))


def check_outside(folder: Path, model: Path) -> None:
    """Refuse (one line) a cache folder that is the model folder or inside it."""
    where, home = Path(folder).expanduser().resolve(), Path(model).resolve()
    if where == home or home in where.parents:
        raise QuantkitError(f"--prompt-cache-dir {folder}: inside the model folder {model}; pick a folder outside "
                            "it (the model folder holds only the model's files)")


def open_store(rt: Any, folder: Path, max_bytes: int | None, warn: Callable[[str], None] = default_warn
               ) -> DiskStore | None:
    """The disk store in `folder` for `rt` (created if missing). A folder inside the model's is refused (one
    line); one that cannot be used (a file, unwritable) gives one warning and None: generation goes on without.
    `max_bytes` None: a quarter of the free space there."""
    folder = Path(folder).expanduser()
    check_outside(folder, Path(rt.folder))
    if folder.exists() and not folder.is_dir():
        warn(f"--prompt-cache-dir {folder}: not a folder; the disk prompt cache is off for this run")
        return None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".qkpc-probe-{os.getpid()}_{threading.get_ident()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        warn(f"--prompt-cache-dir {folder}: cannot write there ({e.strerror or e}); the disk prompt cache is off "
             "for this run")
        return None
    if max_bytes is None:
        free = shutil.disk_usage(folder).free
        if free // 4 < MIN_DISK_BYTES:
            warn(f"--prompt-cache-dir {folder}: {free:,} bytes free there; the disk prompt cache is off for this run "
                 "(free some space, or bound it with --prompt-cache-disk-size)")
            return None
        max_bytes = free // 4
    return DiskStore(folder, max_bytes, layout_of(rt), warn)
