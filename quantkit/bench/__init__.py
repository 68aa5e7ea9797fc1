"""The benchmarks a user runs (`quantkit bench decode|engines|serve`: this machine, against llama.cpp where it is
installed), writing reports/ (markdown + json), and what they share. The lab's drivers live in benchmarks/."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from quantkit.fileio import write_atomic
from quantkit.kernels import cpu as cpu_kernel
from quantkit.runtime import hugepages


def read_bandwidth_gbs(gib: float = 1.0, reps: int = 5) -> float:
    """Read bandwidth: bytes of a large fp32 tensor over the best time of a full sum over it. The tensor
    sits on the memory the runtime's weights use (2 MiB pages where the system has them:
    runtime/hugepages.py) and the sum is the CPU kernel's plain streaming read (`stream_sum`; torch's sum
    where the kernel is missing), so the bound is the best read the machine offers the weights."""
    import torch

    x = hugepages.empty((int(gib * (1 << 30)) // 4,), torch.float32).fill_(1.0)
    mod = cpu_kernel.module()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        float(mod.stream_sum(x)) if mod is not None else float(x.sum())
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def write_reports(reports: Path, stem: str, data: dict[str, Any], markdown: str, indent: int = 2) -> None:
    """reports/STEM.json and reports/STEM.md, each written atomically."""
    write_atomic(reports / f"{stem}.json", json.dumps(data, indent=indent) + "\n")
    write_atomic(reports / f"{stem}.md", markdown)


def write_section(md: Path, section: str, markers: tuple[str, str]) -> None:
    """Put `section` (which starts with markers[0] and ends with markers[1]) into the report `md`: in place of the
    marked section it already holds, else at its end; written atomically, the rest of the report kept."""
    old = md.read_text() if md.is_file() else ""
    if markers[0] in old and markers[1] in old:
        head, rest = old.split(markers[0], 1)
        new = head + section.rstrip("\n") + rest.split(markers[1], 1)[1]
    else:
        new = (old.rstrip("\n") + "\n\n" if old else "") + section
    write_atomic(md, new)
