"""Batched decode (quantkit/runtime/model/batch_step.py, quantkit/runtime/batch.py) against single-request runs,
on the tiny decisive checkpoint (routing robust to rounding): every row of a batch step gives the logits and the
cache states of the same token stepped alone, bit for bit, on every route and every forced op table of the CPU
kernel; a `BatchGenerator`'s rows, joining and leaving mid-batch, generate exactly the tokens each request
generates alone, greedy and seeded."""

from __future__ import annotations

import pytest
import torch

from quantkit.runtime import cpu_kernel, load_model

from test_runtime_common import one_thread, quantized  # noqa: F401

PROMPTS = ["list the files in this folder, then count them", "write a haiku about rivers",
           "what is 17 times 23?", "name three colours", "summarise the plot of a short story in one line",
           "translate 'good morning' to French"]
ROUTES = ["stack", "fused", "torch"]


def _load(tiny_model, recipe: str, route: str | None = None):
    if route not in (None, "torch") and not cpu_kernel.available():
        pytest.skip("the CPU kernel is not built on this machine")
    return load_model(tiny_model if recipe == "bf16" else quantized(tiny_model, recipe), forced_route=route)


def _ids(rt, text: str) -> list[int]:
    return rt.encode(rt.render([{"role": "user", "content": text}]))


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(0, 700, (n,), generator=g)]


def _same_state(a, b) -> bool:
    if a.n != b.n:
        return False
    lin = all(torch.equal(a.conv[i], b.conv[i]) and torch.equal(a.state[i], b.state[i]) for i in a.conv)
    return lin and all(torch.equal(a.keys[i][:, :a.n], b.keys[i][:, :b.n]) and
                       torch.equal(a.values[i][:, :a.n], b.values[i][:, :b.n]) for i in a.keys)


def _check_steps(rt, rows: int, steps: int = 3) -> None:
    """`rows` caches at different positions (prompts of different lengths), stepped together and alone."""
    m = rt.model
    with torch.inference_mode():
        prompts = [_ids(rt, PROMPTS[j % len(PROMPTS)]) + _tokens(j, 10 + j) for j in range(rows)]
        batch, alone = [], []
        for p in prompts:
            for group in (batch, alone):
                c = m.new_cache(len(p) + 1)  # too small on purpose: the step grows it
                m.forward(p, c)
                group.append(c)
        for s in range(steps):
            toks = _tokens(rows, 100 + s)
            got = m.step_batch(toks, batch)
            assert got.shape == (rows, m.vocab)
            for j in range(rows):
                want = m.forward([toks[j]], alone[j])
                assert torch.equal(got[j], want), f"row {j} of {rows}, step {s}"
                assert _same_state(batch[j], alone[j])


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("recipe", ["bf16", "int8", "int4"])
def test_a_batch_step_equals_each_row_stepped_alone(tiny_model, recipe, route, one_thread):  # noqa: F811
    rt = _load(tiny_model, recipe, route)
    assert rt.model.route.kind == route
    for rows in (1, 2, 4, 6):  # 6: more rows than one group of the kernels' multi-row tiles
        _check_steps(rt, rows)


@pytest.mark.parametrize("recipe", ["bf16", "int4"])
def test_a_batch_step_equals_each_row_on_every_op_table(tiny_model, recipe, kernel_table, one_thread):  # noqa: F811
    rt = _load(tiny_model, recipe, "stack")
    _check_steps(rt, 5, steps=2)


def test_a_batch_step_refuses_mismatched_rows(tiny_model, one_thread):  # noqa: F811
    rt = _load(tiny_model, "int4")
    m = rt.model
    c = m.new_cache(8)
    with pytest.raises(ValueError, match="one cache per token"):
        m.step_batch([1, 2], [c])
    with pytest.raises(ValueError, match="appears twice"):
        m.step_batch([1, 2], [c, c])
    assert c.n == 0


def test_the_routed_experts_run_once_per_layer_for_all_rows(tiny_model, monkeypatch, one_thread):  # noqa: F811
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
