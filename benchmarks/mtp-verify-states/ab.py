"""One side of an A/B of two checkouts on a realistic-shape MTP checkpoint: greedy decode tok/s without drafts and
with the oracle drafter (1 and 2 drafts at acceptance 0.88, as `python -m benchmarks.mtp` runs them), a decode step's
median seconds, and 2-4 token verifies' median seconds with every token kept and with all but the first undone
(the rollback a rejected draft costs). Timed here, not by the checkout's own bench code, so both sides time the
same thing. Run it from each checkout in turn, alternating:

    PYTHONPATH=<checkout> python benchmarks/mtp-verify-states/ab.py OUT.json LABEL CHECKPOINT [THREADS]

(CHECKPOINT: a folder `python -m benchmarks.mtp --layers N --workdir DIR` writes, DIR/realistic-mtp-Nx64-v248320)."""

import json
import statistics
import sys
import time
from pathlib import Path

import torch

import quantkit
from benchmarks.mtp import OracleDrafter, decode
from quantkit.kernels import cpu as cpu_kernel
from quantkit.recipe import build_recipe
from quantkit.runtime import load_model

out, label, src = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
torch.set_num_threads(int(sys.argv[4]) if len(sys.argv) > 4 else 2)
rt = load_model(src, recipe=build_recipe().name, verify="quick")
g = torch.Generator().manual_seed(0)
prompt = torch.randint(0, 700, (64,), generator=g).tolist()
real = rt.model.mtp.draft
row = {"label": label, "checkpoint": src.name, "source": str(Path(quantkit.__file__).parent),
       "kernel": cpu_kernel.module().__file__, "threads": torch.get_num_threads()}
row["plain_tok_s"], ref, _ = decode(rt, prompt, 96, 0, 2)
for k in (1, 2):
    rt.model.mtp.draft = OracleDrafter(real, prompt + ref, 0.88, seed=0)
    tps, toks, _stats = decode(rt, prompt, 96, k, 2)
    row[f"mtp{k}_tok_s"], row[f"mtp{k}_same"] = tps, toks == ref
rt.model.mtp.draft = real
rt.set_mtp(0)
m = rt.model
with torch.inference_mode():
    cache = m.new_cache(len(prompt) + 16)
    m.forward(prompt, cache)
    n0 = cache.n
    for name, keep in (("verify_s", lambda t: t), ("verify_rollback_s", lambda t: 1)):
        row[name] = {}
        for t in (1, 2, 3, 4):
            times = []
            for i in range(20):
                toks = [(prompt[-1] + i + j) % 700 for j in range(t)]
                t0 = time.perf_counter()
                if t == 1:
                    m.forward(toks, cache)
                else:
                    m.forward(toks, cache, all_logits=True, keep_positions=True)
                    cache.rewind(n0 + keep(t))
                cache.n = n0  # the KV's fill set back; the linear states drift, which costs the same
                times.append(time.perf_counter() - t0)
            row[name][str(t)] = statistics.median(times)
runs = json.loads(out.read_text()) if out.exists() else []
out.write_text(json.dumps([*runs, row], indent=1) + "\n")
print(json.dumps(row))
