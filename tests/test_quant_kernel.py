"""The quantizer's int4 on quantkit's CPU kernel (`quant_int4_sym`, formats/int4.py's route when the kernel is
built): byte for byte the torch route's codes, scales and error on every op table this CPU runs, including
the groups where candidates tie, and the same quantize() result and error sums with the kernel and without."""

from __future__ import annotations

import pytest
import torch

from quantkit.formats import QuantSpec
from quantkit.formats import int4 as I
from quantkit.formats._common import ErrorSums, pack_nibbles


def _weights(rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.02
    w[0] = 0.0  # all-zero groups: scale 0, codes 8
    w[1, :64] = torch.arange(64) * 0.25 - 8.0  # values on a grid: ties at x.5 after scaling
    w[2, 5] = 40.0  # an outlier that owns its group's scale
    w[3] = torch.randint(-3, 4, (cols,), generator=g).float()  # few distinct values: errors tie exactly
    return w.to(torch.bfloat16)


def _torch_route(w: torch.Tensor, g: int, grid: tuple[float, ...]) -> tuple[torch.Tensor, ...]:
    x = w.float().reshape(-1, w.shape[1] // g, g)
    q, s, err = I._sym(x, grid, True)
    return pack_nibbles(q.reshape(w.shape)), s.reshape(w.shape[0], -1), err.reshape(w.shape[0], -1)


@pytest.mark.parametrize("g", [32, 64, 128])
@pytest.mark.parametrize("grid", [I.CLIP_GRID, ()])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_writes_the_torch_routes_bytes(kernel_table, g, grid, dtype):
    mod = I._kernel()
    w = _weights(96, 512, seed=g + len(grid))
    packed, scales, err = torch.empty(96, 256, dtype=torch.uint8), torch.empty(96, 512 // g, dtype=torch.bfloat16), \
        torch.empty(96, 512 // g)
    mod.quant_int4_sym(w.to(dtype), g, list(grid), packed, scales, err)
    want_p, want_s, want_e = _torch_route(w, g, grid)
    assert torch.equal(packed, want_p)
    assert torch.equal(scales.view(torch.int16), want_s.view(torch.int16))
    assert torch.equal(err, want_e)
    assert (scales[0] == 0).all() and (packed[0] == 0x88).all()


def test_quantize_with_and_without_the_kernel_is_the_same(monkeypatch):
    w = torch.stack([_weights(64, 256, seed=s) for s in range(3)])  # [experts, out, in], as the quantizer sees them
    spec = QuantSpec("int4", 32, True)

    def run() -> tuple[dict[str, torch.Tensor], ErrorSums]:
        sums = ErrorSums()
        return I.Int4().quantize(w, spec, sums=sums), sums

    assert I._kernel() is not None, "the suite builds the kernel"
    calls = []
    real = I._kernel
    monkeypatch.setattr(I, "_kernel", lambda: calls.append(1) or real())
    fast, fast_sums = run()
    monkeypatch.setattr(I, "_kernel", lambda: None)
    slow, slow_sums = run()
    assert calls and fast.keys() == slow.keys()
    for k in fast:
        assert torch.equal(fast[k].view(torch.uint8), slow[k].view(torch.uint8)), k
    assert fast_sums.total() == pytest.approx(slow_sums.total(), rel=1e-9)
