"""Helpers shared by the formats: shape checks and chunked iteration over matrix rows."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from quantkit.errors import QuantkitError

# Rows are processed in chunks of about this many elements: the fp32 temporaries of a chunk stay in
# the L2 cache (1 MB), which measured 2-3x faster than 8M-element chunks, and memory stays bounded.
CHUNK_ELEMENTS = 1 << 18


def check_matrix(w: torch.Tensor, block: int | None, fmt: str) -> None:
    if w.dim() < 2:
        raise QuantkitError(f"{fmt}: expected a matrix [..., out, in], got shape {tuple(w.shape)}")
    if block and w.shape[-1] % block:
        raise QuantkitError(
            f"{fmt}: row length {w.shape[-1]} of shape {tuple(w.shape)} is not a multiple of the block "
            f"size {block}; keep this tensor in bf16 or use int8"
        )
    if not w.is_floating_point():
        raise QuantkitError(f"{fmt}: expected a floating-point tensor, got {w.dtype}")


def row_chunks(rows: int, cols: int) -> Iterator[slice]:
    """Slices over `rows` rows of `cols` elements, each about CHUNK_ELEMENTS large."""
    step = max(1, CHUNK_ELEMENTS // max(cols, 1))
    for start in range(0, rows, step):
        yield slice(start, min(rows, start + step))


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., n] (values 0..15) -> [..., n/2]: element 2j in the low nibble, 2j+1 in the high."""
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_nibbles(p: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_nibbles: uint8 [..., n/2] -> uint8 codes [..., n]."""
    return torch.stack([p & 0x0F, p >> 4], dim=-1).flatten(-2)
