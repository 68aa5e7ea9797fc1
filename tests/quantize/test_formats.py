"""Formats: round-trip error floors, slab independence, bit-identity with bitsandbytes and gguf, and the
torch packed kernels taking our stored codes as they are.

SQNR on the `gaussian` fixture below (dB): int8 41.6; int4 sym g128 20.2 (19.7 without the clip
search), g64 20.8, g32 21.6 (21.3); int4 asym g64 21.2; nf4 20.7; fp4 18.3; mxfp4 18.8.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from quantkit.errors import QuantkitError
from quantkit.formats import QuantSpec, available_formats, bits_per_weight, get_format, stored_parts
from quantkit.formats.int4 import int4_to_q4_0_blocks, to_torch_int4pack_cpu
from quantkit.formats.metrics import rel_error, sqnr_db
from quantkit.formats.mxfp4 import to_gguf_blocks

SPECS = {
    "int8": QuantSpec("int8"),
    "int4-g128": QuantSpec("int4", 128),
    "int4-g64": QuantSpec("int4", 64),
    "int4-g32": QuantSpec("int4", 32),
    "int4-g32-noclip": QuantSpec("int4", 32, clip_search=False),
    "int4-g64-asym": QuantSpec("int4", 64, symmetric=False),
    "int4-g128-asym-noclip": QuantSpec("int4", 128, symmetric=False, clip_search=False),
    "nf4": QuantSpec("nf4", 64),
    "fp4": QuantSpec("fp4", 64),
    "mxfp4": QuantSpec("mxfp4", 32),
}
# Floors a little under what the fixture measures (see the module docstring).
SQNR_FLOOR = {
    "int8": 41.0, "int4-g128": 19.9, "int4-g64": 20.5, "int4-g32": 21.3, "int4-g32-noclip": 21.0,
    "int4-g64-asym": 20.9, "int4-g128-asym-noclip": 19.7, "nf4": 20.4, "fp4": 18.0, "mxfp4": 18.5,
}


@pytest.fixture(scope="module")
def gaussian() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 256, 512, generator=g).to(torch.bfloat16)


def roundtrip(w: torch.Tensor, spec: QuantSpec, dtype=torch.float32) -> torch.Tensor:
    f = get_format(spec.format)
    return f.dequantize(f.quantize(w, spec), spec, tuple(w.shape), dtype)


def test_registry_lists_every_format() -> None:
    assert set(available_formats()) >= {"int8", "int4", "nf4", "fp4", "mxfp4"}
    with pytest.raises(QuantkitError, match="unknown quantization format 'int3'"):
        get_format("int3")


@pytest.mark.parametrize("key", SPECS)
def test_sqnr_floor_on_gaussian_weights(gaussian: torch.Tensor, key: str) -> None:
    assert sqnr_db(gaussian, roundtrip(gaussian, SPECS[key])) > SQNR_FLOOR[key]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("key", SPECS)
def test_input_dtypes_agree_and_the_input_is_left_alone(gaussian: torch.Tensor, key: str, dtype) -> None:
    """bf16 values are exact in fp16 (this range) and fp32, so every input dtype gives the same parts;
    an fp32 input is the very tensor the formats read (`.float()` does not copy it): it must not change."""
    spec = SPECS[key]
    f = get_format(spec.format)
    w = gaussian[:1].to(dtype)
    before = w.clone()
    parts = f.quantize(w, spec)
    assert torch.equal(w, before)
    ref = f.quantize(gaussian[:1], spec)
    assert all(torch.equal(parts[k], ref[k]) for k in ref)
    assert f.dequantize(parts, spec, tuple(w.shape), dtype).dtype == dtype


@pytest.mark.parametrize("key", SPECS)
def test_slab_of_experts_quantizes_like_the_whole_stack(gaussian: torch.Tensor, key: str) -> None:
    spec = SPECS[key]
    f = get_format(spec.format)
    whole = f.quantize(gaussian, spec)
    slabs = [f.quantize(gaussian[i : i + 2], spec) for i in (0, 2)]
    assert set(whole) == set(slabs[0])
    for part, t in whole.items():
        assert t.shape[0] == gaussian.shape[0]
        assert torch.equal(t, torch.cat([s[part] for s in slabs]))
    single = f.quantize(gaussian[3], spec)  # one 2D matrix = that expert of the stack
    assert all(torch.equal(single[k], whole[k][3]) for k in whole)


@pytest.mark.parametrize("key", [k for k in SPECS if SPECS[k].format in ("int8", "int4", "mxfp4")])
def test_row_blocks_of_a_matrix_quantize_like_the_matrix(gaussian: torch.Tensor, key: str) -> None:
    """Per-row and per-group formats: the streaming quantizer may cut a big 2D matrix into row blocks."""
    spec = SPECS[key]
    f = get_format(spec.format)
    w = gaussian[0]
    whole = f.quantize(w, spec)
    blocks = [f.quantize(w[a:b], spec) for a, b in ((0, 100), (100, 256))]
    assert all(torch.equal(whole[k], torch.cat([p[k] for p in blocks])) for k in whole)


@pytest.mark.parametrize("key", SPECS)
def test_all_zero_matrix_is_exact_and_an_outlier_is_kept(key: str) -> None:
    spec = SPECS[key]
    zero = torch.zeros(2, 8, 128)
    assert torch.equal(roundtrip(zero, spec), zero)
    w = torch.randn(8, 128, generator=torch.Generator().manual_seed(1)) * 0.01
    w[3, 17] = 40.0
    w[5] = 0.0  # an all-zero row (whole groups/blocks) next to ordinary ones
    out = roundtrip(w, spec)
    assert torch.isfinite(out).all()
    assert torch.equal(out[5], torch.zeros(128))
    # absmax-scaled formats map the outlier onto their top code (the clip search must not clip it
    # away: it dominates its group's error); mxfp4's power-of-two scale leaves it between E2M1 levels
    # 4 and 6 (x 8), at most 1/5 away
    tol = 0.2 if spec.format == "mxfp4" else 0.02
    assert abs(out[3, 17].item() - 40.0) <= 40.0 * tol
    # the other rows are untouched by the outlier: per-row/per-group scales
    if spec.format != "int8":
        assert rel_error(w[4], out[4]) < 0.2


@pytest.mark.parametrize("key", SPECS)
def test_bits_per_weight_counts_scales(key: str) -> None:
    spec = SPECS[key]
    expected = {
        "int8": 8 + 16 / 512, "int4-g128": 4.125, "int4-g64": 4.25, "int4-g32": 4.5, "int4-g32-noclip": 4.5,
        "int4-g64-asym": 4.5, "int4-g128-asym-noclip": 4.25, "nf4": 4.5, "fp4": 4.5, "mxfp4": 4.25,
    }[key]
    assert bits_per_weight(spec, (256, 512)) == pytest.approx(expected)
    parts = get_format(spec.format).quantize(torch.randn(256, 512), spec)
    # the format's declared layout is exactly what quantize returns, part by part
    declared = stored_parts(spec, (256, 512))
    assert {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in parts.items()} == {
        k: (p.shape, p.dtype) for k, p in declared.items()}
    stored_bits = sum(p.numel() * p.element_size() * 8 for p in parts.values())
    assert stored_bits / (256 * 512) == pytest.approx(expected)


def test_part_names_and_dtypes() -> None:
    w = torch.randn(2, 32, 256)
    layouts = {
        "int8": {"qweight": (torch.int8, (2, 32, 256)), "scales": (torch.bfloat16, (2, 32))},
        "int4": {"qweight": (torch.uint8, (2, 32, 128)), "scales": (torch.bfloat16, (2, 32, 2))},
        "nf4": {"qweight": (torch.uint8, (2, 32 * 128)), "absmax": (torch.float32, (2, 32 * 4))},
        "fp4": {"qweight": (torch.uint8, (2, 32 * 128)), "absmax": (torch.float32, (2, 32 * 4))},
        "mxfp4": {"qweight": (torch.uint8, (2, 32, 128)), "scales": (torch.uint8, (2, 32, 8))},
    }
    for fmt, want in layouts.items():
        parts = get_format(fmt).quantize(w, QuantSpec(fmt))
        assert {k: (v.dtype, tuple(v.shape)) for k, v in parts.items()} == want, fmt
        declared = stored_parts(QuantSpec(fmt), (2, 32, 256))
        assert {k: (getattr(torch, d.dtype), d.shape) for k, d in declared.items()} == want, fmt
    asym = get_format("int4").quantize(w, QuantSpec("int4", 64, symmetric=False))
    assert asym["zeros"].dtype == torch.bfloat16 and tuple(asym["zeros"].shape) == (2, 32, 4)


def test_int4_nibble_order_and_code_convention() -> None:
    """Codes: element 2j in the low nibble; w = (q - 8) * scale (+ zero); the group's largest-magnitude
    value gets code 0 (signed scale, Q4_0's convention)."""
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1], w[0, 2] = -8.0, 7.0, 1.0  # scale 1: codes 0, 15, 9
    parts = get_format("int4").quantize(w, QuantSpec("int4", 32, clip_search=False))
    assert parts["scales"].item() == 1.0
    assert parts["qweight"][0, 0].item() == 0 | (15 << 4) and parts["qweight"][0, 1].item() == 9 | (8 << 4)
    w2 = -w  # now +8 is the extreme: the scale turns negative and +8 still lands on code 0
    parts2 = get_format("int4").quantize(w2, QuantSpec("int4", 32, clip_search=False))
    assert parts2["scales"].item() == -1.0
    assert torch.equal(roundtrip(w2, QuantSpec("int4", 32, clip_search=False)), w2)


@pytest.mark.parametrize("fmt,group", [("int4", 128), ("int4", 32), ("mxfp4", 32), ("nf4", 64)])
def test_rows_that_do_not_split_into_groups_are_refused(fmt: str, group: int) -> None:
    cols = 6 if fmt == "nf4" else 48  # nf4 blocks run over the flattened matrix: 8 x 6 = 48 < 64
    with pytest.raises(QuantkitError, match=rf"{fmt}: .*\(8, {cols}\).* {group}"):
        get_format(fmt).quantize(torch.randn(8, cols), QuantSpec(fmt, group))


def test_unsupported_group_sizes_and_inputs_are_refused() -> None:
    with pytest.raises(QuantkitError, match="int4: group size 48"):
        get_format("int4").quantize(torch.randn(8, 96), QuantSpec("int4", 48))
    with pytest.raises(QuantkitError, match="mxfp4: blocks are 32"):
        get_format("mxfp4").quantize(torch.randn(8, 128), QuantSpec("mxfp4", 64))
    with pytest.raises(QuantkitError, match=r"expected a matrix.*\(64,\)"):
        get_format("int8").quantize(torch.randn(64), QuantSpec("int8"))
    with pytest.raises(QuantkitError, match="floating-point"):
        get_format("int4").quantize(torch.ones(4, 128, dtype=torch.int32), QuantSpec("int4"))


@pytest.mark.parametrize("group,symmetric,gain", [(128, True, 0.35), (32, True, 0.15), (128, False, 0.3)])
def test_clip_search_beats_plain_range(group: int, symmetric: bool, gain: float) -> None:
    """Measured gains on this tensor: 0.48, 0.27 and 0.44 dB."""
    w = torch.randn(256, 1024, generator=torch.Generator().manual_seed(2))
    plain = sqnr_db(w, roundtrip(w, QuantSpec("int4", group, symmetric, clip_search=False)))
    searched = sqnr_db(w, roundtrip(w, QuantSpec("int4", group, symmetric)))
    assert searched > plain + gain


def test_int4_at_4_5_bits_is_no_worse_than_nf4(gaussian: torch.Tensor) -> None:
    """The issue's quality target: int4 at ~4.25-4.5 bits per weight against nf4 blocksize 64 (4.5)."""
    nf4 = sqnr_db(gaussian, roundtrip(gaussian, QuantSpec("nf4", 64)))
    for spec in (QuantSpec("int4", 32), QuantSpec("int4", 64, symmetric=False), QuantSpec("int4", 64)):
        assert bits_per_weight(spec, tuple(gaussian.shape)) <= 4.5
        assert sqnr_db(gaussian, roundtrip(gaussian, spec)) >= nf4, spec


def test_metrics() -> None:
    w = torch.ones(10)
    assert rel_error(w, w) == 0 and sqnr_db(w, w) == float("inf")
    assert rel_error(w, w * 1.1) == pytest.approx(0.1)
    assert sqnr_db(w, w * 1.1) == pytest.approx(20.0)
    assert rel_error(torch.zeros(3), torch.zeros(3)) == 0
    assert rel_error(torch.zeros(3), torch.ones(3)) == float("inf")
    # computed in fp32 from bf16 inputs: an error of 2^-7 is 20 * 7 * log10(2) dB
    assert sqnr_db(w.to(torch.bfloat16), (w * (1 + 2**-7)).to(torch.bfloat16)) == pytest.approx(140 * 0.30103, rel=1e-4)


# --- bit-identity with the peers' own code ------------------------------------------------------------

def _bnb_edge_tensor(dtype: torch.dtype) -> torch.Tensor:
    """Random blocks plus every tie bitsandbytes' rounding can meet: values exactly on its code bounds
    (block absmax 1, so the scaled value is the bound itself), +-0, an all-zero block and an outlier."""
    bnb = pytest.importorskip("bitsandbytes.functional")
    w = torch.randn(3, 64, 256, generator=torch.Generator().manual_seed(3))
    w[0, 0, :64] = 0.0
    w[1, 2, 5] = 50.0
    w[2, 3] = -0.0
    for row, qt in ((4, "nf4"), (5, "fp4")):
        code = bnb.get_4bit_type(qt, device="cpu")
        s = torch.sort(code).values
        bounds = (s[:-1] + s[1:]) / 2
        for j in range(4):
            blk = torch.zeros(64)
            blk[0] = 1.0
            blk[1:16] = bounds
            blk[16:31] = torch.nextafter(bounds, torch.full_like(bounds, 2.0))
            blk[31:46] = torch.nextafter(bounds, torch.full_like(bounds, -2.0))
            blk[46:50] = torch.tensor([-0.0, 1e-30, -1e-30, -1.0])
            w[2, row, 64 * j : 64 * (j + 1)] = blk
    return w.to(dtype)


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_code_tables_are_bitsandbytes(quant_type: str) -> None:
    bnb = pytest.importorskip("bitsandbytes.functional")
    f = get_format(quant_type)
    assert torch.equal(f.code, bnb.get_4bit_type(quant_type, device="cpu"))


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nf4_fp4_match_bitsandbytes_bit_for_bit(quant_type: str, dtype: torch.dtype) -> None:
    bnb = pytest.importorskip("bitsandbytes.functional")
    w = _bnb_edge_tensor(dtype if dtype != torch.float16 else torch.float32)
    if dtype == torch.float16:
        w = w.clamp(-60000, 60000).to(torch.float16)
    spec = QuantSpec(quant_type, 64)
    f = get_format(quant_type)
    parts = f.quantize(w, spec)
    for e in range(3):
        packed, state = bnb.quantize_4bit(w[e].contiguous(), blocksize=64, quant_type=quant_type)
        # same bytes as bitsandbytes' quantizer, absmax bit for bit
        assert torch.equal(parts["qweight"][e], packed.reshape(-1))
        assert torch.equal(parts["absmax"][e].view(torch.int32), state.absmax.view(torch.int32))
        # bitsandbytes dequantizes OUR parts (a QuantState built from them) exactly as we do
        ours_state = bnb.QuantState(absmax=parts["absmax"][e].contiguous(), shape=w[e].shape,
                                    code=bnb.get_4bit_type(quant_type, device="cpu"), blocksize=64,
                                    quant_type=quant_type, dtype=dtype)
        theirs = bnb.dequantize_4bit(parts["qweight"][e].reshape(-1, 1), ours_state)
        ours = f.dequantize({k: v[e] for k, v in parts.items()}, spec, tuple(w[e].shape), dtype)
        assert ours.dtype == theirs.dtype == dtype
        assert torch.equal(_bits(ours), _bits(theirs))
        # and we dequantize bitsandbytes' own parts exactly as it does
        theirs_parts = {"qweight": packed.reshape(-1), "absmax": state.absmax}
        assert torch.equal(_bits(f.dequantize(theirs_parts, spec, tuple(w[e].shape), dtype)),
                           _bits(bnb.dequantize_4bit(packed, state)))


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The bit patterns of `x`, with -0.0 written as +0.0. bitsandbytes 0.50.2 is not consistent about the
    sign of fp4's zero code 8 across CPUs: on an AVX512 machine its C kernel gives +0.0, while on the machine
    of an earlier CI run it gave -0.0 as we do (this test passed bit for bit there). A zero's sign changes no
    product or sum the runtime computes."""
    return (x + 0.0).view(torch.int16 if x.dtype != torch.float32 else torch.int32)


def _mxfp4_edge_tensor() -> torch.Tensor:
    w = torch.randn(3, 16, 256, generator=torch.Generator().manual_seed(4))
    w[0, 0, :32] = 0.0
    w[1, 1, 7] = 1e4
    # values at the rounding midpoints and just under powers of two, where ties and log2 decide
    w[2, 0, :14] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -0.75, -1.25, -5, -2.5, 0, -0.0])
    w[2, 0, 14:32] = 6.0
    w[2, 1, :32] = float(np.nextafter(np.float32(4), np.float32(0)))
    # every doubled midpoint on the scale of a block with absmax 6 (d = 0.5), and its neighbours
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]) * 2 * 0.5
    w[2, 2, :7], w[2, 2, 7:14] = mids, -mids
    w[2, 2, 14:21] = torch.nextafter(mids, torch.full_like(mids, 9.0))
    w[2, 2, 21:28] = torch.nextafter(mids, torch.full_like(mids, -9.0))
    w[2, 2, 28:32] = torch.tensor([6.0, -6.0, 1e-30, -1e-30])
    # tiny blocks: normal, subnormal and mixed magnitudes (E8M0 exponents near 0)
    w[2, 3, :32] = torch.linspace(-1, 1, 32) * 2.0**-120
    w[2, 3, 32:64] = torch.linspace(-1, 1, 32) * 1e-39
    w[2, 3, 64:96] = torch.linspace(-1, 1, 32) * 2.0**100
    return w


def test_mxfp4_matches_gguf_bytes_and_values() -> None:
    w = _mxfp4_edge_tensor()
    spec = QuantSpec("mxfp4", 32)
    f = get_format("mxfp4")
    parts = f.quantize(w, spec)
    ref = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.MXFP4)
    ours = to_gguf_blocks(parts)
    assert ours.dtype == np.uint8 and ours.shape == ref.shape and np.array_equal(ours, ref)
    deq = gguf.quants.dequantize(ref, gguf.GGMLQuantizationType.MXFP4).reshape(w.shape)
    assert np.array_equal(f.dequantize(parts, spec, tuple(w.shape), torch.float32).numpy(), deq)
    # from bf16 input too (the checkpoints' dtype): gguf sees the same values in fp32
    wb = w.to(torch.bfloat16)
    ref_b = gguf.quants.quantize(wb.float().numpy(), gguf.GGMLQuantizationType.MXFP4)
    assert np.array_equal(to_gguf_blocks(f.quantize(wb, spec)), ref_b)


def test_int4_g32_symmetric_rebuilds_gguf_q4_0_losslessly(gaussian: torch.Tensor) -> None:
    spec = QuantSpec("int4", 32)
    f = get_format("int4")
    w = gaussian[:2] * 0.02
    parts = f.quantize(w, spec)
    blocks = int4_to_q4_0_blocks(parts, spec)
    assert blocks.dtype == np.uint8 and blocks.shape == (2, 256, 512 // 32 * 18)
    deq = gguf.quants.dequantize(blocks.reshape(-1, 512 // 32 * 18), gguf.GGMLQuantizationType.Q4_0)
    assert np.array_equal(deq.reshape(w.shape), f.dequantize(parts, spec, tuple(w.shape), torch.float32).numpy())
    with pytest.raises(QuantkitError, match="group 32 only"):
        int4_to_q4_0_blocks(f.quantize(w, QuantSpec("int4", 64)), QuantSpec("int4", 64))
    big = f.quantize(torch.full((16, 32), 1e6), spec)  # scale 1.25e5: beyond fp16
    with pytest.raises(QuantkitError, match="not representable in fp16"):
        int4_to_q4_0_blocks(big, spec)


# --- the stored layouts feed torch's kernels without requantizing ---------------------------------------

@pytest.mark.parametrize("group,symmetric", [(32, True), (128, True), (64, False), (128, False)])
def test_int4_parts_feed_torch_int4pack_kernel(group: int, symmetric: bool) -> None:
    w = torch.randn(96, 256, generator=torch.Generator().manual_seed(5))
    w[:, :64] += 0.5  # skewed groups: asymmetric zeros far from 0, so the kernel's zero convention shows
    spec = QuantSpec("int4", group, symmetric=symmetric)
    parts = get_format("int4").quantize(w, spec)
    packed, scales_and_zeros = to_torch_int4pack_cpu(parts, spec)
    assert scales_and_zeros.dtype == torch.bfloat16 and tuple(scales_and_zeros.shape) == (256 // group, 96, 2)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, scales_and_zeros)
    ref = x.float() @ get_format("int4").dequantize(parts, spec, tuple(w.shape), torch.float32).t()
    assert rel_error(ref, y.float()) < 1e-2  # bf16 accumulation


def test_int4pack_helper_refuses_what_the_kernel_cannot_take() -> None:
    spec = QuantSpec("int4", 32)
    parts = get_format("int4").quantize(torch.randn(2, 16, 64), spec)
    with pytest.raises(QuantkitError, match="one matrix"):
        to_torch_int4pack_cpu(parts, spec)
    with pytest.raises(QuantkitError, match=r"out % 16"):
        to_torch_int4pack_cpu(get_format("int4").quantize(torch.randn(8, 64), spec), spec)


def test_int8_parts_feed_torch_int8pack_kernel() -> None:
    w = torch.randn(96, 256, generator=torch.Generator().manual_seed(7))
    parts = get_format("int8").quantize(w, QuantSpec("int8"))
    assert parts["scales"].dtype == torch.bfloat16
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    y = torch.ops.aten._weight_int8pack_mm(x, parts["qweight"], parts["scales"])
    ref = x.float() @ get_format("int8").dequantize(parts, QuantSpec("int8"), (96, 256), torch.float32).t()
    assert rel_error(ref, y.float()) < 1e-2
