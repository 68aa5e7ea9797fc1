"""The CPU thread count of the runtime and the benchmarks: `--threads N` on chat, generate, serve and bench.

Default: every physical core (hyper-threads share a core's vector units and memory port, so a second
thread per core adds contention, not bandwidth). One pool: torch's intra-op pool (OpenMP), which
quantkit's CPU kernel runs on as well (at::parallel_for), so nothing else spins beside it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from quantkit.errors import QuantkitError


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def physical_cores() -> int:
    try:
        import psutil

        n = psutil.cpu_count(logical=False)
    except Exception:  # psutil cannot read the topology (containers, exotic platforms)
        n = None
    return max(1, min(n or available_cpus(), available_cpus()))


def resolve_threads(n: int | None) -> int:
    """`--threads` checked: None -> every physical core; 1..available CPUs, else a one-line error."""
    if n is None:
        return physical_cores()
    limit = available_cpus()
    if not 1 <= n <= limit:
        raise QuantkitError(f"--threads {n}: use 1 to {limit} (the CPUs this machine gives this process)")
    return n


def set_threads(n: int | None) -> int:
    """Resolve and apply to torch's pool; returns the count in use."""
    t = resolve_threads(n)
    torch.set_num_threads(t)
    return t


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op pool at `n` threads within the block, at its earlier count after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
