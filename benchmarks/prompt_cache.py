"""`python -m benchmarks.prompt_cache`: time to first token of a long prompt after a restart, cold against
restored from `--prompt-cache-dir` (quantkit/runtime/prompt_disk.py), on the realistic shape, quantized.

For each prompt length and kind (a chat prompt: an agent's system prompt of tool logs and a question, rendered
by the chat template; a raw prompt: the same text as /v1/completions sends it): `cold` runs with an empty cache
folder (it prefills everything, then writes its snapshots), then a restart restores the longest cached prefix
from the folder and prefills the rest. By default one process loads the model once and a restart is a new prompt
cache and a new disk store (its index read again from the files' headers, nothing in memory): what a restarted
process does after its load, which is not in the TTFT either way. `--processes` runs each in a fresh process
instead (each loads the model). TTFT is measured from the request to its first token; greedy, so restored and
cold must give the same tokens.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.cli import child_env
from quantkit.bench import write_reports
from quantkit.bench.engines import DEFAULTS, describe_machine, prepare

LENGTHS = (2048, 16384)
KINDS = ("chat", "raw")
NEW_TOKENS = 8


def corpus(n_lines: int) -> str:
    """Tool logs an agent accumulates (deterministic)."""
    verbs = ["GET", "POST", "PUT", "DELETE"]
    return "\n".join(f"[{i:05d}] {verbs[i % 4]} /api/v2/items/{i * 7919 % 100003}?page={i % 37} -> "
                     f"{200 if i % 11 else 404} in {i * 31 % 997} ms (worker {i % 13}, cache {'hit' if i % 3 else 'miss'})"
                     for i in range(n_lines))


def prompt_ids(rt: Any, kind: str, tokens: int) -> list[int]:
    """A prompt of about `tokens` tokens (exactly that many for a raw one)."""
    per_line = len(rt.encode(corpus(64))) / 64
    if kind == "raw":
        return rt.encode(corpus(int(tokens / per_line) + 2))[:tokens]
    text = corpus(max(1, int((tokens - 40) / per_line)))
    return rt.render_ids([{"role": "system", "content": "You are the terminal of an agent's machine. Logs:\n" + text},
                          {"role": "user", "content": "$ grep -c 404 access.log"}], enable_thinking=False)[1]


def worker(qdir: str, kind: str, tokens: int, cache_dir: str | None, context: int, rt: Any = None) -> dict[str, Any]:
    """One run (a restart): load (unless `rt` is given), a new prompt cache on `cache_dir`, then one greedy
    request, timed to its first token."""
    from quantkit.runtime import SamplingParams, load_model

    t0 = time.perf_counter()
    rt = rt or load_model(Path(qdir), context=context)
    rt.set_prompt_cache(1 << 30 if cache_dir is not None else 0, Path(cache_dir) if cache_dir else None,
                        8 << 30 if cache_dir is not None else None)
    load_s = time.perf_counter() - t0
    ids = prompt_ids(rt, kind, tokens)
    sp = SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS)
    t0 = time.perf_counter()
    ttft, resp = None, None
    for e in rt.generate_ids(ids, sp, thinking=False):
        if ttft is None:
            ttft = time.perf_counter() - t0
        resp = e.response or resp
    t_write = time.perf_counter()
    rt.prompt_cache.flush()
    summary = rt.prompt_cache.summary()
    return {"load_s": load_s, "prompt_tokens": len(ids), "ttft_s": ttft, "cached_tokens": resp.cached_tokens,
            "tokens": resp.token_ids, "total_s": t_write - t0,
            "disk": summary.get("disk")}


def _run_worker(qdir: Path, kind: str, tokens: int, cache_dir: Path | None, context: int, threads: int) -> dict:
    args = json.dumps([str(qdir), kind, tokens, str(cache_dir) if cache_dir else None, context])
    env = {**child_env(), "OMP_NUM_THREADS": str(threads)}
    r = subprocess.run([sys.executable, "-m", "benchmarks.prompt_cache", "--worker", args], capture_output=True,
                       text=True, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"bench worker failed: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def run(reports: Path, workdir: Path, lengths: tuple[int, ...] = LENGTHS, kinds: tuple[str, ...] = KINDS,
        layers: int = DEFAULTS["layers"], experts: int = DEFAULTS["experts"], top_k: int = DEFAULTS["top_k"],
        vocab: int = DEFAULTS["vocab"], threads: int | None = None, log: Any = print,
        command: str = "", processes: bool = False) -> dict[str, Any]:
    t_start = time.perf_counter()
    threads = threads or os.cpu_count() or 1
    machine = describe_machine()
    checkpoint, qdir = prepare(workdir, layers, experts, top_k, vocab, None, log)
    context = max(lengths) + 1024
    rt = None
    if not processes:
        import torch

        from quantkit.runtime import load_model

        torch.set_num_threads(threads)
        rt = load_model(qdir, context=context)
    rows: list[dict[str, Any]] = []

    def report() -> dict[str, Any]:
        cfg = json.loads((checkpoint / "config.json").read_text())
        tc = cfg.get("text_config", cfg)
        big = [r for r in rows if r["prompt_tokens"] >= 16000]
        checks = {"restored and cold give the same greedy tokens": all(r["same_tokens"] for r in rows),
                  "the cold runs restored nothing": all(r["cold_cached_tokens"] == 0 for r in rows),
                  "restored TTFT of the 16k prompts <= 0.1x cold": bool(big) and all(r["ratio"] <= 0.1 for r in big)}
        data = {"command": command or "python -m benchmarks.prompt_cache", "machine": machine, "threads": threads,
                "restart": "fresh processes" if processes else "a new prompt cache and disk store in the loaded process",
                "checkpoint": str(checkpoint), "quantized": str(qdir),
                "shape": {"layers": tc["num_hidden_layers"], "experts": tc["num_experts"],
                          "top_k": tc["num_experts_per_tok"], "hidden": tc["hidden_size"], "vocab": tc["vocab_size"]},
                "rows": rows, "checks": checks, "load_avg_at_end": os.getloadavg()[0],
                "seconds": time.perf_counter() - t_start}
        write_reports(reports, "bench-prompt-cache", data, render(data))
        return data

    for kind in kinds:
        for n in lengths:
            folder = workdir / f"prompt-cache-{kind}-{n}"
            shutil.rmtree(folder, ignore_errors=True)
            if processes:
                cold = _run_worker(qdir, kind, n, folder, context, threads)
                restored = _run_worker(qdir, kind, n, folder, context, threads)
            else:
                cold = worker(str(qdir), kind, n, str(folder), context, rt)
                restored = worker(str(qdir), kind, n, str(folder), context, rt)
            row = {"kind": kind, "prompt_tokens": cold["prompt_tokens"], "cold_ttft_s": cold["ttft_s"],
                   "restored_ttft_s": restored["ttft_s"], "cold_cached_tokens": cold["cached_tokens"],
                   "restored_cached_tokens": restored["cached_tokens"],
                   "restore_s": restored["disk"]["last_restore_seconds"], "disk_bytes": restored["disk"]["bytes"],
                   "write_s_after_answer": cold["total_s"] - cold["ttft_s"],
                   "ratio": restored["ttft_s"] / cold["ttft_s"],
                   "same_tokens": cold["tokens"] == restored["tokens"], "tokens": cold["tokens"]}
            rows.append(row)
            log(f"{kind} {row['prompt_tokens']} tokens: cold {cold['ttft_s']:.2f} s, restored "
                f"{restored['ttft_s']:.3f} s ({row['ratio']:.3f}x, {row['restored_cached_tokens']} tokens from disk "
                f"in {row['restore_s']:.3f} s), same tokens: {row['same_tokens']}")
            report()  # what is measured so far, in case a long row does not finish
    return report()


def render(d: dict[str, Any]) -> str:
    m, s = d["machine"], d["shape"]
    out = ["# Prompt cache across a restart: time to first token, cold against restored from disk", "",
           f"Command: `{d['command']}`", "",
           f"Machine: {m['cpu']}, {m['cores']} cores ({d['threads']} threads used), {m['ram_gb']} GB RAM, torch "
           f"{m['torch']}, CPU kernel {m['isa']}; load average {m['load_avg_at_start']:.1f} at the start, "
           f"{d['load_avg_at_end']:.1f} at the end (a shared machine: timings move with it).", "",
           f"Checkpoint: the realistic shape (`quantkit tiny-model --realistic`: hidden {s['hidden']}, "
           f"{s['layers']} layers, {s['experts']} experts top-{s['top_k']}, vocab {s['vocab']:,}) quantized "
           "(experts int4 g32, the rest int8).", "",
           "Each row, on one `--prompt-cache-dir`: cold (an empty folder: prefills all, then writes its snapshots) "
           f"and restored after a restart ({d['restart']}: nothing in memory, the longest cached prefix read from "
           "disk, the rest prefilled). TTFT from the request to the first token (a model load is not in it); "
           f"greedy, {NEW_TOKENS} tokens.", "",
           "| prompt | tokens | cold TTFT (s) | restored TTFT (s) | restored / cold | from disk (tokens) | "
           "restore (s) | disk (MB) | same tokens |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in d["rows"]:
        out.append(f"| {r['kind']} | {r['prompt_tokens']:,} | {r['cold_ttft_s']:.2f} | {r['restored_ttft_s']:.3f} | "
                   f"{r['ratio']:.3f}x | {r['restored_cached_tokens']:,} | {r['restore_s']:.3f} | "
                   f"{r['disk_bytes'] / 1e6:.1f} | {'yes' if r['same_tokens'] else 'NO'} |")
    out += ["", "restore (s) = reading, checking and placing the state from disk (part of the restored TTFT). "
            "A chat prompt restores the state at "
            "the start of the generation prompt (a few tokens to prefill); a raw prompt the last checkpoint "
            "(every 512 tokens) before its end, so at most 512 tokens are prefilled (512 when its length is a "
            "multiple of 512). The cold run writes its "
            "snapshots after its answer (not in its TTFT).", "", "Checks:", ""]
    out += [f"- {'PASS' if ok else 'FAIL'}: {name}" for name, ok in d["checks"].items()]
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    import argparse

    if len(argv) == 2 and argv[0] == "--worker":
        print(json.dumps(worker(*json.loads(argv[1]))))
        return 0
    ap = argparse.ArgumentParser(prog="python -m benchmarks.prompt_cache", description=__doc__.split("\n\n")[0])
    ap.add_argument("--reports", type=Path, default=Path("reports"))
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/quantkit-bench-prompt-cache"))
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="prompt tokens, comma-separated")
    ap.add_argument("--kinds", default=",".join(KINDS), help="chat, raw or both")
    ap.add_argument("--experts", type=int, default=DEFAULTS["experts"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--processes", action="store_true", help="cold and restored each in a fresh process")
    a = ap.parse_args(argv)
    try:
        lengths = tuple(int(x) for x in a.lengths.split(",") if x.strip())
    except ValueError:
        ap.error(f"--lengths {a.lengths!r}: give token counts like 2048,16384")
    kinds = tuple(k.strip() for k in a.kinds.split(",") if k.strip())
    if not lengths or min(lengths) < 64 or not kinds or set(kinds) - set(KINDS):
        ap.error("--lengths: counts of at least 64; --kinds: chat, raw")
    d = run(a.reports, a.workdir, lengths, kinds, experts=a.experts, threads=a.threads, processes=a.processes,
            command="python -m benchmarks.prompt_cache " + " ".join(argv))
    print(f"wrote {a.reports / 'bench-prompt-cache.md'} ({d['seconds']:.0f} s)")
    return 0 if all(d["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
