"""MTP drafts inside a batch (`BatchGenerator`, runtime/batch.py): each row's own drafter, and how many tokens each
row drafts at a step.

`RowDrafter`: one row's state for the model's MTP layer: its own MTP cache (the pairs (token x_(p+1), hidden h_p) of
its sequence), the pairs not fed to it yet, the mark its drafts are rewound to, and its counts (`DraftStats`: per
response `draft_n` / `draft_n_accepted`). A row that decodes without drafts at a step still collects its pair (the
batch's forward gives the hidden), so a later draft sees the whole sequence; pairs are fed at the row's next draft,
or in one chunk past CATCH_UP. Its verify is a segment of the batch's one forward (`Model.step_batch`): the row's
token and its k drafts, positions kept, the cache rewound to the tokens accepted (runtime/speculative.py: the rule
that keeps a draft); the tokens are those the row generates without drafts.

`DraftPlan`: drafts per row at a step where the count is left to quantkit (the default; `--mtp N` drafts N a row,
fewer where its budget ends): the counts with the most tokens per second by what steps of that shape measured:
the seconds of a forward of S rows carrying R tokens (R - S of them drafts; the median of its last COST_SAMPLES,
rewinds included; none older than FORGET steps, so the choice follows the machine's load), the seconds of a draft, and each row's acceptance p (accepted / drafts examined, its own
counts weighed with all rows'; FIRST_ACCEPTANCE for every row until EXPLORE drafts were examined): k drafts yield
1 + p + ... + p^k tokens on average. For each total of drafts the rows likeliest to accept their next one take
them; the total with the best tokens per second is kept. A shape costs at least what a measured shape of as many
rows and fewer tokens cost (more tokens never cost less); shapes are tried upward from the S rows without drafts,
measured first: the next shape not measured is tried when it would be best even at the last one's price, then
judged on its own time. One row alone is `generate`'s case (the runtime keeps one plan, `Runtime.draft_plan`,
across its generations and the server's batch); several rows draft where the larger step still pays
(reports/bench-serve-policy.json: at 2 slots 4 token rows cost little more than 2, at 4 slots 8 cost twice 4).
Where even a lone row's best count is 0, the plan is `off` for good: new rows carry no drafter (an MTP layer that
is rarely right costs a few verifies).
"""

from __future__ import annotations

import itertools
import statistics
from collections import deque
from typing import Any

import torch

from quantkit.runtime.model.cache import HybridCache
from quantkit.runtime.model.executors import STACK_PAIRS
from quantkit.runtime.speculative import MAX_DRAFT, DraftStats, mtp_prefill

CATCH_UP = 512  # pairs a row not drafting collects before feeding them to its MTP cache in one chunk
COST_SAMPLES = 8  # steps of one shape its cost is the median of
FORGET = 256  # steps after which a shape's samples are old: it is measured again (the machine's load moves)
PRIOR = 4.0  # drafts examined that the pooled acceptance weighs as in a row's own estimate
EXPLORE = 16  # drafts examined (all rows) before their acceptance is used: until then every row's is taken as
FIRST_ACCEPTANCE = 0.75  # this (enough to try drafting where it could pay)


class RowDrafter:
    """One batch row's MTP state (module docstring)."""

    def __init__(self, cache: HybridCache, stats: DraftStats, tokens: list[int], hidden: list[torch.Tensor]):
        self.cache = cache
        # pairs not fed yet: tokens[i] with hidden[i] [1, H], the hidden of the position before it (after the
        # prompt, the last prompt position's hidden waits for the first token)
        self.tokens, self.hidden = tokens, hidden
        self.stats = stats
        self.examined = 0  # drafts compared with the target's token (a draft after a rejected one is not)
        self.mark = 0  # the MTP cache's fill before the drafts chained on its own output
        self.drafts: list[int] = []  # the drafts of the step in flight

    @classmethod
    def prefilled(cls, model: Any, prompt: list[int], hidden: torch.Tensor, capacity: int, stats: DraftStats,
                  chunk: int, cache: HybridCache | None = None) -> RowDrafter:
        """A drafter for a prompt prefilled with its hidden rows (`prompt` the prefilled tokens, hidden [T, H]), in
        `cache` (an empty MTP cache made when the row joined; None: a new one)."""
        cache = model.mtp.new_cache(capacity) if cache is None else cache
        mtp_prefill(model, cache, prompt, hidden, chunk)
        return cls(cache, stats, [], [hidden[-1:]])

    def fork(self, model: Any, stats: DraftStats, cache: HybridCache | None = None) -> RowDrafter:
        """A copy for another row in a copy of this row's state (its MTP cache copied into `cache`, an empty one
        made when the fork joined, or a new one; its pairs shared)."""
        src = self.cache
        cache = model.mtp.new_cache(src.capacity) if cache is None else cache
        cache.reserve(src.n + 1)
        for i in src.keys:
            cache.keys[i][:, :src.n].copy_(src.keys[i][:, :src.n])
            cache.values[i][:, :src.n].copy_(src.values[i][:, :src.n])
        cache.n = src.n
        return RowDrafter(cache, stats, list(self.tokens), list(self.hidden))

    @property
    def acceptance(self) -> tuple[int, int]:
        return self.stats.accepted, self.examined

    def draft(self, model: Any, k: int) -> tuple[list[int], bool]:
        """k drafts after the row's last token (its pairs fed first); and whether that feed was a short one (the
        time then is a draft's own)."""
        mtp = model.mtp
        fed = len(self.tokens)
        d, hm = mtp.draft(model, self.tokens, torch.cat(self.hidden), self.cache)
        self.mark = self.cache.n
        ds = [d]
        for _ in range(k - 1):
            d, hm = mtp.draft(model, [ds[-1]], hm, self.cache)
            ds.append(d)
        self.tokens, self.hidden, self.drafts = [], [], ds
        return ds, fed <= STACK_PAIRS

    def checked(self, kept: int) -> tuple[int, int]:
        """The step's drafts were checked, the first `kept` accepted: counted; (accepted, examined) of them."""
        k = len(self.drafts)
        examined = kept + (kept < k)
        self.stats.drafted += k
        self.stats.accepted += kept
        self.examined += examined
        return kept, examined

    def took(self, model: Any, tokens: list[int], hidden: torch.Tensor | None) -> None:
        """The row's step gave `tokens` (accepted drafts, then its own token), the hidden rows of the positions
        before them the first len(tokens) rows of `hidden` (None: the prompt's first token, whose hidden is
        the prompt's last); its drafts' pairs are dropped from the MTP cache."""
        if self.drafts:
            self.cache.rewind(self.mark)
            self.drafts = []
        self.tokens += tokens
        if hidden is not None:
            self.hidden += list(hidden[:len(tokens)].split(1))
        if len(self.tokens) > CATCH_UP:  # all but the last pair, which the next draft starts from
            model.mtp.forward(model, self.tokens[:-1], torch.cat(self.hidden[:-1]), self.cache)
            self.tokens, self.hidden = self.tokens[-1:], self.hidden[-1:]


class DraftPlan:
    """Drafts per row at a batch step, where the count is left to quantkit (module docstring)."""

    def __init__(self) -> None:
        self.costs: dict[tuple[int, int], deque[tuple[int, float]]] = {}  # shape -> (step, seconds)
        self.steps = 0  # forwards recorded
        self.draft_s: deque[float] = deque(maxlen=COST_SAMPLES)  # seconds per draft
        self.accepted = self.examined = 0  # every row's, since the plan began

    def acceptance(self, accepted: int, examined: int) -> float:
        """A row's acceptance: FIRST_ACCEPTANCE until EXPLORE drafts were examined, then its own counts weighed
        with every row's (PRIOR drafts' worth)."""
        if self.examined < EXPLORE:
            return FIRST_ACCEPTANCE
        return (accepted + self.accepted / self.examined * PRIOR) / (examined + PRIOR)

    def cost(self, rows: int, tokens: int) -> float | None:
        """Seconds of a forward of `rows` rows carrying `tokens` tokens: the most any shape of as many rows and
        at most as many tokens measured (None: none measured)."""
        got = [statistics.median(x for _n, x in v) for (s, t), v in self.costs.items()
               if s == rows and t <= tokens and self.measured(s, t)]
        return max(got) if got else None

    def record(self, rows: int, tokens: int, seconds: float) -> None:
        """A forward of `rows` rows and `tokens` tokens (its rewinds included) took `seconds`."""
        self.steps += 1
        self.costs.setdefault((rows, tokens), deque(maxlen=COST_SAMPLES)).append((self.steps, seconds))

    def measured(self, rows: int, tokens: int) -> bool:
        """Whether the shape has a sample of the last FORGET steps."""
        v = self.costs.get((rows, tokens))
        return bool(v) and v[-1][0] > self.steps - FORGET

    def record_drafts(self, n: int, seconds: float) -> None:
        if n:
            self.draft_s.append(seconds / n)

    def count(self, accepted: int, examined: int) -> None:
        """A row's counts of one step, into the pooled acceptance."""
        self.accepted += accepted
        self.examined += examined

    def off(self) -> bool:
        """Drafting pays for no row, even one alone, at the acceptance measured (or FIRST_ACCEPTANCE before it
        is): for good."""
        return self.cost(1, 1) is not None and self.lone() == 0

    def lone(self) -> int:
        """Drafts a row alone takes now, at the pooled acceptance."""
        return self.counts([MAX_DRAFT], [(self.accepted, self.examined)])[0]

    def tried(self) -> list[int]:
        """The draft counts a row alone has been measured with."""
        return sorted(t - 1 for s, t in self.costs if s == 1 and t > 1)

    def line(self) -> str:
        """The default's state in a few words (the load line and /stats)."""
        if self.cost(1, 1) is None:
            return "auto: drafts 1-3 tokens per step where that measures faster than without (--mtp 0: off)"
        k = self.lone()
        if k == 0:  # `off`
            return ("auto, off: drafting measured no faster than decoding without drafts here "
                    "(--mtp N forces N)")
        seen = f", {self.accepted / self.examined:.2f} of drafts accepted" if self.examined >= EXPLORE else ""
        return f"auto: {k} draft{'s' if k != 1 else ''} per step for one conversation now{seen}"

    def counts(self, limits: list[int], rows: list[tuple[int, int]]) -> list[int]:
        """Drafts for each row of a step: limits[j] the most row j may draft (its budget, 0: no drafter), rows[j]
        its (accepted, examined) counts."""
        s = len(limits)
        base = self.cost(s, s)
        if base is None or not any(limits):
            return [0] * s  # a step of s rows without drafts is measured first
        p = [self.acceptance(*r) for r in rows]
        gains = sorted(((p[j] ** m, j) for j in range(s) for m in range(1, limits[j] + 1)), reverse=True)
        per_draft = statistics.median(self.draft_s) if self.draft_s else 0.0
        frontier = next(t for t in itertools.count(s + 1) if not self.measured(s, t))  # the next to try
        best, best_rate = [0] * s, s / base
        k, tokens = [0] * s, float(s)
        for d, (gain, j) in enumerate(gains, 1):
            k[j] += 1
            tokens += gain
            if s + d > frontier and not self.measured(s, s + d):
                continue  # not measured, and not the next shape to try
            secs = self.cost(s, s + d)
            assert secs is not None
            rate = tokens / (secs + d * per_draft)
            if rate > best_rate:
                best, best_rate = list(k), rate
        return best
