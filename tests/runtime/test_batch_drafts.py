"""`DraftPlan` (quantkit/runtime/batch_drafts.py), how many tokens each row of a batch step drafts, on measured
costs given to it: the counts are the best tokens per second of every choice under its cost model (checked against
all of them), one row drafts as far as it pays, two rows draft where a step of twice the tokens costs little more,
four do not where it costs twice, the likeliest rows draft first, a row's budget bounds its drafts, shapes not
measured (or measured long ago) are tried upward, and the plan turns off where drafting pays for no row."""

from __future__ import annotations

import itertools
import random

from quantkit.runtime.batch_drafts import EXPLORE, FIRST_ACCEPTANCE, FORGET, DraftPlan
from quantkit.runtime.speculative import MAX_DRAFT

# step seconds by (rows, tokens) of the realistic shape's policy measure (reports/bench-serve-policy.json): the
# kernels' tiles take 4 rows, so 5-8 token rows cost about twice 4
STEP = {1: 0.0257, 2: 0.0301, 3: 0.0339, 4: 0.0361, 5: 0.0595, 6: 0.0621, 7: 0.0656, 8: 0.0676}
DRAFT_S = 0.003


def _plan(shapes: dict[tuple[int, int], float], acceptance: float = 0.85, examined: int = 200,
          draft_s: float = DRAFT_S) -> DraftPlan:
    plan = DraftPlan()
    for (s, t), secs in shapes.items():
        plan.record(s, t, secs)
    plan.record_drafts(4, 4 * draft_s)
    plan.count(round(acceptance * examined), examined)
    return plan


def _rate(plan: DraftPlan, k: list[int], p: list[float]) -> float:
    s, d = len(k), sum(k)
    tokens = sum(sum(pj ** m for m in range(kj + 1)) for kj, pj in zip(k, p, strict=True))
    return tokens / (plan.cost(s, s + d) + d * DRAFT_S)


def test_the_counts_are_the_best_rate_of_every_choice():
    """Random costs (rising with the tokens), acceptances and budgets: no other choice of counts has a better
    rate under the plan's own model."""
    rng = random.Random(3)
    for _ in range(60):
        s = rng.randint(1, 3)
        secs, shapes = 0.02, {}
        for t in range(s, s * (1 + MAX_DRAFT) + 1):
            secs += rng.choice([0.0005, 0.002, 0.02])
            shapes[(s, t)] = secs
        plan = _plan(shapes, examined=0)
        rows = [(rng.randint(0, 40), 40) for _ in range(s)]
        for a, n in rows:
            plan.count(a, n)
        limits = [rng.randint(0, MAX_DRAFT) for _ in range(s)]
        p = [plan.acceptance(a, n) for a, n in rows]
        got = plan.counts(limits, rows)
        best = max(_rate(plan, list(k), p) for k in itertools.product(*(range(n + 1) for n in limits)))
        assert all(0 <= g <= n for g, n in zip(got, limits, strict=True))
        assert _rate(plan, got, p) >= best * (1 - 1e-12)


def test_one_row_drafts_as_far_as_it_pays():
    one = {(1, t): STEP[t] for t in range(1, 5)}
    assert _plan(one, 0.88).counts([MAX_DRAFT], [(88, 100)]) == [3]
    # a verify that costs a step per token never pays
    assert _plan({(1, t): 0.0257 * t for t in range(1, 5)}, 0.88).counts([3], [(88, 100)]) == [0]
    assert _plan(one, 0.88).counts([1], [(88, 100)]) == [1]  # the budget leaves room for one


def test_two_rows_draft_and_four_do_not_where_eight_token_rows_cost_twice_four():
    two = {(2, t): STEP[t] for t in range(2, 9)}
    assert _plan(two).counts([3, 3], [(85, 100)] * 2) == [1, 1]
    four = {(4, t): STEP[t] if t <= 8 else 2 * STEP[8] for t in range(4, 17)}
    assert _plan(four).counts([3] * 4, [(85, 100)] * 4) == [0, 0, 0, 0]


def test_the_likeliest_rows_draft_first():
    three = {(3, t): STEP[t] if t <= 8 else 2 * STEP[8] for t in range(3, 13)}
    plan = _plan(three)
    rows = [(20, 100), (95, 100), (50, 100)]
    assert plan.counts([3, 3, 3], rows) == [0, 1, 0]  # one draft fills the 4-row tile: the likeliest row's


def test_shapes_not_measured_are_tried_and_a_step_without_drafts_comes_first():
    plan = DraftPlan()
    assert plan.counts([3], [(0, 0)]) == [0]  # nothing measured: the plain step first
    plan.record(1, 1, 0.0257)
    assert plan.counts([3], [(0, 0)]) == [1]  # the next shape up, at the price of the last measured
    plan.record(1, 2, 0.0278)
    plan.record_drafts(1, 0.003)
    assert plan.counts([3], [(0, 0)]) == [2]
    plan.record(1, 3, 0.08)  # measured dear: back to one draft, and three drafts are not tried
    assert plan.counts([3], [(0, 0)]) == [1]
    assert plan.acceptance(0, 0) == FIRST_ACCEPTANCE and not plan.off()


def test_the_plan_turns_off_where_drafting_pays_for_no_row():
    one = {(1, t): STEP[t] for t in range(1, 5)}
    plan = _plan(one, acceptance=0.05, examined=EXPLORE)
    assert plan.off() and plan.counts([3], [(0, 10)]) == [0]
    assert not _plan(one, acceptance=0.85, examined=EXPLORE).off()
    # before EXPLORE drafts the first guess holds, even where the few examined were all rejected
    assert not _plan(one, acceptance=0.0, examined=EXPLORE - 1).off()
    # ... unless drafting does not pay even at it
    assert _plan({(1, t): 0.0257 * t for t in range(1, 5)}, acceptance=0.0, examined=2).off()


def test_a_shape_measured_long_ago_is_measured_again():
    """Costs follow the machine's load: a verify measured dear is not tried while its samples are recent, and is
    tried again once FORGET steps have passed without one; a step without drafts is measured again the same way."""
    plan = _plan({(1, 1): 0.0257, (1, 2): 0.08}, acceptance=0.88)
    assert plan.counts([3], [(88, 100)]) == [0]
    for _ in range(FORGET):
        plan.record(1, 1, 0.0257)
    assert plan.counts([3], [(88, 100)]) == [1]  # (1, 2) forgotten: the next shape up again
    for _ in range(FORGET):
        plan.record(1, 2, 0.027)
    assert plan.counts([3], [(88, 100)]) == [0]  # no step without drafts of the last FORGET: that one first
