"""int4: group-wise, symmetric or asymmetric, two codes per byte, in torch's tinygemm convention.

Parts (w [..., out, in], g = spec.group_size, default 128):
- `qweight` uint8 [..., out, in/2]: unsigned codes q in 0..15, element 2j in the LOW nibble of byte j
  and element 2j+1 in the high nibble;
- `scales` bf16 [..., out, in/g];
- `zeros` bf16 [..., out, in/g], asymmetric only;
and w = (q - 8) * scale + zero (zero = 0 when symmetric). That is the float-zero convention of torch's
`_weight_int4pack_mm*` kernels (torchao's tinygemm layout), so `to_torch_int4pack_cpu` hands them the
stored codes and scales without requantizing. bf16, not fp32, scales: it is what those kernels take
(`scales_and_zeros` bf16), and 16 bits per group is what makes g128 4.125 bits per weight.

Symmetric scales are SIGNED, as in GGUF's Q4_0: scale = -m / 8 where m is the group's value of largest
magnitude, so m itself lands on code 0 (q - 8 = -8) and all 16 codes are used; positive-only scales
(absmax / 7) waste code 0 and measured about 1 dB worse. With group 32 the codes and scales are
Q4_0's own convention, so `int4_to_q4_0_blocks` rebuilds GGUF Q4_0 blocks losslessly.

Scale choice (`spec.clip_search`, QuantSpec's default True): each group also tries clipped scales
(CLIP_GRID times the full one; for asymmetric, the range [min, max] shrunk toward zero) and keeps the
one with the least squared error, all groups at once. Measured on Gaussian weights (tests print it):

    SQNR dB           g32     g64     g128    (nf4 blocksize 64, 4.5 bpw: 20.74)
    sym, no search    21.31   20.45   19.72
    sym, search       21.58   20.80   20.20
    asym, no search   22.12   20.96   20.02
    asym, search      22.29   21.24   20.46

The search quantizes each group 1 + len(CLIP_GRID) times; its throughput cost is in the quantizer
benchmark (reports/bench-quantize.md) and the module docstring of tests/quantize/test_formats.py.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from quantkit.errors import QuantkitError
from quantkit.formats import Part, QuantSpec, ceil_div, register
from quantkit.formats.common import (
    ErrorSums,
    check_matrix,
    out_buffer,
    pack_nibbles,
    row_sq,
    run_chunks,
    to_codes,
    unpack_nibbles,
)
from quantkit.kernels import quant as quant_kernel

DEFAULT_GROUP = 128
GROUPS = (32, 64, 128)
# Shrink factors tried besides 1.0 when spec.clip_search: two cover most of the gain of a fine grid
# (g128 sym: 20.21 dB with these, 20.29 with 40 factors, 19.72 with none).
CLIP_GRID = (0.93, 0.86)


_KERNEL_DTYPES = (torch.bfloat16, torch.float32)


def _fast() -> Any:
    """The quantizer's kernel (kernels/quant.py: bf16 or fp32 rows in, codes, scales and both error sums
    out, eight groups' scale search at once; torch's route below takes some 30 passes over each chunk), else
    None."""
    return quant_kernel.ops()


def _group(spec: QuantSpec) -> int:
    g = spec.group_size or DEFAULT_GROUP
    if g not in GROUPS:
        raise QuantkitError(f"int4: group size {g} is not supported; use one of {', '.join(map(str, GROUPS))}")
    return g


def _inv(s: torch.Tensor) -> torch.Tensor:
    """1/s with 0 for s == 0 (an all-zero group: codes 8, scale 0)."""
    return torch.where(s != 0, 1.0 / s, torch.zeros_like(s))


def _pick(x: torch.Tensor, inv: torch.Tensor, off: torch.Tensor | None, scale: torch.Tensor,
          lo: float, hi: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(index of the candidate with the least squared error per group, that error) [R, G].

    x [R, G, g]; inv, scale (and off) [C, R, G]: candidate c codes x as clamp(round(x * inv + off)),
    whose squared error is scale^2 * sum (code - (x * inv + off))^2. Ties keep the first candidate."""
    t = torch.empty_like(x)
    r = torch.empty_like(x)
    err = torch.empty(scale.shape)
    for c in range(scale.shape[0]):
        torch.mul(x, inv[c][..., None], out=t)
        if off is not None:
            t.add_(off[c][..., None])
        torch.clamp(t, lo, hi, out=r).round_().sub_(t)
        err[c] = _lane_sum(torch.mul(r, r, out=r))
    err.mul_(scale.square())
    # first minimum per group, by elementwise steps: argmin/gather over a short leading dim is much slower
    # than these on [R, G]
    best = torch.zeros(scale.shape[1:], dtype=torch.long)
    best_err = err[0]
    for c in range(1, scale.shape[0]):
        better = err[c] < best_err
        best = torch.where(better, c, best)
        best_err = torch.where(better, err[c], best_err)
    return best, best_err


def _lane_sum(sq: torch.Tensor) -> torch.Tensor:
    """[..., g] -> [...]: the sum in the CPU kernel's order (csrc/qk_quant_impl.h: 8 lanes, each summed in turn, then
    combined pairwise), so both routes choose the same candidate where two errors differ in the last bit."""
    v = sq.unflatten(-1, (-1, 8))
    acc = v[..., 0, :]
    for i in range(1, v.shape[-2]):
        acc = acc + v[..., i, :]
    a = [acc[..., lane] for lane in range(8)]
    return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]))


def _select(cand: torch.Tensor, best: torch.Tensor) -> torch.Tensor:
    """cand [C, R, G], best [R, G] -> cand[best[r, g], r, g]."""
    out = cand[0]
    for c in range(1, cand.shape[0]):
        out = torch.where(best == c, cand[c], out)
    return out


def _sym(x: torch.Tensor, grid: tuple[float, ...], want_err: bool = False) -> tuple[torch.Tensor, ...]:
    """x fp32 [R, G, g] -> (codes 0..15 int8 [R, G, g], bf16 scales [R, G], fp32 squared error [R, G] or
    None when neither the search nor the caller needs it), w = (q - 8) * s."""
    mn, mx = x.amin(dim=-1), x.amax(dim=-1)  # two reductions: torch.aminmax is slower here
    base = torch.where(mx >= -mn, mx, mn).mul_(-1.0 / 8)
    if grid:
        f = torch.tensor((1.0, *grid))[:, None, None]
        cand = (base * f).to(torch.bfloat16)  # [C, R, G]
        candf = cand.float()
        inv = _inv(candf)
        best, err = _pick(x, inv, None, candf, -8, 7)
        s, inv_s = _select(cand, best), _select(inv, best)
    else:
        s = base.to(torch.bfloat16)
        sf = s.float()
        inv_s = _inv(sf)
        err = _pick(x, inv_s[None], None, sf[None], -8, 7)[1] if want_err else None
    q = (x * inv_s[..., None]).clamp_(-8, 7).round_().add_(8)
    return to_codes(q), s, err


def _asym(x: torch.Tensor, grid: tuple[float, ...], want_err: bool = False) -> tuple[torch.Tensor, ...]:
    """x fp32 [R, G, g] -> (codes 0..15 int8, bf16 scales, bf16 zeros, fp32 squared error [R, G]),
    w = (q - 8) * s + z.

    Candidate ranges shrink [min, max] toward zero by the grid's factors (only the side that lies
    beyond zero, so an all-positive group keeps its minimum); code 0 maps to the range's low end."""
    mn, mx = x.amin(dim=-1), x.amax(dim=-1)
    f = torch.tensor((1.0, *grid))[:, None, None]
    lo = torch.where(mn < 0, mn * f, mn)
    hi = torch.where(mx > 0, mx * f, mx)
    cand_s = ((hi - lo) * (1.0 / 15)).to(torch.bfloat16)  # [C, R, G]
    cand_z = (lo + 8 * cand_s.float()).to(torch.bfloat16)
    sf, zf = cand_s.float(), cand_z.float()
    inv = _inv(sf)
    off = 8.0 - zf * inv  # code = (x - (z - 8 s)) / s = x * inv + off
    best, err = _pick(x, inv, off, sf, 0, 15) if grid or want_err else (None, None)
    if grid:
        s, z, inv_b, off_b = (_select(t, best) for t in (cand_s, cand_z, inv, off))
    else:
        s, z, inv_b, off_b = cand_s[0], cand_z[0], inv[0], off[0]
    q = (x * inv_b[..., None]).add_(off_b[..., None]).clamp_(0, 15).round_()
    return to_codes(q), s, z, err


class Int4:
    name = "int4"
    fills_buffers = True  # quantize takes out= and sums= (the streaming quantizer's fast path)

    default_group = DEFAULT_GROUP

    def parts(self, spec: QuantSpec, shape: tuple[int, ...]) -> dict[str, Part]:
        *lead, cols = shape
        groups = (*lead, ceil_div(cols, _group(spec)))
        out = {"qweight": Part((*lead, ceil_div(cols, 2)), "uint8", "weight"),
               "scales": Part(groups, "bfloat16", "scales")}
        if not spec.symmetric:
            out["zeros"] = Part(groups, "bfloat16", "zeros")
        return out

    def quantize(self, w: torch.Tensor, spec: QuantSpec, out: dict[str, torch.Tensor] | None = None,
                 sums: ErrorSums | None = None) -> dict[str, torch.Tensor]:
        """`out`: preallocated parts to fill (the streaming quantizer reuses them); `sums`: gathers the
        squared error of the stored weights, as each group's chosen candidate measured it (scale^2 x the
        squared code residual: the error of (q - 8) * s + z against w up to fp32 rounding of w * (1/s))."""
        g = _group(spec)
        check_matrix(w, g, self.name)
        grid = CLIP_GRID if spec.clip_search else ()
        cols = w.shape[-1]
        flat = w.reshape(-1, cols)
        rows = flat.shape[0]
        packed = out_buffer(out, "qweight", (rows, cols // 2), torch.uint8)
        scales = out_buffer(out, "scales", (rows, cols // g), torch.bfloat16)
        zeros = None if spec.symmetric else out_buffer(out, "zeros", (rows, cols // g), torch.bfloat16)

        cpu = spec.symmetric and flat.device.type == "cpu" and packed.is_contiguous() and scales.is_contiguous()
        fast = _fast() if cpu and flat.dtype in _KERNEL_DTYPES and flat.is_contiguous() else None

        def work(sl: slice) -> None:
            xb = flat[sl]
            if fast is not None:  # the same bytes as the route below
                e, r = quant_kernel.int4_sym(fast, xb, g, grid, packed[sl], scales[sl])
                if sums is not None:
                    sums.add(sl, e, r)
                return
            x = xb.float().reshape(-1, cols // g, g)
            if spec.symmetric:
                q, s, err = _sym(x, grid, sums is not None)
            else:
                q, s, z, err = _asym(x, grid, sums is not None)
                zeros[sl] = z
            scales[sl] = s
            packed[sl] = pack_nibbles(q.reshape(-1, cols))
            if sums is not None:
                sums.add(sl, float(err.sum(dtype=torch.float64)), row_sq(x.view(-1, cols)))

        run_chunks(rows, cols, work)
        lead = w.shape[:-1]
        parts = {"qweight": packed.reshape(*lead, cols // 2), "scales": scales.reshape(*lead, cols // g)}
        if zeros is not None:
            parts["zeros"] = zeros.reshape(*lead, cols // g)
        return parts

    def dequantize(
        self, parts: dict[str, torch.Tensor], spec: QuantSpec, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        g = _group(spec)
        q = unpack_nibbles(parts["qweight"]).float()
        q = q.reshape(*q.shape[:-1], -1, g)
        w = (q - 8) * parts["scales"].float()[..., None]
        if "zeros" in parts:
            w = w + parts["zeros"].float()[..., None]
        return w.reshape(shape).to(dtype)


def codes(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """The unsigned codes 0..15 of the stored parts, uint8 [..., out, in]."""
    return unpack_nibbles(parts["qweight"])


def to_torch_int4pack_cpu(
    parts: dict[str, torch.Tensor], spec: QuantSpec, inner_k_tiles: int = 2
) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed, scales_and_zeros) for `torch.ops.aten._weight_int4pack_mm_for_cpu(x_bf16, packed,
    group_size, scales_and_zeros)` from one matrix's stored parts [out, in], without requantizing.

    `packed` = `_convert_weight_to_int4pack_for_cpu(codes int32 [out, in], inner_k_tiles)` and
    `scales_and_zeros` = bf16 [in/g, out, 2] (scale, zero): the kernel computes (q - 8) * scale + zero,
    our convention (checked in tests/quantize/test_formats.py). The CPU kernel needs out % 16 == 0 (torch 2.13:
    "expect N to be dividable by 16"); pad other matrices' rows first (code 8 with scale 0 is an exact
    zero row). `inner_k_tiles` only matters to the CUDA layout; the CPU op accepts it for symmetry."""
    q = codes(parts)
    if q.dim() != 2:
        raise QuantkitError(f"to_torch_int4pack_cpu takes one matrix [out, in]; got codes {tuple(q.shape)}")
    if q.shape[0] % 16:
        raise QuantkitError(f"int4pack: matrix {tuple(q.shape)} needs out % 16 == 0; pad its rows first")
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), inner_k_tiles)
    s = parts["scales"].to(torch.bfloat16)
    z = parts["zeros"].to(torch.bfloat16) if "zeros" in parts else torch.zeros_like(s)
    return packed, torch.stack([s.t(), z.t()], dim=-1).contiguous()


def int4_to_q4_0_blocks(parts: dict[str, torch.Tensor], spec: QuantSpec) -> np.ndarray:
    """GGUF Q4_0 bytes (per 32: fp16 d, then 16 bytes with element j in the low nibble of byte j and j+16
    in the high one) of symmetric group-32 int4 parts: uint8 [..., out, in/32*18]. Lossless, since Q4_0
    dequantizes (q - 8) * d, ours; raises when a scale is not exactly representable in fp16 (magnitude
    above 65504 or below fp16's subnormal step), where Q4_0 cannot hold the tensor as it is."""
    if spec.format != "int4" or not spec.symmetric or _group(spec) != 32 or "zeros" in parts:
        raise QuantkitError(f"Q4_0 holds symmetric int4 with group 32 only, not {spec.to_dict()}")
    s = parts["scales"]
    d = s.to(torch.float16)
    if not torch.equal(d.to(s.dtype), s):
        raise QuantkitError("int4 -> Q4_0: a group scale is not representable in fp16; keep this tensor as is")
    q = unpack_nibbles(parts["qweight"]).reshape(*s.shape, 32)
    qs = q[..., :16] | (q[..., 16:] << 4)
    blocks = torch.cat([d.view(torch.uint8).reshape(*s.shape, 2), qs], dim=-1)
    return blocks.reshape(*s.shape[:-1], -1).numpy()


INT4 = register(Int4())
