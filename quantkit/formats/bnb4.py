"""nf4 and fp4 in bitsandbytes' layout: blocks of 64 over each flattened matrix, an fp32 absmax per
block, two codes per byte with the FIRST element in the HIGH nibble (bitsandbytes' order).

Parts: `qweight` uint8 [..., out*in/2] and `absmax` fp32 [..., out*in/blocksize], one row per matrix
(expert). The bytes equal `bitsandbytes.functional.quantize_4bit(w[e], blocksize, quant_type)` (its
packed tensor flattened, its `state.absmax`), so a QuantState built from them dequantizes bit-identically
with `dequantize_4bit`, and ours dequantizes bit-identically to it (fp32 code * fp32 absmax, then cast).

Why not call bitsandbytes: its CPU `quantize_4bit` finds codes with `torch.bucketize`, a binary search per
element that dominates its time (formats/common.py). We pick the same codes exactly with a lookup table:
bucketize(v, bounds) is the count of bounds below v; v in [-1, 1] falls in one of 2K+1 bins
[i/K, (i+1)/K) (K a power of two, so floor(v*K) is exact), each holding at most one bound, so the count
is table[bin] + (v > bound_in_bin).
"""

from __future__ import annotations

import torch

from quantkit.errors import QuantkitError
from quantkit.formats import Part, QuantSpec, ceil_div, register
from quantkit.formats.common import check_matrix, pack_nibbles_hi_first, run_chunks, unpack_nibbles_hi_first

DEFAULT_BLOCK = 64
LUT_BINS = 1024  # per unit of v; FP4's closest bounds are 0.0026 apart, more than a bin (0.001)


def _table(values: list[float]) -> torch.Tensor:
    """The code table of bitsandbytes.functional.get_4bit_type, built the same way (fp32, / max |v|)."""
    t = torch.tensor(values, dtype=torch.float32)
    return t.div_(t.abs().max())


NF4_CODE = _table(
    [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
     -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
     0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
     0.7229568362236023, 1.0]
)
# FP4 (E2M1 with bitsandbytes' own bit assignment): index = the stored code.
FP4_CODE = _table([0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0, -0.0, -0.0625, -8.0, -12.0, -4.0, -6.0, -2.0, -3.0])


class Bnb4:
    def __init__(self, name: str, code: torch.Tensor) -> None:
        self.name = name
        self.code = code
        # exactly bitsandbytes' _get_4bit_quantize_bounds: sorted midpoints, and the code of each bucket
        order = torch.argsort(code)
        bounds = (code[order[:-1]] + code[order[1:]]) / 2
        k = LUT_BINS
        lo = torch.arange(-k, k + 1, dtype=torch.float32) / k  # bin i covers [lo[i], lo[i] + 1/k)
        below = (lo[:, None] > bounds[None, :]).sum(dim=1)  # bounds strictly below the bin start
        bound_in_bin = torch.full((2 * k + 1,), float("inf"))
        for b in bounds.tolist():
            i = int(torch.floor(torch.tensor(b, dtype=torch.float32) * k).item()) + k
            if bound_in_bin[i] != float("inf"):
                raise AssertionError(f"{name}: two code bounds in one lookup bin; raise LUT_BINS")
            bound_in_bin[i] = b
        # bucket = below + (v > bound_in_bin) (v == a bound that starts a bin counts it: v > b false)
        self.bound_in_bin = bound_in_bin
        # code of bin i with the comparison bit c at index 2i + c
        bucket = torch.stack([below, (below + 1).clamp(max=15)], dim=1).reshape(-1)
        self.code_of = order[bucket].to(torch.int8)

    def _block(self, spec: QuantSpec) -> int:
        return spec.group_size or DEFAULT_BLOCK

    default_group = DEFAULT_BLOCK

    def parts(self, spec: QuantSpec, shape: tuple[int, ...]) -> dict[str, Part]:
        *lead, out, cols = shape  # blocks run over each matrix flattened, as bitsandbytes does
        per = out * cols
        return {"qweight": Part((*lead, ceil_div(per, 2)), "uint8", "weight"),
                "absmax": Part((*lead, ceil_div(per, self._block(spec))), "float32", "scales")}

    def _codes(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x fp32 [n, b] -> (int8 codes [n, b], fp32 absmax [n]) exactly as bitsandbytes picks them."""
        am = x.abs().amax(dim=1)  # as bitsandbytes (max(amax, -amin) can give -0.0, other bytes)
        scaled = (x * (1.0 / am.clamp(min=1e-38))[:, None]).clamp_(-1, 1)
        k = LUT_BINS
        binf = (scaled * k).floor_().add_(k)  # exact: k is a power of two
        idx = binf.to(torch.int32).view(-1)
        bound = torch.index_select(self.bound_in_bin, 0, idx)
        above = torch.gt(scaled.view(-1), bound, out=bound)  # float 0/1: an op with a bool result is slow (formats/common.py)
        idx2 = above.add_(binf.view(-1), alpha=2).to(torch.int32)
        return torch.index_select(self.code_of, 0, idx2).view(x.shape), am

    def quantize(self, w: torch.Tensor, spec: QuantSpec) -> dict[str, torch.Tensor]:
        b = self._block(spec)
        check_matrix(w, None, self.name)
        per = w.shape[-1] * w.shape[-2]
        if per % b:
            raise QuantkitError(
                f"{self.name}: a matrix of shape {tuple(w.shape[-2:])} does not split into blocks of {b} "
                f"(bitsandbytes' blocks run over the flattened matrix); keep it in bf16"
            )
        lead = w.shape[:-2]
        flat = w.reshape(-1, b)  # blocks never straddle two experts since per % b == 0
        n = flat.shape[0]
        packed = torch.empty(n, b // 2, dtype=torch.uint8)
        absmax = torch.empty(n, dtype=torch.float32)

        def work(sl: slice) -> None:
            q, am = self._codes(flat[sl].float())
            packed[sl] = pack_nibbles_hi_first(q)
            absmax[sl] = am

        run_chunks(n, b, work)
        return {"qweight": packed.reshape(*lead, per // 2), "absmax": absmax.reshape(*lead, per // b)}

    def dequantize(
        self, parts: dict[str, torch.Tensor], spec: QuantSpec, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        b = self._block(spec)
        q = unpack_nibbles_hi_first(parts["qweight"].reshape(-1)).long()
        w = self.code[q].reshape(-1, b) * parts["absmax"].float().reshape(-1, 1)
        return w.reshape(shape).to(dtype)


NF4 = register(Bnb4("nf4", NF4_CODE))
FP4 = register(Bnb4("fp4", FP4_CODE))
