"""Benchmarks that write reports/ (markdown + json); `quantkit bench <name>` runs them."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from quantkit.fileio import write_atomic


def read_bandwidth_gbs(gib: float = 1.0, reps: int = 5) -> float:
    """Read bandwidth: bytes of a large fp32 tensor over the best time of a full sum over it."""
    import torch

    x = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        float(x.sum())
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def write_reports(reports: Path, stem: str, data: dict[str, Any], markdown: str, indent: int = 2) -> None:
    """reports/STEM.json and reports/STEM.md, each written atomically."""
    write_atomic(reports / f"{stem}.json", json.dumps(data, indent=indent) + "\n")
    write_atomic(reports / f"{stem}.md", markdown)
