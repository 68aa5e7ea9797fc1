"""`python -m benchmarks.session`: a scripted AgentWorld session with a growing history, time to first token per
turn with and without quantkit's prompt cache, and llama.cpp on the same conversation.

The session: the `terminal` world's system prompt, then `turns` exchanges; each user message is an agent
action (a shell command) and each assistant message the recorded observation (a listing or log of about
`obs_tokens` tokens), so every engine sees the very same prompts. At each turn the whole history is
rendered by the chat template (thinking on: earlier thinking dropped, as clients resend it) and each engine
generates `new_tokens` greedy tokens:
- quantkit with reuse: the runtime's prompt cache (quantkit.runtime.state_cache) restores the longest cached
  prefix and prefills the rest;
- quantkit without reuse: the same runtime with the cache off (a full prefill every turn);
- llama.cpp (llama-cpp-python, on our GGUF `mixed` export of the same quantized weights: the experts' int4
  codes are copied as Q4_0): reset and evaluate the whole prompt, which is what llama.cpp does every turn
  for hybrid recurrent models (its KV cache can be truncated, a recurrent state cannot, so a changed tail
  means a full re-process; llama.cpp #20225, #21831).
The three are interleaved turn by turn so load from other work on the machine falls on all of them. Time
to first token = the call until the first token is known (prefill + first sampling), wall clock.
Checks: TTFT at the last turn within 1.5x of the first turn's and at least 5x below the re-prefill's, and
the same tokens with and without reuse. Writes reports/bench-session.{md,json,png}.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import typer

from benchmarks.cli import guard_reports, llama_option, run_command, shared
from benchmarks.cli import threads as resolve_threads
from quantkit.bench import write_reports
from quantkit.bench.engines import DEFAULTS, describe_machine, prepare
from quantkit.bench.llama_worker import last_logits, open_llama
from quantkit.cli.options import COUNT, count
from quantkit.export.gguf import export_gguf
from quantkit.runtime import SamplingParams, load_model
from quantkit.runtime.state_cache import PrefixCache
from quantkit.runtime.worlds import world_prompt

FILES = ["README.md", "setup.py", "src", "tests", "Makefile", "config.yaml", "data.csv", "notes.txt", "build", "docs"]
USERS = ["root", "agent", "www-data"]


def observation(turn: int, tokens: int, count: Any) -> str:
    """A terminal observation of about `tokens` tokens: a directory listing and log lines, varied per turn."""
    lines: list[str] = []
    i = 0
    while count("\n".join(lines)) < tokens:
        f = FILES[(turn * 3 + i) % len(FILES)]
        if i % 3 == 2:
            lines.append(f"[{10 + turn:02d}:{(i * 7) % 60:02d}:{(i * 13) % 60:02d}] worker-{i % 4} processed "
                         f"{f} ({(turn + 1) * (i + 3) * 17} bytes) status=ok")
        else:
            lines.append(f"-rw-r--r-- 1 {USERS[i % 3]} staff {(turn + 2) * (i + 5) * 31} Mar {1 + turn % 28} "
                         f"{(9 + i) % 24:02d}:{(turn * 11 + i) % 60:02d} {f}")
        i += 1
    return "<predicted_observation>\n" + "\n".join(lines) + "\n</predicted_observation>"


def actions(turns: int) -> list[str]:
    cmds = ["ls -la", "cat {f}", "grep -n error {f}", "tail -n 20 {f}", "wc -l {f}", "head {f}", "stat {f}"]
    return [f"$ {cmds[t % len(cmds)].format(f=FILES[t % len(FILES)])}" for t in range(turns)]


def prompts(rt: Any, turns: int, obs_tokens: int) -> list[list[int]]:
    """The token ids of each turn's prompt (the whole history, rendered as a client resends it)."""

    msgs: list[dict[str, Any]] = [{"role": "system", "content": world_prompt("terminal")}]
    out = []
    for t, act in enumerate(actions(turns)):
        msgs.append({"role": "user", "content": act})
        out.append(rt.render_ids(msgs)[1])
        msgs.append({"role": "assistant", "content": observation(t, obs_tokens, lambda s: len(rt.encode(s)))})
    return out


def quantkit_turn(rt: Any, ids: list[int], new_tokens: int) -> dict[str, Any]:

    sp = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
    t0 = time.perf_counter()
    ttft, resp = None, None
    for ev in rt.generate_ids(ids, sampling=sp, thinking=True, stop_ids=set()):
        if ttft is None:
            ttft = time.perf_counter() - t0
        resp = ev.response or resp
    assert resp is not None and ttft is not None
    return {"ttft_s": ttft, "prefilled": resp.prefilled_tokens, "reused": resp.cached_tokens,
            "tokens": list(resp.token_ids)}


def llama_turn(llm: Any, ids: list[int], new_tokens: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    llm.reset()
    llm.eval(ids)
    tok = int(np.argmax(last_logits(llm)))
    ttft = time.perf_counter() - t0
    toks = [tok]
    for _ in range(new_tokens - 1):
        llm.eval([tok])
        tok = int(np.argmax(last_logits(llm)))
        toks.append(tok)
    return {"ttft_s": ttft, "prefilled": len(ids), "reused": 0, "tokens": toks}


def run(reports: Path, workdir: Path, turns: int = 12, obs_tokens: int = 250, new_tokens: int = 8,
        layers: int = DEFAULTS["layers"], experts: int = DEFAULTS["experts"], top_k: int = DEFAULTS["top_k"],
        vocab: int = DEFAULTS["vocab"], checkpoint: Path | None = None, threads: int | None = None,
        llama: bool = True, baseline_every: int = 1, log: Any = print) -> dict[str, Any]:

    t_start = time.perf_counter()
    threads = threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    reports.mkdir(parents=True, exist_ok=True)
    machine = describe_machine()
    checkpoint, qdir = prepare(workdir, layers, experts, top_k, vocab, checkpoint, log)
    rt = load_model(qdir, context=32768)
    ids = prompts(rt, turns, obs_tokens)
    llm = None
    if llama:
        gguf = workdir / "session-mixed.gguf"
        if not gguf.is_file():
            log("exporting GGUF mixed")
            export_gguf(qdir, gguf, "mixed", overwrite=True)
        llm = open_llama(gguf, threads, len(ids[-1]) + new_tokens + 8, False)
    runs: dict[str, list[dict[str, Any]]] = {"reuse": [], "no_reuse": [], "llama.cpp": []}
    reuse_cache, off = PrefixCache(1 << 30), PrefixCache(0)
    # the re-prefilling runs (quantkit without reuse, llama.cpp) cost the whole history each turn: on a shared
    # machine they may be sampled every `baseline_every` turns (always the first and the last)
    sampled = {t for t in range(turns) if t % baseline_every == 0 or t == turns - 1}
    empty = {"ttft_s": None, "prefilled": None, "reused": None, "tokens": None}
    try:
        for t, p in enumerate(ids):
            rt.prompt_cache = off
            runs["no_reuse"].append(quantkit_turn(rt, p, new_tokens) if t in sampled else empty)
            rt.prompt_cache = reuse_cache
            runs["reuse"].append(quantkit_turn(rt, p, new_tokens))
            if llm is not None:
                runs["llama.cpp"].append(llama_turn(llm, p, new_tokens) if t in sampled else empty)
            log(f"turn {t + 1}/{turns}: {len(p)} tokens; TTFT reuse {runs['reuse'][-1]['ttft_s']:.2f} s "
                f"(prefilled {runs['reuse'][-1]['prefilled']})"
                + "".join(f", {k} {runs[k][-1]['ttft_s']:.2f} s" for k in ("no_reuse", "llama.cpp")
                          if runs[k] and runs[k][-1]["ttft_s"] is not None))
    finally:
        if llm is not None:
            llm.close()
    cache = reuse_cache.summary()
    reuse, full = runs["reuse"], runs["no_reuse"]
    checks = {
        "last-turn TTFT within 1.5x of the first turn's (reuse)": reuse[-1]["ttft_s"] <= 1.5 * reuse[0]["ttft_s"],
        "last-turn TTFT at least 5x below the re-prefill's": 5 * reuse[-1]["ttft_s"] <= full[-1]["ttft_s"],
        "same tokens with and without reuse, every turn measured both ways": all(
            a["tokens"] == b["tokens"] for a, b in zip(reuse, full, strict=True) if b["tokens"] is not None),
    }
    cfg = json.loads((checkpoint / "config.json").read_text())
    tc = cfg.get("text_config", cfg)
    data = {
        "command": f"python -m benchmarks.session --turns {turns} --obs-tokens {obs_tokens} --new-tokens {new_tokens} "
                   f"--baseline-every {baseline_every}"
                   + (f" --model {checkpoint}" if checkpoint.parent != workdir else
                      f" --layers {layers} --experts {experts}"),
        "machine": machine, "threads": threads, "checkpoint": str(checkpoint), "quantized": str(qdir),
        "shape": {"layers": tc["num_hidden_layers"], "experts": tc["num_experts"], "top_k": tc["num_experts_per_tok"],
                  "hidden": tc["hidden_size"], "vocab": tc["vocab_size"]},
        "turns": [{"turn": t + 1, "prompt_tokens": len(p),
                   **{f"{k}_{f}": runs[k][t][f] for k in runs if runs[k] for f in ("ttft_s", "prefilled", "reused")}}
                  for t, p in enumerate(ids)],
        "prompt_cache": cache, "checks": checks, "llama_cpp": llm is not None,
        "load_avg_at_end": os.getloadavg()[0],
        "seconds": time.perf_counter() - t_start,
    }
    write_reports(reports, "bench-session", data, render(data), indent=2)
    plot(data, reports / "bench-session.png")
    return data


def plot(d: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in (("no_reuse", "quantkit, full prefill each turn"), ("llama.cpp", "llama.cpp (re-processes)"),
                       ("reuse", "quantkit, prompt cache")):
        if f"{key}_ttft_s" in d["turns"][0]:
            pts = [(r["turn"], r[f"{key}_ttft_s"]) for r in d["turns"] if r[f"{key}_ttft_s"] is not None]
            ax.plot([a for a, _b in pts], [b for _a, b in pts], marker="o", label=label)
    ax.set_xlabel("turn")
    ax.set_ylabel("time to first token (s)")
    ax.set_title("Agent session: time to first token per turn")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def spread(d: dict[str, Any]) -> list[str]:
    """How much the reuse run's TTFT varied while its prefilled count stayed flat (a shared machine's noise)."""
    later = d["turns"][1:]
    t = [r["reuse_ttft_s"] for r in later]
    n = [r["reuse_prefilled"] for r in later]
    end = d.get("load_avg_at_end")
    return [f"Noise: from turn 2 on, the reuse run prefilled {min(n)}-{max(n)} tokens per turn and its TTFT ranged "
            f"{min(t):.2f}-{max(t):.2f} s; with the prefilled count flat, that spread is the machine's load (average "
            f"{d['machine']['load_avg_at_start']:.1f} at start" + (f", {end:.1f} at end" if end is not None else "")
            + " on 2 cores), so read each turn's ratios between engines measured back to back, not the absolute "
            "times.", ""]


def render(d: dict[str, Any]) -> str:
    m, s, rows = d["machine"], d["shape"], d["turns"]
    has_llama = d["llama_cpp"]
    first, last = rows[0], rows[-1]
    lines = [
        "# Agent session: time to first token per turn, with and without the prompt cache",
        "",
        f"Command: `{d['command']}` ({d['seconds']:.0f} s). Machine: {m['cpu']}, {m['cores']} cores, "
        f"{m['ram_gb']} GB RAM, torch {m['torch']}, {d['threads']} threads for every engine; load average at start "
        f"{m['load_avg_at_start']:.1f} (other work shares this machine; the engines run interleaved turn by turn, "
        "so compare ratios).",
        "",
        f"Checkpoint: realistic shapes (hidden {s['hidden']}, experts of 512, vocab {s['vocab']:,}) with "
        f"{s['layers']} layers and {s['experts']} experts, top-{s['top_k']}, random weights; quantkit runs its "
        "int4-g32 experts / int8 rest folder, llama.cpp our GGUF `mixed` export of it (the same expert bits). "
        "Session: the `terminal` world's system prompt, then per turn an agent action and a recorded observation "
        "of a few hundred tokens; the whole history is resent every turn. TTFT = prefill + first token.",
        "",
        "| turn | prompt tok | reuse: prefilled | reuse: TTFT s | no reuse: TTFT s | no reuse / reuse |"
        + (" llama.cpp: TTFT s | llama.cpp / reuse |" if has_llama else ""),
        "|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if has_llama else ""),
    ]
    def cells(r: dict[str, Any], key: str) -> str:
        t = r[f"{key}_ttft_s"]
        return " - | - |" if t is None else f" {t:.2f} | {t / r['reuse_ttft_s']:.1f}x |"

    for r in rows:
        line = (f"| {r['turn']} | {r['prompt_tokens']} | {r['reuse_prefilled']} | {r['reuse_ttft_s']:.2f} |"
                + cells(r, "no_reuse") + (cells(r, "llama.cpp") if has_llama else ""))
        lines.append(line)
    c = d["prompt_cache"]
    lines += [
        "",
        f"Last turn vs first (reuse): {last['reuse_ttft_s'] / first['reuse_ttft_s']:.2f}x; last turn, re-prefill vs "
        f"reuse: {last['no_reuse_ttft_s'] / last['reuse_ttft_s']:.1f}x"
        + (f"; llama.cpp vs reuse: {last['llama.cpp_ttft_s'] / last['reuse_ttft_s']:.1f}x" if has_llama else "")
        + f". Prompt cache at the end: {c['entries']} snapshots, {c['bytes'] / 1e6:.1f} MB, hit rate "
        f"{c['hit_rate']:.0%}.",
        "",
        *[f"- {'PASS' if ok else 'FAIL'}: {name}" for name, ok in d["checks"].items()],
        "",
        *spread(d),
        "Reading it: without reuse, each turn prefills the whole history, so TTFT grows with the conversation; "
        "llama.cpp does the same for this hybrid model (a recurrent state cannot be rolled back to where the "
        "re-rendered history departs from what it holds). With the prompt cache quantkit restores the state at "
        "the start of the last answer and prefills only the last observation, the new action and the generation "
        "prompt, so TTFT stays flat. The first turn prefills the system prompt too.",
        "",
        "![TTFT per turn](bench-session.png)",
        "",
    ]
    return "\n".join(lines)


def cli(
    reports: Path = shared("reports", Path("reports")),
    workdir: Path = shared("workdir", Path("/tmp/quantkit-bench")),
    layers: int = shared("layers", 4),
    experts: int = shared("experts", 64),
    threads: int = shared("threads", None),
    new_tokens: int = shared("new_tokens", 8),
    llama: bool = llama_option(True),
    model: Path = shared("model", None),
    turns: int = typer.Option(12, "--turns", parser=count(2), help="agent turns (action + observation) in the "
                              "session"),
    obs_tokens: int = typer.Option(250, "--obs-tokens", parser=COUNT, help="tokens of each recorded observation"),
    baseline_every: int = typer.Option(1, "--baseline-every", parser=COUNT, help="run the re-prefilling baselines "
                                       "(quantkit without reuse, llama.cpp) every N turns, and at the first and last"),
) -> None:
    """A multi-turn agent session: time to first token per turn with and without the prompt cache, and llama.cpp.

    --new-tokens: generated per turn; --model: a bf16 realistic-shape checkpoint instead of the generated one."""
    guard_reports(reports, "session")
    d = run(reports, workdir, turns, obs_tokens, new_tokens, layers, experts, checkpoint=model,
            threads=resolve_threads(threads), llama=llama, baseline_every=baseline_every)
    for name, ok in d["checks"].items():
        print(f"{'PASS' if ok else 'FAIL'} {name}")
    print(f"wrote {reports / 'bench-session.md'} ({d['seconds']:.0f} s)")


def main(argv: list[str] | None = None) -> int:
    return run_command(cli, argv, "session")


if __name__ == "__main__":
    sys.exit(main())
