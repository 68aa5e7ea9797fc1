"""CPU memory for weights the decode kernels stream, backed by 2 MiB pages where Linux offers them.

Why: a decode step reads every resident weight it uses once, from DRAM, in long sequential runs. On 4 KiB
pages each run crosses a page every 4 KiB: a TLB miss (a two-level page walk under a hypervisor) and a
restart of the hardware prefetcher. On 2 MiB pages a streaming read runs faster, and so do quantkit's
int8 and bf16 kernels on a 248k-row lm_head (the `bench` reports carry the figures of each run). glibc's allocator (torch's CPU allocator) asks for no huge pages, and
Linux's default THP mode (`madvise`) gives them only to memory that asks.

Contract: `empty(shape, dtype)` returns an uninitialised CPU tensor. Tensors of at least `MIN_BYTES` come
from anonymous mappings advised `MADV_HUGEPAGE` (pages are faulted on first write, so only bytes written
are resident); smaller ones share chunks of `CHUNK` bytes, page-aligned, so a layer's experts sit on a
few huge pages instead of each starting its own. Each tensor is its own storage over its bytes (a deep
copy or a save takes only those) and keeps its mapping alive; a chunk is unmapped when its last tensor
is freed. Below `MIN_BYTES`, on other systems or inside `off()`, plain
`torch.empty`. `copy(t)` moves a tensor there; when t maps a file (a safetensors shard read lazily), the
file's pages are then unmapped from the process, so the weights count once in its resident memory.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import threading
from collections.abc import Iterator

import torch

HUGE_PAGE = 2 << 20
CHUNK = 64 << 20
MIN_BYTES = 256 << 10  # below this a tensor spans few pages: torch's allocator
_ALIGN = 4096

_lock = threading.Lock()
_chunk: mmap.mmap | None = None
_used = 0
_off = threading.local()


def enabled() -> bool:
    """Whether weights go to advised 2 MiB pages (Linux with MADV_HUGEPAGE, not switched off)."""
    return hasattr(mmap, "MADV_HUGEPAGE") and not getattr(_off, "on", False)


@contextlib.contextmanager
def off() -> Iterator[None]:
    """Plain torch memory within the block (this thread): for models whose weights are never read, such as
    calibrate's stubbed-kernel timing, where a copy would fault in gigabytes `torch.empty` left untouched."""
    prev = getattr(_off, "on", False)
    _off.on = True
    try:
        yield
    finally:
        _off.on = prev


def _mapping(nbytes: int) -> mmap.mmap:
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mm.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # THP off in this kernel: the mapping still works, on 4 KiB pages
        pass
    return mm


def _bytes(nbytes: int) -> torch.Tensor:
    # each tensor gets its own storage over its bytes of the mapping (torch.frombuffer with an offset), so
    # a copy or a save of one tensor takes its bytes, not the chunk's
    global _chunk, _used
    if nbytes > CHUNK // 4:
        return torch.frombuffer(_mapping(nbytes), dtype=torch.uint8, count=nbytes)
    with _lock:
        if _chunk is None or _used + nbytes > CHUNK:
            _chunk, _used = _mapping(CHUNK), 0
        out = torch.frombuffer(_chunk, dtype=torch.uint8, count=nbytes, offset=_used)
        _used += -(-nbytes // _ALIGN) * _ALIGN
        return out


def empty(shape: tuple[int, ...] | list[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor, on 2 MiB pages when large enough (module docstring)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < MIN_BYTES or not enabled():
        return torch.empty(tuple(shape), dtype=dtype)
    return _bytes(nbytes).view(dtype).view(tuple(shape))


def _file_ranges() -> list[tuple[int, int]]:
    """[start, end) of this process's mappings of files (from /proc/self/maps)."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith("/"):
                lo, hi = parts[0].split("-")
                out.append((int(lo, 16), int(hi, 16)))
    return out


def file_backed(t: torch.Tensor) -> bool:
    """Whether t's memory is a mapping of a file (a safetensors shard read lazily). False where /proc is
    missing."""
    try:
        ranges = _file_ranges()
    except OSError:
        return False
    addr = t.data_ptr()
    return any(lo <= addr < hi for lo, hi in ranges)


def _unmap_pages(t: torch.Tensor) -> None:
    """Drop the whole pages under t from this process's mapping of its file (MADV_DONTNEED): they stay in
    the page cache, clean and reclaimable, and a later read of t faults them back in from the file."""
    import ctypes

    page = mmap.PAGESIZE
    lo = -(-t.data_ptr() // page) * page
    hi = (t.data_ptr() + t.numel() * t.element_size()) // page * page
    if hi > lo:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), mmap.MADV_DONTNEED)


def copy(t: torch.Tensor) -> torch.Tensor:
    """`t` copied into `empty`'s memory (a CPU tensor; returned as it is when small or switched off). When t
    maps a file (a safetensors shard the loader reads lazily), its pages are then unmapped from this process
    (`_unmap_pages`), so the copy does not count twice in its resident memory."""
    if t.device.type != "cpu" or t.numel() * t.element_size() < MIN_BYTES or not enabled():
        return t
    out = empty(tuple(t.shape), t.dtype)
    out.copy_(t)
    if file_backed(t):
        _unmap_pages(t)
    return out
