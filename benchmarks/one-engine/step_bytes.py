"""`python benchmarks/one-engine/step_bytes.py [MODEL] --threads 2 --rounds 12 --out DIR`: what bounds a decode step
of B rows on this machine, on the checkpoint `quantkit bench serve --clients` serves.

Per B in ROWS: the bytes a step must read (the head, the dense matrices, the distinct routed experts that B rows
choose under uniform routing, each Gated DeltaNet state read and written), the step itself (`Model.step_batch`
over B caches prefilled with PROMPT random tokens; best and median of `rounds`), and the rate those bytes would
imply. Beside it: the machine's streaming read on 1 and on every thread (`read_bandwidth_gbs`), and the int8 head
alone at each B (`QKernel.rows`). Writes DIR/step-bytes.json; the markdown is written by hand from it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from quantkit.bench import read_bandwidth_gbs
from quantkit.bench.machine import machine_info
from quantkit.bench.serve_checkpoint import prepare
from quantkit.fileio import atomic_write_json
from quantkit.runtime import load_model
from quantkit.runtime.model.qwen3_5_moe import Attention, DeltaNet

ROWS = (1, 2, 4, 8, 16)
PROMPT = 32


def step_bytes(model) -> dict[str, float]:
    """Bytes of the head, of every layer's dense matrices and router, of one routed expert, of one row's states."""
    dense = expert = state = 0
    for L in model.layers:
        mix, moe = L.mixer, L.moe
        mats = [mix.q, mix.k, mix.v, mix.o] if isinstance(mix, Attention) else [mix.qkv, mix.z, mix.b, mix.a, mix.out]
        mats += [moe.shared_gate, moe.shared_up, moe.shared_down, moe.shared_sigmoid]
        dense += sum(k.nbytes for k in mats) + moe.router_w.numel() * moe.router_w.element_size()
        expert = moe.experts.nbytes / moe.experts.num_experts
        if isinstance(mix, DeltaNet):
            state += mix.hv * mix.dk * mix.dv * 4
    return {"head": model.head.nbytes, "dense": dense, "expert": expert, "state_per_row": state}


def expected(b: dict[str, float], rows: int, layers: int, experts: int, top_k: int) -> float:
    """Bytes one step of `rows` rows reads: each expert that any row picks once, each state read and written."""
    distinct = experts * (1 - (1 - top_k / experts) ** rows)
    return b["head"] + b["dense"] + layers * distinct * b["expert"] + 2 * rows * b["state_per_row"]


def best_of(fn, rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=None, help="a quantkit checkpoint (default: the bench's)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/agents-serve"))
    ap.add_argument("--out", type=Path, default=Path("reports/one-engine"))
    a = ap.parse_args()
    model = Path(a.model) if a.model else prepare(a.workdir)
    torch.set_num_threads(1)
    bw1 = read_bandwidth_gbs()
    torch.set_num_threads(a.threads)
    bw = read_bandwidth_gbs()
    rt = load_model(str(model), verify="quick")
    m = rt.model
    moe = m.layers[0].moe
    b = step_bytes(m)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, min(200_000, m.vocab), (max(ROWS), PROMPT), generator=g).tolist()
    rows = []
    with torch.inference_mode():
        caches = []
        for row in ids:
            c = m.new_cache(PROMPT + 8)
            m.forward(row, c)
            caches.append(c)
        for n in ROWS:
            def step(n: int = n) -> None:
                for c in caches[:n]:
                    c.n = PROMPT
                m.step_batch([ids[j][-1] for j in range(n)], caches[:n])

            step()
            s = best_of(step, a.rounds)
            x = torch.randn(n, m.cfg.text.hidden_size, dtype=torch.bfloat16)
            h = best_of(lambda x=x: m.head.rows(x), a.rounds)
            need = expected(b, n, len(m.layers), moe.experts.num_experts, moe.top_k)
            rows.append({"rows": n, "bytes": need, "step_best_s": min(s), "step_median_s": statistics.median(s),
                         "implied_gbs": need / min(s) / 1e9, "head_best_s": min(h),
                         "bytes_bound_s": need / (bw * 1e9)})
            print(json.dumps(rows[-1]), flush=True)
    out = {"command": " ".join(["python", *sys.argv]),
           "machine": machine_info(), "load_avg": os.getloadavg(), "model": str(model), "route": rt.route()["name"],
           "threads": a.threads, "read_gbs_1_thread": bw1, "read_gbs": bw, "bytes": b, "rows": rows}
    a.out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(a.out / "step-bytes.json", out)


if __name__ == "__main__":
    main()
