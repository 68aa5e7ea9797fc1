"""Runs of consecutive rows on one cache in the row path (model/qwen3_5_moe.py `Attention.steps`,
`DeltaNet.steps`; model/ops.py `runs_of`), as `forward_batch` and a verify make them: a prompt chunk or a verify
goes through the attention layer in one
`attention_rows` call (the kernel's `attn_rows`) and through each Gated DeltaNet layer in one `gdn_run` call (the
kernel's `gdn_rows`), the rows alone on their cache through `gdn_rows` (the kernel's `gdn_batch`). Whatever the
grouping, every row is bit for bit the one-token step it stands for: logits, K/V, conv windows, states and the
trail a verify leaves for `rewind`, on every route and every forced op table of the CPU kernel.
"""

from __future__ import annotations

import pytest
import torch
from test_batch_decode import _load

from quantkit.runtime.model.ops import runs_of
from quantkit.runtime.model.qwen3_5_moe import Segment

from helpers.states import random_tokens, same_state

ROUTES = ["stack", "fused", "torch"]


def _primed(m, n: int, seed: int):
    """A cache after a prompt of n tokens (none: a fresh cache), with room for 64 more."""
    c = m.new_cache(n + 64)
    if n:
        m.forward(random_tokens(n, seed), c)
    return c


def _stepped(m, c, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [T, V], final-norm rows [T, H]) of ids as T single-token forwards on c: what every row must equal."""
    outs = [m.forward([t], c, hidden=True) for t in ids]
    return torch.stack([lg for lg, _h in outs]), torch.cat([h for _lg, h in outs])


def _rows(m, segs: list[list[int]], caches: list) -> list:
    """`forward_batch` of segs[j] on caches[j] in one forward of rows, nothing kept: a prompt chunk ("prefill")
    where a segment has several tokens, else a decode step."""
    return m.forward_batch([Segment(c, s, "prefill" if len(s) > 1 else "decode")
                            for c, s in zip(caches, segs, strict=True)], hidden=True)


def test_runs_of_groups_consecutive_rows_of_one_cache():
    a, b = object(), object()
    slots = [(a, 5), (a, 6), (a, 7), (b, 0), (a, 9)]
    assert runs_of(slots) == [(a, 0, 3), (b, 3, 1), (a, 4, 1)]
    assert runs_of([]) == []


def _check_chunk(rt, start: int, t: int) -> None:
    """A chunk of t tokens at position `start` through the rows (a prompt chunk, nothing kept) and as a verify
    (states kept) against t single-token forwards: every row's final-norm output, the logits and the caches bit for
    bit, and the verify rewound to a position inside it equals the steps that stopped there."""
    m = rt.model
    ids = random_tokens(t, 7 + start)
    with torch.inference_mode():
        ref = _primed(m, start, 1)
        want, want_h = _stepped(m, ref, ids)
        rows = _primed(m, start, 1)
        got = _rows(m, [ids], [rows])[0]
        assert torch.equal(got.hidden, want_h) and torch.equal(got.logits, want[-1:])
        assert same_state(rows, ref)
        ver = _primed(m, start, 1)
        assert torch.equal(m.forward(ids, ver, all_logits=True, keep_positions=True), want)
        assert same_state(ver, ref)
        keep = t // 2 + 1
        ver.rewind(start + keep)
        short = _primed(m, start, 1)
        _stepped(m, short, ids[:keep])
        assert same_state(ver, short)


@pytest.mark.parametrize("route", ROUTES)
def test_a_chunk_through_the_rows_equals_one_token_steps(tiny_model, route, one_thread):
    rt = _load(tiny_model, "int4", route)
    for start, t in ((0, 9), (23, 17), (40, 2)):
        _check_chunk(rt, start, t)


@pytest.mark.parametrize("recipe", ["bf16", "int4"])
def test_a_chunk_through_the_rows_on_every_op_table(tiny_model, recipe, kernel_table, one_thread):
    rt = _load(tiny_model, recipe, "fused")
    _check_chunk(rt, 30, 13)


def _check_mixed(rt) -> None:
    """One forward of rows holding a chunk of 9 tokens, two single decode rows and a chunk of 3 on four caches:
    each row's final-norm output and each cache bit for bit its own tokens stepped one at a time; then a step of
    all four."""
    m = rt.model
    starts, lengths = [12, 30, 0, 21], [9, 1, 3, 1]
    with torch.inference_mode():
        segs = [random_tokens(t, 50 + j) for j, t in enumerate(lengths)]
        batch = [_primed(m, s, 60 + j) for j, s in enumerate(starts)]
        alone = [_primed(m, s, 60 + j) for j, s in enumerate(starts)]
        got = _rows(m, segs, batch)
        for j, seg in enumerate(segs):
            want, want_h = _stepped(m, alone[j], seg)
            assert torch.equal(got[j].hidden, want_h) and torch.equal(got[j].logits, want[-1:]), f"row {j}"
            assert same_state(batch[j], alone[j]), f"cache {j} of {lengths}"
        nxt = random_tokens(4, 70)
        got = m.step_batch(nxt, batch)
        for j in range(4):
            assert torch.equal(got[j], m.forward([nxt[j]], alone[j]))


@pytest.mark.parametrize("route", ROUTES)
def test_a_mixed_forward_of_runs_and_single_rows_equals_each_cache_alone(tiny_model, route, one_thread):
    _check_mixed(_load(tiny_model, "int4", route))


@pytest.mark.parametrize("recipe", ["bf16", "int4"])
def test_a_mixed_forward_on_every_op_table(tiny_model, recipe, kernel_table, one_thread):
    _check_mixed(_load(tiny_model, recipe, "fused"))


@pytest.mark.parametrize("route", ["fused", "torch"])
def test_each_run_is_one_call(tiny_model, route, monkeypatch, one_thread):
    """The chunk of 9 is one attention_rows and one gdn_run call per layer; the single rows share one gdn_rows."""
    rt = _load(tiny_model, "int4", route)
    m, calls = rt.model, {"attention_rows": [], "gdn_run": [], "gdn_rows": []}
    ops = type(m.ops)
    for name in calls:
        real = getattr(ops, name)

        def spy(self, mod, qkv, *args, _real=real, _name=name):
            calls[_name].append(qkv.shape[0])
            return _real(self, mod, qkv, *args)

        monkeypatch.setattr(ops, name, spy)
    with torch.inference_mode():
        caches = [_primed(m, s, 80 + j) for j, s in enumerate((5, 0, 11))]
        _rows(m, [random_tokens(9, 90), [3], [4]], caches)
    attn = sum(L.mixer.kind == "attention" for L in m.layers)
    assert calls["attention_rows"] == [9, 1, 1] * attn
    assert calls["gdn_run"] == [9] * (len(m.layers) - attn)
    assert calls["gdn_rows"] == [2] * (len(m.layers) - attn)
