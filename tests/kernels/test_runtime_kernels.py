"""Every kernel route against its plain dequantize-then-matmul reference (formats' own dequantize)."""

from __future__ import annotations

import zlib

import pytest
import torch

from quantkit.formats import QuantSpec, get_format
from quantkit.runtime.kernels import (
    DenseKernel,
    DequantKernel,
    Int4Kernel,
    Int8Kernel,
    QKernel,
    mxfp4_to_int4x2,
    prepare,
    reference_matmul,
)

SPECS = [QuantSpec("int8"), QuantSpec("int4", 32), QuantSpec("int4", 64, symmetric=False), QuantSpec("int4", 128),
         QuantSpec("nf4", 64), QuantSpec("fp4", 64), QuantSpec("mxfp4", 32)]
# out sizes: not a multiple of 16 (padded for tinygemm), the 4-head in_proj_a/b shape, a real-ish one
SHAPES = [(4, 128), (40, 128), (256, 256)]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.format}-g{s.group_size}-{'s' if s.symmetric else 'a'}")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("route", [None, "dequant", "torch"])
@pytest.mark.usefixtures("each_table")
def test_kernel_matches_dequantize_then_matmul(spec, shape, route):
    g = torch.Generator().manual_seed(zlib.crc32(repr((spec.format, spec.group_size, shape)).encode()))
    w = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
    parts = get_format(spec.format).quantize(w, spec)
    k = prepare(parts, spec, shape, route=route)
    for m in (1, 7):
        # 8 calls of m rows each, judged together: a 4-output matrix's error over one call's 4 values
        # swings with the draw (it measured 3% on one of them)
        xs = [torch.randn(m, shape[1], generator=g).to(torch.bfloat16) for _ in range(8)]
        ys = [k(x) for x in xs]
        assert all(y.shape == (m, shape[0]) and y.dtype == torch.bfloat16 for y in ys)
        y, ref = torch.cat(ys), torch.cat([reference_matmul(x, parts, spec, shape) for x in xs])
        # bf16 activations and outputs: ~2^-8 per element; the packed kernels may also round scales to bf16.
        # quantkit's CPU kernel rounds activations to int8 per block of 32 (about 0.6% rms per element on
        # Gaussian inputs)
        tol = 2e-2 if isinstance(k, QKernel) else 1e-2
        assert rel(y, ref) < tol, (k.route, m)


def test_routes_on_cpu():
    """Which kernel each format gets on a CPU: quantkit's C++ kernel for int4/int8 where it is built,
    else (and with route="torch") the packed torch ops, never the slow fallback."""
    from quantkit.kernels import cpu as cpu_kernel

    shape = (64, 128)
    w = torch.randn(shape).to(torch.bfloat16)
    for f in ("int4", "int8"):
        spec = QuantSpec(f, 32 if f == "int4" else None)
        k = prepare(get_format(f).quantize(w, spec), spec, shape)
        assert isinstance(k, QKernel) == cpu_kernel.available(), k.route
    kinds = {}
    for spec in SPECS:
        kinds[spec.format] = prepare(get_format(spec.format).quantize(w, spec), spec, shape, route="torch")
    assert isinstance(kinds["int8"], Int8Kernel) and kinds["int8"].route == "torch._weight_int8pack_mm"
    assert isinstance(kinds["int4"], Int4Kernel) and "_weight_int4pack_mm_for_cpu" in kinds["int4"].route
    assert isinstance(kinds["mxfp4"], Int4Kernel) and kinds["mxfp4"].route.startswith("mxfp4 as exact int4 pair")
    assert "bitsandbytes" in kinds["nf4"].route and "bitsandbytes" in kinds["fp4"].route
    assert isinstance(prepare(w, None, shape), DenseKernel)
    assert isinstance(prepare(get_format("nf4").quantize(w, SPECS[4]), SPECS[4], shape, route="dequant"),
                      DequantKernel)


def test_mxfp4_int4_pair_is_exact():
    """The lo + 4*hi split reproduces the stored MXFP4 weights exactly (all 16 codes, a zero block,
    scales over a wide exponent range)."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(32, 256, generator=g) * torch.logspace(-6, 2, 32)[:, None]
    w[3, :32] = 0  # an all-zero block: exponent 0
    w[5, :16] = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])  # every code
    spec = QuantSpec("mxfp4", 32)
    fmt = get_format("mxfp4")
    parts = fmt.quantize(w.to(torch.bfloat16), spec)
    want = fmt.dequantize(parts, spec, (32, 256), torch.float32)
    codes, scales = mxfp4_to_int4x2(parts)
    assert codes.shape == (32, 512) and int(codes.min()) >= 5 and int(codes.max()) <= 11
    q = (codes.float() - 8).reshape(32, -1, 32) * scales.float()[..., None]
    q = q.reshape(32, 512)
    got = q[:, :256] + q[:, 256:]
    assert torch.equal(got, want)


def test_int4_padding_rows_are_exact_zeros():
    """out=4 is padded to 16 rows for the CPU packer; the extra rows must not leak into the output."""
    w = torch.randn(4, 64).to(torch.bfloat16)
    spec = QuantSpec("int4", 64)
    parts = get_format("int4").quantize(w, spec)
    k = prepare(parts, spec, (4, 64), route="torch")
    x = torch.randn(3, 64).to(torch.bfloat16)
    assert k(x).shape == (3, 4)
    assert rel(k(x), reference_matmul(x, parts, spec, (4, 64))) < 1e-2


@pytest.mark.usefixtures("each_table")
def test_zero_matrix_gives_zero():
    for spec in SPECS:
        w = torch.zeros(32, 128, dtype=torch.bfloat16)
        k = prepare(get_format(spec.format).quantize(w, spec), spec, (32, 128))
        assert torch.count_nonzero(k(torch.randn(2, 128).to(torch.bfloat16))) == 0, spec.format


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.format}-g{s.group_size}-{'s' if s.symmetric else 'a'}")
@pytest.mark.usefixtures("each_table")
def test_parts_at_any_byte_offset(spec):
    """Stored parts read from a shard can start at any byte offset (views into one buffer); torch's int8
    kernel crashed on a weight 8 bytes off, so every route must work on such views."""
    shape = (128, 256)
    w = (torch.randn(shape, generator=torch.Generator().manual_seed(3)) * 0.02).to(torch.bfloat16)
    parts = get_format(spec.format).quantize(w, spec)
    shifted = {}
    for name, t in parts.items():
        raw = t.contiguous().view(-1).view(torch.uint8)
        buf = torch.zeros(raw.numel() + 8, dtype=torch.uint8)
        buf[8:] = raw
        shifted[name] = buf[8:].view(t.dtype).view(t.shape)
        assert shifted[name].data_ptr() % 16 == 8
    x = torch.randn(5, shape[1], generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    k = prepare(shifted, spec, shape)
    assert rel(k(x), reference_matmul(x, parts, spec, shape)) < (2e-2 if isinstance(k, QKernel) else 1e-2)
