"""`python -m benchmarks.serve_policy`: the inputs of `serve --parallel`'s MTP choice (issue 45): while several slots
decode, draft per slot inside the batched verify, or decode them without drafts?

On the checkpoint `quantkit bench serve --clients` serves (quantkit/bench/serve_checkpoint.py unless --model), in
alternated rounds: `Model.step_batch` over B = 1..MAX_ROWS rows (one token each, every row its own cache), a 2-token
verify of one row (`forward(..., keep_positions=True)`, what one draft costs to check) and a prefill chunk
(PREFILL_CHUNK tokens, the unit the long-prompt bound of `bench serve --clients` counts). The acceptance comes from
reports/bench-mtp.md (the trained MTP layer, quantized; the oracle rows' decode speed at that acceptance gives one
draft's cost beside a step). At S slots, without drafts: S tokens per step_batch(S). Drafting one token per slot
inside a batched verify (not built yet: estimated): each row's verify holds 2 tokens, so one verify costs about a
step_batch of 2S rows (the same token rows through the same matrices, the experts of all of them read once) plus
S drafts, and yields S (1 + acceptance) tokens. Writes reports/bench-serve-policy.json and a section of
reports/bench-serve.md.
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.cli import command_line, guard_reports, run_command, shared, write_json
from benchmarks.cli import threads as check_threads
from quantkit.bench import write_section
from quantkit.bench.machine import machine_info

SECTION = ("<!-- serve policy: begin -->", "<!-- serve policy: end -->")
MAX_ROWS = 8
PREFILL_CHUNK = 512
SLOTS = (2, 4)
# From reports/bench-mtp.md: the trained MTP layer's acceptance with one draft, quantized ("A trained MTP layer");
# the realistic-shape decode speed with one draft at that acceptance against no drafts (its oracle rows
# interpolated, as that report does); a 2-token verify against one step.
ACCEPTANCE = 0.85
ONE_DRAFT_SPEEDUP = 1.52
VERIFY_2_STEPS = 1.10
# a verify yields 1 + ACCEPTANCE tokens in (1 + ACCEPTANCE) / ONE_DRAFT_SPEEDUP steps, of which the verify is
# VERIFY_2_STEPS: the rest is the draft's cost
DRAFT_STEPS = (1 + ACCEPTANCE) / ONE_DRAFT_SPEEDUP - VERIFY_2_STEPS


def measure(model_dir: Path, n_threads: int, rounds: int, prompt: int = 32) -> dict[str, Any]:
    """Best and median seconds of step_batch(B) for B = 1..MAX_ROWS, a 2-token verify and a prefill chunk,
    alternated (the best: what it costs when no other work takes the cores, as the rounds share them); on a
    worker thread as the server steps its slots (torch's pool behaves otherwise on the main thread when the machine
    is shared)."""
    out: dict[str, Any] = {}
    errors: list[BaseException] = []

    def work() -> None:
        try:
            out.update(_measure(model_dir, n_threads, rounds, prompt))
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            errors.append(e)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    if errors:
        raise errors[0]
    return out


def _measure(model_dir: Path, n_threads: int, rounds: int, prompt: int) -> dict[str, Any]:
    import torch

    from quantkit.runtime import load_model

    torch.set_num_threads(n_threads)
    rt = load_model(model_dir, verify="quick")
    m = rt.model
    g = torch.Generator().manual_seed(0)
    vocab = 200_000
    ids = torch.randint(0, vocab, (MAX_ROWS, prompt), generator=g).tolist()
    chunk = torch.randint(0, vocab, (PREFILL_CHUNK,), generator=g).tolist()
    times: dict[str, list[float]] = {}
    with torch.inference_mode():
        caches = []
        for row in ids:
            c = m.new_cache(prompt + rounds + 8)
            m.forward(row, c)
            caches.append(c)
        one = m.new_cache(prompt + 8)
        m.forward(ids[0], one)
        n0 = one.n
        for r in range(rounds + 1):  # the first round warms the kernels up and is not kept
            for b in range(1, MAX_ROWS + 1):
                batch = caches[:b]
                for c in batch:
                    c.n = prompt  # every round steps from the same position
                t0 = time.perf_counter()
                m.step_batch([ids[j][-1] for j in range(b)], batch)
                if r:
                    times.setdefault(f"step_batch_{b}", []).append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            m.forward([ids[0][-1], ids[1][-1]], one, all_logits=True, keep_positions=True)
            if r:
                times.setdefault("verify_2", []).append(time.perf_counter() - t0)
            one.rewind(n0 + 1)
            one.n = n0
            fresh = m.new_cache(PREFILL_CHUNK + 8)
            t0 = time.perf_counter()
            m.forward(chunk, fresh)
            if r:
                times.setdefault("prefill_chunk", []).append(time.perf_counter() - t0)
            del fresh
    return {"route": rt.route()["name"], "best_s": {k: min(v) for k, v in times.items()},
            "median_s": {k: statistics.median(v) for k, v in times.items()},
            "samples": {k: len(v) for k, v in times.items()}}


def policies(med: dict[str, float]) -> list[dict[str, Any]]:
    """Tokens/s of each policy at SLOTS slots from the times `med` (module docstring)."""
    step1 = med["step_batch_1"]
    out = []
    for s in SLOTS:
        plain = s / med[f"step_batch_{s}"]
        verify = med.get(f"step_batch_{2 * s}")
        draft = s * (1 + ACCEPTANCE) / (verify + s * DRAFT_STEPS * step1) if verify else None
        out.append({"slots": s, "no_drafts_tok_s": plain, "drafts_tok_s": draft,
                    "better": None if draft is None else "drafts" if draft > plain else "no drafts"})
    return out


def write_report(reports: Path, d: dict[str, Any]) -> None:
    write_json(reports / "bench-serve-policy.json", d)
    med, m = d["measured"]["best_s"], d["machine"]
    ms = [f"{med[f'step_batch_{b}'] * 1000:.1f}" for b in range(1, MAX_ROWS + 1)]
    mid = [f"{d['measured']['median_s'][f'step_batch_{b}'] * 1000:.1f}" for b in range(1, MAX_ROWS + 1)]
    lines = [SECTION[0], "## MTP while several slots decode: the measured inputs", "",
             f"Command: `{d['command']}`. Machine: {m.get('cpu', '?')}, {m.get('logical_cores', '?')} logical cores, "
             f"{d['threads']} threads, load average at start {m.get('load_avg_at_start')}, at end {d['load_avg_at_end']} "
             f"(above the core count, other work shared the machine). Model: `{d['model']}`, route "
             f"{d['measured']['route']}; the best of {d['rounds']} alternated rounds (the medians beside it show the "
             "load).", "",
             "| rows B | " + " | ".join(str(b) for b in range(1, MAX_ROWS + 1)) + " |",
             "|---|" + "---:|" * MAX_ROWS,
             "| `step_batch` ms, best | " + " | ".join(ms) + " |",
             "| `step_batch` ms, median | " + " | ".join(mid) + " |",
             "| tokens/s (B / time) | " + " | ".join(f"{b / med[f'step_batch_{b}']:.1f}"
                                                   for b in range(1, MAX_ROWS + 1)) + " |", "",
             f"A 2-token verify of one row: {med['verify_2'] * 1000:.1f} ms ({med['verify_2'] / med['step_batch_1']:.2f}x "
             f"one step); a prefill chunk of {PREFILL_CHUNK} tokens: {med['prefill_chunk'] * 1000:.0f} ms. Acceptance "
             f"{ACCEPTANCE} (reports/bench-mtp.md, the trained layer quantized, one draft); a draft costs "
             f"{DRAFT_STEPS:.2f} of a step (from that report's realistic-shape rows).", "",
             "| slots | no drafts tok/s | drafting per slot in the batched verify, tok/s (estimated) | better |",
             "|---:|---:|---:|---|"]
    for p in d["policies"]:
        drafts = "-" if p["drafts_tok_s"] is None else f"{p['drafts_tok_s']:.1f}"
        lines.append(f"| {p['slots']} | {p['no_drafts_tok_s']:.1f} | {drafts} | {p['better'] or '-'} |")
    lines += ["", "The estimate: at S slots a verify carries 2 tokens a row, costed as `step_batch` of 2S rows, plus S "
              "drafts; it yields S x (1 + acceptance) tokens. Without drafts: S tokens per `step_batch` of S rows.",
              SECTION[1]]
    write_section(reports / "bench-serve.md", "\n".join(lines) + "\n", SECTION)


def cli(
    reports: Path = shared("reports", Path("reports")),
    workdir: Path = shared("workdir", Path("/tmp/quantkit-bench-serve")),
    model: Path = shared("model", None),
    threads: int = shared("threads", None),
    rounds: int = shared("rounds", 10),
) -> None:
    """Time step_batch for 1..8 rows, a 2-token verify and a prefill chunk; the tok/s each MTP policy gives at 2
    and 4 slots. Writes bench-serve-policy.json and its section of bench-serve.md."""
    guard_reports(reports, "serve-policy")
    n = check_threads(threads)
    if model is None:
        from quantkit.bench.serve_checkpoint import prepare

        model = prepare(workdir, print)
    d: dict[str, Any] = {"command": command_line("serve_policy", sys.argv[1:]), "machine": machine_info(),
                         "model": str(model), "threads": n, "rounds": rounds}
    d["measured"] = measure(model, n, rounds)
    d["policies"] = policies(d["measured"]["best_s"])
    d["acceptance"], d["draft_steps"] = ACCEPTANCE, DRAFT_STEPS
    d["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    write_report(reports, d)
    for p in d["policies"]:
        print(f"{p['slots']} slots: no drafts {p['no_drafts_tok_s']:.1f} tok/s, drafts {p['drafts_tok_s']:.1f} tok/s")
    print(f"wrote {reports / 'bench-serve.md'}")


def main(argv: list[str] | None = None) -> int:
    return run_command(cli, argv, "serve_policy")


if __name__ == "__main__":
    sys.exit(main())
