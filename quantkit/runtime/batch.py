"""`BatchGenerator`: several conversations decoded together, one batched forward per token for all of them.

    from quantkit.runtime import BatchGenerator, load_model

    rt = load_model("/tmp/q4")
    batch = BatchGenerator(rt)
    a = batch.add(messages_a, temperature=0, max_new_tokens=64)          # prefilled in the next steps
    b = batch.add(messages_b, seed=1, max_new_tokens=32, stop_ids=set())
    b2 = batch.fork(b)                                                   # another choice, its prompt not prefilled again
    while batch:
        for row, ev in batch.step():                                     # one token for every row
            ...                                                          # ev as generate_stream yields it
    batch.cancel(a)                                                      # the row ends at the next step

Each row has its own sampling (temperature, top-k / top-p, seed, hook), stop tokens and token budget; a fork
inherits its parent's (temperature, top-p / top-k, max_new_tokens, ignore_eos, stop tokens, thinking), with the
seed the parent's + 1, + 2, ... per fork (None stays None) and no hook, unless given (`fork`); a row
leaves the batch when it ends (stop token, its max_new_tokens, the context, `cancel`, or "error": its sampling
hook raised, kept in `errors`, the other rows unaffected) and a new one joins between steps, its prompt (past
the longest prefix the prompt cache holds) prefilled in chunks inside the next steps beside the decoding rows,
in the runtime's arithmetic (`Runtime.set_prefill`, runtime/batch_prompts.py). A step is one
`Model.forward_batch` over every row still decoding and those chunks (model/qwen3_5_moe.py): the dense matrices
and the chosen experts are read once for all rows, and each row's tokens are the ones the same request generates
alone, greedy or seeded (tests/runtime/test_batch_decode.py, test_batch_rows.py).

MTP: on a model with an MTP layer each row has its own drafter (runtime/batch_drafts.py) as the runtime sets it
(`Runtime.set_mtp`: --mtp N drafts N a row, the default decides per step, 0 none). A row that drafts k tokens
is a verify of k + 1 tokens inside the step's one forward, rewound to the tokens accepted, one to k + 1 tokens a
step; how many each row drafts follows the measured cost of a step of that shape (`DraftPlan`), so a row alone
drafts as `generate` does and several rows draft where the larger step still pays. A draft never changes a
token; each response carries its counts (`mtp`: drafted, accepted).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from quantkit.errors import ArgumentError, ArgumentTypeError, QuantkitError
from quantkit.runtime import args, batch_prompts
from quantkit.runtime.batch_drafts import DraftPlan, RowDrafter
from quantkit.runtime.batch_prompts import PromptFeed
from quantkit.runtime.channels import ANSWER, THINKING, ChannelSplitter
from quantkit.runtime.devices import release_free_heap
from quantkit.runtime.generate import (
    PREFILL_CHUNK,
    TRIM_AFTER_PREFILL,
    GenerationResponse,
    SamplingParams,
    TokenEvent,
    peak_memory,
    sample,
)
from quantkit.runtime.model.cache import HybridCache
from quantkit.runtime.model.qwen3_5_moe import Segment
from quantkit.runtime.speculative import MAX_DRAFT, DraftStats, Pick, picker

if TYPE_CHECKING:
    from quantkit.runtime.engine import Runtime


@dataclass
class _Row:
    id: int
    prompt_ids: list[int]
    sampling: SamplingParams
    stops: set[int]
    cache: HybridCache
    logits: torch.Tensor | None  # [t, V]: the rows the next tokens are picked from; None when cancelled in prefill
    pick: Pick
    budget: int
    split: ChannelSplitter
    cached_tokens: int
    prefill_seconds: float
    cancel: threading.Event | None
    generated: list[int] = field(default_factory=list)
    decode_seconds: float = 0.0
    stop_ids: set[int] | None = None  # as given to `add` (None: the model's), what a fork inherits
    forks: int = 0  # rows forked from this one: the n-th takes seed + n
    drafter: RowDrafter | None = None  # the row's MTP state (None: it decodes without drafts)
    fixed: int | None = None  # --mtp N for this row (None: the plan's choice)
    stats: DraftStats | None = None  # its drafts' counts (None: MTP off for it)
    hidden: torch.Tensor | None = None  # the final norm's output of the rows of `logits` (what the drafter pairs)
    feed: PromptFeed | None = None  # the row arithmetic: the prompt still being prefilled in the steps
    follows: int | None = None  # a fork of a row still prefilling: it takes that row's prompt state when it is in
    mtp_cache: HybridCache | None = None  # the row arithmetic: its drafter's MTP cache, made when it joined


class BatchGenerator:
    """Conversations of one `Runtime` decoded together (module docstring)."""

    def __init__(self, rt: Runtime, max_rows: int | None = None):
        if max_rows is not None and args.whole(max_rows, "max_rows") < 1:
            raise ArgumentError(f"max_rows={max_rows}: a batch needs at least one row")
        self.rt, self.max_rows = rt, max_rows
        self._rows: dict[int, _Row] = {}
        self._ended: list[tuple[int, TokenEvent]] = []  # rows that ended outside a step (cancelled prefill)
        self._ids = itertools.count()
        self.errors: dict[int, Exception] = {}  # rows that ended with finish_reason "error": what their hook raised
        self._fixed_plan = DraftPlan()  # the plan's step costs where the runtime's MTP is --mtp N (no plan of its own)
        self._timed: tuple[int, int, float] | None = None  # the last forward (rows, tokens, seconds), its rewinds due

    @property
    def plan(self) -> DraftPlan:
        """Drafts per row at a step for rows on the default (auto): the runtime's plan, kept across generations and
        read at each use, so `Runtime.set_mtp` reaches a batch already running."""
        return self.rt.draft_plan if self.rt.draft_plan is not None else self._fixed_plan

    def __len__(self) -> int:
        """Rows still decoding (or with their last event not yet given out by `step`)."""
        return len(self._rows) + len(self._ended)

    @property
    def rows(self) -> list[int]:
        return list(self._rows)

    def add(self, messages: list[dict[str, Any]] | None = None, *, ids: list[int] | None = None,
            tools: list[dict[str, Any]] | None = None, enable_thinking: bool = True,
            sampling: SamplingParams | None = None, stop_ids: set[int] | None = None,
            cancel: threading.Event | None = None, **sampling_kw: Any) -> int:
        """Add a conversation (chat `messages`, or prompt `ids` already rendered) to the batch: its cache starts
        at the longest prefix the prompt cache holds, the rest of its prompt is prefilled in chunks inside the next
        steps, and its first token comes at the step that ends the prompt. Sampling as `Runtime.generate_stream`
        takes it; `stop_ids` as `Runtime.generate_ids`. Returns the row's id. Every argument is checked here
        (quantkit/runtime/args.py: ArgumentError / ArgumentTypeError naming it)."""
        rt = self.rt
        if (messages is None) == (ids is None):
            raise ArgumentTypeError("add takes messages or ids: give exactly one of them")
        sp = rt.sampling(sampling, **sampling_kw)
        stop_ids = args.stop_token_ids(stop_ids, rt.model.vocab)
        args.event(cancel)
        if messages is not None:
            ids = rt.render_ids(messages, tools, enable_thinking)[1]
        else:
            ids = args.token_ids(ids, rt.model.vocab)
            args.tools(tools)
            args.flag(enable_thinking, "enable_thinking")
        if self.max_rows is not None and len(self._rows) >= self.max_rows:
            raise QuantkitError(f"the batch is full ({self.max_rows} rows): wait for a row to end")
        n = len(ids)
        if n == 0:
            raise QuantkitError("empty prompt: give some text")
        if n >= rt.context:
            raise QuantkitError(f"the prompt is {n} tokens; the context holds {rt.context} "
                                "(shorten it, or run with a larger --context)")
        stops = set() if sp.ignore_eos else rt.stop_ids if stop_ids is None else stop_ids
        gen = torch.Generator().manual_seed(sp.seed) if sp.seed is not None else None
        fixed, stats, drafts = self._mtp()
        capacity = min(rt.context, n + sp.max_new_tokens)
        ids = list(ids)
        with rt._lock, torch.inference_mode():
            cache, feed, same = batch_prompts.start(rt.model, ids, capacity, rt.prompt_cache, rt.boundary_ids, drafts,
                                                    0 if self.row_arithmetic else PREFILL_CHUNK)
        if feed is not None and self.row_arithmetic:  # one being prefilled shares its start: wait where they part
            batch_prompts.join(feed, [r.feed for r in self._rows.values() if r.feed is not None])
        budget = min(sp.max_new_tokens, rt.context - n)
        row = _Row(next(self._ids), ids, sp, stops, cache, None, picker(sp, gen, sample), budget,
                   ChannelSplitter(rt.tokenizer, rt.think_ids, enable_thinking),
                   n if same is not None else feed.at, 0.0, cancel, stop_ids=stop_ids, fixed=fixed, stats=stats,
                   feed=feed)
        if drafts and budget > 1:  # made now, in the order rows join (its prompt pairs go in when the prompt is)
            row.mtp_cache = rt.model.mtp.new_cache(capacity)
        if same is not None:  # the same prompt again: its state and last logits, no token to prefill
            assert same.logits is not None
            row.logits = same.logits.clone().view(1, -1)
            if drafts and budget > 1:
                assert same.hidden is not None
                with rt._lock, torch.inference_mode():
                    row.drafter = RowDrafter.prefilled(rt.model, [], same.hidden.clone(), capacity, stats,
                                                       PREFILL_CHUNK, row.mtp_cache)
        self._rows[row.id] = row
        return row.id

    @property
    def row_arithmetic(self) -> bool:
        """Prompts compute as one-token steps (`Runtime.set_prefill("rows")`): snapshots anywhere, shared starts
        prefilled once, answers snapshotted."""
        return self.rt.prefill == "rows"

    def fork(self, row: int, sampling: SamplingParams | None = None, *, stop_ids: set[int] | None = None,
             cancel: threading.Event | None = None, **sampling_kw: Any) -> int:
        """Another choice of `row`'s prompt, without prefilling it again: a new row in a copy of that row's prompt
        state (HybridCache snapshot), its tokens the ones the same request generates alone. Only before `row`
        takes its first step (its state is still the prompt's). Returns the new row's id.

        What the fork inherits, as `n` choices of one request share them (vLLM's and the server's `n`): without
        `sampling`, the parent's sampling (temperature, top_p, top_k, max_new_tokens, ignore_eos), its seed + k
        for the parent's k-th fork (choice k of a request seeded s runs with s + k; an unseeded parent's forks are
        unseeded) and no hook (a hook holds one row's state); `sampling` replaces all of that, and `sampling_kw`
        overrides single fields of either (None keeps). The parent's stop tokens unless `stop_ids` is given; its
        thinking switch; never its `cancel` (each row has its own)."""
        rt = self.rt
        row = args.whole(row, "row")
        r = self._rows.get(row)
        # the row arithmetic: a prompt still being prefilled is forked by waiting for it (`_prompt_in` copies it)
        waits = r is not None and not r.generated and (r.feed is not None or r.follows is not None)
        if r is None or r.generated or (r.logits is None and not waits):
            raise QuantkitError(f"row {row} has no prompt state left to fork: fork before its first step")
        if sampling is None:
            seed = r.sampling.seed
            sampling = replace(r.sampling, hook=None, seed=None if seed is None else seed + r.forks + 1)
        sp = rt.sampling(sampling, **sampling_kw)
        stop_ids = r.stop_ids if stop_ids is None else args.stop_token_ids(stop_ids, rt.model.vocab)
        args.event(cancel)
        if self.max_rows is not None and len(self._rows) >= self.max_rows:
            raise QuantkitError(f"the batch is full ({self.max_rows} rows): wait for a row to end")
        n = len(r.prompt_ids)
        stops = set() if sp.ignore_eos else rt.stop_ids if stop_ids is None else stop_ids
        gen = torch.Generator().manual_seed(sp.seed) if sp.seed is not None else None
        capacity = min(rt.context, n + sp.max_new_tokens)
        budget = min(sp.max_new_tokens, rt.context - n)
        stats = DraftStats(r.fixed or 0, auto=r.fixed is None) if r.stats is not None else None
        split = ChannelSplitter(rt.tokenizer, rt.think_ids, r.split.channel == THINKING)
        if waits:
            new = _Row(next(self._ids), list(r.prompt_ids), sp, stops, r.cache, None, picker(sp, gen, sample), budget,
                       split, 0, 0.0, cancel, stop_ids=stop_ids, fixed=r.fixed, stats=stats,
                       follows=r.follows if r.follows is not None else r.id)
            if r.mtp_cache is not None and stats is not None and budget > 1:
                new.mtp_cache = rt.model.mtp.new_cache(capacity)
        else:
            with rt._lock, torch.inference_mode():
                src = r.cache
                cache = HybridCache.from_snapshot(src.snapshot(r.prompt_ids), src.cfg, src.devices, src.dtype,
                                                  capacity)
                assert r.logits is not None
                logits = r.logits.clone()
                drafter = (r.drafter.fork(rt.model, stats) if r.drafter is not None and stats is not None
                           and budget > 1 else None)
            new = _Row(next(self._ids), list(r.prompt_ids), sp, stops, cache, logits, picker(sp, gen, sample),
                       budget, split, n, 0.0, cancel, stop_ids=stop_ids, drafter=drafter, fixed=r.fixed, stats=stats)
        r.forks += 1
        self._rows[new.id] = new
        return new.id

    def cancel(self, row: int) -> None:
        """End a row: it gives its last event ("cancelled") at the next step and leaves the batch."""
        r = self._rows.get(row)
        if r is not None:
            r.cancel = r.cancel or threading.Event()
            r.cancel.set()

    def step(self) -> list[tuple[int, TokenEvent]]:
        """One batched forward of the rows that went on at the last step (each with the drafts the plan gives it),
        then the tokens of every row (one, or a verify's accepted drafts and one; a row just added, its first).
        Returns (row id, event) pairs: a token's event as `generate_stream` yields it, and a row's last event
        (response set) when it ends."""
        with self.rt._lock, torch.inference_mode():
            return self._step()

    def _mtp(self) -> tuple[int | None, DraftStats | None, bool]:
        """The runtime's MTP setting for a new row: --mtp N (None: the plan's choice), the counts its response
        reports (None: MTP off) and whether it drafts (not where the plan has turned drafting off)."""
        rt = self.rt
        fixed = None if rt.draft_plan is not None else rt.mtp
        if rt.model.mtp is None or fixed == 0:
            return fixed, None, False
        return fixed, DraftStats(fixed or 0, auto=fixed is None), fixed is not None or not self.plan.off()

    def _step(self) -> list[tuple[int, TokenEvent]]:
        """`step`, under the runtime's lock (held by the caller): one forward of the rows whose last token has not
        been through the model yet, then every row's tokens from its logits (a row just added picks its first
        from the prompt's), so a token's event never waits for the forward of the next."""
        out, self._ended = self._ended, []
        for r in list(self._rows.values()):  # a prompt cancelled while it is prefilled ends now
            if (r.feed is not None or r.follows is not None) and r.cancel is not None and r.cancel.is_set():
                if r.feed is not None:
                    batch_prompts.abandon(r.feed, r.cache, self.rt.prompt_cache)
                self._end(r, "cancelled", out)
        go = [r for r in self._rows.values() if r.logits is None and r.feed is None and r.follows is None]
        if any(r.drafter is not None and r.fixed is None for r in go) and self.plan.off():
            for r in go:
                if r.fixed is None:
                    r.drafter = None
        feeds = [r for r in self._rows.values() if r.feed is not None]
        if go or feeds:
            self._forward(go, feeds)
        t0 = time.perf_counter()
        for r in list(self._rows.values()):
            if r.feed is None and r.follows is None:  # not a prompt still being prefilled
                self._take(r, out)
        if self._timed is not None:  # the forward's cost, its rewinds (just made) included
            rows, tokens, secs = self._timed
            self.plan.record(rows, tokens, secs + time.perf_counter() - t0)
            self._timed = None
        if any(ev.response is not None for _r, ev in out):
            # the disk store's writes of the prompts prefilled since, after an answer (not before its tokens)
            self.rt.prompt_cache.flush()
        return out

    def _take(self, r: _Row, out: list[tuple[int, TokenEvent]]) -> None:
        """Row r's tokens from its logits rows (a verify's: its drafts kept while they are the tokens picked),
        its cache rewound to them; its events into `out`, its last one where it ends."""
        if r.cancel is not None and r.cancel.is_set():
            self._end(r, "cancelled", out)
            return
        assert r.logits is not None
        d = r.drafter
        drafts = d.drafts if d is not None else []
        toks: list[tuple[int, Any]] = []
        kept = 0
        try:
            for j in range(len(drafts) + 1):
                tok, info, ok = r.pick(r.logits[j], drafts[j] if j < len(drafts) else None)
                toks.append((tok, info))
                kept += ok
                if not ok or tok in r.stops:
                    break
        except Exception as e:  # the row's own sampling hook (a grammar, a penalty): it ends alone
            self.errors[r.id] = e
            self._emit(r, toks, out)
            self._end(r, "error", out)
            return
        if drafts:
            assert d is not None
            self.plan.count(*d.checked(kept))
        finish = self._emit(r, toks, out)
        if finish is not None:
            self._end(r, finish, out)
            return
        t0 = time.perf_counter()
        if drafts:
            r.cache.rewind(r.cache.n - len(drafts) + kept)
        if d is not None:
            d.took(self.rt.model, [t for t, _i in toks], r.hidden)
        r.decode_seconds += time.perf_counter() - t0
        r.logits = r.hidden = None

    def _emit(self, r: _Row, toks: list[tuple[int, Any]], out: list[tuple[int, TokenEvent]]) -> str | None:
        """The picked tokens into the row and their events into `out`; how the row ends there, or None."""
        for tok, info in toks:
            r.generated.append(tok)
            i = len(r.generated) - 1
            if tok in r.stops:
                return "stop"
            channel, delta = r.split.feed(tok)
            out.append((r.id, TokenEvent(delta, tok, channel, i, cached_tokens=r.cached_tokens, info=info,
                                         drafts=r.stats)))
            if i == r.budget - 1:
                return "length" if r.budget == r.sampling.max_new_tokens else "context"
        return None

    def _end(self, r: _Row, finish: str, out: list[tuple[int, TokenEvent]]) -> None:
        del self._rows[r.id]
        heirs = [k for k in self._rows.values() if k.follows == r.id]
        if heirs and r.feed is not None:  # its forks still wait for the prompt: the first carries it on
            heirs[0].feed, heirs[0].follows, heirs[0].cache = r.feed, None, r.cache
            for k in heirs[1:]:
                k.follows = heirs[0].id
        elif r.feed is not None:  # prompts that waited for this one's start prefill it themselves
            for k in self._rows.values():
                if k.feed is not None and k.feed.waits is r.feed:
                    k.feed.waits = None
        if self.row_arithmetic and finish in ("stop", "length") and r.feed is None and r.follows is None:
            batch_prompts.answer_snapshot(r.cache, r.prompt_ids, r.generated, self.rt.prompt_cache)
        out.append((r.id, self._last(r, finish)))

    def _forward(self, go: list[_Row], feeds: list[_Row]) -> None:
        """Drafts for the rows the plan gives them to, then one forward of every row's token and drafts and of
        the waiting prompts' chunks (`batch_prompts.plan_chunks`: PREFILL_CHUNK tokens in all)."""
        # no draft for a token past the budget: a verify's k + 1 tokens all within it
        limits = [min(MAX_DRAFT, r.budget - len(r.generated) - 1) if r.drafter is not None else 0 for r in go]
        counts = self.plan.counts(limits, [r.drafter.acceptance if r.drafter is not None else (0, 0) for r in go])
        t0 = time.perf_counter()
        drafted, short = 0, True
        for r, n, k in zip(go, limits, counts, strict=True):
            if r.drafter is None:
                continue
            if r.fixed is not None:  # --mtp N (set for this row when it joined)
                k = min(r.fixed, n)
            else:
                r.drafter.stats.draft = k
            if k:
                _ds, fed_short = r.drafter.draft(self.rt.model, k)
                drafted, short = drafted + k, short and fed_short
        t1 = time.perf_counter()
        if drafted and short:
            self.plan.record_drafts(drafted, t1 - t0)
        segs = [[r.generated[-1], *(r.drafter.drafts if r.drafter is not None else [])] for r in go]
        chunks = batch_prompts.plan_chunks([r.feed for r in feeds if r.feed is not None], PREFILL_CHUNK)
        by_feed = {id(r.feed): r for r in feeds}
        hidden = any(r.drafter is not None for r in go) or any(f.hidden for f, _ids in chunks)
        batch = [Segment(r.cache, seg, "decode" if len(seg) == 1 else "verify") for r, seg in zip(go, segs, strict=True)]
        batch += [Segment(by_feed[id(f)].cache, ids, f.kind) for f, ids in chunks]
        outs = self.rt.model.forward_batch(batch, hidden=hidden)
        t2 = time.perf_counter()
        if not chunks:  # a step's cost for the draft plan: decode rows alone
            self._timed = (len(go), sum(map(len, segs)), t2 - t1)
        for r, o in zip(go, outs[:len(go)], strict=True):
            r.logits, r.hidden = o.logits, o.hidden
            r.decode_seconds += t2 - t0
        for (f, ids), o in zip(chunks, outs[len(go):], strict=True):
            r = by_feed[id(f)]
            f.fed(len(ids), r.cache, o.hidden)
            self._part(r)
            if f.left == 0:
                self._prompt_in(r, o.logits)

    def _part(self, r: _Row) -> None:
        """The prompts waiting for row r's where it is now (they share its tokens so far) restore its state there:
        a snapshot, kept in the prompt cache too (the point where prompts part)."""
        f = r.feed
        assert f is not None
        rows = [k for k in self._rows.values() if k.feed is not None]
        waiting = batch_prompts.waiting_for(f, [k.feed for k in rows if k.feed is not None])
        if not waiting:
            return
        snap = batch_prompts.parting_snapshot(f, r.cache)
        self.rt.prompt_cache.put(snap, persist=True)
        for k in rows:
            w = k.feed
            if w in waiting:
                assert w is not None
                k.cache = HybridCache.from_snapshot(snap, r.cache.cfg, r.cache.devices, r.cache.dtype,
                                                    k.cache.capacity)
                w.at = w.cached = f.at
                w.waits = None

    def _prompt_in(self, r: _Row, logits: torch.Tensor) -> None:
        """Row r's prompt is in (the row arithmetic): its snapshots stored, its first token's logits set, its
        drafter made; the rows that forked it take a copy of its state."""
        rt, f = self.rt, r.feed
        assert f is not None
        rows = batch_prompts.finish(f, r.cache, rt.prompt_cache, logits[-1])
        r.feed, r.logits, r.cached_tokens = None, logits.view(1, -1), f.cached
        r.prefill_seconds = time.perf_counter() - f.started
        capacity = r.cache.capacity
        if r.stats is not None and rows is not None and r.budget > 1:
            r.drafter = RowDrafter.prefilled(rt.model, f.ids[f.cached:], rows, capacity, r.stats, PREFILL_CHUNK,
                                             r.mtp_cache)
        if len(f.ids) - f.cached >= TRIM_AFTER_PREFILL:
            release_free_heap()
        for k in [k for k in self._rows.values() if k.follows == r.id]:
            k.cache = HybridCache.from_snapshot(r.cache.snapshot(r.prompt_ids), r.cache.cfg, r.cache.devices,
                                                r.cache.dtype, capacity)
            k.logits, k.follows, k.cached_tokens = r.logits.clone(), None, r.cached_tokens
            k.prefill_seconds = r.prefill_seconds
            if r.drafter is not None and k.stats is not None and k.budget > 1:
                k.drafter = r.drafter.fork(rt.model, k.stats, k.mtp_cache)

    def run(self) -> Iterator[tuple[int, TokenEvent]]:
        """`step` until every row has ended, its events one by one."""
        while self:
            yield from self.step()

    def _last(self, r: _Row, finish: str) -> TokenEvent:
        """A row's final event and its response (generation tok/s over the steps after the first token)."""
        n_gen = len(r.generated)
        steps = max(0, n_gen - 1) if finish != "cancelled" else n_gen
        t_dec, t_pre = r.decode_seconds, r.prefill_seconds
        n = len(r.prompt_ids)
        resp = GenerationResponse(
            text=r.split.text(ANSWER).strip(), thinking=r.split.text(THINKING),
            token=r.generated[-1] if r.generated else None, prompt_tokens=n, generation_tokens=n_gen,
            prompt_tps=(n - r.cached_tokens) / t_pre if t_pre > 0 else 0.0,
            generation_tps=steps / t_dec if t_dec > 0 and steps else 0.0,
            peak_memory=peak_memory(self.rt._io_devices()), finish_reason=finish, prefill_seconds=t_pre,
            decode_seconds=t_dec, token_ids=list(r.generated), cached_tokens=r.cached_tokens,
            mtp=r.stats.to_dict() if r.stats is not None else None)
        r.cache = None  # type: ignore[assignment]  # the row's state is given back now, not when the batch goes
        return TokenEvent("", None, r.split.channel, n_gen, resp, r.cached_tokens)
