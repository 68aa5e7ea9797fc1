"""The devices weights and states live on: whether one exists here, and how much memory is free on it now."""

from __future__ import annotations

import ctypes
import os

import psutil
import torch

from quantkit.errors import QuantkitError


def check_device_exists(dev: str) -> None:
    """Refuse a device this machine does not have (one line naming it)."""
    d = torch.device(dev)
    if d.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (d.index or 0) >= n:
            raise QuantkitError(f"the plan puts weights on {dev}, but this machine has {n} CUDA device(s)")
    elif d.type == "mps":
        if not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
            raise QuantkitError(f"the plan puts weights on {dev}, but no Apple GPU is available")
    elif d.type != "cpu":
        raise QuantkitError(f"device {dev!r} in the plan is not one quantkit runs on (cpu, cuda:N, mps)")


def available_bytes(dev: str) -> int:
    """Memory free for weights on `dev` right now."""
    d = torch.device(dev)
    if d.type == "cuda":
        free, _total = torch.cuda.mem_get_info(d)
        return int(free)
    return int(psutil.virtual_memory().available)


HEAP_SLACK = 256 << 20  # resident bytes a prefill may add before the C heap's free pages go back
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes() -> int:
    """This process's resident memory (/proc/self/statm; 0 where there is none)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


class HeapGuard:
    """Gives the C heap's free pages back (`release_free_heap`) once the resident memory has grown more than
    `slack` since the last time (or since this guard was made), checked between a prefill's layers. Each layer
    frees its temporaries into the heap in pieces it does not reuse whole: without this the resident memory
    grew by about 3 GB over a 2k-token prompt at 35B (reports/bench-full-size.md), out of the plan; trimming
    after every layer instead slows a prefill (its pages faulted in again)."""

    def __init__(self, slack: int = HEAP_SLACK):
        self.slack, self.floor = slack, resident_bytes()

    def check(self) -> bool:
        if resident_bytes() - self.floor <= self.slack:
            return False
        release_free_heap()
        self.floor = resident_bytes()  # what stays is held (caches filling up), not heap slack
        return True


def release_free_heap() -> None:
    """Give the C heap's free pages back to the system (glibc `malloc_trim`; a no-op elsewhere). Loading left
    the freed read slabs and repacking temporaries inside the heap, counted in RSS as if they were weights
    (half as much again as the weights on a 0.56 GB folder); a long prefill leaves its temporaries the same way."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
