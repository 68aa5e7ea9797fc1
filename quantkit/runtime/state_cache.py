"""Snapshots of the hybrid cache (attention KV + Gated DeltaNet states) keyed by token prefix, and a
byte-bounded LRU of them, so that a conversation is never prefilled twice.

The model's cache (runtime/model/cache.py `HybridCache`) holds, per full-attention layer, keys and values
filled up to its length, and per linear-attention layer a conv state and a recurrent state updated IN PLACE.
An attention KV can be cut back to any length; a recurrent state cannot be rolled back. So a `Snapshot` of
the state after the tokens `ids` is a COPY of every layer's state, taken when the prefill passes that position
(`HybridCache.snapshot`): per linear-attention layer conv [1, C, K] and recurrent [1, Hv, Dk, Dv], per
attention layer keys and values [1, kv_heads, len(ids), head_dim]. `HybridCache.from_snapshot` builds a new
cache from copies of them, so two requests that start from one snapshot never share a state.

Where snapshots are taken, and why generation stays bit-exact: `prefill_plan` cuts a prompt into
segments at message boundaries (each `<|im_start|>`), then each segment into chunks of at most `chunk`
tokens counted from the segment's start. The state at a boundary therefore depends only on the tokens
before it, computed with the same chunk shapes whichever prompt it came from; restoring it and prefilling
the rest performs exactly the arithmetic of a full prefill of that prompt. The chat template re-renders
the generation prompt and drops earlier thinking (`<think>\\n` becomes `<think>\\n\\n</think>` or the
answer), so the end of a prompt is rarely a prefix of the next one, while the boundary before the
generation prompt always is: snapshots are taken at the last `keep` boundaries of the new part of each
prompt (the start of the generation prompt and of the last message).

A raw prompt (/v1/completions, no chat template) may hold no boundary at all, so snapshots are also taken at
checkpoints, as llama.cpp does: every `every` tokens from the start of the prompt's last segment (the last
boundary, or 0), the last `keep` of them past the last boundary. `every` is a multiple of the prefill chunk,
so a checkpoint is where a full prefill's chunk ends anyway: restoring it and prefilling from there cuts the
same chunks, and the arithmetic stays that of a full prefill. The very end of a prompt is not such a point
unless it falls on one (a prompt that extends it would be prefilled in other chunks), so it is kept apart: a
whole snapshot, with the logits after its last token, that only the same prompt restores (`whole`). A repeated
raw prompt is thus reused whole, no token prefilled; an extended one restores the last checkpoint before it and
prefills at most `every` tokens. A whole snapshot enters as the least recently used (it is the first evicted
to make room; a restore of it marks it used).

A `PrefixCache` may carry a disk store (quantkit.runtime.prompt_disk): every snapshot it is given with
`persist` is written there too (after the generation, `flush`), and `lookup` restores from disk a longer
prefix than memory holds, so a restarted process finds them again.

`PrefixCache` holds snapshots up to `max_bytes` (0 disables it): `lookup(ids)` returns the longest one
whose tokens are a proper prefix of `ids` (at least one token must remain to be prefilled, for the
logits), least recently used ones are evicted first. Bytes count each linear state and each KV storage
once, however many snapshots share it (a snapshot read from a session file shares nothing). It is thread-safe (one lock); its statistics feed /stats and
/health.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from quantkit.planner.budget import DEFAULT_PREFILL_CHUNK, SNAPSHOTS_PER_PROMPT

# boundaries snapshotted per prompt: the generation prompt's start and the last message's (the planner
# budgets the prompt cache in units of these and the whole prompt)
DEFAULT_KEEP = SNAPSHOTS_PER_PROMPT - 1
# checkpoints of a raw prompt: every prefill chunk (a multiple of it keeps the arithmetic; a smaller interval
# leaves a repeated prompt fewer tokens to prefill)
CHECKPOINT_EVERY = DEFAULT_PREFILL_CHUNK


@dataclass
class Snapshot:
    """The cache state after `ids`: per layer ("kv", keys, values) or ("linear", conv, recurrent)."""

    ids: tuple[int, ...]
    layers: list[tuple[str, torch.Tensor | None, torch.Tensor | None]]
    # a whole prompt's snapshot (`PrefixCache.whole`): the logits after its last token, and the final norm's
    # output there (what the MTP layer drafts from; None where the prefill did not keep it)
    logits: torch.Tensor | None = None
    hidden: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return len(self.ids)

    def state_bytes(self) -> int:
        """Bytes of the linear-attention states (and a whole prompt's logits) this snapshot owns."""
        return (sum(_nbytes(a) + _nbytes(b) for kind, a, b in self.layers if kind == "linear")
                + _nbytes(self.logits) + _nbytes(self.hidden))

    def kv_storages(self) -> dict[tuple[str, int], int]:
        """The KV storages this snapshot references: (device, address) -> bytes of the whole storage."""
        out: dict[tuple[str, int], int] = {}
        for kind, a, b in self.layers:
            if kind == "kv":
                for t in (a, b):
                    if t is not None:
                        s = t.untyped_storage()
                        out[(str(t.device), s.data_ptr())] = s.nbytes()
        return out

    def nbytes(self) -> int:
        return self.state_bytes() + sum(self.kv_storages().values())

    def tensors(self) -> dict[str, torch.Tensor]:
        """Named contiguous copies (for a session file): `L.conv`, `L.recurrent`, `L.keys`, `L.values`."""
        names = {"linear": ("conv", "recurrent"), "kv": ("keys", "values")}
        out = {}
        for i, (kind, a, b) in enumerate(self.layers):
            for name, t in zip(names[kind], (a, b), strict=True):
                if t is not None:
                    out[f"{i}.{name}"] = t.contiguous().cpu()
        return out

    @classmethod
    def from_tensors(cls, ids: Sequence[int], kinds: Sequence[str], tensors: dict[str, torch.Tensor],
                     devices: Sequence[str]) -> Snapshot:
        """The inverse of `tensors`, each layer's tensors moved to its device. KeyError on a missing one."""
        names = {"linear": ("conv", "recurrent"), "kv": ("keys", "values")}
        layers = []
        for i, kind in enumerate(kinds):
            a, b = (tensors[f"{i}.{n}"].to(devices[i]) for n in names[kind])
            layers.append((kind, a, b))
        return cls(tuple(ids), layers)


# the first item of a whole prompt's key in `PrefixCache`: no token id, so `lookup` never takes it for a prefix
WHOLE = "whole"


def _key(snap: Snapshot) -> tuple[Any, ...]:
    return (WHOLE, *snap.ids) if snap.logits is not None else snap.ids


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def prefill_plan(ids: Sequence[int], start: int, boundary_ids: set[int] | frozenset[int],
                 chunk: int) -> list[tuple[int, int]]:
    """The chunks [a, b) that prefill ids[start:]: cut at every boundary token (a position p > 0 holding
    one of `boundary_ids`), then every `chunk` tokens from each segment's start. `start` must be 0, a
    boundary or a checkpoint (`snapshot_points`) for the arithmetic to equal a full prefill's."""
    cuts = [p for p in range(start + 1, len(ids)) if ids[p] in boundary_ids]
    out = []
    for a, b in zip([start, *cuts], [*cuts, len(ids)], strict=True):
        out.extend((s, min(s + chunk, b)) for s in range(a, b, chunk))
    return out


def snapshot_points(ids: Sequence[int], start: int, boundary_ids: set[int] | frozenset[int],
                    keep: int = DEFAULT_KEEP, every: int = 0) -> list[int]:
    """Where a prefill from `start` takes snapshots, in order: the last `keep` boundary positions after
    `start`, then (with `every`, a multiple of the prefill chunk) the last `keep` checkpoints past them: the
    positions p <= len(ids) that are a multiple of `every` from the last segment's start."""
    if keep <= 0:
        return []
    bounds = [p for p in range(1, len(ids)) if ids[p] in boundary_ids]
    points = [p for p in bounds if p > start][-keep:]
    if every > 0:
        seg = bounds[-1] if bounds else 0
        after = max(start, points[-1] if points else 0)
        checks = range(seg + every, len(ids) + 1, every)
        points += [p for p in checks if p > after][-keep:]
    return points


@dataclass
class CacheStats:
    lookups: int = 0
    hits: int = 0
    reused_tokens: int = 0
    evictions: int = 0
    stored: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0


@dataclass
class _Entry:
    snap: Snapshot
    state_bytes: int
    storages: dict[tuple[str, int], int] = field(default_factory=dict)


class PrefixCache:
    """Snapshots keyed by their token prefix, least recently used evicted past `max_bytes` (0: off)."""

    def __init__(self, max_bytes: int, keep: int = DEFAULT_KEEP, disk: Any = None):
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self.max_bytes = int(max_bytes)
        self.keep = keep
        self.every = CHECKPOINT_EVERY
        # a quantkit.runtime.prompt_disk.DiskStore (or None): `persist` snapshots are written there at `flush`
        self.disk = disk
        self._pending: list[Snapshot] = []
        self.stats = CacheStats()
        self._entries: OrderedDict[tuple[Any, ...], _Entry] = OrderedDict()  # WHOLE first: a whole prompt
        self._storage_refs: dict[tuple[str, int], list[int]] = {}  # key -> [bytes, references]
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0 or self.disk is not None

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def _longest(self, ids: tuple[int, ...]) -> tuple[Any, ...] | None:
        # a whole prompt's key starts with WHOLE, so it is never a prefix of token ids
        best: tuple[Any, ...] | None = None
        for key in self._entries:
            if len(key) < len(ids) and (best is None or len(key) > len(best)) and ids[:len(key)] == key:
                best = key
        return best

    def whole(self, ids: Sequence[int]) -> Snapshot | None:
        """The snapshot of exactly the prompt `ids` with its last logits (marked most recently used; counted as a
        hit of every token), or None. Memory only: the disk store keeps prefix snapshots."""
        if self.max_bytes <= 0:
            return None
        key = (WHOLE, *ids)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            self.stats.lookups += 1
            self.stats.hits += 1
            self.stats.reused_tokens += entry.snap.length
            return entry.snap

    def peek(self, ids: Sequence[int]) -> Snapshot | None:
        """What `lookup` would return, without counting it or touching the LRU order."""
        with self._lock:
            best = self._longest(tuple(ids))
            return self._entries[best].snap if best is not None else None

    def lookup(self, ids: Sequence[int]) -> Snapshot | None:
        """The longest snapshot whose ids are a proper prefix of `ids` (marked most recently used), from
        memory or, where it holds a longer one, from the disk store (then kept in memory too)."""
        if not self.enabled:
            return None
        self.flush()
        ids = tuple(ids)
        with self._lock:
            self.stats.lookups += 1
            best = self._longest(ids)
            snap = self._entries[best].snap if best is not None else None
            if best is not None:
                self._entries.move_to_end(best)
        if self.disk is not None:
            found = self.disk.lookup(ids, len(best) if best is not None else 0)
            if found is not None:
                snap = found
                self.put(found)
        if snap is None:
            return None
        with self._lock:
            self.stats.hits += 1
            self.stats.reused_tokens += snap.length
        return snap

    def put(self, snap: Snapshot, persist: bool = False, spare: bool = False) -> bool:
        """Store `snap` (replacing one of the same ids); evict LRU entries to fit. False if it cannot fit.
        `persist`: also write it to the disk store at the next `flush`. `spare`: it enters as the least recently
        used, as a whole prompt's does (a prompt's points before its last: the next turn continues from the last)."""
        if persist and self.disk is not None:
            with self._lock:
                self._pending.append(snap)
        if self.max_bytes <= 0:
            return False
        entry = _Entry(snap, snap.state_bytes(), snap.kv_storages())
        if entry.state_bytes + sum(entry.storages.values()) > self.max_bytes:
            return False
        key = _key(snap)
        with self._lock:
            if key in self._entries:
                self._drop(key)
            self._entries[key] = entry
            if snap.logits is not None or spare:
                # only a repeat of the same prompt uses it (or an edit of the last message): the first to go, never
                # the point another turn continues from
                self._entries.move_to_end(key, last=False)
            self._bytes += entry.state_bytes
            for k, nb in entry.storages.items():
                ref = self._storage_refs.setdefault(k, [nb, 0])
                if ref[1] == 0:
                    self._bytes += nb
                ref[1] += 1
            self.stats.stored += 1
            while self._bytes > self.max_bytes and len(self._entries) > 1:
                self._drop(next(iter(self._entries)))
                self.stats.evictions += 1
            return key in self._entries

    def flush(self) -> None:
        """Write the snapshots given with `persist` to the disk store (after a generation, not before its
        first token: writing is never on the way to the answer)."""
        with self._lock:
            pending, self._pending = self._pending, []
        for snap in pending:
            assert self.disk is not None
            if snap.logits is None:
                self.disk.write(snap)

    def clear(self) -> None:
        with self._lock:
            for key in list(self._entries):
                self._drop(key)

    def _drop(self, key: tuple[Any, ...]) -> None:
        entry = self._entries.pop(key)
        self._bytes -= entry.state_bytes
        for k in entry.storages:
            ref = self._storage_refs[k]
            ref[1] -= 1
            if ref[1] == 0:
                self._bytes -= ref[0]
                del self._storage_refs[k]

    def snapshots(self) -> list[Snapshot]:
        """The snapshots held, least recently used first."""
        with self._lock:
            return [e.snap for e in self._entries.values()]

    def summary(self) -> dict[str, Any]:
        """What /health and /stats show."""
        with self._lock:
            return {"enabled": self.enabled, "max_bytes": self.max_bytes, "bytes": self._bytes,
                    "entries": len(self._entries), "lookups": self.stats.lookups, "hits": self.stats.hits,
                    "hit_rate": round(self.stats.hit_rate, 4), "reused_tokens": self.stats.reused_tokens,
                    "evictions": self.stats.evictions,
                    "disk": self.disk.summary() if self.disk is not None else None}
