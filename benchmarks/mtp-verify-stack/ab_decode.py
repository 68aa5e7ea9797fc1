"""Interleaved A/B on a shared machine: greedy decode tok/s without MTP and with MTP (oracle drafter at a set
acceptance, the real MTP layer's cost paid), whole draft head vs the reduced one, the stack verify vs the
layers' Python verify; one generation of each per round, the rounds alternating, ratios taken within a round."""

import json
import os
import statistics
import sys
from pathlib import Path

import torch

from benchmarks.mtp import OracleDrafter, checkpoint, decode
from quantkit.runtime import load_model
from quantkit.runtime.model import executors as mm

layers = int(sys.argv[1])
rounds = int(sys.argv[2])
out = Path(sys.argv[3])
torch.set_num_threads(int(sys.argv[4]) if len(sys.argv) > 4 else 2)
src = checkpoint(Path("/tmp/quantkit-bench-28"), layers, 64, 248320, print)
rt = load_model(src, recipe="int4", verify="quick")
real = rt.model.mtp.forward
g = torch.Generator().manual_seed(0)
prompt = torch.randint(0, 700, (64,), generator=g).tolist()
load0 = os.getloadavg()
_, ref, _ = decode(rt, prompt, 32, 0, 1)
configs = [
    ("none", 0, 0.0, 32768, 4),
    ("1@0.88", 1, 0.88, 32768, 4),
    ("2@0.88", 2, 0.88, 32768, 4),
    ("3@0.88", 3, 0.88, 32768, 4),
    ("2@0.80", 2, 0.80, 32768, 4),
    ("1@0.88 whole head", 1, 0.88, 0, 4),
    ("1@0.88 python verify", 1, 0.88, 0, 0),
]
res = {c[0]: [] for c in configs}
same = {c[0]: True for c in configs}
for rnd in range(rounds):
    for name, k, a, rows, vrows in configs:
        mm.STACK_VERIFY_ROWS = vrows
        rt.model.mtp.draft_rows = rows
        rt.model.mtp.forward = OracleDrafter(real, prompt + ref, a, seed=rnd) if k else real
        tps, toks, _ = decode(rt, prompt, 32, k, 1)
        res[name].append(tps)
        same[name] = same[name] and toks == ref
    print(rnd, {k: round(v[-1], 1) for k, v in res.items()}, flush=True)
mm.STACK_VERIFY_ROWS = 4
rt.model.mtp.forward = real
rt.set_mtp(0)
ratio = {k: statistics.median(a / b for a, b in zip(v, res["none"], strict=False)) for k, v in res.items()}
d = {
    "layers": layers,
    "rounds": rounds,
    "threads": torch.get_num_threads(),
    "load_at_start": load0,
    "load_at_end": os.getloadavg(),
    "tok_s_median": {k: statistics.median(v) for k, v in res.items()},
    "tok_s_best": {k: max(v) for k, v in res.items()},
    "median_ratio_vs_none_within_round": ratio,
    "same_tokens": same,
    "per_round": res,
}
out.write_text(json.dumps(d, indent=1))
for k in res:
    print(
        f"{k:22s} median {d['tok_s_median'][k]:7.1f}  best {d['tok_s_best'][k]:7.1f}  ratio {ratio[k]:.2f}x  same {same[k]}"
    )
print("load", load0, os.getloadavg(), "threads", torch.get_num_threads())
