"""Where generated tokens come from: one forward per token (`plain_tokens`), or speculative decoding with the model's
own MTP layer (`mtp_tokens`).

Speculative decoding: the MTP layer (runtime/model/qwen3_5_moe.py) drafts k tokens; the main model verifies the current
token and the k drafts in one forward that computes exactly what k + 1 one-token steps would (bit for bit) and keeps
its Gated DeltaNet states at every position; the longest prefix of drafts the target accepts is kept, plus the
target's own next token, and the cache is rewound to it (`HybridCache.rewind`, no recompute). Acceptance: each row's
token is the target's own, picked as without drafts (its argmax, or drawn from its sampling distribution with the
same random draws, one per token kept), and a draft is kept when it equals that token. The drafts are the MTP's
argmax (a one-hot draft distribution), for which this is the standard speculative-sampling rule (keep draft d with
probability p(d), else a token from p with d removed and renormalised), and the tokens are those of decoding without
drafts, greedy or seeded (llama.cpp's speculative loop accepts the same way). Logits processors
(`SamplingParams.hook`) see every row in order, as without drafts. How many drafts: `--mtp N`, or by default as many
as `DraftTuner` measures to decode fastest (none where drafting does not pay).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from quantkit.runtime import cpu_kernel
from quantkit.runtime.model.cache import HybridCache

MAX_DRAFT = 3
AUTO_CYCLES = 8  # verifies a draft count is timed over before the auto mode judges it


@dataclass
class DraftStats:
    draft: int  # drafts per verify asked for (auto: the count in use at the end)
    drafted: int = 0
    accepted: int = 0
    auto: bool = False  # the count was left to `DraftTuner`

    def to_dict(self) -> dict[str, int | bool]:
        out: dict[str, int | bool] = {"draft": self.draft, "drafted": self.drafted, "accepted": self.accepted}
        return {**out, "auto": True} if self.auto else out


@dataclass
class DraftTuner:
    """`--mtp` left to quantkit: the draft count that decodes fastest with this model on this machine, measured.
    A plain step is timed once (`step_s`); draft counts are tried for AUTO_CYCLES verifies each (1, then 2 and 3
    while each beats the one before), their tokens per second against the plain step's; the fastest is kept (and
    its rate kept up to date). Where one draft does not beat the plain step, two are tried only if they could
    (`could_pay`: where a verify of several rows is compute-bound, one draft can lose and two win); where no count
    beats the plain step, drafting stops, for the rest of the generation and the next ones: an MTP layer that is
    rarely right (untrained, or another model's) costs no more than a few verifies. Speculative decoding's output
    does not depend on the count, so changing it mid-way is safe."""

    step_s: float | None = None
    current: int = 1
    settled: bool = False
    off: bool = False
    timed: dict[int, list[float]] = field(default_factory=dict)  # count -> [seconds, tokens, verifies]

    def draft(self) -> int:
        return 0 if self.off else self.current

    def rate(self, k: int) -> float:
        """Tokens per second measured with k drafts (0: the plain step's)."""
        if k == 0:
            return 1.0 / self.step_s if self.step_s else 0.0
        s, t, _n = self.timed.get(k, (0.0, 0.0, 0.0))
        return t / s if s > 0 else 0.0

    def record(self, k: int, seconds: float, tokens: int) -> None:
        """One verify with k drafts took `seconds` (its drafts included) and gave `tokens`."""
        rec = self.timed.setdefault(k, [0.0, 0.0, 0.0])
        rec[0] += seconds
        rec[1] += tokens
        rec[2] += 1
        if self.settled or self.off or k != self.current or rec[2] < AUTO_CYCLES or self.step_s is None:
            return
        if k == 1 and self.rate(1) <= self.rate(0) and not self.could_pay():
            self.off = True
        elif k < MAX_DRAFT and (k == 1 or self.rate(k) > self.rate(k - 1)):
            self.current = k + 1
        else:
            self.current = max(self.timed, key=self.rate)
            self.settled = True
            self.off = self.rate(self.current) <= self.rate(0)

    def could_pay(self) -> bool:
        """Whether two drafts could beat the plain step where one did not: at best a second draft adds a^2 tokens
        to a verify's 1 + a (a: the acceptance measured with one) at no cost."""
        _s, t, n = self.timed.get(1, (0.0, 0.0, 0.0))
        if not n:
            return False
        a = t / n - 1.0
        return self.rate(1) * (1.0 + a + a * a) / (1.0 + a) > self.rate(0)

    def line(self) -> str:
        """The auto mode's state in a few words (the load line and /stats)."""
        if self.off:
            best = max(self.timed, key=self.rate)
            return (f"auto, off: {best} draft{'s' if best != 1 else ''} per step measured "
                    f"{self.rate(best) / self.rate(0):.2f}x decoding without drafts here (--mtp N forces N)")
        if self.step_s is None or not self.timed:
            return "auto: drafts 1-3 tokens per step where that measures faster than without (--mtp 0: off)"
        how = "kept" if self.settled else "trying"
        speed = f", {self.rate(self.current) / self.rate(0):.2f}x without drafts" if self.current in self.timed else ""
        return f"auto, {how} {self.current} draft{'s' if self.current != 1 else ''} per step{speed}"


class Clock:
    """Seconds spent in forwards and rewinds (what generation tok/s divides by)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def time(self, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        out = fn()
        self.seconds += time.perf_counter() - t0
        return out


Pick = Callable[[torch.Tensor, int | None], tuple[int, Any, bool]]  # (logits row, draft) -> (token, info, kept)


def time_step(model: Any, steps: int = 5) -> float:
    """Seconds of one plain decode step of `model`: the median of `steps` on a scratch cache, after one that warms
    up (what `DraftTuner` weighs its verifies against)."""
    cache = model.new_cache(steps + 1)
    times = []
    with torch.inference_mode():
        for i in range(steps + 1):
            t0 = time.perf_counter()
            cpu_kernel.argmax(model.forward([i], cache))
            times.append(time.perf_counter() - t0)
    return sorted(times[1:])[steps // 2]


def plain_tokens(model: Any, cache: HybridCache, logits: torch.Tensor, pick: Pick, clock: Clock
                 ) -> Iterator[tuple[int, Any]]:
    """A token per forward; the forward of a token runs only when the consumer asks for the next one."""
    while True:
        tok, info, _ = pick(logits, None)
        yield tok, info
        logits = clock.time(lambda tok=tok: model.forward([tok], cache))


def mtp_prefill(model: Any, mtp_cache: HybridCache, tokens: list[int], hidden: torch.Tensor, chunk: int) -> None:
    """The MTP layer's KV over a prompt: pairs (tokens[i + 1], hidden[i]) in chunks."""
    for a in range(0, len(tokens) - 1, chunk):
        b = min(a + chunk, len(tokens) - 1)
        model.mtp.forward(model, tokens[a + 1:b + 1], hidden[a:b], mtp_cache)


def mtp_tokens(model: Any, cache: HybridCache, mtp_cache: HybridCache, logits: torch.Tensor, last_hidden: torch.Tensor,
               draft: int, limit: int, pick: Pick, clock: Clock, stats: DraftStats, tuner: DraftTuner | None = None
               ) -> Iterator[tuple[int, Any]]:
    """Tokens from speculative decoding with up to `draft` drafts per verify (or as many as `tuner` says, timing
    each verify for it), none at or past position `limit` (the prompt and the token budget: no draft is made for a
    token the budget would drop; see the module docstring). `last_hidden` [1, H]: the final norm's output at the last
    cached position."""
    mtp = model.mtp
    tok, info, _ = pick(logits, None)
    yield tok, info
    pairs_tok, pairs_hid = [tok], last_hidden
    first = True  # the first verify binds the kernel's stacks to these caches: not timed for the tuner
    while True:
        if tuner is not None:
            draft = stats.draft = tuner.draft()
        # `tok` is the cache's position n; a verify yields up to k + 1 tokens from it, none past `limit`
        k = min(draft, limit - cache.n - 2)
        if k <= 0:  # no drafts the budget would keep (or the tuner stopped them): a plain step
            logits = clock.time(lambda tok=tok: model.forward([tok], cache))
            tok, info, _ = pick(logits, None)
            yield tok, info
            continue

        def drafts_then_verify(tok: int = tok, k: int = k, pairs: tuple[list[int], torch.Tensor] = (pairs_tok, pairs_hid)
                               ) -> tuple[list[int], int, torch.Tensor, torch.Tensor]:
            d, hm = mtp.draft(model, *pairs, mtp_cache)
            mark = mtp_cache.n
            ds = [d]
            for _ in range(k - 1):
                d, hm = mtp.draft(model, [ds[-1]], hm, mtp_cache)
                ds.append(d)
            lv, hv = model.forward([tok, *ds], cache, all_logits=True, keep_positions=True, hidden=True)
            return ds, mark, lv, hv

        t0 = clock.seconds
        ds, mark, lv, hv = clock.time(drafts_then_verify)
        n0 = cache.n - (k + 1)
        stats.drafted += k
        kept = 0
        for j in range(k + 1):
            tok, info, ok = pick(lv[j], ds[j] if j < k else None)
            kept += ok
            stats.accepted += ok
            yield tok, info
            if not ok:
                break
        t1 = time.perf_counter()
        cache.rewind(n0 + kept + 1)  # a rejected draft's replay is decode time too
        mtp_cache.rewind(mark)
        clock.seconds += time.perf_counter() - t1
        spent = clock.seconds - t0
        pairs_tok, pairs_hid = [*ds[:kept], tok], hv  # the MTP layer pairs the first kept + 1 rows
        if tuner is not None and not first:
            tuner.record(k, spent, kept + 1)
        first = False


def picker(sampling: Any, gen: torch.Generator | None, sample: Callable[..., int]) -> Pick:
    """The token for a row of logits, through the sampling hook, and whether it keeps the row's draft (module
    docstring's rule: the token decoding without drafts would pick there, and the draft kept where they agree)."""
    hook = sampling.hook

    def pick(logits: torch.Tensor, draft: int | None) -> tuple[int, Any, bool]:
        tok = sample(logits if hook is None else hook.process(logits), sampling, gen)
        return tok, (None if hook is None else hook.accept(tok)), draft is not None and tok == draft

    return pick
