"""The machine a report's figures came from: CPU, vector extensions, cores, RAM, library versions and the
load when the bench started (other work on the machine colours every timing)."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

import torch


def machine_info() -> dict[str, Any]:
    import psutil

    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info: dict[str, Any] = {
        "cpu": cpu,
        "isa": cpu_isa(),
        "logical_cores": os.cpu_count(),
        "physical_cores": psutil.cpu_count(logical=False),
        "ram_gb": round(psutil.virtual_memory().total / 1e9, 1),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
    }
    from importlib.metadata import PackageNotFoundError, version

    for mod in ("bitsandbytes", "gguf", "numpy", "safetensors"):
        try:
            info[mod] = version(mod)  # the gguf package has no __version__
        except PackageNotFoundError:
            info[mod] = None
    return info


def cpu_isa() -> str:
    """The vector extensions that decide kernel speed, from /proc/cpuinfo ("" where it is not there)."""
    try:
        flags = next((ln.split(":", 1)[1].split() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                      if ln.startswith("flags")), [])
    except OSError:
        return ""
    return " ".join(f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "sha_ni")
                    if f in flags)
