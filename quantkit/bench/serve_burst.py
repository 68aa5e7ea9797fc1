"""`quantkit bench serve --burst 8`: N new prompts of about 2k tokens arriving together, quantkit against
llama-server (issue 52: time to first token p95 no worse than llama-server `-np 8`'s on the same codes).

Each of N clients holds a DIFFERENT prompt (`burst_prompts`: the chat markup of one user message of seeded words,
about `tokens` tokens, its first word the client's number, so two prompts share only the markup's first tokens and
no prompt cache serves any of them). Each opens its connection (a GET /health) and waits at a barrier
(`at_once`); once all are there, each sends its prompt as one streamed `/v1/completions` request (`ANSWER`
tokens, ignore_eos, temperature 0, usage included). Per request: time to first text (TTFT) from its sending, and
the prompt tokens the engine counted against the model tokenizer's count of the same text (after the round).
Per engine and round: TTFT p50/p95/max over the N requests, the wall time from the first sending to the last
answer's end, and how far apart the N sendings were.

Engines, each a fresh process with N slots (one at a time, alternated per round: quantkit, then llama-server):
- quantkit: `quantkit serve --parallel N` (serve_slots.quantkit_command, its prompt cache at its default), plus
  `extra` (`--quantkit-args`, for comparisons of its settings);
- llama-server: `-np N` on the GGUF `mixed` export of the same codes, `-c` N times the per-slot context
  (serve_slots.llama_command: llama-server splits -c over its slots).
A short warm-up request first (first-request costs kept out; it shares no prefix with the burst). An engine that
fails is a row with its error, the rest run on.

Figures go to reports/bench-serve-burst.json and a section of reports/bench-serve.md.
"""

from __future__ import annotations

import os
import shlex
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from quantkit.bench import write_section
from quantkit.bench.agent_texts import render
from quantkit.bench.machine import machine_info
from quantkit.bench.serve import free_port
from quantkit.bench.serve_agents import last_error, read_stream, record, start, stop, stream_completion
from quantkit.bench.serve_slots import (
    llama_command,
    long_prompt_text,
    parse_extra,
    quantkit_command,
    served_checkpoint,
    summary,
    tokenizer_coverage,
)
from quantkit.errors import QuantkitError
from quantkit.fileio import atomic_write_json
from quantkit.planner.slots import MAX_SLOTS

SECTION = ("<!-- bench serve --burst: begin -->", "<!-- bench serve --burst: end -->")
BURST_TOKENS = 2048
ANSWER = 8  # tokens each request generates: a few, so the round is the prefills
ROOM = 16  # the markup's tokens and a word that crosses the count
ROUNDS = 1
ENGINES = ("quantkit", "llama-server")
TARGET = 1.0  # issue 52: quantkit's TTFT p95 / llama-server -np N's, at most


def check_count(n: int) -> int:
    if not 1 <= n <= MAX_SLOTS:
        raise QuantkitError(f"--burst {n}: give a client count from 1 to {MAX_SLOTS}, e.g. 8")
    return n


def burst_prompts(count: Callable[[str], int], n: int, tokens: int, seed: int = 0) -> list[str]:
    """`n` distinct prompts (chat markup of one user message), each the fewest seeded words that `count` makes at
    least `tokens` tokens; prompt i starts with `i + 1.`, so no two share more than the markup's opening."""
    def prompt(i: int, words: str) -> str:
        return render([("user", f"{i + 1}. {words}")])

    return [prompt(i, long_prompt_text(lambda s, i=i: count(prompt(i, s)), tokens, seed=seed * MAX_SLOTS + i))
            for i in range(n)]


def shared_prefix(a: list[int], b: list[int]) -> int:
    """How many leading token ids `a` and `b` share."""
    k = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        k += 1
    return k


def at_once(prepares: list[Callable[[], Any]], sends: list[Callable[[Any], Any]], timeout: float = 600
            ) -> list[Any]:
    """Each client on a thread of its own: `prepares[i]()` (connect), then a barrier, then `sends[i](prepared)`
    all at once; the sends' results in order. The first exception is raised once every thread is done (a failed
    prepare breaks the barrier, so no other client waits for it)."""
    n = len(sends)
    barrier = threading.Barrier(n, timeout=timeout)
    out: list[Any] = [None] * n
    errors: list[BaseException] = []
    lock = threading.Lock()

    def go(i: int) -> None:
        try:
            got = prepares[i]()
            barrier.wait()
            out[i] = sends[i](got)
        except threading.BrokenBarrierError as e:
            with lock:
                errors.append(e)
        except BaseException as e:  # noqa: BLE001 - re-raised below, on the caller's thread
            with lock:
                errors.insert(0, e)  # the cause first, before the broken barrier it makes of the others
            barrier.abort()

    threads = [threading.Thread(target=go, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def _connect(base: str) -> httpx.Client:
    client = httpx.Client(base_url=base, timeout=900)
    client.get("/health")  # the connection is open before the barrier: the burst is the requests alone
    return client


def _send(client: httpx.Client, prompt: str) -> dict[str, Any]:
    body = {"model": "bench", "prompt": prompt, "max_tokens": ANSWER, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    try:
        sent = time.perf_counter()
        with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise QuantkitError(f"{client.base_url}: status {r.status_code}: {r.read()[:300]!r}")
            got = read_stream(r.iter_lines())
        return {"sent": sent, **got, "end": time.perf_counter()}
    finally:
        client.close()


def figures(raws: list[dict[str, Any]], local: list[int] | None = None) -> dict[str, Any]:
    """One burst's figures from its streams (in client order); `local`: the tokenizer's count of each prompt."""
    reqs = [record(raw, i, 0, ANSWER) for i, raw in enumerate(raws)]
    sent, end = [r["sent"] for r in raws], [r["end"] for r in raws]
    prompt = [r["prompt_tokens"] for r in reqs]
    out = {"requests": len(reqs), "ttft_s": summary([r["ttft_s"] for r in reqs if r["ttft_s"] is not None]),
           "wall_s": max(end) - min(sent) if raws else None, "sent_spread_s": max(sent) - min(sent) if raws else None,
           "tokens": sum(r["tokens"] for r in reqs), "no_text": sum(r["ttft_s"] is None for r in reqs),
           "prompt_tokens": prompt, "per_request": reqs}
    if local is not None:
        out["prompt_tokens_local"] = local
        out["prompt_tokens_same"] = sum(a == b for a, b in zip(prompt, local, strict=True))
    return out


def burst_round(base: str, prompts: list[str], count: Callable[[str], int] | None = None) -> dict[str, Any]:
    """The prompts sent together to the server at `base` (module docstring)."""
    raws = at_once([lambda: _connect(base)] * len(prompts),
                   [lambda c, p=p: _send(c, p) for p in prompts])
    return figures(raws, [count(p) for p in prompts] if count is not None else None)  # counted after: no cores taken


def _measure(name: str, cmd: list[str], log: Path, prompts: list[str], count: Callable[[str], int],
             round_: int, say: Callable[[str], None]) -> dict[str, Any]:
    say(f"{name}, round {round_ + 1}, {len(prompts)} slots: {shlex.join(cmd)}")
    load = [round(x, 2) for x in os.getloadavg()]
    proc, base = start(cmd, log)
    try:
        stream_completion(base, "warm up", 2)
        got = burst_round(base, prompts, count)
    finally:
        stop(proc)
    return {"engine": name, "round": round_, "clients": len(prompts), "load_avg_before": load, **got}


def ratio(d: dict[str, Any], round_: int) -> float | None:
    """quantkit's TTFT p95 / llama-server's in one round."""
    p95 = {r["engine"]: r["ttft_s"]["p95"] for r in d["rows"] if r["round"] == round_ and "ttft_s" in r}
    q, ll = p95.get("quantkit"), p95.get("llama-server")
    return q / ll if q is not None and ll else None


def run(reports: Path, model_dir: Path | None, workdir: Path, clients: int, tokens: int, context: int,
        threads: int | None, llama_server: Path | None, extra: str | None = None, rounds: int = ROUNDS,
        log: Callable[[str], None] = print) -> dict[str, Any]:
    """`rounds` bursts of `clients` new prompts on each engine, alternated (module docstring); the report written."""
    check_count(clients)
    args = parse_extra(extra)
    if llama_server is not None and not llama_server.is_file():  # before anything is made
        raise QuantkitError(f"--llama-server {llama_server}: no such file; build one with scripts/build-llama-server.sh")
    if tokens + ROOM + ANSWER > context:
        raise QuantkitError(f"--burst-tokens {tokens}: with the markup and its {ANSWER}-token answer it does not fit "
                            f"each slot's --context {context}; give at most {context - ROOM - ANSWER} or a larger "
                            "--context")
    machine = machine_info()
    model = served_checkpoint(model_dir, workdir, log)
    coverage = tokenizer_coverage(model)
    from quantkit.runtime.engine import load_tokenizer

    tok = load_tokenizer(model)

    def count(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False))

    engines: list[tuple[str, Callable[[int], list[str]]]] = [
        ("quantkit", lambda port: [*quantkit_command(model, port, clients, context, threads, prompt_cache=True),
                                   *args])]
    gguf = None
    if llama_server is not None:
        from quantkit.export.gguf import export_gguf

        gguf = workdir / "serve-burst-mixed.gguf"
        log(f"exporting {model} to {gguf} (mixed: the same codes)")
        export_gguf(model, gguf, "mixed", overwrite=True)
        engines.append(("llama-server", lambda port: llama_command(llama_server, gguf, port, clients, context,
                                                                   threads)))
    rows: list[dict[str, Any]] = []
    commands: dict[str, str] = {}
    ids = None
    for k in range(rounds):
        prompts = burst_prompts(count, clients, tokens, seed=k)  # each round its own texts, both engines the same
        ids = ids or [tok.encode(p, add_special_tokens=False) for p in prompts]
        for name, make in engines:
            lf = workdir / f"burst-{name}-{clients}-{k}.log"
            cmd = make(free_port())
            commands[name] = shlex.join(cmd)
            try:
                rows.append(_measure(name, cmd, lf, prompts, count, k, log))
            except (QuantkitError, httpx.HTTPError, threading.BrokenBarrierError) as e:
                log(f"{name}, round {k + 1} failed: {e}")
                rows.append({"engine": name, "round": k, "clients": clients,
                             "error": f"{e} (log: {lf}: {last_error(lf) if lf.is_file() else 'none'})"})
    shared = max((shared_prefix(a, b) for i, a in enumerate(ids or []) for b in (ids or [])[i + 1:]), default=0)
    d = {"command": " ".join(["quantkit", *map(shlex.quote, sys.argv[1:])]) if sys.argv[1:] else "quantkit bench serve",
         "machine": machine, "load_avg_at_end": [round(x, 2) for x in os.getloadavg()], "model": str(model),
         "tokenizer": coverage, "gguf": str(gguf) if gguf else None,
         "settings": {"clients": clients, "burst_tokens": tokens, "answer_tokens": ANSWER, "context": context,
                      "threads": threads, "rounds": rounds, "quantkit_args": args,
                      "most_shared_prefix_tokens": shared},
         "engine_commands": commands, "rows": rows}
    d["ratios"] = [ratio(d, k) for k in range(rounds)]
    write_report(reports, d)
    return d


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f}"


def write_report(reports: Path, d: dict[str, Any]) -> None:
    """bench-serve-burst.json, and the --burst section of bench-serve.md (replaced in place, the rest kept)."""
    reports.mkdir(parents=True, exist_ok=True)
    atomic_write_json(reports / "bench-serve-burst.json", d)
    m, st, cov = d["machine"], d["settings"], d["tokenizer"]
    n = st["clients"]
    cmds = "; ".join(f"{e}: `{c}`" for e, c in d["engine_commands"].items())
    lines = [SECTION[0], "## Burst of new prompts (`--burst`)", "",
             f"Command: `{d['command']}`. Machine: {m.get('cpu', '?')}, {m.get('logical_cores', '?')} logical cores, "
             f"load average at start {m.get('load_avg_at_start')}, at end {d['load_avg_at_end']} (above the core "
             "count, other work shared the machine). "
             f"Model: `{d['model']}`, its tokenizer {cov['tokens']:,} tokens for {cov['vocab']:,} vocabulary rows. "
             f"Load: {n} clients, each with a different prompt of about {st['burst_tokens']} tokens (no two share "
             f"more than {st['most_shared_prefix_tokens']} leading tokens), connect, wait at a barrier, then all send "
             f"at once a streamed `/v1/completions` of {st['answer_tokens']} tokens (ignore_eos, greedy) to a fresh "
             f"server with {n} slots, after one short warm-up request; {st['rounds']} round(s), the engines "
             "alternated. TTFT: from each request's sending to its first text, in ms (p95 of "
             f"{n} requests interpolates between the two slowest). Wall: from the first sending to the last answer's "
             "end. Sent within: the spread of the sendings. Each TTFT: the requests' first texts in order (one after another where the "
             "engine prefills its prompts in turn, together where it batches them). Prompt tokens: as the engine counted them; same: "
             "requests whose count equals the model tokenizer's.", "", f"Engines: {cmds}.", "",
             "| round | engine | load before | prompt tokens | same | TTFT p50 | TTFT p95 | TTFT max | wall s "
             "| sent within ms | each TTFT, s |", "|---:|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in d["rows"]:
        if "error" in r:
            lines.append(f"| {r['round'] + 1} | {r['engine']} | failed: {r['error']} | | | | | | | | |")
            continue
        ft, pt = r["ttft_s"], [p for p in r["prompt_tokens"] if p is not None]
        span = "-" if not pt else f"{min(pt):,}" if min(pt) == max(pt) else f"{min(pt):,}-{max(pt):,}"
        same = f"{r['prompt_tokens_same']}/{r['requests']}" if "prompt_tokens_same" in r else "-"
        each = " ".join(f"{q['ttft_s']:.1f}" for q in sorted(r["per_request"], key=lambda q: q["ttft_s"] or 1e30)
                        if q["ttft_s"] is not None)
        lines.append(f"| {r['round'] + 1} | {r['engine']} | {r['load_avg_before']} | {span} | {same} | "
                     f"{_ms(ft['p50'])} | {_ms(ft['p95'])} | {_ms(ft['max'])} | {r['wall_s']:.1f} | "
                     f"{_ms(r['sent_spread_s'])} | {each} |")
    rs = [x for x in d["ratios"] if x is not None]
    if rs:
        worst = max(rs)
        lines += ["", f"TTFT p95, quantkit / llama-server `-np {n}`: "
                  + ", ".join(f"round {k + 1} {x:.2f}x" for k, x in enumerate(d["ratios"]) if x is not None)
                  + f". Target (issue 52): at most {TARGET:.1f}x: " + ("met" if worst <= TARGET else "not met")
                  + (" in every round." if len(rs) > 1 and worst <= TARGET else ".")]
    else:
        lines += ["", "Target (issue 52), quantkit's TTFT p95 at most llama-server's: not measured (no llama-server "
                  "row; give `--llama-server PATH`)."]
    lines.append(SECTION[1])
    write_section(reports / "bench-serve.md", "\n".join(lines) + "\n", SECTION)
