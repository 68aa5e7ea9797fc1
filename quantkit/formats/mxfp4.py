"""mxfp4 (OCP MX): E2M1 codes in blocks of 32 with one E8M0 scale byte, as ggml stores it.

Parts: `scales` uint8 [..., out, in/32] (E8M0 exponents) and `qweight` uint8 [..., out, in/2] where
each block's 16 bytes hold elements 0..15 in the low nibbles and 16..31 in the high ones (ggml's
order). Scale and code choices follow the `gguf` package's MXFP4 exactly (floor(log2(absmax)) - 2,
nearest code with ties to the smaller magnitude), so `to_gguf_blocks` rebuilds its bytes as they are.
"""

from __future__ import annotations

import numpy as np
import torch

from quantkit.errors import QuantkitError
from quantkit.formats import Part, QuantSpec, ceil_div, register
from quantkit.formats.common import check_matrix, run_chunks

BLOCK = 32
# E2M1 magnitudes, doubled (0, .5, 1, 1.5, 2, 3, 4, 6); codes 8..15 are the negatives.
LEVELS = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12], dtype=torch.float32)
KVALUES = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.float32)


def _code_of_ceil() -> torch.Tensor:
    """Code for each signed k = ceil(|2x/d|) * sign(x) + 32, k in 0..64: the level index is the count of
    doubled midpoints (1, 3, 5, 7, 10, 14, 20) below k; negative magnitudes add 8 (zero stays code 0)."""
    mids2 = torch.tensor([1, 3, 5, 7, 10, 14, 20])
    mag = (torch.arange(33)[:, None] > mids2).sum(dim=1)
    neg = torch.where(mag > 0, mag + 8, mag)
    return torch.cat([neg.flip(0)[:-1], mag]).to(torch.int8)


CODE_OF_CEIL = _code_of_ceil()


def e8m0_to_fp32_half(e: torch.Tensor) -> torch.Tensor:
    """2**(e - 128) as float32, subnormals included (ggml_e8m0_to_fp32_half)."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, torch.tensor(0x00200000, dtype=torch.int32) << e, (e - 1) << 23)
    return bits.view(torch.float32)


def _exponents(amax: torch.Tensor) -> torch.Tensor:
    # numpy's float32 log2, as the gguf package uses it: torch's log2 may round differently just
    # below a power of two, which would pick another exponent. This runs on block maxima only (1/32).
    a = amax.numpy()
    with np.errstate(divide="ignore"):
        e = np.where(a > 0, np.floor(np.log2(a)) - 2 + 127, 0).astype(np.uint8)
    return torch.from_numpy(e)


class MXFP4:
    name = "mxfp4"

    default_group = BLOCK

    def parts(self, spec: QuantSpec, shape: tuple[int, ...]) -> dict[str, Part]:
        *lead, cols = shape
        return {"scales": Part((*lead, ceil_div(cols, BLOCK)), "uint8", "scales"),
                "qweight": Part((*lead, ceil_div(cols, 2)), "uint8", "weight")}

    def quantize(self, w: torch.Tensor, spec: QuantSpec) -> dict[str, torch.Tensor]:
        check_matrix(w, BLOCK, self.name)
        if spec.group_size not in (None, BLOCK):
            raise QuantkitError(f"mxfp4: blocks are {BLOCK} elements by definition, not {spec.group_size}")
        cols = w.shape[-1]
        flat = w.reshape(-1, BLOCK)
        n = flat.shape[0]
        scales = torch.empty(n, dtype=torch.uint8)
        packed = torch.empty(n, BLOCK // 2, dtype=torch.uint8)

        def work(sl: slice) -> None:
            x = flat[sl].float()
            e = _exponents(x.abs().amax(dim=1))
            # v = 2x/d is exact (d is a power of two; divide, since 2/d overflows for the smallest d).
            # The E2M1 midpoints are odd integers or 10, 14, 20 on that doubled scale, so ceil(|v|)
            # alone decides the code, ties to the smaller magnitude as gguf's first-argmin does.
            v = x / (e8m0_to_fp32_half(e) * 0.5)[:, None]  # not in place: x may be the caller's w
            k = torch.copysign(v.abs().ceil_(), v).add_(32)  # -0.0 -> 32 like +0.0: code 0
            q = torch.index_select(CODE_OF_CEIL, 0, k.to(torch.int32).view(-1)).view(-1, BLOCK)
            # elements 0..15 low nibbles, 16..31 high: as int64 words of 8 codes, lo | hi << 4
            q64 = q.view(torch.int64)
            packed[sl] = (q64[:, :2] | (q64[:, 2:] << 4)).view(torch.uint8)
            scales[sl] = e

        run_chunks(n, BLOCK, work)
        lead = w.shape[:-1]
        return {"scales": scales.reshape(*lead, cols // BLOCK), "qweight": packed.reshape(*lead, cols // 2)}

    def dequantize(
        self, parts: dict[str, torch.Tensor], spec: QuantSpec, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        p = parts["qweight"].reshape(-1, BLOCK // 2)
        q = torch.cat([p & 0x0F, p >> 4], dim=1).long()
        d = e8m0_to_fp32_half(parts["scales"].reshape(-1))[:, None]
        return (d * KVALUES[q]).reshape(shape).to(dtype)


def to_gguf_blocks(parts: dict[str, torch.Tensor]) -> np.ndarray:
    """ggml's MXFP4 bytes for the stored parts: uint8 [..., out, in/32*17] (scale byte, then 16 bytes)."""
    s = parts["scales"]
    q = parts["qweight"].reshape(*s.shape, BLOCK // 2)
    return torch.cat([s[..., None], q], dim=-1).reshape(*s.shape[:-1], -1).numpy()


MXFP4_FORMAT = register(MXFP4())
