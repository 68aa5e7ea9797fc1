"""A/B: verify cost T=1..4 with the kernel's stack verify (new) vs the layers' Python verify (old), alternating."""

import os
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.mtp import checkpoint
from quantkit.runtime import load_model
from quantkit.runtime.model import executors as mm

torch.set_num_threads(int(sys.argv[3]) if len(sys.argv) > 3 else 2)
src = checkpoint(
    Path("/tmp/quantkit-bench-28"), int(sys.argv[1]) if len(sys.argv) > 1 else 4, 64, 248320, print
)
rt = load_model(src, recipe="int4", verify="quick")
m = rt.model
print("route", rt.route()["name"], "load", os.getloadavg())
g = torch.Generator().manual_seed(0)
prompt = torch.randint(0, 700, (64,), generator=g).tolist()
res = {}
with torch.inference_mode():
    cache = m.new_cache(len(prompt) + 16)
    m.forward(prompt, cache)
    n0 = cache.n
    for rnd in range(int(sys.argv[2]) if len(sys.argv) > 2 else 10):
        for mode in ("new", "old"):
            mm.STACK_VERIFY_ROWS = 4 if mode == "new" else 0
            for t in (1, 2, 3, 4):
                toks = [(prompt[-1] + rnd + j) % 700 for j in range(t)]
                t0 = time.perf_counter()
                if t == 1:
                    m.forward(toks, cache)
                    cache.n = n0
                else:
                    m.forward(toks, cache, all_logits=True, keep_positions=True)
                    cache.rewind(n0 + 1)
                    cache.n = n0
                res.setdefault((mode, t), []).append(time.perf_counter() - t0)
for mode in ("new", "old"):
    one = statistics.median(res[(mode, 1)])
    print(
        mode,
        " ".join(
            f"T{t}={statistics.median(res[(mode, t)]) * 1e3:.2f}ms ({statistics.median(res[(mode, t)]) / one:.2f}x)"
            for t in (1, 2, 3, 4)
        ),
    )
print("load", os.getloadavg(), "threads", torch.get_num_threads())
