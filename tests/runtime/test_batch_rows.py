"""Prompts prefilled inside the batch's steps (`Runtime.set_prefill("rows")`, quantkit/runtime/batch_prompts.py):
rows joining and leaving, with and without MTP drafts, and the `n` choices of one prompt generate exactly what each
request generates alone; the chunks of several prompts ride in one forward with the decoding rows, a long prompt
holding them up by one chunk at most; the end of every answer is a snapshot, so a conversation's next turn is
prefilled from there and still gives a cold run's tokens; the two arithmetics never share a snapshot."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_batch_decode import PROMPTS, ROUTES, _alone, _check_batch, _drafted_batch, _ids, _load

from quantkit.errors import QuantkitError
from quantkit.runtime import batch_prompts
from quantkit.runtime.batch import BatchGenerator
from quantkit.runtime.generate import PREFILL_CHUNK, SamplingParams
from quantkit.runtime.model.qwen3_5_moe import Segment

from helpers.mtp import MTP_ROUTES

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.mark.parametrize("route", ROUTES)
def test_rows_joining_and_leaving_generate_what_each_generates_alone(tiny_model, route, one_thread):
    _check_batch(_load(tiny_model, "int4", route, prefill="rows"))


@pytest.mark.parametrize("recipe", ["bf16", "int4"])
def test_rows_joining_and_leaving_on_every_op_table(tiny_model, recipe, kernel_table, one_thread):
    _check_batch(_load(tiny_model, recipe, "stack", prefill="rows"))


@pytest.mark.parametrize("route", MTP_ROUTES)
@pytest.mark.parametrize(("draft", "wrong_every"), [(2, 4), (None, 0)])
def test_rows_with_drafts_generate_what_each_generates_alone(tiny_model_mtp, route, draft, wrong_every,
                                                            monkeypatch, one_thread):
    _drafted_batch(_load(tiny_model_mtp, "int4", route, prefill="rows"), monkeypatch, draft, wrong_every)


def _spy(monkeypatch, rt) -> list[list[tuple[str, int]]]:
    """Each forward_batch's segments as (kind, tokens)."""
    calls: list[list[tuple[str, int]]] = []
    real = rt.model.forward_batch

    def spy(batch, hidden=False):
        calls.append([(s.kind, len(s.ids)) for s in batch])
        return real(batch, hidden=hidden)

    monkeypatch.setattr(rt.model, "forward_batch", spy)
    return calls


def test_new_prompts_are_prefilled_together_in_one_forward(tiny_model, monkeypatch, one_thread):
    rt = _load(tiny_model, "int4", prefill="rows")
    sp = SamplingParams(max_new_tokens=5, **GREEDY)
    want = [_alone(rt, _ids(rt, p), sp, None).token_ids for p in PROMPTS[:3]]
    calls = _spy(monkeypatch, rt)
    batch = BatchGenerator(rt)
    rows = [batch.add(ids=_ids(rt, p), sampling=replace(sp)) for p in PROMPTS[:3]]
    assert calls == []  # nothing is prefilled at `add`
    last = {}
    while batch:
        for row, ev in batch.step():
            if ev.response is not None:
                last[row] = ev.response
    assert calls[0] == [("prefill", len(_ids(rt, p))) for p in PROMPTS[:3]]  # three prompts, one forward
    assert all(kinds == [("decode", 1)] * 3 for kinds in calls[1:])
    assert [last[r].token_ids for r in rows] == want


def test_a_long_prompt_holds_the_decoding_rows_up_one_chunk_at_a_time(tiny_model, monkeypatch, one_thread):
    rt = _load(tiny_model, "int4", prefill="rows")
    monkeypatch.setattr("quantkit.runtime.batch.PREFILL_CHUNK", 8)
    sp = SamplingParams(max_new_tokens=30, **GREEDY)
    long_ids = _ids(rt, " ".join(PROMPTS))
    refs = [_alone(rt, _ids(rt, p), sp, None).token_ids for p in PROMPTS[:2]] + [_alone(rt, long_ids, sp, None).token_ids]
    calls = _spy(monkeypatch, rt)
    batch = BatchGenerator(rt)
    rows = [batch.add(ids=_ids(rt, p), sampling=replace(sp)) for p in PROMPTS[:2]]
    got: dict[int, list[int]] = {r: [] for r in rows}
    while not all(got.values()):  # both decoding
        for row, ev in batch.step():
            got[row].append(ev.token)
    rows.append(batch.add(ids=long_ids, sampling=replace(sp)))
    got[rows[-1]] = []
    calls.clear()
    while batch:
        for row, ev in batch.step():
            if ev.token is not None:
                got[row].append(ev.token)
    during = [c for c in calls if any(k == "prefill" for k, _t in c)]
    assert len(during) == -(-len(long_ids) // 8) > 3
    for c in during:  # every decoding row steps beside each chunk, and a chunk is at most the budget
        assert c[:2] == [("decode", 1), ("decode", 1)] and sum(t for k, t in c if k == "prefill") <= 8
    assert [got[r] for r in rows] == refs


def _run(batch) -> dict[int, object]:
    last = {}
    while batch:
        for row, ev in batch.step():
            if ev.response is not None:
                last[row] = ev.response
    return last


def test_a_next_turn_is_prefilled_from_the_end_of_the_answer(tiny_model, one_thread):
    """An agent's next turn sends its prompt, the answer and new tokens: restored at the answer's end, only the new
    tokens are prefilled, and the tokens are a cold run's."""
    rt = _load(tiny_model, "int4", prefill="rows")
    sp = SamplingParams(max_new_tokens=9, **GREEDY)
    turn1 = _ids(rt, PROMPTS[0])
    rt.set_prompt_cache(1 << 28)
    first = _alone(rt, turn1, replace(sp), None)
    new = _ids(rt, PROMPTS[1])
    turn2 = turn1 + first.token_ids + new
    got = _alone(rt, turn2, replace(sp), None)
    assert got.cached_tokens == len(turn1) + len(first.token_ids) - 1  # the last token was never fed
    rt.prompt_cache.clear()
    cold = _alone(rt, turn2, replace(sp), None)
    assert cold.cached_tokens == 0 and got.token_ids == cold.token_ids


def test_the_answer_snapshot_equals_a_cold_prefill_to_the_same_token(tiny_model, one_thread):
    rt = _load(tiny_model, "int4", prefill="rows")
    m = rt.model
    sp = SamplingParams(max_new_tokens=7, **GREEDY)
    turn1 = _ids(rt, PROMPTS[2])
    rt.set_prompt_cache(1 << 28)
    ans = _alone(rt, turn1, replace(sp), None)
    ids = turn1 + ans.token_ids[:-1]
    snap = rt.prompt_cache.peek(ids + [0])
    assert snap is not None and list(snap.ids) == ids
    with torch.inference_mode():
        cold = m.new_cache(len(ids))
        m.forward_batch([Segment(cold, ids, "prefill")])
        got = cold.snapshot(ids)
    for (k1, a1, b1), (k2, a2, b2) in zip(snap.layers, got.layers, strict=True):
        assert k1 == k2 and torch.equal(a1, a2) and torch.equal(b1, b2)


def test_forks_of_a_prompt_still_prefilling_take_its_state_and_outlive_its_cancel(tiny_model, monkeypatch,
                                                                                   one_thread):
    rt = _load(tiny_model, "int4", prefill="rows")
    monkeypatch.setattr("quantkit.runtime.batch.PREFILL_CHUNK", 8)
    ids = _ids(rt, PROMPTS[4])
    seeded = dict(temperature=0.9, top_p=0.9, top_k=20, ignore_eos=True)
    sps = [SamplingParams(max_new_tokens=9, seed=5, **seeded), SamplingParams(max_new_tokens=6, seed=6, **seeded),
           SamplingParams(max_new_tokens=7, **GREEDY)]
    want = [_alone(rt, ids, replace(sp), None).token_ids for sp in sps]
    calls = _spy(monkeypatch, rt)
    batch = BatchGenerator(rt, max_rows=3)
    first = batch.add(ids=ids, sampling=replace(sps[0]))
    rows = [first, *(batch.fork(first, replace(sp)) for sp in sps[1:])]
    batch.step()  # one chunk of the prompt
    batch.cancel(first)  # the first choice leaves while its prompt is prefilled: the forks carry it on
    last = _run(batch)
    assert sum(t for c in calls for k, t in c if k == "prefill") == len(ids)  # the prompt prefilled once
    assert last[first].finish_reason == "cancelled" and last[first].token_ids == []
    assert [last[r].token_ids for r in rows[1:]] == want[1:]


def test_the_two_arithmetics_never_share_a_snapshot(tiny_model, tmp_path, one_thread):
    rt = _load(tiny_model, "int4", prefill="rows")
    rt.set_prompt_cache(1 << 28, tmp_path / "pc", None)
    sp = SamplingParams(max_new_tokens=4, **GREEDY)
    turn1 = _ids(rt, PROMPTS[3])
    _alone(rt, turn1, replace(sp), None)
    assert rt.prompt_cache.disk.summary()["entries"] > 0
    with pytest.raises(QuantkitError, match="before the disk prompt cache"):
        rt.set_prefill("tokens")
    other = _load(tiny_model, "int4")  # the T-token arithmetic: the folder's entries are another identity's
    other.set_prompt_cache(1 << 28, tmp_path / "pc", None)
    again = _alone(other, turn1 + [17, 18], replace(sp), None)
    assert again.cached_tokens == 0
    with pytest.raises(QuantkitError, match="prefill='bogus'"):
        rt.set_prefill("bogus")


def test_plan_chunks_shares_the_budget_first_come_first_served():
    feeds = [batch_prompts.PromptFeed(list(range(n)), 0, points, False, 0) for n, points in
             ((5, []), (20, [12]), (9, []))]
    got = batch_prompts.plan_chunks(feeds, 16)
    assert [len(ids) for _f, ids in got] == [5, 11]  # the second stops at 16 in all
    feeds[1].at = 5
    assert feeds[1].chunk(100) == list(range(5, 12))  # a chunk ends where a snapshot is due
    assert PREFILL_CHUNK >= 256


def test_prompts_arriving_together_prefill_their_shared_start_once(tiny_model, monkeypatch, one_thread):
    """Agents over one tool prompt arrive together: the shared start is prefilled once, the others restore the
    state where they part (and the prompt cache keeps it), and every agent's tokens are its tokens alone."""
    rt = _load(tiny_model, "int4", prefill="rows")
    monkeypatch.setattr("quantkit.runtime.batch.PREFILL_CHUNK", 16)
    system = "You are an agent with tools: list, read, write, search and run. " * 3
    prompts = [rt.render_ids([{"role": "system", "content": system}, {"role": "user", "content": p}])[1]
               for p in PROMPTS[:3]]
    common = batch_prompts.shared(prompts[0], prompts[1])
    assert common > batch_prompts.MIN_SHARED and batch_prompts.shared(prompts[0], prompts[2]) == common
    sp = SamplingParams(max_new_tokens=5, **GREEDY)
    want = [_alone(rt, ids, replace(sp), None) for ids in prompts]
    rt.set_prompt_cache(1 << 28)
    calls = _spy(monkeypatch, rt)
    batch = BatchGenerator(rt)
    rows = [batch.add(ids=ids, sampling=replace(sp)) for ids in prompts]
    last = _run(batch)
    prefilled = sum(t for c in calls for k, t in c if k == "prefill")
    assert prefilled == sum(map(len, prompts)) - 2 * common  # the shared start once
    assert [last[r].token_ids for r in rows] == [w.token_ids for w in want]
    assert [last[r].cached_tokens for r in rows] == [0, common, common]
    assert rt.prompt_cache.peek(prompts[0][:common] + [1]) is not None  # the parting point, kept


def test_a_prompt_waiting_for_a_cancelled_one_prefills_its_start_itself(tiny_model, monkeypatch, one_thread):
    rt = _load(tiny_model, "int4", prefill="rows")
    monkeypatch.setattr("quantkit.runtime.batch.PREFILL_CHUNK", 8)
    system = "You are an agent with tools: list, read, write, search and run. " * 3
    prompts = [rt.render_ids([{"role": "system", "content": system}, {"role": "user", "content": p}])[1]
               for p in PROMPTS[:2]]
    sp = SamplingParams(max_new_tokens=4, **GREEDY)
    want = _alone(rt, prompts[1], replace(sp), None)
    batch = BatchGenerator(rt)
    first = batch.add(ids=prompts[0], sampling=replace(sp))
    second = batch.add(ids=prompts[1], sampling=replace(sp))
    batch.step()
    batch.cancel(first)
    last = _run(batch)
    assert last[first].finish_reason == "cancelled" and last[second].token_ids == want.token_ids
    assert last[second].cached_tokens == 0
