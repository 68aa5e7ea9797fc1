"""`quantkit bench serve --clients 1,2,4,8`: many conversations at once, `quantkit serve --parallel N` against
llama-server `-np N` on the GGUF export of the same codes.

Per client count N, each engine is started as its own process with N slots (quantkit first, then llama-server:
one run, alternated), and N clients each stream one request at once (ignore_eos, so every request generates
exactly --max-tokens tokens; each prompt distinct, so no prompt cache serves it): total tokens/s over the
round's wall time, time to first token and time between tokens (p50/p95/max) over all requests. Then, on N = 4
slots plus one, four clients decode while a fifth sends a long prompt: the largest gap between two tokens of a
running slot while the long prompt is prefilled shows whether the running slots were held up for longer than one
prefill chunk. Without a llama-server binary (`--llama-server PATH`) quantkit runs alone and the report says the
peer is absent. Figures go to reports/bench-serve-slots.json and a section of reports/bench-serve.md.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from quantkit.bench import write_section
from quantkit.bench.quantize import machine_info
from quantkit.bench.serve import free_port, percentile, prepare_model, stop_server
from quantkit.errors import QuantkitError
from quantkit.fileio import atomic_write_json
from quantkit.server.scheduler import MAX_SLOTS

SECTION = ("<!-- bench serve --clients: begin -->", "<!-- bench serve --clients: end -->")
LONG_PROMPT_WORDS = 750  # about 2k tokens with the generated checkpoints' tokenizer (2.7 tokens a word here)
WORDS = "the river runs past old stone walls and quiet fields where small boats rest".split()
RUNNING = 4  # slots decoding while the long prompt arrives


def parse_clients(text: str, most: int = MAX_SLOTS) -> list[int]:
    """`1,2,4,8` as client counts (each 1..most, no repeats), or one clear error."""
    out: list[int] = []
    for part in str(text).split(","):
        p = part.strip()
        if not p.isdigit() or not 1 <= int(p) <= most:
            raise QuantkitError(f"--clients {text!r}: give client counts from 1 to {most}, e.g. 1,2,4,8")
        if int(p) in out:
            raise QuantkitError(f"--clients {text!r}: {p} is given twice")
        out.append(int(p))
    return out


def quantkit_command(model: Path, port: int, slots: int, context: int, threads: int | None) -> list[str]:
    cmd = [sys.executable, "-m", "quantkit", "serve", str(model), "--port", str(port), "--parallel", str(slots),
           "--max-queue", str(slots + 1), "--context", str(context), "--log-level", "warning",
           "--prompt-cache-size", "0"]
    return cmd + (["--threads", str(threads)] if threads else [])


def llama_command(binary: Path, gguf: Path, port: int, slots: int, context: int, threads: int | None) -> list[str]:
    # llama-server splits -c over its -np slots: each slot gets the context quantkit's slots get
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", str(slots),
           "-c", str(context * slots)]
    return cmd + (["-t", str(threads)] if threads else [])


def wait_ready(base: str, proc: subprocess.Popen, log: Path, timeout: float = 900) -> None:
    """Until /health answers 200 (both engines answer 503 while loading)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise QuantkitError(f"the server exited while starting (code {proc.returncode}); see {log}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise QuantkitError(f"the server did not come up within {timeout:.0f} s; see {log}")


def stream_request(url: str, prompt: str, max_tokens: int, on_token: Callable[[], None] | None = None
                   ) -> dict[str, Any]:
    """One streamed chat request: when it was sent, each text chunk's arrival, the tokens it generated."""
    body = {"model": "bench", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            # every token comes with its logprob: a token that decodes to no text still marks its arrival
            "logprobs": True,
            "chat_template_kwargs": {"enable_thinking": False}}
    sent, times, usage = time.perf_counter(), [], None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=900) as r:
        if r.status_code != 200:
            raise QuantkitError(f"{url}: status {r.status_code}: {r.read()[:200]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            usage = ev.get("usage") or usage
            for c in ev.get("choices") or []:
                d = c.get("delta") or {}
                if (d.get("content") or d.get("reasoning_content") or d.get("tool_calls")
                        or (c.get("logprobs") or {}).get("content")):
                    times.append(time.perf_counter())
                    if on_token is not None:
                        on_token()
    tokens = (usage or {}).get("completion_tokens") or max_tokens
    return {"sent": sent, "times": times, "tokens": tokens, "prompt_tokens": (usage or {}).get("prompt_tokens")}


def _together(fns: list[Callable[[], dict[str, Any]]]) -> list[dict[str, Any]]:
    out: list[Any] = [None] * len(fns)
    errors: list[BaseException] = []

    def go(i: int) -> None:
        try:
            out[i] = fns[i]()
        except BaseException as e:  # noqa: BLE001 - re-raised below, on the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def _gaps(r: dict[str, Any]) -> list[float]:
    t = r["times"]
    return [b - a for a, b in zip(t, t[1:], strict=False)]


def _summary(xs: list[float]) -> dict[str, float | None]:
    return {"p50": percentile(xs, 0.5), "p95": percentile(xs, 0.95), "max": max(xs) if xs else None}


def round_of(url: str, clients: int, max_tokens: int, tag: str) -> dict[str, Any]:
    """`clients` streamed requests at once: total tokens/s, time to first token, time between tokens."""
    t0 = time.perf_counter()
    got = _together([lambda c=c: stream_request(url, f"[{tag} client {c}] Describe a quiet harbour town at dawn.",
                                                max_tokens) for c in range(clients)])
    wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in got)
    return {"clients": clients, "wall_s": wall, "tokens": tokens, "tok_s": tokens / wall if wall > 0 else None,
            "ttft_s": _summary([r["times"][0] - r["sent"] for r in got if r["times"]]),
            "tbt_s": _summary([g for r in got for g in _gaps(r)])}


def long_prompt_round(url: str, max_tokens: int, tag: str, words: int = LONG_PROMPT_WORDS) -> dict[str, Any]:
    """RUNNING clients decoding while a fifth sends a long prompt (once each has its first token): their largest
    gap between two tokens while it is prefilled (from its sending to its first token)."""
    firsts = [threading.Event() for _ in range(RUNNING)]

    def running(c: int) -> dict[str, Any]:
        try:
            return stream_request(url, f"[{tag} running {c}] Tell a long story about a lighthouse keeper.",
                                  max_tokens, on_token=firsts[c].set)
        finally:  # a reply whose chunks carry no text must not hold the long prompt back until the timeout
            firsts[c].set()

    def long() -> dict[str, Any]:
        for f in firsts:
            f.wait(600)
        text = " ".join(WORDS[i % len(WORDS)] for i in range(words))
        return stream_request(url, f"[{tag} long] Summarise these notes: {text}", 4)

    got = _together([*(lambda c=c: running(c) for c in range(RUNNING)), long])
    runs, lp = got[:RUNNING], got[RUNNING]
    end = lp["times"][0] if lp["times"] else lp["sent"]
    during = [b - a for r in runs for a, b in zip(r["times"], r["times"][1:], strict=False)
              if b >= lp["sent"] and a <= end]
    return {"long_prompt_tokens": lp["prompt_tokens"], "prefill_s": end - lp["sent"],
            "gap_during_prefill_max_s": max(during) if during else None,
            "tbt_s": _summary([g for r in runs for g in _gaps(r)])}


def _engine(cmd: list[str], port: int, log_path: Path) -> tuple[subprocess.Popen, str]:
    log = log_path.open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, proc, log_path)
    except BaseException:
        stop_server(proc)
        raise
    return proc, base


def run(reports: Path, model_dir: Path | None, workdir: Path, clients: list[int], max_tokens: int,
        context: int, threads: int | None, llama_server: Path | None, long_words: int = LONG_PROMPT_WORDS,
        log: Callable[[str], None] = print) -> dict[str, Any]:
    """Each client count on each engine (module docstring), then the long prompt round (`long_words` words; 0:
    none); the report written to `reports`."""
    if llama_server is not None and not llama_server.is_file():  # before anything is made
        raise QuantkitError(f"--llama-server {llama_server}: no such file; build one with scripts/build-llama-server.sh")
    workdir.mkdir(parents=True, exist_ok=True)
    model = model_dir or prepare_model(workdir, log)
    gguf = None
    if llama_server is not None:
        from quantkit.export.gguf import export_gguf

        gguf = workdir / "serve-slots-mixed.gguf"
        log(f"exporting {model} to {gguf} (mixed: the same codes)")
        export_gguf(model, gguf, "mixed", overwrite=True)
    engines: list[tuple[str, Callable[[int, int], list[str]]]] = [
        ("quantkit", lambda port, n: quantkit_command(model, port, n, context, threads))]
    if llama_server is not None and gguf is not None:
        engines.append(("llama-server", lambda port, n: llama_command(llama_server, gguf, port, n, context, threads)))
    rows: list[dict[str, Any]] = []
    commands: dict[str, str] = {}
    counts = [*clients, *([RUNNING + 1] if long_words else [])]
    for n in counts:
        for name, make in engines:  # one run, alternated: quantkit then the peer at each count
            port = free_port()
            cmd = make(port, n)
            commands[name] = shlex.join(cmd)
            log(f"{name} with {n} slots: {shlex.join(cmd)}")
            proc, base = _engine(cmd, port, workdir / f"{name}-{n}.log")
            try:
                stream_request(base, "warm up", 2)  # first-request costs (lazy kernels, page faults) kept out
                if n in clients:
                    rows.append({"engine": name, **round_of(base, n, max_tokens, f"{name}-{n}")})
                else:
                    rows.append({"engine": name, "clients": n,
                                 "long_prompt": long_prompt_round(base, max_tokens, f"{name}-long", long_words)})
            finally:
                stop_server(proc)
    d = {"command": " ".join(["quantkit", *map(shlex.quote, sys.argv[1:])]) if sys.argv[1:] else "quantkit bench serve",
         "machine": machine_info(), "model": str(model), "gguf": str(gguf) if gguf else None,
         "peer": "llama-server" if llama_server is not None else None,
         "settings": {"clients": clients, "max_tokens": max_tokens, "context": context, "threads": threads,
                      "long_prompt_words": long_words or None},
         "engine_commands": commands, "rows": rows}
    write_report(reports, d)
    return d


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f}"


def write_report(reports: Path, d: dict[str, Any]) -> None:
    """bench-serve-slots.json, and the --clients section of bench-serve.md (replaced in place, the rest kept)."""
    reports.mkdir(parents=True, exist_ok=True)
    atomic_write_json(reports / "bench-serve-slots.json", d)
    m = d["machine"]
    peer = "llama-server `-np N` on the GGUF `mixed` export of the same codes" if d["peer"] else \
        "no peer: llama-server is absent (give `--llama-server PATH`, e.g. from scripts/build-llama-server.sh)"
    lines = [SECTION[0], "## Many conversations at once (`--clients`)", "",
             f"Command: `{d['command']}`. Machine: {m.get('cpu', '?')}, {m.get('threads', '?')} threads. "
             f"quantkit `serve --parallel N` against {peer}; {d['settings']['max_tokens']} tokens per request "
             "(ignore_eos, greedy), one request per client, all at once; times in ms.", "",
             "| engine | clients | total tok/s | TTFT p50 | TTFT p95 | TTFT max | TBT p50 | TBT p95 | TBT max |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in d["rows"]:
        if "long_prompt" in r:
            continue
        ft, bt = r["ttft_s"], r["tbt_s"]
        lines.append(f"| {r['engine']} | {r['clients']} | {r['tok_s']:.1f} | {_s(ft['p50'])} | {_s(ft['p95'])} | "
                     f"{_s(ft['max'])} | {_s(bt['p50'])} | {_s(bt['p95'])} | {_s(bt['max'])} |")
    longs = [r for r in d["rows"] if "long_prompt" in r]
    if longs:
        lines += ["", f"A fifth client's long prompt while {RUNNING} decode: the largest gap between two tokens of a "
                  "running slot while it is prefilled.", "",
                  "| engine | prompt tokens | its prefill ms | max gap ms | TBT p50 | TBT p95 |", "|---|---:|---:|---:|---:|---:|"]
        for r in longs:
            lp = r["long_prompt"]
            lines.append(f"| {r['engine']} | {lp['long_prompt_tokens'] or '-'} | {_s(lp['prefill_s'])} | "
                         f"{_s(lp['gap_during_prefill_max_s'])} | {_s(lp['tbt_s']['p50'])} | {_s(lp['tbt_s']['p95'])} |")
    lines.append(SECTION[1])
    section = "\n".join(lines) + "\n"
    write_section(reports / "bench-serve.md", section, SECTION)
