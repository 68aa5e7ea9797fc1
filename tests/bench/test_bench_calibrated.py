"""bench calibrated's per-linear path (no timing): padding to the group size keeps the real columns, and
the methods go through quantkit's own functions with the statistics the accumulator hooks collect."""

from __future__ import annotations

import torch

from benchmarks.calibrated import quantize_weight
from quantkit.formats import QuantSpec
from quantkit.quantize.stats import LayerSums


def test_padded_group_matrices_quantize_and_gptq_beats_rtn_on_the_statistics():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, 96, generator=g)  # 96 columns: not a multiple of 128, as SmolLM2's 576
    x = torch.randn(512, 96, generator=g) * torch.linspace(0.1, 3.0, 96)
    acc = LayerSums()
    acc.hessian("lin", x)
    spec = QuantSpec("int4", 128, True)
    out = {m: quantize_weight(w, spec, m, acc.sums, "lin") for m in ("rtn", "imatrix", "gptq")}
    assert all(v.shape == w.shape for v in out.values())
    err = {m: float(((x @ (v - w).T) ** 2).sum()) for m, v in out.items()}
    assert err["gptq"] < err["rtn"] and err["imatrix"] < err["rtn"]
