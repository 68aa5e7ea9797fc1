"""`python -m benchmarks.step_rows --peer /work/main`: what one `Model.step_batch` of B rows costs, B in ROWS, in
this checkout and in a peer checkout (another tree of quantkit: main before a change), alternated in one run.

Each tree runs in its own process (benchmarks/step_rows_worker.py with that tree's root on PYTHONPATH: its own
Python code and its own CPU kernel, built from its own sources), both on the checkpoint `quantkit bench serve
--clients` serves (quantkit/bench/serve_checkpoint.py unless --model), every row its own cache. Per round, per B,
one step in each tree, which tree goes first alternating; the first round warms up and is not kept. The two trees'
logits are compared by digest at every step: a change of speed only must leave every bit where it was.
Writes reports/bench-step-rows.json and the measured section of bench-step-rows.md: per tree and B the best, median
and slowest step, tokens per second (B / best) and the ratio of a step of B rows to a step of 4.
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
from quantkit.bench import write_section
from quantkit.fileio import write_atomic

ROWS = (1, 2, 4, 5, 6, 8, 12, 16)
SECTION = ("<!-- step rows: begin -->", "<!-- step rows: end -->")
PROMPT = 32
WORKER = Path(__file__).with_name("step_rows_worker.py")


def measure(trees: dict[str, str], model: str, n_threads: int, rounds: int) -> dict[str, Any]:
    args = [model, str(n_threads), str(max(ROWS)), str(PROMPT)]
    workers = [Worker(name, Path(root), WORKER, args) for name, root in trees.items()]
    times: dict[str, dict[int, list[float]]] = {w.name: {b: [] for b in ROWS} for w in workers}
    differ: list[str] = []
    try:
        for r in range(rounds + 1):
            for i, b in enumerate(ROWS):
                order = workers if (r + i) % 2 == 0 else workers[::-1]
                got = {w.name: w.ask(str(b)) for w in order}
                if len({g["digest"] for g in got.values()}) > 1:
                    differ.append(f"round {r}, {b} rows")
                if r:
                    for name, g in got.items():
                        times[name][b].append(g["s"])
            print(f"round {r}: " + ", ".join(f"{w.name} {b} rows {times[w.name][b][-1] * 1e3:.1f} ms"
                                              for w in workers for b in (4, 8) if r), flush=True)
    finally:
        for w in workers:
            w.close()
    return {"routes": {w.name: w.route for w in workers}, "logits_differ": differ,
            "seconds": {name: {str(b): v for b, v in t.items()} for name, t in times.items()}}


def summary(seconds: dict[str, list[float]]) -> dict[str, Any]:
    best = {b: min(v) for b, v in seconds.items()}
    return {"best_ms": {b: round(v * 1e3, 2) for b, v in best.items()},
            "median_ms": {b: round(statistics.median(v) * 1e3, 2) for b, v in seconds.items()},
            "slowest_ms": {b: round(max(v) * 1e3, 2) for b, v in seconds.items()},
            "tok_s": {b: round(int(b) / v, 1) for b, v in best.items()},
            "vs_4_rows": {b: round(v / best["4"], 2) for b, v in best.items()}}


def write_report(reports: Path, d: dict[str, Any]) -> None:
    """bench-step-rows.json, and the measured section of bench-step-rows.md (the text around it is kept)."""
    write_json(reports / "bench-step-rows.json", d)
    m = d["machine"]
    lines = [SECTION[0], "## The measured run", "",
             f"Command: `{d['command']}`. Machine: {m.get('cpu', '?')}, {m.get('logical_cores', '?')} logical cores, "
             f"{d['threads']} threads, load average at start {m.get('load_avg_at_start')}, at end "
             f"{d['load_avg_at_end']} (above the core count, other work shared the machine). Model: `{d['model']}`. "
             f"{d['rounds']} rounds, each B stepped once per tree per round, the trees' order alternating.", "",
             "Trees: " + ", ".join(f"{k} = `{v}` (route {d['routes'][k]})" for k, v in d["trees"].items()) + ". Logits of "
             "the two trees at every step: " + ("the same bits." if not d["logits_differ"] else
                                                 f"DIFFERENT at {', '.join(d['logits_differ'][:8])}."), ""]
    lines += ["| tree | rows B | " + " | ".join(str(b) for b in ROWS) + " |", "|---|---|" + "---:|" * len(ROWS)]
    for name, s in d["summary"].items():
        for key, label in (("best_ms", "ms, best"), ("median_ms", "ms, median"), ("slowest_ms", "ms, slowest"),
                           ("tok_s", "tokens/s (B / best)"), ("vs_4_rows", "best / best of 4 rows")):
            lines.append(f"| {name} | {label} | " + " | ".join(str(s[key][str(b)]) for b in ROWS) + " |")
    md = reports / "bench-step-rows.md"
    if not md.is_file():
        write_atomic(md, "# One decode step of B rows: this tree against its peer\n\n")
    write_section(md, "\n".join([*lines, SECTION[1]]) + "\n", SECTION)


def cli(
    peer: Path = typer.Option(..., "--peer", help="the other quantkit checkout (its root), e.g. main's"),
    reports: Path = shared("reports", Path("reports")),
    workdir: Path = shared("workdir", Path("/tmp/quantkit-bench-serve")),
    model: Path = shared("model", None),
    threads: int = shared("threads", None),
    rounds: int = shared("rounds", 10),
) -> None:
    """Time step_batch of 1..16 rows in this checkout and in --peer, alternated; writes bench-step-rows.{md,json}."""
    d = start("step_rows", peer, reports, workdir, model, threads, rounds)
    d.update(measure(d["trees"], d["model"], d["threads"], rounds))
    d["summary"] = {name: summary(s) for name, s in d["seconds"].items()}
    d["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    write_report(reports, d)
    for name, s in d["summary"].items():
        print(f"{name}: " + ", ".join(f"{b} rows {s['best_ms'][str(b)]} ms" for b in ROWS))
    print(f"wrote {reports / 'bench-step-rows.md'}")


def main(argv: list[str] | None = None) -> int:
    return run_command(cli, argv, "step_rows")


if __name__ == "__main__":
    sys.exit(main())
