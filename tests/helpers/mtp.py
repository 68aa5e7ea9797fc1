"""Generation with and without MTP drafts, on every route the kernel offers."""

from __future__ import annotations

from quantkit.kernels import cpu as kernel_cpu
from quantkit.runtime import SamplingParams
from quantkit.runtime.batch_drafts import DraftPlan

MTP_ROUTES = ["stack", "torch"] if kernel_cpu.available() else ["torch"]

PROMPT = [{"role": "user", "content": "write a long story about rivers, files and folders"}]


def generate_events(rt, ids: list[int], sp: SamplingParams, draft: int, stop_ids: set[int] | None = None) -> list:
    """The events of `rt.generate_ids` with `draft` drafts a step (0: none; stop_ids None: none), the runtime's own
    MTP setting put back after."""
    saved = rt.mtp, rt.draft_plan
    rt.set_mtp(draft)
    try:
        return list(rt.generate_ids(ids, sp, stop_ids=set() if stop_ids is None else stop_ids))
    finally:
        rt.mtp, rt.draft_plan = saved


def generate_tokens(rt, draft: int, n: int = 40, **kw) -> tuple[list[int], dict | None]:
    """`PROMPT`'s tokens and MTP counts with `draft` drafts a step (`generate_events`)."""
    sp = SamplingParams(**{"temperature": 0, "max_new_tokens": n, "ignore_eos": True, **kw})
    resp = generate_events(rt, rt.render_ids(PROMPT)[1], sp, draft)[-1].response
    return resp.token_ids, resp.mtp


class RowOracle:
    """Stands in for `MTP.draft` in a batch: each row's MTP cache drafts that row's reference continuation (the
    whole token sequence of its run alone), a wrong token instead every `wrong_every`-th draft. `expect(seq)`
    before adding (or forking) a row: the next MTP cache made is that row's."""

    def __init__(self, model, wrong_every: int):
        self.wrong_every, self.calls, self.seqs, self.next = wrong_every, 0, {}, None
        self.made = model.mtp.new_cache

    def new_cache(self, capacity):
        cache = self.made(capacity)
        if self.next is not None:
            self.seqs[cache.serial] = self.next
        return cache

    def expect(self, seq: list[int]) -> None:
        self.next = seq

    def __call__(self, model, tokens, hidden, cache):
        cache.n += len(tokens)  # pair i carries the token at position i + 1: it predicts position n + 1
        seq = self.seqs[cache.serial]
        want = seq[cache.n + 1] if cache.n + 1 < len(seq) else 0
        self.calls += 1
        if self.wrong_every and self.calls % self.wrong_every == 0:
            want = (want + 1) % model.vocab
        return want, hidden[-1:]

    def install(self, monkeypatch, model) -> RowOracle:
        monkeypatch.setattr(model.mtp, "new_cache", self.new_cache)
        monkeypatch.setattr(model.mtp, "draft", self)
        return self


class PricedPlan(DraftPlan):
    """The default's plan with each step priced by its shape, not the wall clock, so a loaded machine cannot decide:
    a forward of R rows carrying T tokens costs a second plus `verify` seconds per draft it checks, a draft `draft`
    seconds (one draft pays where it is accepted more than verify + draft of the time)."""

    def __init__(self, verify: float = 0.5, draft: float = 0.1):
        super().__init__()
        self.verify, self.draft = verify, draft

    def record(self, rows: int, tokens: int, seconds: float) -> None:
        super().record(rows, tokens, 1.0 + self.verify * (tokens - rows))

    def record_drafts(self, n: int, seconds: float) -> None:
        super().record_drafts(n, self.draft * n)
