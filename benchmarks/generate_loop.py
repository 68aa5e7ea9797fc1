"""`python -m benchmarks.generate_loop --peer /work/before`: one generation alone (`generate`, `chat`) in this
checkout and in a peer checkout (main before a change), alternated in one run: issue 52's "single-stream decode
and prefill not below today's" for the change that made a generation the batch engine's one-row case.

Each tree runs in its own process (benchmarks/generate_loop_worker.py with that tree's root on PYTHONPATH), both on
the checkpoint `quantkit bench serve --clients` serves (quantkit/bench/serve_checkpoint.py unless --model), MTP
and the prompt cache off. Per round one greedy generation in each tree (the order alternating; the first round
warms up and is not kept): time to the first token, prompt tok/s and decode tok/s as the response counts them; the
two trees' tokens are compared at every round. Writes reports/bench-generate-loop.{md,json}.
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path
from typing import Any

import typer

from benchmarks.cli import run_command, shared, write_json
from benchmarks.peer import Worker, start
from quantkit.fileio import write_atomic

PROMPT = 512
NEW = 48
WORKER = Path(__file__).with_name("generate_loop_worker.py")
FIGURES = ("ttft", "prompt_tps", "decode_tps")


def measure(trees: dict[str, str], model: str, n_threads: int, rounds: int) -> dict[str, Any]:
    args = [model, str(n_threads), str(PROMPT), str(NEW)]
    workers = [Worker(name, Path(root), WORKER, args) for name, root in trees.items()]
    runs: dict[str, list[dict[str, Any]]] = {w.name: [] for w in workers}
    differ: list[int] = []
    try:
        for r in range(rounds + 1):
            order = workers if r % 2 == 0 else workers[::-1]
            got = {w.name: w.ask(str(r)) for w in order}
            if len({g["digest"] for g in got.values()}) > 1:
                differ.append(r)
            if r:
                for name, g in got.items():
                    runs[name].append(g)
                print(f"round {r}: " + ", ".join(f"{n} decode {g['decode_tps']:.1f} tok/s, first token "
                                                 f"{g['ttft'] * 1e3:.0f} ms" for n, g in got.items()), flush=True)
    finally:
        for w in workers:
            w.close()
    return {"routes": {w.name: w.route for w in workers}, "tokens_differ_in_rounds": differ, "runs": runs}


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per figure the best (least time, most tok/s) and the median of the rounds."""
    out: dict[str, Any] = {}
    for f in FIGURES:
        xs = [g[f] for g in runs]
        out[f] = {"best": min(xs) if f == "ttft" else max(xs), "median": statistics.median(xs)}
    return out


def write_report(reports: Path, d: dict[str, Any]) -> None:
    write_json(reports / "bench-generate-loop.json", d)
    m, s = d["machine"], d["summary"]
    lines = ["# One generation alone: this tree against its peer", "",
             f"Command: `{d['command']}`. Machine: {m.get('cpu', '?')}, {m.get('logical_cores', '?')} logical cores, "
             f"{d['threads']} threads, load average at start {m.get('load_avg_at_start')}, at end "
             f"{d['load_avg_at_end']}. Model: `{d['model']}`. {d['rounds']} rounds (one warm-up before them), one "
             f"greedy generation of {NEW} tokens after a {PROMPT + 1}-token prompt per tree per round, the trees' order "
             "alternating; MTP and the prompt cache off.", "",
             "Trees: " + ", ".join(f"{k} = `{v}` (route {d['routes'][k]})" for k, v in d["trees"].items()) + ". Tokens "
             "of the two trees: " + ("the same in every round." if not d["tokens_differ_in_rounds"] else
                                     f"DIFFERENT in rounds {d['tokens_differ_in_rounds']}."), "",
             "| tree | first token ms (best / median) | prompt tok/s (best / median) | decode tok/s (best / median) |",
             "|---|---:|---:|---:|"]
    for name, x in s.items():
        lines.append(f"| {name} | {x['ttft']['best'] * 1e3:.0f} / {x['ttft']['median'] * 1e3:.0f} | "
                     f"{x['prompt_tps']['best']:.1f} / {x['prompt_tps']['median']:.1f} | "
                     f"{x['decode_tps']['best']:.1f} / {x['decode_tps']['median']:.1f} |")
    this, peer = s["this"], s["peer"]
    lines += ["", "This tree / its peer, best against best: decode "
              f"{this['decode_tps']['best'] / peer['decode_tps']['best']:.3f}x, prompt "
              f"{this['prompt_tps']['best'] / peer['prompt_tps']['best']:.3f}x, first token "
              f"{this['ttft']['best'] / peer['ttft']['best']:.3f}x the time; medians: decode "
              f"{this['decode_tps']['median'] / peer['decode_tps']['median']:.3f}x, prompt "
              f"{this['prompt_tps']['median'] / peer['prompt_tps']['median']:.3f}x, first token "
              f"{this['ttft']['median'] / peer['ttft']['median']:.3f}x the time.", ""]
    write_atomic(reports / "bench-generate-loop.md", "\n".join(lines))


def cli(
    peer: Path = typer.Option(..., "--peer", help="the other quantkit checkout (its root), e.g. main's"),
    reports: Path = shared("reports", Path("reports")),
    workdir: Path = shared("workdir", Path("/tmp/quantkit-bench-serve")),
    model: Path = shared("model", None),
    threads: int = shared("threads", None),
    rounds: int = shared("rounds", 8),
) -> None:
    """Time one generation in this checkout and in --peer, alternated; writes bench-generate-loop.{md,json}."""
    d = start("generate_loop", peer, reports, workdir, model, threads, rounds)
    d.update(measure(d["trees"], d["model"], d["threads"], rounds))
    d["summary"] = {name: summary(r) for name, r in d["runs"].items()}
    d["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    write_report(reports, d)
    print(f"wrote {reports / 'bench-generate-loop.md'}")


def main(argv: list[str] | None = None) -> int:
    return run_command(cli, argv, "generate_loop")


if __name__ == "__main__":
    sys.exit(main())
