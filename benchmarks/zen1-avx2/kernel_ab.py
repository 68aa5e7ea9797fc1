"""One side of an A/B of two kernel builds on the realistic-shape MTP checkpoint: a decode step's and 2-4 token
verifies' median seconds, and greedy decode tok/s without drafts and with the oracle drafter (1 and 2 drafts at
acceptance 0.88), as `python -m benchmarks.mtp` measures them. Run it from each checkout in turn, alternating:

    PYTHONPATH=<checkout> python benchmarks/zen1-avx2/kernel_ab.py OUT.json LABEL [THREADS]

(the checkpoint is the one `python -m benchmarks.mtp --workdir /tmp/quantkit-bench-28` writes)."""

import json
import sys
from pathlib import Path

import torch

import quantkit
from benchmarks.mtp import OracleDrafter, decode, verify_costs
from quantkit.kernels import cpu as cpu_kernel
from quantkit.recipe import build_recipe
from quantkit.runtime import load_model

out, label = Path(sys.argv[1]), sys.argv[2]
torch.set_num_threads(int(sys.argv[3]) if len(sys.argv) > 3 else 2)
src = Path("/tmp/quantkit-bench-28/realistic-mtp-4x64-v248320")
rt = load_model(src, recipe=build_recipe().name, verify="quick")
g = torch.Generator().manual_seed(0)
prompt = torch.randint(0, 700, (64,), generator=g).tolist()
real = rt.model.mtp.draft
row = {"label": label, "source": str(Path(quantkit.__file__).parent), "kernel": cpu_kernel.module().__file__,
       "threads": torch.get_num_threads()}
row["plain_tok_s"], ref, _ = decode(rt, prompt, 96, 0, 2)
for k in (1, 2):
    rt.model.mtp.draft = OracleDrafter(real, prompt + ref, 0.88, seed=0)
    tps, toks, stats = decode(rt, prompt, 96, k, 2)
    row[f"mtp{k}_tok_s"], row[f"mtp{k}_same"] = tps, toks == ref
rt.model.mtp.draft = real
rt.set_mtp(0)
row["verify_s"] = verify_costs(rt, prompt, 20)
runs = json.loads(out.read_text()) if out.exists() else []
out.write_text(json.dumps([*runs, row], indent=1) + "\n")
print(json.dumps(row))
