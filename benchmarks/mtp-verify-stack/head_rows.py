"""Medians of the head (248k rows), a Gated DeltaNet in_proj and one layer's routed experts at 1 and 2 rows."""

import statistics
import sys
import time
from pathlib import Path

import torch

from quantkit.kernels import cpu as cpu_kernel
from quantkit.runtime import load_model
from quantkit.runtime.kernels import Projections

torch.set_num_threads(int(sys.argv[1]))
rt = load_model(Path("/tmp/quantkit-bench-28/realistic-mtp-4x64-v248320"), recipe="int4", verify="quick")
m = rt.model
mod = cpu_kernel.module()

tab = Projections([m.head]).table
L = m.layers[0]
moe = L.moe
_, etab, _ = moe.experts._fused_table()
res = {}
g = torch.Generator().manual_seed(0)
for _r in range(20):
    for t in (1, 2):
        x = torch.randn(t, 2048).to(torch.bfloat16)
        t0 = time.perf_counter()
        mod.linear_many(x, tab)
        res.setdefault(f"head{t}", []).append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        mod.linear_many(x, L.mixer.proj_in.table)
        res.setdefault(f"inproj{t}", []).append(time.perf_counter() - t0)
        ids = torch.stack([torch.randperm(64, generator=g)[:8] for _ in range(t)])
        w = torch.full((t, 8), 0.125)
        t0 = time.perf_counter()
        mod.moe(x, etab, ids, w)
        res.setdefault(f"moe{t}", []).append(time.perf_counter() - t0)
for k, v in res.items():
    print(k, f"{statistics.median(v) * 1e3:.2f} ms min {min(v) * 1e3:.2f}")
