"""GPTQ with static scales and the importance-weighted scale search: lower output error than
round-to-nearest on the activations they were calibrated on, the format's own stored layout, and the
fallbacks (singular Hessian, rare experts) counted."""

from __future__ import annotations

import pytest
import torch

from quantkit.checkpoint.reader import Checkpoint
from quantkit.formats import QuantSpec, get_format
from quantkit.quantize.calibrated import Calibration
from quantkit.quantize.gptq import gptq, inverse_cholesky
from quantkit.quantize.imatrix import imatrix_quantize
from quantkit.quantize.stats import LM, Stats

SPECS = [QuantSpec("int4", 128, True), QuantSpec("int4", 32, True), QuantSpec("int4", 64, False), QuantSpec("int8")]


def _problem(rows=48, cols=256, tokens=1024, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g).to(torch.bfloat16)
    # correlated inputs with uneven column scales, as real activations have
    x = torch.randn(tokens, cols, generator=g) @ torch.randn(cols, cols, generator=g) * 0.1
    x = x + torch.randn(tokens, cols, generator=g) * torch.linspace(0.05, 2.0, cols)
    return w, x


def _out_err(w, parts, spec, x):
    deq = get_format(spec.format).dequantize(parts, spec, tuple(w.shape), torch.float32)
    return float(((x @ (deq - w.float()).T) ** 2).sum())


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.format}-{s.group_size}-{'sym' if s.symmetric else 'asym'}")
def test_gptq_beats_rtn_on_its_calibration_activations_in_the_same_layout(spec):
    w, x = _problem()
    fmt = get_format(spec.format)
    rtn = fmt.quantize(w, spec)
    parts, info = gptq(w, x.T @ x, spec)
    assert not info.fallback
    assert {k: (v.shape, v.dtype) for k, v in parts.items()} == {k: (v.shape, v.dtype) for k, v in rtn.items()}
    assert torch.equal(parts["scales"], rtn["scales"])  # static scales: the format's own
    assert _out_err(w, parts, spec, x) < 0.85 * _out_err(w, rtn, spec, x)


def test_gptq_on_a_stack_sharing_one_hessian_equals_per_matrix_solves():
    w, x = _problem(rows=64)
    spec = SPECS[0]
    h = x.T @ x
    whole, _ = gptq(w, h, spec)
    halves = [gptq(w[:32], h, spec)[0], gptq(w[32:], h, spec)[0]]
    for k in whole:
        assert torch.equal(whole[k], torch.cat([p[k] for p in halves]))


def test_a_hessian_that_cannot_be_factored_raises_damping_then_falls_back_to_rtn():
    w, _ = _problem(cols=128)
    spec = SPECS[0]
    indefinite = torch.full((128, 128), 10.0) - 9.5 * torch.eye(128)  # eigenvalues 1270.5 and -9.5 (x127)
    upper, d = inverse_cholesky(indefinite)
    assert upper is None and d == pytest.approx(1.0)
    parts, info = gptq(w, indefinite, spec)
    assert "not positive definite" in info.fallback
    rtn = get_format("int4").quantize(w, spec)
    assert all(torch.equal(parts[k], rtn[k]) for k in rtn)
    # a singular but damped-solvable Hessian (rank 8) still runs GPTQ
    x = torch.randn(8, 128)
    _, info = gptq(w, x.T @ x, spec)
    assert not info.fallback


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.format}-{s.group_size}-{'sym' if s.symmetric else 'asym'}")
def test_importance_weighted_scales_lower_the_weighted_error(spec):
    w, x = _problem(seed=1)
    imp = x.square().mean(0)
    fmt = get_format(spec.format)
    rtn = fmt.quantize(w, spec)
    parts = imatrix_quantize(w, imp, spec)
    assert {k: (v.shape, v.dtype) for k, v in parts.items()} == {k: (v.shape, v.dtype) for k, v in rtn.items()}

    def weighted(p):
        deq = fmt.dequantize(p, spec, tuple(w.shape), torch.float32)
        return float(((deq - w.float()).square() * imp).sum())

    if spec.format == "int8":  # 255 levels: clipping the row maximum rarely pays; never worse
        assert weighted(parts) <= weighted(rtn)
    else:
        assert weighted(parts) < weighted(rtn)


def test_rare_experts_fall_back_to_rtn_and_are_counted(tiny_model, tiny_stats):
    stats = Stats.open(tiny_stats)
    ck = Checkpoint.open(tiny_model)
    name = f"{LM}layers.0.mlp.experts.down_proj"
    w = ck.load(name)
    counts = stats.get(f"{name}.count")
    spec = QuantSpec("int4", 32, True)
    # a threshold between the two least-routed experts' counts: exactly one falls back
    lo2 = sorted(int(c) for c in counts)[:2]
    frac = (lo2[0] + lo2[1]) / 2 / stats.tokens
    cal = Calibration("gptq", stats, min_fraction=frac)
    parts, fallbacks, why = cal.quantize(name, w, 0, spec)
    assert fallbacks == 1 and "calibration tokens" in why
    rare = int(counts.argmin())
    rtn = get_format("int4").quantize(w[rare], spec)
    assert all(torch.equal(parts[k][rare], rtn[k]) for k in rtn)
    # slabs of experts give the same parts as the whole stack
    a = cal.quantize(name, w[:4], 0, spec)[0]
    b = cal.quantize(name, w[4:], 4, spec)[0]
    assert all(torch.equal(parts[k], torch.cat([a[k], b[k]])) for k in parts)


def test_gptq_lowers_held_out_output_error_of_every_role_on_the_tiny_model(tiny_model, tiny_stats):
    stats = Stats.open(tiny_stats)
    ck = Checkpoint.open(tiny_model)
    spec = QuantSpec("int4", 32, True)
    for name in (f"{LM}layers.0.linear_attn.in_proj_qkv.weight", f"{LM}layers.3.self_attn.o_proj.weight",
                 f"{LM}layers.1.mlp.experts.gate_up_proj", f"{LM}layers.2.mlp.experts.down_proj"):
        w = ck.load(name)
        errs = {}
        for method in ("rtn", "gptq"):
            cal = Calibration(method, stats)
            parts, fb, _ = cal.quantize(name, w, 0, spec)
            deq = get_format("int4").dequantize(parts, spec, tuple(w.shape), torch.float32)
            errs[method] = cal.output_error(name, deq - w.float(), w, 0)[0]
        assert errs["gptq"] < errs["rtn"], (name, errs)
