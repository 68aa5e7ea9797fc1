"""nf4 and fp4 in bitsandbytes' layout: blocks of 64 over each flattened matrix, an fp32 absmax per
block, two codes per byte with the FIRST element in the HIGH nibble (bitsandbytes' order).

Parts: `qweight` uint8 [..., out*in/2] and `absmax` fp32 [..., out*in/blocksize], one row per expert.
Codes are chosen as bitsandbytes does (nearest code by midpoint buckets), so our bytes equal
`bitsandbytes.functional.quantize_4bit` and dequantize bit-identically to its `dequantize_4bit`.
We quantize in torch ourselves because bitsandbytes' CPU quantizer copies each tensor through one
flat buffer and runs at about 124 MB/s; here experts are quantized as a [E, ...] batch without copies.
"""

from __future__ import annotations

import torch

from quantkit.formats import QuantSpec, register
from quantkit.formats._common import check_matrix, row_chunks

DEFAULT_BLOCK = 64

# The code tables of bitsandbytes.functional.get_4bit_type, built the same way (fp32, divided by the
# largest magnitude): NF4 sorted; FP4 in bitsandbytes' bit order.
def _table(values: list[float]) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float32)
    return t.div_(t.abs().max())


NF4_CODE = _table(
    [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
     -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
     0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
     0.7229568362236023, 1.0]
)
FP4_CODE = _table([0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0, -0.0, -0.0625, -8.0, -12.0, -4.0, -6.0, -2.0, -3.0])


class Bnb4:
    def __init__(self, name: str, code: torch.Tensor) -> None:
        self.name = name
        self.code = code
        self.order = torch.argsort(code, stable=True)
        sorted_code = code[self.order]
        self.bounds = (sorted_code[:-1] + sorted_code[1:]) / 2

    def _block(self, spec: QuantSpec) -> int:
        return spec.group_size or DEFAULT_BLOCK

    def bits_per_weight(self, spec: QuantSpec, shape: tuple[int, ...]) -> float:
        return 4.0 + 32.0 / self._block(spec)

    def quantize(self, w: torch.Tensor, spec: QuantSpec) -> dict[str, torch.Tensor]:
        b = self._block(spec)
        check_matrix(w, None, self.name)
        per = w.shape[-1] * w.shape[-2]
        if per % b:
            raise QuantkitError_block(self.name, w, b)
        lead = w.shape[:-2]
        flat = w.reshape(-1, b)  # blocks never straddle two experts since per % b == 0
        n = flat.shape[0]
        packed = torch.empty(n, b // 2, dtype=torch.uint8)
        absmax = torch.empty(n, dtype=torch.float32)
        for sl in row_chunks(n, b):
            x = flat[sl].float()
            am = x.abs().amax(dim=1)
            scaled = torch.clamp(x * (1.0 / am.clamp(min=1e-38))[:, None], -1, 1)
            q = torch.bucketize(scaled, self.bounds, out_int32=True)
            if self.name != "nf4":
                q = self.order.to(torch.int32)[q]
            q8 = q.to(torch.uint8)
            packed[sl] = (q8[:, 0::2] << 4) | q8[:, 1::2]
            absmax[sl] = am
        return {"qweight": packed.reshape(*lead, per // 2), "absmax": absmax.reshape(*lead, per // b)}

    def dequantize(
        self, parts: dict[str, torch.Tensor], spec: QuantSpec, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        b = self._block(spec)
        p = parts["qweight"].reshape(-1)
        q = torch.stack([p >> 4, p & 0x0F], dim=-1).reshape(-1).long()
        w = self.code[q].reshape(-1, b) * parts["absmax"].float().reshape(-1, 1)
        return w.reshape(shape).to(dtype)


def QuantkitError_block(name: str, w: torch.Tensor, b: int):  # noqa: N802
    from quantkit.errors import QuantkitError

    return QuantkitError(
        f"{name}: a matrix of shape {tuple(w.shape[-2:])} does not split into blocks of {b}; keep it in bf16"
    )


NF4 = register(Bnb4("nf4", NF4_CODE))
FP4 = register(Bnb4("fp4", FP4_CODE))
