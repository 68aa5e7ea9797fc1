"""GPTQ with static group scales: error-compensating rounding of one matrix given its input Hessian.

Contract: `gptq(w, hessian, spec)` takes a weight matrix w [R, C] (any float dtype), the sum of x x^T
over its calibration inputs [C, C] (quantize/stats.py) and a QuantSpec of a format with a `Grid`
(int4, int8; quantize/grid.py). It returns the format's stored parts, bit-for-bit the layout
round-to-nearest writes, and a `GptqInfo` (the damping used, or why it fell back to RTN).

The algorithm (Frantar et al., GPTQ; the choices below are the ones llm-compressor's GPTQModifier and
GPTQModel make in their code):
- scales are chosen BEFORE the solve, by the format's own round-to-nearest (with its clip search), so
  the stored scales are the format's and no g_idx is needed;
- columns are processed in order of decreasing Hessian diagonal ("static" act-order: only the order
  changes, the scales stay tied to their groups);
- dead inputs (zero diagonal) get a unit diagonal; damping adds `damp` x mean(diag) to the diagonal;
  a failed Cholesky multiplies the damping by 10 (up to DAMP_TRIES times), then the matrix falls back
  to round-to-nearest (`info.fallback` says so);
- blocked updates: BLOCK columns are solved one by one against the inverse Hessian's Cholesky factor,
  then the block's error updates the rest of the matrix in one product.
Rows are independent given H, so a stack of matrices sharing one Hessian (all experts' gate_up of a
layer under all-expert calibration) is solved as one [n*R, C] problem with one Cholesky.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantkit.formats import QuantSpec
from quantkit.quantize.grid import grid_for

BLOCK = 128
DAMP = 0.01
DAMP_TRIES = 3


@dataclass
class GptqInfo:
    damp: float = 0.0
    fallback: str = ""  # why round-to-nearest was used instead, "" when GPTQ ran


def inverse_cholesky(h: torch.Tensor, damp: float = DAMP) -> tuple[torch.Tensor | None, float]:
    """Upper Cholesky factor of (H + damping)^-1 (fp64 for the factorizations), raising the damping on
    failure; (None, last damping) when it still fails."""
    h = h.double().clone()
    diag = torch.diagonal(h)
    diag[diag <= 0] = 1.0
    mean = float(diag.mean())
    eye = torch.eye(h.shape[0], dtype=torch.float64)
    d = damp
    for _ in range(DAMP_TRIES):
        hd = h + eye * (d * mean)
        lower, bad = torch.linalg.cholesky_ex(hd)
        if not int(bad):
            hinv = torch.cholesky_inverse(lower)
            upper, bad = torch.linalg.cholesky_ex(hinv, upper=True)
            if not int(bad) and torch.isfinite(upper).all():
                return upper.float(), d
        d *= 10
    return None, d / 10


def gptq(w: torch.Tensor, hessian: torch.Tensor, spec: QuantSpec, block: int = BLOCK, damp: float = DAMP,
         act_order: bool = True) -> tuple[dict[str, torch.Tensor], GptqInfo]:
    """Stored parts of w [R, C] quantized by GPTQ under `spec` (module docstring)."""
    grid, rtn_parts = grid_for(w, spec)
    if grid is None:
        return rtn_parts, GptqInfo(fallback=f"format {spec.format} has no GPTQ grid: round-to-nearest")
    cols = w.shape[-1]
    h = hessian.float()
    if not torch.isfinite(h).all():
        return rtn_parts, GptqInfo(fallback="non-finite Hessian: round-to-nearest")
    dead = torch.diagonal(h) <= 0
    perm = torch.argsort(torch.diagonal(h), descending=True, stable=True) if act_order else torch.arange(cols)
    upper, d = inverse_cholesky(h[perm][:, perm], damp)
    if upper is None:
        return rtn_parts, GptqInfo(d, f"Hessian not positive definite at damping {d:g}: round-to-nearest")
    wp = w.float()[:, perm].clone()
    wp[:, dead[perm]] = 0.0
    codes = torch.empty(wp.shape, dtype=torch.int32)
    for b0 in range(0, cols, block):
        b1 = min(b0 + block, cols)
        wb = wp[:, b0:b1].clone()
        err = torch.empty_like(wb)
        hb = upper[b0:b1, b0:b1]
        for j in range(b1 - b0):
            col = perm[b0 + j:b0 + j + 1]
            q, v = grid.round(wb[:, j:j + 1], col)
            codes[:, b0 + j] = q[:, 0]
            e = (wb[:, j] - v[:, 0]) / hb[j, j]
            wb[:, j:] -= e[:, None] * hb[j, j:][None, :]
            err[:, j] = e
        if b1 < cols:
            wp[:, b1:] -= err @ upper[b0:b1, b1:]
    out = torch.empty_like(codes)
    out[:, perm] = codes
    return grid.parts(out), GptqInfo(d)
