"""`quantkit bench serve`: a bounded load test of `quantkit serve`, with faults, written to reports/.

The server runs as its own process (`python -m quantkit serve`, loopback, a free port), so its RSS is
measured alone. After two warm-up requests its RSS is the starting level; N client threads then each
send M requests, alternating streaming and plain, every one checked for a complete well-formed answer
(plain: the OpenAI object with usage and timings; streaming: the role chunk, text chunks, one finish
chunk, the usage chunk, `[DONE]`) or a clean 429 (queue full: the client waits Retry-After and tries
again, up to a bound) or 503. Requests use `ignore_eos` so each generates exactly `max_tokens` tokens and
throughput figures compare. A fault phase follows: clients that hang up mid-stream, malformed and
oversized requests, all while the server must keep serving; cancelled generations must stop (the
server's counters say so). RSS is sampled throughout; after the load it must come back to the starting
level (within max(5%, 64 MiB), since allocators keep some freed pages). The peer is the same runtime
called in-process without HTTP (same prompt, same token count), so the server's overhead shows as a ratio.
"""

from __future__ import annotations

import functools
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from quantkit.bench.machine import machine_info
from quantkit.errors import QuantkitError
from quantkit.fileio import atomic_write_json
from quantkit.server.runtime_backend import load_backend

PROMPTS = [
    "$ ls -la /home/user/project",
    "$ git status",
    "Search: weather in Paris tomorrow",
    "tap the Settings button",
    "$ python -c 'print(2 + 3)'",
    "open https://example.org/docs",
]
RSS_SLACK_FRACTION = 0.05
RSS_SLACK_BYTES = 64 << 20


@dataclass
class Outcome:
    kind: str  # "ok" | "429" | "503" | "bad"
    stream: bool
    latency_s: float
    ttft_s: float | None = None
    completion_tokens: int = 0
    attempts: int = 1
    detail: str = ""


@dataclass
class LoadResult:
    outcomes: list[Outcome] = field(default_factory=list)
    wall_s: float = 0.0


def free_port() -> int:
    """A free loopback port (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_server(proc: subprocess.Popen, timeout: float = 60) -> None:
    """Ctrl-C the server process as a user would; kill it if it has not exited within `timeout` s."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@functools.cache
def http() -> httpx.Client:
    """The one client that every request of a bench run goes through, made once, by the first wait for a server's
    health, before any request is timed: a client per request built an SSL context on each client's thread inside
    the timed request, CPU taken from the engines' cores (reports/one-engine/bench-client.md). Each request still
    has a connection of its own, closed after it: llama-server dropped kept connections that were reused ("Server
    disconnected without sending a response")."""
    return httpx.Client(timeout=900, limits=httpx.Limits(max_connections=64, max_keepalive_connections=0))


def wait_for_health(base: str, proc: subprocess.Popen, server_log: Path, timeout: float = 600) -> dict[str, Any]:
    """Poll /health until the server says ok (its JSON), or fail with one line naming its log."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise QuantkitError(f"the server exited ({proc.returncode}): see {server_log}")
        try:
            h = http().get(base + "/health", timeout=2).json()
            if h.get("status") == "ok":
                return h
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise QuantkitError(f"the server did not come up in {timeout:.0f} s: see {server_log}")
        time.sleep(0.3)


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _is_error(body: Any, status: int) -> bool:
    err = body.get("error") if isinstance(body, dict) else None
    return isinstance(err, dict) and {"message", "type", "param", "code"} <= set(err) and bool(err["message"])


def check_plain(body: Any, max_tokens: int) -> str:
    """'' when `body` is a complete chat.completion for an ignore_eos request, else what is wrong."""
    try:
        ch = body["choices"][0]
        msg, u, t = ch["message"], body["usage"], body["timings"]
        if body["object"] != "chat.completion" or msg["role"] != "assistant":
            return "not a chat.completion"
        if ch["finish_reason"] != "length" or u["completion_tokens"] != max_tokens:
            return f"finish {ch['finish_reason']} after {u['completion_tokens']} tokens, asked {max_tokens}"
        if u["total_tokens"] != u["prompt_tokens"] + u["completion_tokens"] or t["predicted_n"] != max_tokens:
            return "usage/timings inconsistent"
        if not isinstance(msg.get("content"), str) and not msg.get("reasoning_content"):
            return "no text"
    except (KeyError, IndexError, TypeError) as e:
        return f"malformed: {e!r}"
    return ""


def check_stream(events: list[str], max_tokens: int) -> str:
    """'' when the SSE `data:` payloads are a complete stream for an ignore_eos request, else what is wrong."""
    if not events or events[-1] != "[DONE]":
        return "no [DONE] at the end"
    try:
        chunks = [json.loads(e) for e in events[:-1]]
    except ValueError as e:
        return f"a chunk is not JSON: {e}"
    if any("error" in c for c in chunks):
        return f"error chunk: {next(c for c in chunks if 'error' in c)}"
    if chunks[0]["choices"][0]["delta"].get("role") != "assistant":
        return "first chunk is not the role"
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    if finishes != ["length"]:
        return f"finish reasons {finishes}"
    usage = chunks[-1].get("usage")
    if chunks[-1]["choices"] != [] or not usage or usage["completion_tokens"] != max_tokens:
        return f"usage chunk {usage}"
    return ""


class RssSampler(threading.Thread):
    def __init__(self, pid: int, every_s: float = 0.1):
        import psutil

        super().__init__(daemon=True)
        self.proc = psutil.Process(pid)
        self.every = every_s
        self.peak = 0
        self.samples: list[tuple[float, int]] = []
        self._done = threading.Event()

    def rss(self) -> int:
        return int(self.proc.memory_info().rss)

    def run(self) -> None:
        t0 = time.perf_counter()
        while not self._done.is_set():
            try:
                r = self.rss()
            except Exception:  # noqa: BLE001 - the server died; the load phase reports it
                return
            self.peak = max(self.peak, r)
            self.samples.append((round(time.perf_counter() - t0, 2), r))
            self._done.wait(self.every)

    def stop(self) -> None:
        self._done.set()
        self.join(5)


def one_request(url: str, model: str, prompt: str, stream: bool, max_tokens: int, retries: int,
                timeout: float) -> Outcome:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "stream": stream, "ignore_eos": True}
    if stream:
        body["stream_options"] = {"include_usage": True}  # the usage chunk the checker counts
    attempts = 0
    t0 = time.perf_counter()
    while True:
        attempts += 1
        try:
            if not stream:
                r = http().post(url, json=body, timeout=timeout)
                status, payload = r.status_code, r.json()
                ttft, events = None, None
            else:
                ttft, events = None, []
                with http().stream("POST", url, json=body, timeout=timeout) as r:
                    status = r.status_code
                    if status != 200:
                        r.read()
                        payload = r.json()
                    else:
                        payload = None
                        for line in r.iter_lines():
                            if line.startswith("data: "):
                                data = line[6:]
                                if ttft is None and ('"content":"' in data and '"content":""' not in data
                                                     or '"reasoning_content"' in data):
                                    ttft = time.perf_counter() - t0
                                events.append(data)
        except Exception as e:  # noqa: BLE001 - a transport failure is a finding, not a crash
            return Outcome("bad", stream, time.perf_counter() - t0, attempts=attempts, detail=f"{type(e).__name__}: {e}")
        lat = time.perf_counter() - t0
        if status == 429 and _is_error(payload, status):
            if attempts <= retries:
                time.sleep(float(r.headers.get("retry-after", "1")))
                continue
            return Outcome("429", stream, lat, attempts=attempts)
        if status == 503 and _is_error(payload, status):
            return Outcome("503", stream, lat, attempts=attempts)
        if status != 200:
            return Outcome("bad", stream, lat, attempts=attempts, detail=f"HTTP {status}: {str(payload)[:200]}")
        problem = check_stream(events, max_tokens) if stream else check_plain(payload, max_tokens)
        if problem:
            return Outcome("bad", stream, lat, ttft, attempts=attempts, detail=problem)
        return Outcome("ok", stream, lat, ttft, completion_tokens=max_tokens, attempts=attempts)


def run_load(url: str, model: str, clients: int, requests: int, max_tokens: int, retries: int,
             timeout: float) -> LoadResult:
    res = LoadResult()
    lock = threading.Lock()

    def client(c: int) -> None:
        for i in range(requests):
            o = one_request(url, model, PROMPTS[(c + i) % len(PROMPTS)], stream=(c + i) % 2 == 0,
                            max_tokens=max_tokens, retries=retries, timeout=timeout)
            with lock:
                res.outcomes.append(o)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    res.wall_s = time.perf_counter() - t0
    return res


def run_faults(base: str, model: str, n_disconnects: int, max_body: int) -> dict[str, Any]:
    """Hang-ups mid-stream and bad requests, concurrently; each bad request must get its error status."""
    url = base + "/v1/chat/completions"
    # far more tokens than the hang-up reads, yet within the context: prompt + max_tokens over it is a 400
    # (context_length_exceeded, as vLLM and OpenAI answer), and PROMPTS render to well under 100 tokens
    long = http().get(base + "/health", timeout=10).json()["max_context"] - 100
    statuses: list[tuple[str, int]] = []
    lock = threading.Lock()

    def hang_up(i: int) -> None:
        body = {"model": model, "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                "max_tokens": long, "stream": True, "ignore_eos": True}
        try:
            with http().stream("POST", url, json=body, timeout=300) as r:
                lines = r.iter_lines()
                seen = 0
                for line in lines:
                    seen += line.startswith("data: ")
                    if seen >= 3 or r.status_code != 200:
                        break
                with lock:
                    statuses.append(("hang-up", r.status_code))
        except httpx.HTTPError as e:
            with lock:
                statuses.append((f"hang-up {type(e).__name__}", -1))

    bad = [("malformed JSON", b'{"model": ', 400), ("n over the limit", json.dumps(
        {"model": model, "messages": [{"role": "user", "content": "x"}], "n": 1000}).encode(), 400),
        ("max_tokens 0", json.dumps({"model": model, "messages": [{"role": "user", "content": "x"}],
                                     "max_tokens": 0}).encode(), 400),
        ("unknown role", json.dumps({"model": model, "messages": [{"role": "robot", "content": "x"}]}).encode(), 400),
        ("huge body", b"{" + b" " * (max_body + 10) + b"}", 413)]
    threads = [threading.Thread(target=hang_up, args=(i,)) for i in range(n_disconnects)]
    for t in threads:
        t.start()
    wrong = []
    for name, data, want in bad:
        r = http().post(url, content=data, headers={"content-type": "application/json"}, timeout=60)
        if r.status_code != want or not _is_error(r.json(), r.status_code):
            wrong.append(f"{name}: HTTP {r.status_code} {r.text[:120]}")
    for t in threads:
        t.join()
    return {"hang_ups": statuses, "bad_requests": [b[0] for b in bad], "wrong_answers": wrong}


def direct_peer(model_dir: Path, prompt: str, max_tokens: int, reps: int, context: int | None) -> dict[str, Any]:
    """The same generation through the runtime in this process (no HTTP, no queue)."""
    b = load_backend(model_dir, max_context=context)
    p = b.render([{"role": "user", "content": prompt}], None, True)
    sp = b.sampling(max_new_tokens=max_tokens, ignore_eos=True)  # the server's defaults, as the load's requests get
    times: list[float] = []
    counts: list[int] = []

    def work() -> None:
        for i in range(2 + reps):  # two warm-ups, as the server had (first kernel calls are slow)
            t0 = time.perf_counter()
            n = sum(1 for e in b.generate(p, sp, threading.Event()) if e.token is not None)
            if i >= 2:
                times.append(time.perf_counter() - t0)
                counts.append(n)

    # on a worker thread like the server's: measured here, torch's CPU thread pool behaves differently
    # from the main thread when the machine is oversubscribed (2-10x), so the threads must match
    t = threading.Thread(target=work)
    t.start()
    t.join()
    if any(n != max_tokens for n in counts):
        raise QuantkitError(f"direct generation made {counts} tokens, asked {max_tokens}")
    return {"reps": reps, "median_s": statistics.median(times), "tok_s": max_tokens / statistics.median(times)}


def direct_peer_process(model_dir: Path, prompt: str, max_tokens: int, reps: int, context: int | None) -> dict[str, Any]:
    """`direct_peer` in a fresh process, so it runs under the same conditions as the server process."""
    code = ("import json, sys; from pathlib import Path; from quantkit.bench.serve import direct_peer; "
            "print(json.dumps(direct_peer(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), "
            "int(sys.argv[5]) or None)))")
    r = subprocess.run([sys.executable, "-c", code, str(model_dir), prompt, str(max_tokens), str(reps),
                        str(context or 0)], capture_output=True, text=True)
    if r.returncode != 0:
        raise QuantkitError(f"the direct-runtime peer failed: {r.stderr.strip().splitlines()[-1:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def prepare_model(workdir: Path, log) -> Path:
    """A tiny checkpoint quantized to int4, as in the issue's done-when commands."""
    q4 = workdir / "q4"
    if (q4 / "quantkit-manifest.json").is_file():
        return q4
    t = workdir / "t"
    for args in (["tiny-model", str(t), "--overwrite"], ["quantize", str(t), "--bits", "4", "--out", str(q4),
                                                         "--overwrite"]):
        log(f"$ quantkit {' '.join(args)}")
        r = subprocess.run([sys.executable, "-m", "quantkit", *args], capture_output=True, text=True)
        if r.returncode != 0:
            raise QuantkitError(f"quantkit {args[0]} failed: {r.stderr.strip().splitlines()[-1:]}")
    return q4


def run(reports: Path, model_dir: Path | None, workdir: Path, clients: int, requests: int, max_tokens: int,
        max_queue: int, retries: int, disconnects: int, context: int | None, log=print) -> dict[str, Any]:

    command = " ".join(["quantkit", *map(shlex.quote, sys.argv[1:])]) if sys.argv[1:] else "quantkit bench serve"
    machine = machine_info()
    workdir.mkdir(parents=True, exist_ok=True)
    model = model_dir or prepare_model(workdir, log)
    log("direct runtime (no HTTP, own process), same prompt and token count")
    peer_before = direct_peer_process(model, PROMPTS[0], max_tokens, 3, context)
    port = free_port()
    max_body = 1 << 20
    serve_cmd = [sys.executable, "-m", "quantkit", "serve", str(model), "--port", str(port), "--max-queue",
                 str(max_queue), "--max-body", str(max_body), "--log-level", "warning"]
    if context:
        serve_cmd += ["--context", str(context)]
    log("$ " + " ".join(serve_cmd[2:]).replace("-m quantkit", "quantkit"))
    server_log = workdir / "serve.log"
    with server_log.open("w") as lf:
        proc = subprocess.Popen(serve_cmd, stdout=lf, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        t_start = time.perf_counter()
        h = wait_for_health(base, proc, server_log)
        startup_s = time.perf_counter() - t_start
        model_id = h["model"]
        url = base + "/v1/chat/completions"
        for s in (False, True):  # warm-up: first kernel calls, allocator pools
            o = one_request(url, model_id, PROMPTS[0], s, max_tokens, retries=5, timeout=600)
            if o.kind != "ok":
                raise QuantkitError(f"warm-up request failed: {o.kind} {o.detail}")
        time.sleep(1.0)
        sampler = RssSampler(proc.pid)
        rss_start = sampler.rss()
        sampler.start()
        log(f"load: {clients} clients x {requests} requests, max_tokens {max_tokens}, --max-queue {max_queue}")
        load = run_load(url, model_id, clients, requests, max_tokens, retries, timeout=600)
        time.sleep(2.0)
        rss_after_load = sampler.rss()
        log(f"faults: {disconnects} mid-stream hang-ups + 5 bad requests")
        faults = run_faults(base, model_id, disconnects, max_body)
        deadline = time.monotonic() + 120
        while True:
            q = http().get(base + "/health", timeout=10).json()["queue"]
            if (q["running"] == 0 and q["waiting"] == 0) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        after = one_request(url, model_id, PROMPTS[1], False, max_tokens, retries=5, timeout=600)
        time.sleep(2.0)
        rss_end = sampler.rss()
        sampler.stop()
        health = http().get(base + "/health", timeout=10).json()
    finally:
        stop_server(proc)
    log("direct runtime (no HTTP, own process), same prompt and token count")
    peer_after = direct_peer_process(model, PROMPTS[0], max_tokens, 3, context)
    peer = {"reps": 3, "tok_s_before": peer_before["tok_s"], "tok_s_after": peer_after["tok_s"],
            "tok_s": (peer_before["tok_s"] + peer_after["tok_s"]) / 2}

    oks = [o for o in load.outcomes if o.kind == "ok"]
    kinds = {k: sum(o.kind == k for o in load.outcomes) for k in ("ok", "429", "503", "bad")}
    tokens = sum(o.completion_tokens for o in oks)
    slack = max(RSS_SLACK_FRACTION * rss_start, RSS_SLACK_BYTES)

    def lat(stream: bool) -> dict[str, float | None]:
        xs = [o.latency_s for o in oks if o.stream == stream]
        return {"n": len(xs), "p50": percentile(xs, 0.5), "p90": percentile(xs, 0.9), "p99": percentile(xs, 0.99),
                "max": max(xs) if xs else None}

    ttfts = [o.ttft_s for o in oks if o.stream and o.ttft_s is not None]
    checks = {
        "every_request_complete_or_clean_429_503": kinds["bad"] == 0,
        "server_up_after_load_and_faults": after.kind == "ok" and proc.returncode in (0, None),
        "bad_requests_got_their_status": not faults["wrong_answers"],
        "hang_ups_were_streaming": all(code == 200 for _, code in faults["hang_ups"]),
        "hang_ups_cancelled": health["queue"]["cancelled"] >= disconnects,
        "rss_back_to_start": rss_end <= rss_start + slack,
    }
    d = {
        "command": command or "quantkit bench serve",
        "server_command": " ".join(["quantkit", *serve_cmd[3:]]),
        "machine": machine,
        "model": str(model),
        "settings": {"clients": clients, "requests_per_client": requests, "max_tokens": max_tokens,
                     "max_queue": max_queue, "retries_after_429": retries, "ignore_eos": True,
                     "stream": "alternating", "disconnects": disconnects},
        "startup_s": round(startup_s, 2),
        "outcomes": kinds,
        "attempts": sum(o.attempts for o in load.outcomes),
        "rejections_429": sum(o.attempts - 1 for o in load.outcomes) + kinds["429"],
        "bad_details": [o.detail for o in load.outcomes if o.kind == "bad"][:10],
        "wall_s": round(load.wall_s, 2),
        "throughput": {"completion_tok_s": round(tokens / load.wall_s, 2) if load.wall_s else None,
                       "requests_s": round(len(oks) / load.wall_s, 3) if load.wall_s else None},
        "latency_s": {"plain": lat(False), "stream": lat(True)},
        "ttft_s": {"p50": percentile(ttfts, 0.5), "p90": percentile(ttfts, 0.9), "p99": percentile(ttfts, 0.99)},
        "peer_direct_runtime": {**peer, "server_tok_s_vs_direct": round((tokens / load.wall_s) / peer["tok_s"], 3)
                                if load.wall_s and peer["tok_s"] else None},
        "faults": faults,
        "queue_counters": health["queue"],
        "rss": {"start": rss_start, "peak": sampler.peak, "after_load": rss_after_load, "end": rss_end,
                "slack": int(slack)},
        "checks": checks,
        "load_avg_at_end": [round(x, 2) for x in os.getloadavg()],
    }
    write_report(reports, d)
    return d


def _f(x: float | None, nd: int = 3) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def write_report(reports: Path, d: dict[str, Any]) -> None:

    reports.mkdir(parents=True, exist_ok=True)
    atomic_write_json(reports / "bench-serve.json", d)
    m, s, r = d["machine"], d["settings"], d["rss"]
    mib = 1 << 20
    lines = [
        "# bench serve: `quantkit serve` under bounded load and faults", "",
        f"Command: `{d['command']}`  ",
        f"Server: `{d['server_command']}` (loopback, its own process; started in {d['startup_s']} s)  ",
        f"Machine: {m['cpu']}, {m['logical_cores']} logical cores, {m['ram_gb']} GB RAM, torch {m['torch']}, "
        f"load average at start {m['load_avg_at_start']}, at end {d['load_avg_at_end']} (other jobs share this "
        f"machine when the load is above its core count: the timings then are lower bounds)  ",
        f"Model: `{d['model']}`", "",
        f"Load: {s['clients']} concurrent clients x {s['requests_per_client']} requests, streaming and plain "
        f"alternating, {s['max_tokens']} tokens each (`ignore_eos`), `--max-queue {s['max_queue']}`; a 429 is "
        f"retried after Retry-After up to {s['retries_after_429']} times.", "",
        "## Checks", "",
        *[f"- {'PASS' if ok else 'FAIL'}: {name.replace('_', ' ')}" for name, ok in d["checks"].items()], "",
        "## Outcomes", "",
        "| complete answers | final 429 | 503 | malformed/failed | attempts | 429s seen |",
        "|---:|---:|---:|---:|---:|---:|",
        f"| {d['outcomes']['ok']} | {d['outcomes']['429']} | {d['outcomes']['503']} | {d['outcomes']['bad']} "
        f"| {d['attempts']} | {d['rejections_429']} |", "",
        "## Latency and throughput", "",
        "| requests | n | p50 s | p90 s | p99 s | max s |", "|---|---:|---:|---:|---:|---:|",
        *[f"| {k} | {v['n']} | {_f(v['p50'])} | {_f(v['p90'])} | {_f(v['p99'])} | {_f(v['max'])} |"
          for k, v in d["latency_s"].items()],
        f"| time to first token (stream) | | {_f(d['ttft_s']['p50'])} | {_f(d['ttft_s']['p90'])} | "
        f"{_f(d['ttft_s']['p99'])} | |", "",
        f"Throughput over the load phase ({d['wall_s']} s): {d['throughput']['completion_tok_s']} completion "
        f"tok/s, {d['throughput']['requests_s']} requests/s.  ",
        f"Peer, the same runtime called directly without HTTP, in its own process on a worker thread like the "
        f"server's (same prompt, {s['max_tokens']} tokens, median of {d['peer_direct_runtime']['reps']}, run "
        f"before and after the load): {d['peer_direct_runtime']['tok_s_before']:.2f} and "
        f"{d['peer_direct_runtime']['tok_s_after']:.2f} tok/s; the server under load reaches "
        f"{d['peer_direct_runtime']['server_tok_s_vs_direct']}x of their mean. The server runs at its default "
        f"--parallel, so concurrent requests decode together and the ratio can pass 1; it is HTTP's, the queue's "
        f"and the parsers' cost only where the load keeps one request at a time (a ratio far from the two peer "
        f"runs' spread is the machine's noise, see the load average).", "",
        "## Memory (server process RSS)", "",
        "| start | peak | after load | end (after faults) | allowed end |", "|---:|---:|---:|---:|---:|",
        f"| {r['start'] / mib:.1f} MiB | {r['peak'] / mib:.1f} MiB | {r['after_load'] / mib:.1f} MiB | "
        f"{r['end'] / mib:.1f} MiB | {(r['start'] + r['slack']) / mib:.1f} MiB |", "",
        "## Faults", "",
        f"{len(d['faults']['hang_ups'])} clients hung up after three chunks while these bad requests were sent: "
        f"{', '.join(d['faults']['bad_requests'])}. Wrong answers: {d['faults']['wrong_answers'] or 'none'}.  ",
        f"Server counters at the end: {json.dumps(d['queue_counters'])}", "",
    ]
    if d["bad_details"]:
        lines += ["Failures:", "", *[f"- {x}" for x in d["bad_details"]], ""]
    tmp = reports / "bench-serve.md.tmp"
    tmp.write_text("\n".join(lines))
    os.replace(tmp, reports / "bench-serve.md")
