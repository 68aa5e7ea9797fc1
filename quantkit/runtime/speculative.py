"""Where generated tokens come from: one forward per token (`plain_tokens`), or speculative decoding with the
model's own MTP layer (`mtp_tokens`).

Speculative decoding: the MTP layer (runtime/model/mtp.py) drafts k tokens; the main model verifies the current
token and the k drafts in one forward that computes exactly what k + 1 one-token steps would (bit for bit) and
keeps its Gated DeltaNet states at every position; the longest prefix of drafts the target accepts is kept, plus
the target's own next token, and the cache is rewound to it (`HybridCache.rewind`, no recompute). Acceptance:
greedy, a draft is kept when it is the target's argmax, so the output equals decoding without drafts; sampling,
the drafts are the MTP's argmax (a one-hot draft distribution), so the standard speculative-sampling rule is:
keep draft d with probability p(d) under the target's sampling distribution, else draw from p with d removed
and renormalised; the output distribution is the target's. Logits processors (`SamplingParams.hook`) see every
row in order, as without drafts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from quantkit.runtime import cpu_kernel
from quantkit.runtime.model.cache import HybridCache

MAX_DRAFT = 3


@dataclass
class DraftStats:
    draft: int  # drafts per verify asked for
    drafted: int = 0
    accepted: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"draft": self.draft, "drafted": self.drafted, "accepted": self.accepted}


class Clock:
    """Seconds spent in forwards (what generation tok/s divides by)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def time(self, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        out = fn()
        self.seconds += time.perf_counter() - t0
        return out


Pick = Callable[[torch.Tensor, int | None], tuple[int, Any, bool]]  # (logits row, draft) -> (token, info, kept)


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
               draft: int, limit: int, pick: Pick, clock: Clock, stats: DraftStats) -> Iterator[tuple[int, Any]]:
    """Tokens from speculative decoding with up to `draft` drafts per verify, never past `limit` positions in
    `cache` (see the module docstring). `last_hidden` [1, H]: the final norm's output at the last cached position."""
    mtp = model.mtp
    tok, info, _ = pick(logits, None)
    yield tok, info
    pairs_tok, pairs_hid = [tok], last_hidden
    while True:
        k = min(draft, limit - cache.n - 1)
        if k <= 0:  # no room for drafts: a plain step
            logits = clock.time(lambda tok=tok: model.forward([tok], cache))
            tok, info, _ = pick(logits, None)
            yield tok, info
            continue

        def drafts_then_verify(tok: int = tok, k: int = k, pairs: tuple[list[int], torch.Tensor] = (pairs_tok, pairs_hid)
                               ) -> tuple[list[int], int, torch.Tensor, torch.Tensor]:
            lg, hm = mtp.forward(model, *pairs, mtp_cache)
            mark = mtp_cache.n
            ds = [cpu_kernel.argmax(lg)]
            for _ in range(k - 1):
                lg, hm = mtp.forward(model, [ds[-1]], hm, mtp_cache)
                ds.append(cpu_kernel.argmax(lg))
            lv, hv = model.forward([tok, *ds], cache, all_logits=True, keep_positions=True, hidden=True)
            return ds, mark, lv, hv

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
        cache.rewind(n0 + kept + 1)
        mtp_cache.rewind(mark)
        pairs_tok, pairs_hid = [*ds[:kept], tok], hv[:kept + 1]


def picker(sampling: Any, gen: torch.Generator | None, sample: Callable[..., int],
           candidates: Callable[..., tuple[torch.Tensor | None, torch.Tensor]]) -> Pick:
    """The token for a row of logits, through the sampling hook, and whether it keeps the row's draft (module
    docstring's rule)."""
    hook = sampling.hook

    def pick(logits: torch.Tensor, draft: int | None) -> tuple[int, Any, bool]:
        lg = logits if hook is None else hook.process(logits)
        if draft is None or sampling.temperature == 0:
            tok = sample(lg, sampling, gen)
            kept = draft is not None and tok == draft
        else:
            ids, probs = candidates(lg, sampling)
            where = (ids == draft).nonzero() if ids is not None else torch.tensor([[draft]])
            p_draft = float(probs[where[0, 0]]) if where.numel() else 0.0
            if float(torch.rand((), generator=gen)) < p_draft:
                tok, kept = draft, True
            else:
                rest = probs.clone()
                if where.numel():
                    rest[where[0, 0]] = 0.0
                j = int(torch.multinomial(rest / rest.sum(), 1, generator=gen))
                tok, kept = (int(ids[j]) if ids is not None else j), False
        return tok, (None if hook is None else hook.accept(tok)), kept

    return pick
