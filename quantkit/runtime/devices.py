"""The devices weights and states live on: whether one exists here, and how much memory is free on it now."""

from __future__ import annotations

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


def release_free_heap() -> None:
    """Give the C heap's free pages back to the system (glibc `malloc_trim`; a no-op elsewhere). Loading left
    the freed read slabs and repacking temporaries inside the heap, counted in RSS as if they were weights
    (half as much again as the weights on a 0.56 GB folder); a long prefill leaves its temporaries the same way."""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
