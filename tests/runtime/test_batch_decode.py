"""Batched decode (quantkit/runtime/model/qwen3_5_moe.py, quantkit/runtime/batch.py) against single-request runs,
on the tiny decisive checkpoint (routing robust to rounding): every row of a batch step gives the logits and the
cache states of the same token stepped alone, bit for bit, on every route and every forced op table of the CPU
kernel, and so does every row of a step that carries speculative verifies (and its rewind to any position); a
`BatchGenerator`'s rows, joining and leaving mid-batch, generate exactly the tokens each request generates alone,
greedy and seeded, with and without MTP drafts (an oracle drafter per row, right and wrong at a set rate; the
tiny model's own MTP layer, which the default then stops using)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from quantkit.errors import QuantkitError
from quantkit.kernels import cpu as cpu_kernel
from quantkit.runtime import load_model
from quantkit.runtime.batch import BatchGenerator
from quantkit.runtime.batch_drafts import DraftPlan
from quantkit.runtime.generate import GenerationResponse, SamplingParams

from helpers.mtp import MTP_ROUTES, PricedPlan, RowOracle
from helpers.runtime import quantized
from helpers.states import random_tokens, same_state

PROMPTS = ["list the files in this folder, then count them", "write a haiku about rivers",
           "what is 17 times 23?", "name three colours", "summarise the plot of a short story in one line",
           "translate 'good morning' to French"]
ROUTES = ["stack", "fused", "torch"]


def _load(tiny_model, recipe: str, route: str | None = None, prefill: str = "tokens"):
    if route not in (None, "torch") and not cpu_kernel.available():
        pytest.skip("the CPU kernel is not built on this machine")
    rt = load_model(tiny_model if recipe == "bf16" else quantized(tiny_model, recipe), forced_route=route)
    rt.set_prefill(prefill)
    return rt


def _ids(rt, text: str) -> list[int]:
    return rt.encode(rt.render([{"role": "user", "content": text}]))


def _check_steps(rt, rows: int, steps: int = 3) -> None:
    """`rows` caches at different positions (prompts of different lengths), stepped together and alone."""
    m = rt.model
    with torch.inference_mode():
        prompts = [_ids(rt, PROMPTS[j % len(PROMPTS)]) + random_tokens(j, 10 + j) for j in range(rows)]
        batch, alone = [], []
        for p in prompts:
            for group in (batch, alone):
                c = m.new_cache(len(p) + 1)  # too small on purpose: the step grows it
                m.forward(p, c)
                group.append(c)
        for s in range(steps):
            toks = random_tokens(rows, 100 + s)
            got = m.step_batch(toks, batch)
            assert got.shape == (rows, m.vocab)
            for j in range(rows):
                want = m.forward([toks[j]], alone[j])
                assert torch.equal(got[j], want), f"row {j} of {rows}, step {s}"
                assert same_state(batch[j], alone[j])


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("recipe", ["bf16", "int8", "int4"])
def test_a_batch_step_equals_each_row_stepped_alone(tiny_model, recipe, route, one_thread):
    rt = _load(tiny_model, recipe, route)
    assert rt.model.route.kind == route
    for rows in (1, 2, 4, 6, 9):  # 1: the route's own step; 9: more rows than one pass of the multi-row tiles
        _check_steps(rt, rows)


@pytest.mark.parametrize("recipe", ["bf16", "int4"])
def test_a_batch_step_equals_each_row_on_every_op_table(tiny_model, recipe, kernel_table, one_thread):
    rt = _load(tiny_model, recipe, "stack")
    _check_steps(rt, 9, steps=2)  # every table's passes of several rows and a remainder


def test_a_batch_step_refuses_mismatched_rows(tiny_model, one_thread):
    rt = _load(tiny_model, "int4")
    m = rt.model
    c = m.new_cache(8)
    with pytest.raises(ValueError, match="one cache per token"):
        m.step_batch([1, 2], [c])
    with pytest.raises(ValueError, match="appears twice"):
        m.step_batch([1, 2], [c, c])
    assert c.n == 0


def test_the_routed_experts_run_once_per_layer_for_all_rows(tiny_model, monkeypatch, one_thread):
    """int4 experts on the CPU kernel: one multi-row expert call per layer for the whole batch, no one-token
    expert call."""
    if not cpu_kernel.available():
        pytest.skip("the CPU kernel is not built on this machine")
    rt = _load(tiny_model, "int4", "stack")
    m = rt.model
    calls = []
    for L in m.layers:
        many = L.moe.experts._rows_call()
        assert many is not None
        monkeypatch.setattr(L.moe.experts, "_rows", lambda x, ids, wts, f=many: calls.append(x.shape[0]) or f(x, ids, wts))
        monkeypatch.setattr(L.moe, "routed", _not_called)
    caches = [m.new_cache(4) for _ in range(3)]
    with torch.inference_mode():
        m.step_batch([5, 6, 7], caches)
    assert calls == [3] * len(m.layers)


def _not_called(*a, **k):
    raise AssertionError("a row's experts ran alone")


class _Counting:
    """A kernel module that records the rows of each dense-matrix call."""

    def __init__(self, mod, rows: list[int]):
        self.mod, self.rows = mod, rows

    def __getattr__(self, name):
        f = getattr(self.mod, name)
        if name not in ("linear", "linear_many", "linear_bf16"):
            return f
        return lambda x, *a: self.rows.append(x.shape[0]) or f(x, *a)


@pytest.mark.parametrize("recipe", ["bf16", "int4"])
def test_every_dense_matrix_is_one_call_for_all_rows(tiny_model, recipe, one_thread):
    """A step of 9 rows: each layer's projections, its output matrix, the shared expert's matrices with the router
    and the head each take the 9 rows in one kernel call (the matrix read once for the batch), bf16 ones too."""
    rt = _load(tiny_model, recipe, "stack")
    m, rows = rt.model, []
    for L in m.layers:
        mix, moe = L.mixer, L.moe
        for obj in (getattr(mix, "qkv_in", None) or mix.proj_in, getattr(mix, "o", None) or mix.out,
                    moe.shared_and_router, moe.shared_down):
            assert obj._mod is not None
            obj._mod = _Counting(obj._mod, rows)
    m.head._mod = _Counting(m.head._mod, rows)
    caches = [m.new_cache(4) for _ in range(9)]
    with torch.inference_mode():
        m.step_batch(list(range(5, 14)), caches)
    assert rows == [9] * (4 * len(m.layers) + 1)


# ---- BatchGenerator: rows joining and leaving ----

def _requests(rt) -> list[tuple[int, list[int], SamplingParams, set[int] | None]]:
    """(step it joins at, prompt ids, sampling, stop ids): greedy and seeded rows of different budgets, one that
    stops on a token its run alone generates, rows joining mid-batch."""
    greedy = dict(temperature=0, ignore_eos=True)
    seeded = dict(temperature=0.8, top_p=0.9, top_k=20, ignore_eos=True)
    return [
        (0, _ids(rt, PROMPTS[0]), SamplingParams(max_new_tokens=12, **greedy), None),
        (0, _ids(rt, PROMPTS[1]), SamplingParams(max_new_tokens=5, seed=7, **seeded), None),
        (0, _ids(rt, PROMPTS[2]), SamplingParams(max_new_tokens=9, seed=3, **seeded), None),
        (2, _ids(rt, PROMPTS[3]), SamplingParams(max_new_tokens=8, **greedy), None),
        (4, _ids(rt, PROMPTS[4]), SamplingParams(max_new_tokens=10, seed=11, **seeded), None),
        (4, _ids(rt, PROMPTS[5]), SamplingParams(max_new_tokens=16, **greedy), "stop"),
        (7, _ids(rt, PROMPTS[0]) + [17], SamplingParams(max_new_tokens=4, seed=5, **seeded), None),
    ]


def _alone(rt, ids, sp, stops) -> GenerationResponse:
    """The request served alone, as the server and `generate` run it."""
    return [e.response for e in rt.generate_ids(ids, sampling=sp, stop_ids=stops) if e.response is not None][0]


def _check_batch(rt) -> None:
    reqs = _requests(rt)
    want, stops = [], []
    for _at, ids, sp, stop in reqs:
        ref = _alone(rt, ids, replace(sp), None)
        s = None
        if stop == "stop":  # stop on its 6th token: the row leaves early
            s = {ref.token_ids[5]}
            ref = _alone(rt, ids, replace(sp, ignore_eos=False), s)
            assert ref.finish_reason == "stop"
        want.append(ref)
        stops.append(s)
    batch = BatchGenerator(rt)
    rows: dict[int, int] = {}
    got: dict[int, list[int]] = {}
    last: dict[int, GenerationResponse] = {}
    sizes = []
    step = 0
    while step == 0 or batch:
        for j, (at, ids, sp, _s) in enumerate(reqs):
            if at == step:
                sp = replace(sp, ignore_eos=False) if stops[j] is not None else replace(sp)
                rows[batch.add(ids=ids, sampling=sp, stop_ids=stops[j])] = j
        sizes.append(len(batch.rows))
        for row, ev in batch.step():
            if ev.response is None:
                got.setdefault(rows[row], []).append(ev.token)
            else:
                last[rows[row]] = ev.response
        step += 1
    assert max(sizes) >= 4 and len(set(sizes)) > 2  # rows joined and left
    for j, ref in enumerate(want):
        r = last[j]
        assert r.token_ids == ref.token_ids, f"request {j}"
        assert r.finish_reason == ref.finish_reason and r.text == ref.text
        emitted = ref.token_ids[:-1] if ref.finish_reason == "stop" else ref.token_ids
        assert got.get(j, []) == emitted


@pytest.mark.parametrize("route", ROUTES)
def test_batched_rows_generate_what_each_request_generates_alone(tiny_model, route, one_thread):
    _check_batch(_load(tiny_model, "int4", route))


@pytest.mark.parametrize("recipe", ["bf16", "int4"])
def test_batched_rows_on_every_op_table(tiny_model, recipe, kernel_table, one_thread):
    _check_batch(_load(tiny_model, recipe, "stack"))


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("recipe", ["bf16", "int4"])
def test_a_prompt_whose_plan_ends_in_one_token_computes_it_as_a_step(tiny_model, recipe, route, monkeypatch,
                                                                      one_thread):
    """The T-token arithmetic's last chunk of one token (a prompt one past a chunk) is a step, as a forward of one
    token always was: a generation gives the tokens of the prompt forwarded chunk by chunk, then stepped."""
    rt = _load(tiny_model, recipe, route)
    monkeypatch.setattr("quantkit.runtime.batch.PREFILL_CHUNK", 8)
    m = rt.model
    ids = [5 + 7 * k for k in range(17)]  # no boundary token: chunks of 8, 8 and 1
    with torch.inference_mode():
        c = m.new_cache(len(ids) + 4)
        m.forward(ids[:8], c)
        m.forward(ids[8:16], c)
        want = [int(torch.argmax(m.forward(ids[16:], c)))]
        for _ in range(3):
            want.append(int(torch.argmax(m.forward([want[-1]], c))))
    sp = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
    assert _alone(rt, ids, sp, set()).token_ids == want


def test_a_cancelled_row_leaves_and_the_others_go_on(tiny_model, one_thread):
    rt = _load(tiny_model, "int4")
    sp = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    refs = [_alone(rt, _ids(rt, p), sp, None).token_ids for p in PROMPTS[:3]]
    batch = BatchGenerator(rt, max_rows=3)
    rows = [batch.add(ids=_ids(rt, p), sampling=sp) for p in PROMPTS[:3]]
    with pytest.raises(QuantkitError, match="batch is full"):
        batch.add(ids=_ids(rt, PROMPTS[3]), sampling=sp)
    last, seen = {}, 0
    for _k in range(20):
        for row, ev in batch.step():
            if ev.response is not None:
                last[row] = ev.response
            seen += row == rows[1] and ev.token is not None
        if seen == 3 and rows[1] in batch.rows:  # its third token out: it ends at the next step
            batch.cancel(rows[1])
        if not batch:
            break
    assert last[rows[1]].finish_reason == "cancelled" and last[rows[1]].token_ids == refs[1][:3]
    assert [last[rows[j]].token_ids for j in (0, 2)] == [refs[0], refs[2]]


def test_a_batch_refuses_bad_rows_in_one_line(tiny_model, one_thread):
    rt = _load(tiny_model, "int4")
    batch = BatchGenerator(rt)
    with pytest.raises(QuantkitError, match="messages or ids: give exactly one"):
        batch.add()
    with pytest.raises(QuantkitError, match="empty prompt"):
        batch.add(ids=[])
    with pytest.raises(QuantkitError, match="max_new_tokens=0: give a whole number >= 1"):
        batch.add(ids=[1, 2], max_new_tokens=0)
    with pytest.raises(QuantkitError, match="context holds"):
        batch.add(ids=[1] * rt.context)
    with pytest.raises(QuantkitError, match="at least one row"):
        BatchGenerator(rt, max_rows=0)
    assert not batch and batch.step() == []


def test_a_new_prompt_rides_in_the_running_rows_steps_one_planned_chunk_each(tiny_model, monkeypatch, one_thread):
    """A long prompt joining the batch (the T-token arithmetic) is prefilled inside the running rows' steps, one
    chunk of its own plan per step (cut where it is cut alone, whatever else rides), so the running rows wait one
    chunk at a time, not for the whole prompt; every row's tokens are the ones it gets alone."""
    from quantkit.runtime.state_cache import prefill_plan

    rt = _load(tiny_model, "int4")
    sp = SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True)
    long_ids = _ids(rt, " ".join(PROMPTS))
    monkeypatch.setattr("quantkit.runtime.batch.PREFILL_CHUNK", 8)
    monkeypatch.setattr("quantkit.runtime.generate.PREFILL_CHUNK", 8)
    refs = [_alone(rt, _ids(rt, p), sp, None).token_ids for p in PROMPTS[:2]] + [_alone(rt, long_ids, sp, None).token_ids]
    plan = [b - a for a, b in prefill_plan(long_ids, 0, rt.boundary_ids, 8)]
    assert len(plan) > 3
    batch = BatchGenerator(rt)
    rows = [batch.add(ids=_ids(rt, p), sampling=sp) for p in PROMPTS[:2]]
    got: dict[int, list[int]] = {r: [] for r in rows}
    seen: list[list[tuple[str, int]]] = []
    real = rt.model.forward_batch
    monkeypatch.setattr(rt.model, "forward_batch", lambda segs, hidden=False: (
        seen.append([(s.kind, len(s.ids)) for s in segs]), real(segs, hidden=hidden))[1])

    def take(events):
        for row, ev in events:
            if ev.token is not None:
                got.setdefault(row, []).append(ev.token)

    while not all(got[r] for r in rows):  # both prompts in: the rows decode
        take(batch.step())
    seen.clear()
    new = batch.add(ids=long_ids, sampling=sp)
    while batch:
        take(batch.step())
    chunks = [[n for kind, n in step if kind == "prompt"] for step in seen]
    assert [c for c in chunks if c] == [[n] for n in plan]  # its plan's chunks, one a step
    assert all(("decode", 1) in step for step in seen[:len(plan)])  # the running rows stepped beside each
    assert [got[r] for r in (*rows, new)] == refs


def test_a_continued_conversation_reuses_the_prompt_cache_in_a_batch(tiny_model, one_thread):
    """With the prompt cache on, a row whose conversation continues an earlier one is prefilled only past the
    cached prefix, and still generates what the request generates alone without any cache."""
    rt = _load(tiny_model, "int4")
    sp = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    first = [{"role": "user", "content": PROMPTS[0]}]
    alone = _alone(rt, rt.render_ids(first)[1], sp, None)
    turn2 = [*first, {"role": "assistant", "content": alone.text or "ok"}, {"role": "user", "content": PROMPTS[1]}]
    want = _alone(rt, rt.render_ids(turn2)[1], sp, None)
    rt.set_prompt_cache(1 << 28)
    batch = BatchGenerator(rt)
    batch.add(first, sampling=sp)
    batch.add(messages=[{"role": "user", "content": PROMPTS[2]}], sampling=sp)
    last = {}
    while batch:
        for row, ev in batch.step():
            if ev.response is not None:
                last[row] = ev.response
    row = batch.add(turn2, sampling=sp)
    batch.add(messages=[{"role": "user", "content": PROMPTS[3]}], sampling=sp)
    while batch:
        for r, ev in batch.step():
            if ev.response is not None:
                last[r] = ev.response
    assert last[row].cached_tokens > 0 and last[row].token_ids == want.token_ids


def test_forked_choices_share_one_prefill_and_generate_what_each_generates_alone(tiny_model, monkeypatch,
                                                                                   one_thread):
    """`n` choices of one prompt: the prompt prefilled once, each choice a row in a copy of its state, decoded
    together; each choice's tokens (greedy, and seeded per choice) are the ones it generates alone."""
    rt = _load(tiny_model, "int4")
    ids = _ids(rt, PROMPTS[0])
    seeded = dict(temperature=0.9, top_p=0.9, top_k=20, ignore_eos=True)
    sps = [SamplingParams(max_new_tokens=9, seed=5, **seeded), SamplingParams(max_new_tokens=6, seed=6, **seeded),
           SamplingParams(temperature=0, max_new_tokens=7, ignore_eos=True)]
    want = [_alone(rt, ids, replace(sp), None).token_ids for sp in sps]
    assert want[0] != want[1]  # the seeds differ, so do the choices
    prefilled = []  # the prompt tokens that went through the model
    real = rt.model.forward_batch
    monkeypatch.setattr(rt.model, "forward_batch", lambda segs, hidden=False: (
        prefilled.extend(t for s in segs if s.kind == "prompt" for t in s.ids), real(segs, hidden=hidden))[1])
    batch = BatchGenerator(rt, max_rows=3)
    first = batch.add(ids=ids, sampling=replace(sps[0]))
    rows = [first, *(batch.fork(first, replace(sp)) for sp in sps[1:])]
    with pytest.raises(QuantkitError, match="batch is full"):
        batch.fork(first, replace(sps[0]))
    last, sizes = {}, []
    while batch:
        sizes.append(len(batch.rows))
        for row, ev in batch.step():
            if ev.response is not None:
                last[row] = ev.response
    assert prefilled == ids and sizes[0] == 3
    assert [last[r].token_ids for r in rows] == want
    with pytest.raises(QuantkitError, match="no prompt state left"):
        batch.fork(first, replace(sps[0]))


# ---- verifies inside a batch, MTP drafts per row ----

def _check_verifies(rt, lengths: list[int]) -> None:
    """Rows of `lengths` tokens each (a step, or a verify of several) in one `step_batch`, against each row's
    forward alone: logits and hidden bit for bit, and every verify rewound to each of its positions gives the state
    the same rewind gives alone."""
    m = rt.model
    with torch.inference_mode():
        prompts = [_ids(rt, PROMPTS[j % len(PROMPTS)]) + random_tokens(j, 20 + j) for j in range(len(lengths))]
        segs = [random_tokens(t, 200 + j) for j, t in enumerate(lengths)]
        for keep_of in range(max(lengths)):
            batch, alone = [], []
            for p in prompts:
                for group in (batch, alone):
                    c = m.new_cache(len(p) + 1)
                    m.forward(p, c)
                    group.append(c)
            logits, hidden = m.step_batch(segs, batch, hidden=True)
            assert logits.shape == (sum(lengths), m.vocab) and hidden.shape[0] == sum(lengths)
            a = 0
            for j, seg in enumerate(segs):
                want, want_h = m.forward(seg, alone[j], all_logits=True, keep_positions=len(seg) > 1, hidden=True)
                assert torch.equal(logits[a:a + len(seg)], want), f"row {j} of {lengths}"
                assert torch.equal(hidden[a:a + len(seg)], want_h), f"row {j} of {lengths}"
                a += len(seg)
                keep = min(keep_of + 1, len(seg))  # tokens of the row kept, as a verify's acceptance leaves it
                for c in (batch[j], alone[j]):
                    c.rewind(c.n - len(seg) + keep)
                assert same_state(batch[j], alone[j]), f"row {j} of {lengths} rewound to {keep}"
            nxt = random_tokens(len(segs), 300 + keep_of)  # the next step from the rewound states
            got = m.step_batch(nxt, batch)
            for j in range(len(segs)):
                assert torch.equal(got[j], m.forward([nxt[j]], alone[j]))


@pytest.mark.parametrize("route", ROUTES)
def test_a_batch_of_verifies_equals_each_verify_alone(tiny_model, route, one_thread):
    rt = _load(tiny_model, "int4", route)
    for lengths in ([2], [4], [1], [1, 3], [2, 1, 4, 1, 3], [4, 4]):  # one row: the route's own call
        _check_verifies(rt, lengths)


@pytest.mark.parametrize("recipe", ["bf16", "int4"])
def test_a_batch_of_verifies_on_every_op_table(tiny_model, recipe, kernel_table, one_thread):
    rt = _load(tiny_model, recipe, "stack")
    _check_verifies(rt, [2, 1, 4, 3])


def _drafted_batch(rt, monkeypatch, draft: int | None, wrong_every: int) -> None:
    """`_requests` in a batch on the MTP model, every row drafting (`draft` per step, None: the plan's choice) from
    an oracle of its own continuation: each row's tokens, finish and text are those it generates alone without
    drafts, and its response counts its drafts."""
    reqs = _requests(rt)
    rt.set_mtp(0)
    want, stops = [], []
    for _at, ids, sp, stop in reqs:
        ref = _alone(rt, ids, replace(sp), None)
        s = None
        if stop == "stop":
            s = {ref.token_ids[5]}
            ref = _alone(rt, ids, replace(sp, ignore_eos=False), s)
        want.append(ref)
        stops.append(s)
    if draft is None:
        rt.draft_plan = DraftPlan()  # the default: the batch's plan chooses
    else:
        rt.set_mtp(draft)
    oracle = RowOracle(rt.model, wrong_every).install(monkeypatch, rt.model)
    batch = BatchGenerator(rt)
    rows, got, last, step = {}, {}, {}, 0
    while step == 0 or batch:
        for j, (at, ids, sp, _s) in enumerate(reqs):
            if at == step:
                oracle.expect(ids + want[j].token_ids)
                sp = replace(sp, ignore_eos=False) if stops[j] is not None else replace(sp)
                rows[batch.add(ids=ids, sampling=sp, stop_ids=stops[j])] = j
        for row, ev in batch.step():
            if ev.response is None:
                got.setdefault(rows[row], []).append(ev.token)
            else:
                last[rows[row]] = ev.response
        step += 1
    for j, ref in enumerate(want):
        r = last[j]
        assert r.token_ids == ref.token_ids, f"request {j}"
        assert r.finish_reason == ref.finish_reason and r.text == ref.text
        assert got.get(j, []) == (ref.token_ids[:-1] if ref.finish_reason == "stop" else ref.token_ids)
        assert r.mtp is not None and r.mtp.get("auto", False) == (draft is None)
        assert 0 <= r.mtp["accepted"] <= r.mtp["drafted"]
    drafted = sum(last[j].mtp["drafted"] for j in last)
    accepted = sum(last[j].mtp["accepted"] for j in last)
    if draft is not None:  # every row drafts: each verify keeps its right drafts and rejects the oracle's wrong ones
        assert drafted >= len(reqs) and (accepted == drafted) == (wrong_every == 0)
    assert accepted > 0


@pytest.mark.parametrize("route", MTP_ROUTES)
@pytest.mark.parametrize(("draft", "wrong_every"), [(1, 0), (1, 3), (2, 4), (3, 2), (None, 0), (None, 5)])
def test_batched_rows_with_drafts_generate_what_each_generates_alone(tiny_model_mtp, route, draft, wrong_every,
                                                                    monkeypatch, one_thread):
    _drafted_batch(_load(tiny_model_mtp, "int4", route), monkeypatch, draft, wrong_every)


def test_batched_rows_with_drafts_on_every_op_table(tiny_model_mtp, kernel_table, monkeypatch, one_thread):
    _drafted_batch(_load(tiny_model_mtp, "int4", "stack"), monkeypatch, 2, 3)


def test_forked_choices_draft_from_a_copy_of_the_prompts_mtp_state(tiny_model_mtp, monkeypatch, one_thread):
    """`n` choices of one prompt with drafts: each fork drafts on its own copy of the first row's MTP cache and
    generates what it generates alone."""
    rt = _load(tiny_model_mtp, "int4")
    ids = _ids(rt, PROMPTS[1])
    seeded = dict(temperature=0.9, top_p=0.9, top_k=20, ignore_eos=True)
    sps = [SamplingParams(max_new_tokens=14, seed=5, **seeded), SamplingParams(max_new_tokens=11, seed=6, **seeded),
           SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)]
    rt.set_mtp(0)
    want = [_alone(rt, ids, replace(sp), None).token_ids for sp in sps]
    rt.set_mtp(2)
    oracle = RowOracle(rt.model, wrong_every=4).install(monkeypatch, rt.model)
    batch = BatchGenerator(rt)
    oracle.expect(ids + want[0])
    first = batch.add(ids=ids, sampling=replace(sps[0]))
    rows = [first]
    for sp, w in zip(sps[1:], want[1:], strict=True):
        oracle.expect(ids + w)
        rows.append(batch.fork(first, replace(sp)))
    last = {}
    while batch:
        for row, ev in batch.step():
            if ev.response is not None:
                last[row] = ev.response
    assert [last[r].token_ids for r in rows] == want
    assert all(last[r].mtp["accepted"] > 0 for r in rows)


@pytest.mark.parametrize("route", MTP_ROUTES)
def test_the_default_stops_drafting_with_a_layer_that_is_never_right(tiny_model_mtp, route, one_thread):
    """The tiny model's random MTP layer is almost never accepted: a row alone drafts until the plan has measured
    that drafting does not pay (at most EXPLORE drafts at the first guess of an acceptance, then at the measured
    one), then the plan is off and rows joining after carry no drafter; every row's tokens are its tokens alone."""
    rt = _load(tiny_model_mtp, "int4", route)
    sp = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    rt.set_mtp(0)
    want = [_alone(rt, _ids(rt, p), replace(sp), None).token_ids for p in PROMPTS[:3]]
    rt.draft_plan = PricedPlan()
    batch = BatchGenerator(rt)
    last = {}

    def run():
        while batch:
            for row, ev in batch.step():
                if ev.response is not None:
                    last[row] = ev.response

    rows = [batch.add(ids=_ids(rt, PROMPTS[0]), sampling=replace(sp))]
    run()
    assert batch.plan.off() and last[rows[0]].mtp["drafted"] > 0
    rows += [batch.add(ids=_ids(rt, p), sampling=replace(sp)) for p in PROMPTS[1:3]]
    run()
    assert [last[r].token_ids for r in rows] == want
    assert [last[r].mtp["drafted"] for r in rows[1:]] == [0, 0] and all(last[r].mtp["auto"] for r in rows)


@pytest.mark.parametrize("mtp", [0, 2])
def test_a_repeated_prompt_is_reused_whole_alone_and_in_the_batch(tiny_model_mtp, mtp, one_thread):
    """The same prompt again restores its whole snapshot (its last logits, and the hidden row the MTP layer drafts
    from): no token prefilled, in `generate` and in the batch, and the tokens are those of its first run, with
    drafts or not."""
    rt = _load(tiny_model_mtp, "int4")
    rt.set_prompt_cache(1 << 28)
    rt.set_mtp(mtp)
    ids = _ids(rt, PROMPTS[4])
    sp = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    first, again = (_alone(rt, ids, replace(sp), None) for _ in range(2))
    batch = BatchGenerator(rt)
    row = batch.add(ids=ids, sampling=replace(sp))
    last = {}
    while batch:
        for r, ev in batch.step():
            if ev.response is not None:
                last[r] = ev.response
    assert first.cached_tokens < len(ids)
    for got in (again, last[row]):
        assert got.cached_tokens == len(ids) and got.token_ids == first.token_ids
        assert (got.mtp["drafted"] > 0) if mtp else got.mtp is None
