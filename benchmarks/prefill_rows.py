"""`python -m benchmarks.prefill_rows --model DIR`: one prompt chunk prefilled with the two arithmetics
(docs/engine.md "One forward"): the T-token path (`Model.forward`, transformers' eager arithmetic) against the row
arithmetic (`Model.forward_batch` of one "prefill" segment: each token as a decode step computes it), the chunk at
several depths of the cache, alternated in one process, best of --reps each. What `serve --prefill rows` gives up
on a lone prompt; the packing it gains is measured by `quantkit bench serve --agents/--burst --quantkit-args
"--prefill tokens"`. Prints one line per depth and writes reports/bench-prefill-rows.json (the machine, its
load before and after).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

from benchmarks.cli import command_line, guard_reports, run_command, shared, threads, write_json
from quantkit.bench.machine import machine_info
from quantkit.errors import QuantkitError

DEPTHS = (0, 2048, 3584)
CHUNK = 512


def cli(model: Path = shared("model", None), reps: int = shared("reps", 3),
        n_threads: int = shared("threads", None), reports: Path = shared("reports", Path("reports"))) -> None:
    """Prefill one chunk with the T-token and the row arithmetic at several depths, alternated."""
    if model is None:
        raise QuantkitError("--model: give the quantized checkpoint to time (e.g. the one `quantkit bench serve "
                            "--agents` serves)")
    guard_reports(reports, "prefill-rows")
    from quantkit.runtime import load_model
    from quantkit.runtime.model.cache import HybridCache
    from quantkit.runtime.model.qwen3_5_moe import Segment

    torch.set_num_threads(threads(n_threads))
    load_before = [round(x, 2) for x in os.getloadavg()]
    room = max(DEPTHS) + CHUNK
    rt = load_model(model, context=room)
    m = rt.model
    ids = torch.randint(1000, min(100_000, m.vocab), (room,), generator=torch.Generator().manual_seed(0)).tolist()
    rows = []
    with torch.inference_mode():
        for depth in DEPTHS:
            snap = None
            if depth:  # the prefix once, each run from a copy of its state
                c = m.new_cache(room)
                m.forward(ids[:depth], c)
                snap = c.snapshot(ids[:depth])
            times: dict[str, list[float]] = {"tokens": [], "rows": []}
            for _ in range(reps):
                for kind in times:
                    c = (m.new_cache(room) if snap is None
                         else HybridCache.from_snapshot(snap, m.cfg, m.layer_devices, m.dtype, room))
                    chunk = ids[depth:depth + CHUNK]
                    t0 = time.perf_counter()
                    if kind == "tokens":
                        m.forward(chunk, c)
                    else:
                        m.forward_batch([Segment(c, chunk, "prefill")])
                    times[kind].append(time.perf_counter() - t0)
            tok, row = CHUNK / min(times["tokens"]), CHUNK / min(times["rows"])
            rows.append({"depth": depth, "tokens_tps": round(tok, 1), "rows_tps": round(row, 1),
                         "rows_over_tokens": round(row / tok, 3)})
            print(f"depth {depth}: T-token {tok:.0f} tok/s, rows {row:.0f} tok/s, rows / T-token {row / tok:.2f}")
    write_json(reports / "bench-prefill-rows.json", {
        "command": command_line("prefill_rows", sys.argv[1:]), "machine": machine_info(), "chunk": CHUNK,
        "load_avg": {"before": load_before, "after": [round(x, 2) for x in os.getloadavg()]}, "rows": rows})


def main(argv: list[str] | None = None) -> int:
    return run_command(cli, argv, "prefill_rows")


if __name__ == "__main__":
    sys.exit(main())
