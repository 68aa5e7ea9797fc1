"""The quantizer's kernels (csrc/qk_quant_impl.h, ops of every table of the CPU kernel, called through
kernels/quant.py: formats/int4.py's route for bf16 and fp32 rows, int8.py's for bf16 rows). Each table
writes byte for byte the torch route's codes and scales, including the groups where candidates tie, all-zero
groups of either sign and a chunk whose groups do not fill the last block of eight; quantize() gives the same
parts and error sums on every route."""

from __future__ import annotations

import pytest
import torch

from quantkit.formats import QuantSpec
from quantkit.formats import int4 as I
from quantkit.formats.common import ErrorSums, pack_nibbles, row_sq
from quantkit.formats.int8 import Int8
from quantkit.kernels import quant as QK


def _weights(rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.02
    w[0] = 0.0  # all-zero groups: scale 0, codes 8
    w[1, :64] = torch.arange(64) * 0.25 - 8.0  # values on a grid: ties at x.5 after scaling
    w[2, 5] = 40.0  # an outlier that owns its group's scale
    w[3] = torch.randint(-3, 4, (cols,), generator=g).float()  # few distinct values: errors tie exactly
    w[4, :32] = -0.0  # all-zero groups of either sign: the first zero's sign is the scale's
    w[4, 32:64] = torch.tensor([-0.0, 0.0] * 16)
    w[4, 64:96] = torch.tensor([0.0, -0.0] * 16)
    w[5] *= 1e-30  # scales near bf16's smallest
    w[6, ::3] = 0.0
    return w.to(torch.bfloat16)


def _torch_route(w: torch.Tensor, g: int, grid: tuple[float, ...]) -> tuple[torch.Tensor, ...]:
    x = w.float().reshape(-1, w.shape[1] // g, g)
    q, s, err = I._sym(x, grid, True)
    return pack_nibbles(q.reshape(w.shape)), s.reshape(w.shape[0], -1), err.reshape(w.shape[0], -1)


@pytest.mark.parametrize("g", [32, 64, 128])
@pytest.mark.parametrize("grid", [I.CLIP_GRID, ()])
@pytest.mark.parametrize("rows", [96, 3])  # 3 rows of 64: a chunk whose groups end mid-block
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_each_table_writes_the_torch_routes_int4_bytes(kernel_table, g, grid, rows, dtype):
    cols = 512 if rows > 8 else 2 * g + (g if g < 128 else 0)
    w = _weights(96, 512, seed=g + len(grid))[:rows, :cols].contiguous() if rows > 8 else \
        _weights(96, 512, seed=g)[4:4 + rows, :cols].contiguous()
    if dtype == torch.float32:  # past the special rows, values bf16 cannot hold: fp32 rows are quantized as they are
        w = w.float()
        w[7:] += torch.randn(w[7:].shape, generator=torch.Generator().manual_seed(g)) * 1e-4
    packed, scales = torch.empty(rows, cols // 2, dtype=torch.uint8), torch.empty(rows, cols // g, dtype=torch.bfloat16)
    e, r = QK.int4_sym(QK.ops(), w, g, grid, packed, scales)
    want_p, want_s, want_e = _torch_route(w, g, grid)
    assert torch.equal(packed, want_p)
    assert torch.equal(scales.view(torch.int16), want_s.view(torch.int16))
    assert e == pytest.approx(float(want_e.sum(dtype=torch.float64)), rel=1e-9)
    assert r == pytest.approx(row_sq(w), rel=1e-6)  # the torch route's reference is an fp32 norm per row
    if rows > 8:
        assert (scales[0] == 0).all() and (packed[0] == 0x88).all()


@pytest.mark.parametrize("cols", [512, 100])  # 100: a row that does not fill its last vector
def test_each_table_writes_the_torch_routes_int8_bytes(kernel_table, cols, monkeypatch):
    w = _weights(96, 512, seed=7)[:, :cols].contiguous()
    w[8], w[9] = 0.0, -0.0
    q, scales = torch.empty(96, cols, dtype=torch.int8), torch.empty(96, dtype=torch.bfloat16)
    e, r = QK.int8_row(QK.ops(), w, q, scales)
    monkeypatch.setattr(QK, "ops", lambda: None)
    sums = ErrorSums()
    want = Int8().quantize(w, QuantSpec("int8", None, True), sums=sums)
    assert torch.equal(q, want["qweight"])
    assert torch.equal(scales.view(torch.int16), want["scales"].view(torch.int16))
    assert (e, r) == pytest.approx(sums.total(), rel=1e-6)


def test_bad_arguments_are_errors_not_crashes():
    mod = QK.ops()
    if mod is None:
        pytest.skip("the CPU kernel is not built on this machine")
    w = torch.zeros(4, 64, dtype=torch.bfloat16)
    packed, scales = torch.empty(4, 32, dtype=torch.uint8), torch.empty(4, 2, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="group"):
        QK.int4_sym(mod, w, 24, (), packed, scales)
    with pytest.raises(RuntimeError, match="sized"):
        QK.int4_sym(mod, w, 32, (), packed[:2], scales)
    with pytest.raises(RuntimeError, match="contiguous"):
        QK.int4_sym(mod, w.t().contiguous().t(), 32, (), packed, scales)
    with pytest.raises(RuntimeError, match="bf16"):
        QK.int8_row(mod, w.float(), torch.empty(4, 64, dtype=torch.int8), torch.empty(4, dtype=torch.bfloat16))


def _quantize(fmt, w: torch.Tensor, spec: QuantSpec) -> tuple[dict[str, torch.Tensor], ErrorSums]:
    sums = ErrorSums()
    return fmt.quantize(w, spec, sums=sums), sums


def _same(a: tuple[dict[str, torch.Tensor], ErrorSums], b: tuple[dict[str, torch.Tensor], ErrorSums]) -> None:
    assert a[0].keys() == b[0].keys()
    for k in a[0]:
        assert torch.equal(a[0][k].view(torch.uint8), b[0][k].view(torch.uint8)), k
    assert a[1].total() == pytest.approx(b[1].total(), rel=1e-6)


def test_quantize_on_every_route_is_the_same(monkeypatch):
    """The kernel (bf16 and fp32 rows) and torch's ops: the same parts and error sums."""
    w = torch.stack([_weights(64, 256, seed=s) for s in range(3)])  # [experts, out, in], as the quantizer sees them
    spec = QuantSpec("int4", 32, True)
    assert QK.ops() is not None, "the suite builds the kernel"
    calls = []
    real = QK.ops
    monkeypatch.setattr(QK, "ops", lambda: calls.append("kernel") or real())
    fast = _quantize(I.Int4(), w, spec)
    fast32 = _quantize(I.Int4(), w.float(), spec)
    fast8 = _quantize(Int8(), w, QuantSpec("int8", None, True))
    monkeypatch.setattr(QK, "ops", lambda: None)
    slow = _quantize(I.Int4(), w, spec)
    slow32 = _quantize(I.Int4(), w.float(), spec)
    slow8 = _quantize(Int8(), w, QuantSpec("int8", None, True))
    assert calls == ["kernel"] * 3
    _same(fast, slow)
    _same(fast32, slow32)
    _same(fast32, slow)  # bf16 values in fp32 rows: the same bytes as the bf16 rows
    _same(fast8, slow8)


@pytest.mark.parametrize("fmt,spec", [(I.Int4(), QuantSpec("int4", 32, True)), (Int8(), QuantSpec("int8", None, True))])
def test_quant_library_gives_the_same_bytes_and_sums_on_any_thread_count(fmt, spec):
    """Many row chunks (2^18 elements each) spread over 1 or 2 threads: the same parts and, summed in chunk
    order, exactly the same error figures."""
    if QK.ops() is None:
        pytest.skip("the quantizer's kernel is not built on this machine")
    w = torch.stack([_weights(512, 1024, seed=s) for s in range(4)])  # 8 chunks
    before = torch.get_num_threads()
    got = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            got.append(_quantize(fmt, w, spec))
    finally:
        torch.set_num_threads(before)
    (a, sa), (b, sb) = got
    assert a.keys() == b.keys() and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)
    assert sa.total() == sb.total() and len(sa._by_chunk) == 8
