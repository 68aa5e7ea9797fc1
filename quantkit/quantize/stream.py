"""The quantizer's three stages on threads: read the next block, quantize this one, write the last one.

Profiled file to file (reports/bench-quantize.md), the one-thread loop spent its time in a dense fp32
dequantize for the error figures, in page faults (every block's source, result and temporaries were fresh
allocations: 5 million minor faults for a 1.9 GB model) and in waiting for reads, writes, fsync and the
sha256 read-back. Here:
- each block of a source tensor is read with plain reads into one of two reused buffers, never mapped: a mapped
  page of a file cut short during the run (a user restoring or re-downloading it) kills the process with SIGBUS,
  where a read comes back short and the run ends in one line naming the file (the copy a read makes in the
  kernel is small beside quantizing the block);
- the formats quantize straight into one of two reused output arenas and measure the error inside their
  row chunks (formats/common.ErrorSums), spread over `threads` workers;
- a writer thread writes each block at its planned offset, then commits the shard (fsync, rename) and
  hashes it for the journal while the next shard is being quantized.

Memory, beside the interpreter and torch (about 0.3 GB): 2 x B_in + 2 x B_out + threads x C + 16 MiB, where B_in is
the largest block read (max(slab size, one expert matrix, one row block), or a whole tensor that cannot be
split: a 1D tensor, or a format whose parts do not split by rows), B_out its quantized size (at most
B_in for every format), C the fp32 temporaries of one row chunk (16 x 2^18 x 4 bytes = 16 MiB) and 16 MiB
for the stages' own objects. With the default 32 MB slab and 2 threads: about 0.15 GB whatever the model.
`peak_bound` in quantize/run.py computes it; tests/quantize/test_quantize_stream.py holds a run under it.

Output bytes do not depend on the thread count or the timing: every block lands at an offset fixed by
the plan, and the error sums are added in chunk order.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from quantkit.errors import QuantkitError
from quantkit.formats.common import CHUNK_ELEMENTS

# fp32 temporaries of one row chunk (x, t, r, candidates, codes...): measured under 16 per element
CHUNK_TEMP_BYTES = 16 * CHUNK_ELEMENTS * 4
# the stage threads' stacks and malloc arenas, the error sums and the plan's Python objects (measured 9 MiB
# over the buffers on a 1-layer model with 1 MiB slabs)
STAGE_OVERHEAD_BYTES = 16 << 20


def keep_small_allocations() -> None:
    """Let glibc's malloc reuse freed blocks under 8 MiB instead of unmapping them.

    The formats allocate fp32 temporaries of about 1 MiB per op per row chunk; above glibc's default
    mmap threshold every one was a fresh mapping, zero-filled page by page: millions of minor faults and
    most of the quantizer's system time (reports/bench-quantize.md). The freed
    blocks stay in the arenas, bounded by the chunk temporaries (threads x CHUNK_TEMP_BYTES). Process-wide
    and idempotent; a no-op where the C library is not glibc."""
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    mallopt(-3, 8 << 20)  # M_MMAP_THRESHOLD
    mallopt(-1, 64 << 20)  # M_TRIM_THRESHOLD


class StageTimes:
    """Seconds each stage spent, summed over the run (the profile bench quantize reports): reading, checking,
    quantizing (with the error sums), writing, fsync, sha256, and the main thread's waits on the reader and
    the writer. Each key is added to by one thread."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def stage(self, key: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - t0


@dataclass(frozen=True)
class Block:
    """Rows `start:stop` along dim 0 of one tensor (experts of a stack, rows of a matrix, or all of it)."""

    name: str
    start: int
    stop: int
    whole: bool  # the tensor in one block

    @property
    def rows(self) -> int:
        return self.stop - self.start


def stored_ranges(ckpt: Any) -> dict[str, tuple[Path, int, int]]:
    """(file, start, end) of every canonical tensor stored as one source tensor in its canonical dtype,
    which plain reads can stream; fused per-expert sources and FP8 are absent (Checkpoint.load reads them)."""
    src = getattr(ckpt, "_src", {})  # the header entries Checkpoint keeps (source name -> HeaderEntry)
    out = {}
    for t in ckpt.canonical():
        e = src.get(t.name)
        if e is not None and e.dtype == t.dtype and tuple(e.shape) == tuple(t.shape):
            out[t.name] = (Path(e.file), e.start, e.end)
    return out


class BufferPool:
    """`n` reusable byte buffers of `nbytes` each: acquire blocks until one is free (bounded memory)."""

    def __init__(self, n: int, nbytes: int, failed: Callable[[], BaseException | None]):
        self.nbytes = nbytes
        self._free: queue.Queue[torch.Tensor] = queue.Queue()
        self._failed = failed
        self._n = n
        self._made = 0
        self.closed = threading.Event()

    def acquire(self) -> torch.Tensor:
        try:
            return self._free.get_nowait()
        except queue.Empty:
            if self._made < self._n:  # allocated on first use: a run of small tensors never pays for them
                self._made += 1
                return torch.empty(self.nbytes, dtype=torch.uint8)
        while True:
            try:
                return self._free.get(timeout=0.2)
            except queue.Empty:
                if (e := self._failed()) is not None:
                    raise e from None
                if self.closed.is_set():
                    raise Stopped from None

    def release(self, buf: torch.Tensor | None) -> None:
        if buf is not None:
            self._free.put(buf)


class Stopped(Exception):
    """A stage was told to stop (the run failed or was interrupted elsewhere)."""


def view_as(buf: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
    """A tensor of `shape`/`dtype` over `buf[offset:]` (offset aligned to 64 bytes by the callers)."""
    n = math.prod(shape) * dtype.itemsize
    return buf[offset:offset + n].view(dtype).view(shape)


def align(n: int) -> int:
    return -(-n // 64) * 64


class Reader:
    """A thread that reads blocks in order into pool buffers; `get()` returns (block, tensor, buffer)."""

    def __init__(self, ckpt: Any, blocks: list[tuple[Block, tuple[int, ...], str]], pool: BufferPool,
                 check_shape: Callable[[str, torch.Tensor, tuple[int, ...]], None], times: StageTimes):
        self.times = times
        self.ckpt = ckpt
        self.blocks = blocks
        self.pool = pool
        self.check_shape = check_shape
        self.q: queue.Queue[Any] = queue.Queue(maxsize=1)
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self._files: dict[Path, Any] = {}
        self._whole: tuple[str, torch.Tensor] | None = None
        self.ranges = stored_ranges(ckpt)
        self.t = threading.Thread(target=self._run, name="quantkit-read", daemon=True)
        self.t.start()

    def _open(self, file: Path) -> Any:
        f = self._files.get(file)
        if f is None:
            try:
                f = self._files[file] = open(file, "rb", buffering=0)
            except OSError as e:
                raise QuantkitError(f"{file}: cannot read ({e.strerror})") from None
        return f

    def _read_into(self, file: Path, off: int, n: int, buf: torch.Tensor) -> None:
        f = self._open(file)
        mv = memoryview(buf.numpy())[:n]
        got = 0
        try:
            while got < n:
                k = os.preadv(f.fileno(), [mv[got:]], off + got)
                if not k:
                    raise QuantkitError(f"{file}: cut short while it was being quantized (the file changed during "
                                        "the run); restore it, then run the same command with --resume")
                got += k
        except OSError as e:
            raise QuantkitError(f"{file}: cannot read ({e.strerror}); check the disk, then run the same command "
                                "with --resume") from None

    def _load(self, blk: Block, shape: tuple[int, ...], dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The block as a tensor, and the pool buffer that holds it (None when it is not the pool's)."""
        lead = (blk.rows,) + tuple(shape[1:]) if shape else ()
        rng = self.ranges.get(blk.name)
        tdt = getattr(torch, dtype)
        if rng is not None:
            file, start, end = rng
            row = (end - start) // shape[0] if shape and shape[0] else end - start
            n = (blk.rows * row) if shape else end - start
            with self.times.stage("reader idle (buffers in use)"):
                buf = self.pool.acquire() if n <= self.pool.nbytes else torch.empty(n, dtype=torch.uint8)
            with self.times.stage("read"):
                self._read_into(file, start + blk.start * row, n, buf)
            return view_as(buf, lead if shape else (), tdt), buf if n <= self.pool.nbytes else None
        with self.times.stage("read"):
            return self._load_fallback(blk, shape)

    def _load_fallback(self, blk: Block, shape: tuple[int, ...]) -> tuple[torch.Tensor, None]:
        """Fused per-expert sources and FP8: through Checkpoint.load (a slab of experts, or the whole tensor)."""
        last = blk.stop >= (shape[0] if shape else 0)
        if len(shape) == 3 and not blk.whole:
            w = self.ckpt.load(blk.name, experts=slice(blk.start, blk.stop))
        else:
            if self._whole is None or self._whole[0] != blk.name:
                self._whole = None
                self._whole = (blk.name, self.ckpt.load(blk.name))
                self.check_shape(blk.name, self._whole[1], tuple(shape))
            w = self._whole[1] if blk.whole else self._whole[1][blk.start:blk.stop]
        if last:
            self._whole = None
            self.ckpt.close()  # drop any handle the checkpoint opened, so RSS does not grow to the checkpoint's size
        return w, None

    def _run(self) -> None:
        try:
            for blk, shape, dtype in self.blocks:
                if self.stop.is_set():
                    return
                item = (blk, *self._load(blk, shape, dtype))
                while not self.stop.is_set():
                    try:
                        self.q.put(item, timeout=0.2)
                        break
                    except queue.Full:
                        continue
        except Stopped:
            return
        except BaseException as e:  # handed to the main thread, which raises it
            self.error = e
            self.q.put(None)
        finally:
            for f in self._files.values():
                f.close()

    def get(self) -> tuple[Block, torch.Tensor, torch.Tensor | None]:
        with self.times.stage("wait for reads"):
            return self._get()

    def _get(self) -> tuple[Block, torch.Tensor, torch.Tensor | None]:
        while True:
            try:
                item = self.q.get(timeout=0.2)
            except queue.Empty:
                if self.error is not None or not self.t.is_alive():
                    raise self.error or QuantkitError("internal: the reader stopped early") from None
                continue
            if item is None:
                raise self.error or QuantkitError("internal: the reader stopped early")
            return item

    def close(self) -> None:
        self.stop.set()
        self.pool.closed.set()
        while self.t.is_alive():
            try:
                self.q.get_nowait()
            except queue.Empty:
                pass
            self.t.join(0.05)


class Writer:
    """A thread that runs submitted jobs in order (write a block, commit a shard); the first error stops it
    and is raised in the submitting thread at its next call."""

    def __init__(self, depth: int = 2):
        self.q: queue.Queue[Callable[[], None] | None] = queue.Queue(maxsize=depth)
        self.error: BaseException | None = None
        self.t = threading.Thread(target=self._run, name="quantkit-write", daemon=True)
        self.t.start()

    def _run(self) -> None:
        while True:
            job = self.q.get()
            if job is None:
                return
            if self.error is None:
                try:
                    job()
                except BaseException as e:  # raised in the main thread by submit/finish
                    self.error = e

    def failed(self) -> BaseException | None:
        return self.error

    def submit(self, job: Callable[[], None]) -> None:
        while True:
            if self.error is not None:
                raise self.error
            try:
                self.q.put(job, timeout=0.2)
                return
            except queue.Full:
                continue

    def finish(self) -> None:
        """Wait for every job; raise the first error."""
        self.q.put(None)
        while self.t.is_alive():
            self.t.join(0.2)
        if self.error is not None:
            raise self.error

    def abandon(self) -> None:
        """Stop after the job in hand (on interrupt); drop the rest."""
        self.error = self.error or KeyboardInterrupt()
        while True:
            try:
                self.q.get_nowait()
            except queue.Empty:
                break
        self.q.put(None)
        while self.t.is_alive():
            self.t.join(0.2)
