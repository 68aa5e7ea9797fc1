"""A format's quantization grid with its scales fixed: rounding columns onto it and encoding the codes.

GPTQ (gptq.py) and the importance-weighted scale search (imatrix.py) choose WHICH code each weight gets
(or which scale a group gets) differently from round-to-nearest, but store exactly the parts the formats
store: codes and scales in the layouts of quantkit/formats/int4.py and int8.py, so every writer, kernel
and export reads the result as it is. A `Grid` holds the scales (and zeros) of one matrix [R, C] and:
- `round(w, cols)`: the codes and dequantized values of columns `cols` of w (round to nearest on the
  fixed grid, clamped to the code range);
- `parts(codes)`: the stored parts of a full code matrix.

Grids exist for int4 (symmetric and asymmetric, any group) and int8 (per channel); `grid_for` returns
None for the other formats (nf4, fp4, mxfp4), whose callers fall back to round-to-nearest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantkit.formats import QuantSpec, get_format
from quantkit.formats.common import pack_nibbles
from quantkit.formats.int4 import DEFAULT_GROUP

SUPPORTED = ("int4", "int8")


@dataclass
class Grid:
    spec: QuantSpec
    scales: torch.Tensor  # stored dtype (bf16): int4 [R, C/g], int8 [R]
    zeros: torch.Tensor | None  # int4 asymmetric only, [R, C/g]
    group: int  # columns per scale (int8: C)
    lo: int
    hi: int
    offset: int  # stored code = signed code + offset (int4: 8, int8: 0)

    def __post_init__(self) -> None:
        # fp32 copies made once: GPTQ asks for one column at a time
        self._s = self.scales.float()
        self._z = self.zeros.float() if self.zeros is not None else None

    def _col_params(self, cols: torch.Tensor | slice) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.scales.dim() == 1:
            n = len(range(self.group)[cols]) if isinstance(cols, slice) else cols.numel()
            return self._s[:, None].expand(-1, n), None
        if isinstance(cols, slice):
            g = torch.arange(self.scales.shape[-1] * self.group)[cols] // self.group
        else:
            g = cols // self.group
        return self._s[:, g], (self._z[:, g] if self._z is not None else None)

    def round(self, w: torch.Tensor, cols: torch.Tensor | slice) -> tuple[torch.Tensor, torch.Tensor]:
        """w [R, n] (the columns `cols` of the matrix) -> (signed codes int32 [R, n], values fp32 [R, n])."""
        s, z = self._col_params(cols)
        inv = torch.where(s != 0, 1.0 / s, torch.zeros_like(s))
        x = w.float() if z is None else w.float() - z
        q = torch.round(x * inv).clamp_(self.lo, self.hi)
        v = q * s if z is None else q * s + z
        return q.to(torch.int32), v

    def parts(self, codes: torch.Tensor) -> dict[str, torch.Tensor]:
        """Signed codes [R, C] -> the format's stored parts of the matrix."""
        stored = (codes + self.offset).to(torch.int8)
        if self.spec.format == "int8":
            return {"qweight": stored, "scales": self.scales}
        out = {"qweight": pack_nibbles(stored), "scales": self.scales}
        if self.zeros is not None:
            out["zeros"] = self.zeros
        return out


def grid_from_parts(spec: QuantSpec, parts: dict[str, torch.Tensor], cols: int) -> Grid | None:
    """The grid of a matrix quantized by its format (`parts` of a [R, C] matrix); None if unsupported."""
    if spec.format == "int8":
        return Grid(spec, parts["scales"], None, cols, -127, 127, 0)
    if spec.format == "int4":
        return Grid(spec, parts["scales"], parts.get("zeros"), spec.group_size or DEFAULT_GROUP, -8, 7, 8)
    return None


def grid_for(w: torch.Tensor, spec: QuantSpec) -> tuple[Grid | None, dict[str, torch.Tensor]]:
    """Round-to-nearest parts of w [R, C] by the format itself, and their grid (static scales)."""
    parts = get_format(spec.format).quantize(w, spec)
    return grid_from_parts(spec, parts, w.shape[-1]), parts
