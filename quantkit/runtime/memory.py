"""Memory free right now on a device the runtime uses (the loader checks a plan against it; the prompt cache
sizes its default from it)."""

from __future__ import annotations

import psutil
import torch


def available_bytes(dev: str) -> int:
    """Memory free on `dev` right now: CUDA's free memory, or the host's available RAM."""
    d = torch.device(dev)
    if d.type == "cuda":
        free, _total = torch.cuda.mem_get_info(d)
        return int(free)
    return int(psutil.virtual_memory().available)
