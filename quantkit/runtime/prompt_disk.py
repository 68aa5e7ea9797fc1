"""The prompt cache on disk (`--prompt-cache-dir DIR`): snapshots of conversation states (quantkit.runtime.state_cache)
kept in files, so that a restarted `serve`, `chat` or `generate` restores a prompt's longest cached prefix
instead of prefilling it again.

One snapshot per file, `qkpc-<identity hash>-<ids hash>.safetensors` (never a pickle), written 0600: the tensors
are the snapshot's (`L.conv`, `L.recurrent`, `L.keys`, `L.values`, as in a session file); the string metadata
holds `quantkit_prompt_cache` (the format version, quantkit's mark), `identity` (JSON: hashes of the model's
config, its weights' fingerprint, the recipe and the state layout, not the placement), `ids` and `kinds` (the
snapshot's tokens and layer kinds), `sha256` (of those fields and every tensor's bytes, in name order) and `mac`
(the folder key's HMAC of all of them: quantkit/runtime/prompt_folder.py says who may write DIR and its key).

Bound to the weights and the key: an entry of another identity is counted and never restored nor removed
(another model's server may share DIR); one of this identity without a valid `mac` (edited, re-signed without
the key, or written by an older quantkit, format 1) is reported once, never restored, and left in place.
Safe to share: each file is written under a per-writer temporary name and renamed into place; there is no
shared index file, each process indexes DIR by reading the files' headers, again at each lookup. Read with a
size bound, checked (signature, checksum, this model's shapes, finite) before anything reaches the cache. A
signed entry that fails a check is quantkit's own and damaged: removed with one warning line. A file with
quantkit's name but no readable mark is skipped with one warning and left alone; other files are not looked at.

The bound (`--prompt-cache-disk-size`) covers this identity's entries only: before a write, its least recently
used ones (by modification time; a restore touches its file) are removed until the new one fits. Other files
are never evicted; when they put DIR over the bound, `summary()` says so (`over_bound`) and one warning is
given. A DIR that cannot be used (a file, unwritable) or a write that fails (a full disk) turns the disk cache
off with one warning; generation goes on from memory.
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
from quantkit.fileio import fsync_dir
from quantkit.planner.budget import snapshot_bytes
from quantkit.planner.disk_cache import MIN_DISK_BYTES
from quantkit.runtime.prompt_folder import (
    cache_folder,
    check_private,
    clean_dead_writers,
    load_key,
    sign,
    signed,
)
from quantkit.runtime.session_file import identity, state_shapes
from quantkit.runtime.state_cache import Snapshot

MAGIC, VERSION = "quantkit_prompt_cache", "2"
OLD_VERSIONS = ("1",)  # unsigned: never restored, left in place
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


def signed_fields(meta: dict[str, Any]) -> list[str]:
    """What an entry's `mac` covers: the format and every other field of its header."""
    return [f"{MAGIC}={VERSION}", *(str(meta.get(k, "")) for k in ("identity", "ids", "kinds", "sha256"))]


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
    # "ours" | "foreign" (another identity) | "unsigned" (this identity, no valid mac) | "old" (an older
    # format) | "unknown" (no readable mark)
    state: str
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
    """The entries of one identity in `folder`, up to `max_bytes` of them, signed with `key` (see the module
    docstring)."""

    def __init__(self, folder: Path, max_bytes: int, layout: Layout, key: bytes,
                 warn: Callable[[str], None] = default_warn):
        self.folder = folder
        self.max_bytes = int(max_bytes)
        self.layout = layout
        self.warn = warn
        self.writable = True
        self.stats = DiskStats()
        self._key = key
        self._id_json = json.dumps(layout.identity, sort_keys=True)
        self._id_hash = _hash({"format": VERSION, **layout.identity})[:16]  # never an older format's name
        self._files: dict[str, _File] = {}
        self._warned: set[tuple[str, int, int]] = set()
        self._warned_over = False
        self._lock = threading.Lock()
        self.refresh()
        self._note_over_bound()

    # ---- the index, rebuilt from the files' headers ----
    def refresh(self) -> None:
        """Index the entry files in the folder: new or replaced ones by their header, gone ones dropped."""
        with self._lock:
            try:
                entries = [e for e in os.scandir(self.folder) if NAME.match(e.name)]
            except OSError:
                entries = []
            seen = {}
            new: dict[str, list[Path]] = {"unsigned": [], "old": []}
            for e in entries:
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                if not e.is_file(follow_symlinks=False):
                    continue
                old = self._files.get(e.name)
                if old is not None and (old.size, old.inode) == (st.st_size, st.st_ino):
                    seen[e.name] = old
                    continue
                seen[e.name] = f = self._classify(Path(e.path), st.st_size, st.st_ino)
                if f is not None and f.state in new:
                    new[f.state].append(Path(e.path))
            self._files = {k: v for k, v in seen.items() if v is not None}
        self._report(new["unsigned"], "not signed with this folder's key (edited, or signed without "
                                      f"{self.folder / '.qkpc-key'})")
        self._report(new["old"], "written by an older quantkit (format 1, unsigned)")

    def _report(self, paths: list[Path], why: str) -> None:
        if paths:
            what = f"{paths[0]}: a prompt-cache entry" if len(paths) == 1 else \
                f"{self.folder}: {len(paths)} prompt-cache entries (e.g. {paths[0].name})"
            self.warn(f"{what} {why}; never restored, left in place (remove by hand what you do not need)")

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
        if meta.get(MAGIC) in OLD_VERSIONS:
            return _File(size, inode, "old")
        if meta.get(MAGIC) != VERSION:
            self._warn_once(path, size, inode, "not a quantkit prompt-cache entry of this version; skipped, left "
                                               "in place")
            return _File(size, inode, "unknown")
        if meta.get("identity") != self._id_json:
            return _File(size, inode, "foreign")
        if not signed(self._key, signed_fields(meta), meta.get("mac")):
            return _File(size, inode, "unsigned")
        try:  # signed with this folder's key: quantkit's own, so a failed check means damage
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
        try:  # replaced since it was indexed: only a header signed with the key makes it quantkit's own
            meta = parse_header(data, len(data), bound)
            ok = meta.get(MAGIC) == VERSION and meta.get("identity") == self._id_json \
                and signed(self._key, signed_fields(meta), meta.get("mac"))
        except ValueError:
            ok = False
        if not ok:
            with self._lock:
                self._files.pop(path.name, None)  # indexed again (and reported) at the next lookup
            return None
        try:
            if len(data) > bound:
                raise ValueError(f"more than {bound} bytes")
            tensors = load(data)
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
        """Write `snap` as an entry (already there: only marked most recently used). False when not written,
        and when its name holds a file that is not a signed entry of this identity (never replaced)."""
        from safetensors.torch import save

        if not self.writable or not 0 < snap.length < self.layout.context:
            return False
        path = self.folder / self.name(snap.ids)
        self.refresh()
        with self._lock:
            have = self._files.get(path.name)
        if have is not None and (have.state != "ours" or have.ids == snap.ids):
            if have.state == "ours":
                try:
                    os.utime(path)
                except OSError:
                    pass
            return have.state == "ours"
        tensors = snap.tensors()
        meta = {MAGIC: VERSION, "identity": self._id_json, "ids": json.dumps(list(snap.ids)),
                "kinds": json.dumps([k for k, _a, _b in snap.layers])}
        meta["sha256"] = digest(meta, tensors)
        meta["mac"] = sign(self._key, signed_fields(meta))
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
        self._note_over_bound()
        return True

    def _make_room(self, need: int, keep: str) -> None:
        """Remove this identity's least recently used entries until `need` more bytes fit under the bound
        (which counts them only: other files are another model's, or not provably quantkit's)."""
        with self._lock:
            files = [(name, f) for name, f in self._files.items() if f.state == "ours"]
        total = sum(f.size for _n, f in files)
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

    def _bytes(self) -> tuple[int, int]:
        """(bytes of this identity's entries, bytes of the other files with an entry's name)."""
        with self._lock:
            files = list(self._files.values())
        ours = sum(f.size for f in files if f.state == "ours")
        return ours, sum(f.size for f in files) - ours

    def _note_over_bound(self) -> None:
        ours, other = self._bytes()
        if other and ours + other > self.max_bytes and not self._warned_over:
            self._warned_over = True
            self.warn(f"{self.folder}: {other:,} bytes of other models' entries and other files besides this "
                      f"model's {ours:,} put the folder over --prompt-cache-disk-size ({self.max_bytes:,}); only "
                      "this model's entries count toward it and are evicted: give each model its own folder, or "
                      "remove what is not needed")

    # ---- what /health, /metrics and chat's /stats show ----
    def summary(self) -> dict[str, Any]:
        with self._lock:
            files = list(self._files.values())
        ours, other = self._bytes()
        s = self.stats
        return {"dir": str(self.folder), "max_bytes": self.max_bytes, "bytes": ours, "other_bytes": other,
                "over_bound": ours + other > self.max_bytes,
                "entries": sum(f.state == "ours" for f in files),
                "ignored_other_weights": sum(f.state == "foreign" for f in files),
                "ignored_unsigned": sum(f.state == "unsigned" for f in files),
                "ignored_old_format": sum(f.state == "old" for f in files),
                "skipped_unknown": sum(f.state == "unknown" for f in files), "writable": self.writable,
                "hits": s.hits, "restored_tokens": s.restored_tokens,
                "restore_seconds": round(s.restore_seconds, 6),
                "last_restore_seconds": round(s.last_restore_seconds, 6), "writes": s.writes,
                "evictions": s.evictions, "removed_damaged": s.removed_damaged, "write_errors": s.write_errors}


def _write_file(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)  # prompts are private
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def layout_of(rt: Any) -> Layout:
    """The layout of `rt`'s states: its identity without the placement (a state is the same wherever its
    layers ran) plus the state layout (layer kinds and shapes, dtype)."""
    ident = {k: v for k, v in identity(rt).items() if k != "placement"}
    ident["layout"] = _hash([state_shapes(rt, 0), str(getattr(rt.model, "dtype", ""))])[:16]
    if getattr(rt, "prefill", "tokens") != "tokens":  # the row arithmetic's states are not the T-token path's
        ident["prefill"] = rt.prefill
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


def open_store(rt: Any, folder: str | os.PathLike[str], max_bytes: int | None,
               warn: Callable[[str], None] = default_warn) -> DiskStore | None:
    """The disk store in `folder` for `rt` (created 0700 if missing, its key made if missing). An empty name,
    a folder inside the model's or one others could write is refused (one line, QuantkitError); one that
    cannot be used (a file, unwritable) gives one warning and None: generation goes on without. Leftovers of
    dead writers are removed first. `max_bytes` None: a quarter of the free space there."""
    folder = cache_folder(folder)
    check_outside(folder, Path(rt.folder))
    if folder.exists() and not folder.is_dir():
        warn(f"--prompt-cache-dir {folder}: not a folder; the disk prompt cache is off for this run")
        return None
    check_private(folder)
    try:
        for p in [*reversed(folder.parents), folder]:  # each folder it makes private (as `mkdir -p` does not)
            if not p.is_dir():
                try:
                    p.mkdir(mode=0o700)
                except FileExistsError:
                    pass
        check_private(folder)  # as made (a folder another user made meanwhile is theirs)
        clean_dead_writers(folder)
        probe = folder / f".qkpc-probe-{os.getpid()}_{threading.get_ident()}"
        try:
            probe.write_bytes(b"")
        finally:
            probe.unlink(missing_ok=True)
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
    try:
        key = load_key(folder)
    except OSError as e:
        warn(f"--prompt-cache-dir {folder}: cannot write its key there ({e.strerror or e}); the disk prompt cache "
             "is off for this run")
        return None
    return DiskStore(folder, max_bytes, layout_of(rt), key, warn)
