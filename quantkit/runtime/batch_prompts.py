"""Prompts prefilled inside the batch's steps (docs/engine.md): a row joins the batch with its prompt not yet
prefilled, a `PromptFeed` (the prompt, how much of it is in the cache, where snapshots are due). Each step,
`plan_chunks` gives the waiting prompts chunks of a token budget in the order they came (a long prompt holds the
decoding rows up by one chunk at most; several short ones share a step), and each chunk rides in the step's one
`Model.forward_batch` beside the decode rows, in the runtime's arithmetic (`Runtime.set_prefill`):
- "rows" ("prefill" segments): a chunk's tokens compute as one-token steps do, so the state after any token is
  what a prefill cut there gives and a snapshot may sit anywhere: at the end of an answer (`answer_snapshot`),
  and where prompts that arrive together part. A new feed sharing at least MIN_SHARED more tokens with one being
  prefilled `waits` for it (`join`); that one takes a snapshot where they part, which the waiting one restores (and
  the prompt cache keeps), so the shared tokens are prefilled once.
- "tokens" ("prompt" segments, transformers' eager arithmetic): a chunk's bits depend on where it is cut, so the
  cuts are the prompt's own plan (`state_cache.prefill_plan`: boundaries, then every PREFILL_CHUNK tokens), never
  the budget's, and a request's tokens never depend on its neighbours.
Snapshots of a prompt: the last boundaries, checkpoints past them, the whole prompt with its last logits; chunks
end where one is due. All but the last point enter the prompt cache as spare (evicted first, with the whole
prompt's): the last is where the conversation's next turn continues. A prompt cancelled part way keeps those it
passed (`abandon`). Entries of the two arithmetics never meet: a runtime uses one, and the disk store's identity
names it (prompt_disk.py `layout_of`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from quantkit.runtime.model.cache import HybridCache
from quantkit.runtime.state_cache import PrefixCache, Snapshot, prefill_plan, snapshot_points

MIN_SHARED = 32  # tokens a prompt must share with one being prefilled to wait for it rather than prefill them


@dataclass(eq=False)  # a feed is itself: compared by identity
class PromptFeed:
    """A prompt being prefilled in the batch's steps: `ids` the whole prompt, `at` tokens of it in the cache."""

    ids: list[int]
    at: int
    points: list[int]  # positions (ascending, past `at`) where a snapshot is due
    hidden: bool  # keep the final norm's rows (the MTP layer pairs them with the prompt's tokens)
    cached: int  # tokens restored from the prompt cache
    started: float = field(default_factory=time.perf_counter)
    taken: list[tuple[int, dict[int, tuple[torch.Tensor, torch.Tensor]]]] = field(default_factory=list)
    rows: list[torch.Tensor] = field(default_factory=list)  # with `hidden`: the chunks' final-norm rows
    waits: PromptFeed | None = None  # the feed prefilling this one's first `part` tokens (`join`)
    part: int = 0
    cuts: list[int] | None = None  # the T-token arithmetic: where its chunks end (None: the row arithmetic)

    @property
    def kind(self) -> str:
        """Its chunks' `Segment` kind."""
        return "prefill" if self.cuts is None else "prompt"

    @property
    def left(self) -> int:
        return len(self.ids) - self.at

    def chunk(self, budget: int) -> list[int]:
        """The next chunk: up to `budget` tokens, ending where the next snapshot is due (the T-token arithmetic:
        its plan's next chunk, whatever the budget)."""
        if self.cuts is not None:
            return self.ids[self.at:next(p for p in self.cuts if p > self.at)]
        end = min(len(self.ids), self.at + budget)
        due = [p for p in self.points if self.at < p < end]
        return self.ids[self.at:due[0] if due else end]

    def fed(self, n: int, cache: HybridCache, hidden: torch.Tensor | None) -> None:
        """`n` more tokens are in `cache` (their final-norm rows `hidden`); a snapshot taken where one is due."""
        self.at += n
        if self.hidden and hidden is not None:
            self.rows.append(hidden)
        if self.at in self.points and self.at < len(self.ids):
            self.taken.append((self.at, cache.linear_copies()))


def shared(a: list[int], b: list[int]) -> int:
    """Tokens a and b share from the start."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def join(feed: PromptFeed, feeds: list[PromptFeed]) -> None:
    """Make `feed` wait for the feed in `feeds` (not itself waiting, not yet past the parting point) it shares
    the most tokens with, where that is MIN_SHARED more than it holds: that feed then takes a snapshot where they
    part (its chunks end there)."""
    best, part = None, feed.at + MIN_SHARED - 1
    for f in feeds:
        n = min(shared(feed.ids, f.ids), len(feed.ids) - 1)  # at least one token of its own left, for the logits
        if f is not feed and f.waits is None and n > part and f.at < n:
            best, part = f, n
    if best is not None:
        feed.waits, feed.part = best, part
        best.points = sorted({*best.points, part})


def waiting_for(feed: PromptFeed, feeds: list[PromptFeed]) -> list[PromptFeed]:
    """The feeds in `feeds` that wait for `feed` where it is now."""
    return [w for w in feeds if w.waits is feed and w.part == feed.at]


def parting_snapshot(feed: PromptFeed, cache: HybridCache) -> Snapshot:
    """The state where `feed` is now, for the feeds waiting there: from the linear copies `fed` took at that point
    (a snapshot was due there since `join`), which `finish` then does not store again."""
    lin = feed.taken.pop() if feed.taken and feed.taken[-1][0] == feed.at else (feed.at, cache.linear_copies())
    return cache.snapshots(feed.ids, [lin])[0]


def plan_chunks(feeds: list[PromptFeed], budget: int) -> list[tuple[PromptFeed, list[int]]]:
    """Chunks of the prompts being prefilled for one step, `budget` tokens in all, the first come first served
    (a feed that waits for another takes none; a planned chunk past what is left waits for the next step)."""
    out = []
    for f in feeds:
        if budget <= 0:
            break
        if f.waits is not None:
            continue
        ids = f.chunk(budget)
        if out and len(ids) > budget:
            break
        out.append((f, ids))
        budget -= len(ids)
    return out


def start(model: Any, ids: list[int], capacity: int, cache_: PrefixCache, boundary_ids: frozenset[int],
          hidden: bool, chunk: int = 0) -> tuple[HybridCache, PromptFeed | None, Snapshot | None]:
    """A row's cache for prompt `ids`: (cache, the feed of what is left, None) from the longest cached prefix (or
    nothing); or (cache, None, the whole prompt's snapshot) where the same prompt was prefilled before (its logits
    and, with `hidden`, its last hidden row restored with it: no token to prefill). `chunk`: the T-token
    arithmetic, its chunks cut by the prompt's plan at most `chunk` tokens long (0: the row arithmetic)."""
    room = max(capacity, len(ids))
    same = cache_.whole(ids)
    if same is not None and same.logits is not None and (not hidden or same.hidden is not None):
        return HybridCache.from_snapshot(same, model.cfg, model.layer_devices, model.dtype, room), None, same
    snap = cache_.lookup(ids)
    cache = (HybridCache.from_snapshot(snap, model.cfg, model.layer_devices, model.dtype, room) if snap is not None
             else model.new_cache(room))
    at = snap.length if snap is not None else 0
    points = (snapshot_points(ids, at, boundary_ids, cache_.keep, cache_.every) if cache_.enabled else [])
    cuts = [b for _a, b in prefill_plan(ids, at, boundary_ids, chunk)] if chunk else None
    return cache, PromptFeed(list(ids), at, points, hidden, at, cuts=cuts), None


def finish(feed: PromptFeed, cache: HybridCache, cache_: PrefixCache, logits: torch.Tensor) -> torch.Tensor | None:
    """The prompt is in: its snapshots (and the whole prompt's, with its last logits) to the prompt cache; the
    final-norm rows of every prefilled token (None without `hidden`)."""
    rows = torch.cat(feed.rows) if feed.rows else None
    whole = cache_.max_bytes > 0
    taken = [*feed.taken, (len(feed.ids), cache.linear_copies())] if whole else feed.taken
    snaps = cache.snapshots(feed.ids, taken)
    if whole:
        snaps[-1].logits = logits.clone()
        snaps[-1].hidden = rows[-1:].clone() if rows is not None else None
    last = len(feed.taken) - 1  # the point nearest the prompt's end: where its next turn continues
    for i, snap in enumerate(snaps):
        cache_.put(snap, persist=True, spare=i < last)
    return rows


def abandon(feed: PromptFeed, cache: HybridCache, cache_: PrefixCache) -> None:
    """A prompt cancelled part way: the snapshots it passed to the prompt cache (a resend prefills the rest)."""
    for snap in cache.snapshots(feed.ids, feed.taken):
        cache_.put(snap, persist=True)
    feed.taken = []


def answer_snapshot(cache: HybridCache, prompt: list[int], generated: list[int], cache_: PrefixCache) -> None:
    """The state after a finished answer (the prompt and every generated token but the last, which was never fed)
    to the prompt cache: an agent's next turn, which sends the answer back with its new message, prefills only
    the new tokens. Drafts fed past it are rewound first."""
    n = len(prompt) + len(generated) - 1
    if not cache_.enabled or n <= len(prompt) or cache.n < n:
        return
    if cache.n > n:
        try:
            cache.rewind(n)
        except ValueError:  # the drafts' positions were not kept (a row ended before its verify's rewind could)
            return
    cache_.put(cache.snapshot([*prompt, *generated][:n]), persist=True)
