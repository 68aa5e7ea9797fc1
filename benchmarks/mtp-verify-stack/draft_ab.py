"""A/B in one process, alternating: one decode step, a 2-token verify, an MTP draft with the whole head vs the
reduced one. Prints min and median ms."""

import os
import statistics
import sys
import time
from pathlib import Path

import torch

from quantkit.runtime import load_model

torch.set_num_threads(2)
rt = load_model(Path("/tmp/quantkit-bench-28/realistic-mtp-4x64-v248320"), recipe="int4", verify="quick")
m = rt.model
mtp = m.mtp
print("route", rt.route()["name"], "load", os.getloadavg())
res = {}
with torch.inference_mode():
    cache = m.new_cache(200)
    lg, hid = m.forward(list(range(64)), cache, hidden=True)
    mc = mtp.new_cache(200)
    n0, k0 = cache.n, mc.n
    for _rnd in range(int(sys.argv[1]) if len(sys.argv) > 1 else 20):
        for name in ("step", "verify2", "draft-full", "draft-32k"):
            t0 = time.perf_counter()
            if name == "step":
                m.forward([7], cache)
                cache.n = n0
            elif name == "verify2":
                m.forward([7, 8], cache, all_logits=True, keep_positions=True, hidden=True)
                cache.rewind(n0 + 1)
                cache.n = n0
            else:
                mtp.draft_rows = 0 if name == "draft-full" else 32768
                mtp.head(m)
                t0 = time.perf_counter()
                mtp.forward(m, [9], hid[-1:], mc)
                mc.n = k0
            res.setdefault(name, []).append(time.perf_counter() - t0)
one = statistics.median(res["step"])
for k, v in res.items():
    print(
        f"{k:12s} min {min(v) * 1e3:7.2f} ms  median {statistics.median(v) * 1e3:7.2f} ms  ({statistics.median(v) / one:.2f}x step)"
    )
print("load", os.getloadavg())
