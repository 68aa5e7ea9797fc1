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


def busy_note(load_before: float, load_after: float, own_threads: int, cpus: int) -> str | None:
    """A warning when other work ran on the CPUs during a measurement: the 1-minute load average before it, or
    at its end less the measurement's own threads, reaches half the CPUs (its figures then read slower than
    this host idle); None on a quiet host."""
    others = max(load_before, load_after - own_threads)
    if others < cpus / 2:
        return None
    return (f"the host was busy while measuring (load average {others:.1f} from other work on {cpus} CPUs): the "
            "figures are slower than this host when quiet; run it again when the host is idle")


def load_average() -> float:
    """The 1-minute load average (0 where the platform has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0
