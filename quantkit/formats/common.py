"""Helpers shared by the formats: shape checks, chunked iteration over matrix rows, nibble packing.

Speed notes (torch's CPU ops): a float -> uint8 cast, any op producing bool and strided pair slicing
(q[..., 0::2]) each cost several times a float elementwise op, and `torch.bucketize` (a search per element)
far more. So codes are made as int8 (fast cast) and packed through an int16/int64 view of adjacent bytes,
comparisons write float outputs, and non-uniform code books go through a lookup table (`torch.index_select`)
instead of a search.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

import torch

from quantkit.errors import QuantkitError

# The byte-view packing below assumes little-endian element order inside a 16/64-bit word.
assert sys.byteorder == "little", "quantkit.formats packs nibbles through little-endian views"

# Rows are processed in chunks of about this many elements: the fp32 temporaries of a chunk stay in
# the L2 cache (chunks that spill it run markedly slower), and memory stays bounded.
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


_THREADS_LOCK = threading.Lock()


@lru_cache(maxsize=4)
def _pool(threads: int) -> ThreadPoolExecutor:
    """One long-lived pool per thread count (a fresh pool per call cost a thread start per slab)."""
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="quantkit-chunk")


class ErrorSums:
    """Squared error and squared reference of one quantize call, gathered per row chunk by the format
    (fused into its chunk work, so no dense dequantized copy is made) and summed in chunk order, so the
    figures do not depend on the thread count."""

    def __init__(self) -> None:
        self._by_chunk: dict[int, tuple[float, float]] = {}

    def add(self, chunk: slice, err: float, ref: float) -> None:
        self._by_chunk[chunk.start] = (err, ref)  # one key per chunk: no lock needed (GIL-atomic store)

    def total(self) -> tuple[float, float]:
        err = ref = 0.0
        for k in sorted(self._by_chunk):
            e, r = self._by_chunk[k]
            err += e
            ref += r
        return err, ref


def row_sq(x: torch.Tensor) -> float:
    """Sum of squares of a chunk [rows, cols]: fp32 norms per row, squared and summed in float64 (as exact
    as one float64 sum for rows a few thousand wide, and cheaper: float64 runs on the row sums alone)."""
    rows = torch.linalg.vector_norm(x.reshape(-1, x.shape[-1]), dim=1, dtype=torch.float32)
    return float(rows.double().pow_(2).sum())


def out_buffer(out: dict[str, torch.Tensor] | None, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The caller's preallocated part `key` viewed as `shape` (checked), or a fresh one."""
    if out is None:
        return torch.empty(shape, dtype=dtype)
    t = out[key]
    if t.dtype != dtype or t.numel() != torch.Size(shape).numel() or not t.is_contiguous():
        raise QuantkitError(f"internal: output buffer {key} is {tuple(t.shape)} {t.dtype}, need {shape} {dtype}")
    return t.view(shape)


def run_chunks(rows: int, cols: int, work: Callable[[slice], None]) -> None:
    """Call `work(rows_slice)` for every row chunk, chunks spread over torch's thread count.

    Each chunk runs ~20 small ops; with torch's intra-op threads every op is a barrier, and on a busy
    machine (cores shared with other jobs) a descheduled thread stalls all of them, worse than one thread
    alone. So intra-op threading is off while whole chunks run in parallel in
    a thread pool (torch ops release the GIL); the thread count is restored afterwards. Chunks write
    disjoint rows of preallocated outputs."""
    slices = list(row_chunks(rows, cols))
    threads = torch.get_num_threads()
    if threads <= 1 or len(slices) < 2:
        for sl in slices:
            work(sl)
        return
    with _THREADS_LOCK:  # set_num_threads is process-wide: one parallel section at a time
        torch.set_num_threads(1)
        try:
            with ThreadPoolExecutor(max_workers=min(threads, len(slices))) as pool:
                for _ in pool.map(work, slices):
                    pass
        finally:
            torch.set_num_threads(threads)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """int8/uint8 codes [..., n] (0..15) -> uint8 [..., n/2]: element 2j low nibble, 2j+1 high."""
    a = q.contiguous().view(torch.int16)  # little-endian: low byte = element 2j
    return (a | (a >> 4)).to(torch.uint8)


def pack_nibbles_hi_first(q: torch.Tensor) -> torch.Tensor:
    """int8/uint8 codes [..., n] (0..15) -> uint8 [..., n/2]: element 2j HIGH nibble (bitsandbytes)."""
    a = q.contiguous().view(torch.int16)
    return ((a << 4) | (a >> 8)).to(torch.uint8)


def unpack_nibbles(p: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_nibbles: uint8 [..., n/2] -> uint8 codes [..., n]."""
    return torch.stack([p & 0x0F, p >> 4], dim=-1).flatten(-2)


def unpack_nibbles_hi_first(p: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_nibbles_hi_first."""
    return torch.stack([p >> 4, p & 0x0F], dim=-1).flatten(-2)


def to_codes(qf: torch.Tensor) -> torch.Tensor:
    """Float codes holding small non-negative integers -> int8 (the fast cast; see module notes)."""
    return qf.to(torch.int8)
