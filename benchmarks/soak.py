"""`python -m benchmarks.soak`: the server under a bounded soak (issue 14). `quantkit serve` runs in its own process
on loopback; N clients hammer it for a fixed time with a mix of ordinary requests, streams hung up after the
first chunks, bodies over the size limit (declared and chunked), bodies just under it whose text cannot fit
the context (refused before tokenizing), and foreign Host headers; a poller asks /health twice a second.

Checks: /health always answered (within 5 s), no 500 and no transport failure except our own hang-ups,
every answer the status its kind must get, peak RSS within `start + bound`, and RSS back within
max(5%, 64 MB) of its start after the load stops. Figures go to reports/bench-soak.json and a section of
reports/bench-serve.md."""

from __future__ import annotations

import collections
import json
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import typer

from benchmarks.cli import command_line, guard_reports, run_command, shared
from quantkit.bench import write_section
from quantkit.bench.serve import (
    RSS_SLACK_BYTES,
    RSS_SLACK_FRACTION,
    RssSampler,
    free_port,
    prepare_model,
    stop_server,
    wait_for_health,
)
from quantkit.cli.options import COUNT, SECONDS
from quantkit.fileio import write_atomic

MAX_BODY = 8 * 10**6  # the server's default --max-body (8MB)
PEAK_BOUND = 1 << 30  # the stated bound: peak RSS under the soak stays within start + 1 GiB
KINDS = {"ok": 5, "hangup": 2, "oversize": 1, "oversize_chunked": 1, "too_long": 1, "foreign_host": 1}
EXPECT = {"ok": {200, 429}, "hangup": {200, 429}, "oversize": {413, 429}, "oversize_chunked": {413, 429},
          "too_long": {400, 429}, "foreign_host": {403}}
SECTION = ("<!-- soak:start -->", "<!-- soak:end -->")


class _Bodies:
    def __init__(self, model: str):
        base = {"model": model, "max_tokens": 4, "ignore_eos": True}
        self.ok = json.dumps({**base, "messages": [{"role": "user", "content": "$ ls"}]}).encode()
        self.stream = json.dumps({**base, "max_tokens": 64, "stream": True,
                                  "messages": [{"role": "user", "content": "$ ls"}]}).encode()
        filler = "x" * (MAX_BODY - 400)  # 7.99 MB of text: under the body limit, far beyond any context
        self.too_long = json.dumps({**base, "messages": [{"role": "user", "content": filler}]}).encode()
        self.oversize = b'{"model": "m", "messages": [' + b" " * (MAX_BODY + 1000) + b"]}"


def _client(base: str, bodies: _Bodies, stop_at: float, seed: int, counts: collections.Counter,
            problems: list[str], lock: threading.Lock) -> None:
    import httpx

    rng = random.Random(seed)
    kinds, weights = zip(*KINDS.items(), strict=True)
    url = base + "/v1/chat/completions"
    json_h = {"content-type": "application/json"}
    with httpx.Client(timeout=120) as http:
        while time.monotonic() < stop_at:
            kind = rng.choices(kinds, weights)[0]
            try:
                if kind == "hangup":
                    with http.stream("POST", url, content=bodies.stream, headers=json_h) as r:
                        status = r.status_code
                        if status == 200:
                            for i, _ in enumerate(r.iter_lines()):
                                if i >= 2:
                                    break  # hang up mid-stream
                elif kind == "oversize_chunked":
                    def chunks():
                        for i in range(0, len(bodies.oversize), 1 << 20):
                            yield bodies.oversize[i:i + (1 << 20)]
                    status = http.post(url, content=chunks(), headers=json_h).status_code
                elif kind == "foreign_host":
                    status = http.get(base + "/v1/models", headers={"host": "rebind.example"}).status_code
                else:
                    body = {"ok": bodies.ok, "oversize": bodies.oversize, "too_long": bodies.too_long}[kind]
                    status = http.post(url, content=body, headers=json_h).status_code
            except httpx.HTTPError as e:
                if kind.startswith("oversize"):  # the server may answer 413 and close while we still send
                    status = 413
                else:
                    with lock:
                        problems.append(f"{kind}: {type(e).__name__}: {e}")
                    continue
            with lock:
                counts[f"{kind} {status}"] += 1
                if status not in EXPECT[kind]:
                    problems.append(f"{kind}: HTTP {status}")
            if status == 429:
                time.sleep(0.2)


def _poll_health(base: str, stop: threading.Event, lat: list[float], fails: list[str]) -> None:
    import httpx

    while not stop.is_set():
        t0 = time.perf_counter()
        try:
            r = httpx.get(base + "/health", timeout=5)
            if r.status_code != 200 or r.json().get("status") != "ok":
                fails.append(f"HTTP {r.status_code}")
        except httpx.HTTPError as e:
            fails.append(f"{type(e).__name__}")
        lat.append(time.perf_counter() - t0)
        stop.wait(0.5)


def run_soak(model_dir: Path | None, workdir: Path, clients: int = 16, seconds: float = 120, max_queue: int = 8,
             seed: int = 0, log: Any = print) -> dict[str, Any]:
    import httpx

    workdir.mkdir(parents=True, exist_ok=True)
    model = model_dir or prepare_model(workdir, log)
    port = free_port()
    cmd = [sys.executable, "-m", "quantkit", "serve", str(model), "--port", str(port), "--max-queue", str(max_queue),
           "--log-level", "warning"]
    server_log = workdir / "soak-serve.log"
    with server_log.open("w") as lf:
        proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        h = wait_for_health(base, proc, server_log)
        bodies = _Bodies(h["model"])
        httpx.post(base + "/v1/chat/completions", content=bodies.ok, headers={"content-type": "application/json"},
                   timeout=600)  # warm-up
        time.sleep(1.0)
        sampler = RssSampler(proc.pid, every_s=0.05)
        rss_start = sampler.rss()
        sampler.start()
        counts: collections.Counter = collections.Counter()
        problems: list[str] = []
        lock = threading.Lock()
        stop = threading.Event()
        lat: list[float] = []
        health_fails: list[str] = []
        poller = threading.Thread(target=_poll_health, args=(base, stop, lat, health_fails), daemon=True)
        poller.start()
        log(f"soak: {clients} clients for {seconds:.0f} s against {base} (--max-queue {max_queue})")
        stop_at = time.monotonic() + seconds
        threads = [threading.Thread(target=_client, args=(base, bodies, stop_at, seed + i, counts, problems, lock),
                                    daemon=True) for i in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(seconds + 300)
        stop.set()
        poller.join(10)
        settle = time.monotonic() + 60
        while time.monotonic() < settle:
            q = httpx.get(base + "/health", timeout=10).json()["queue"]
            if q["running"] == 0 and q["waiting"] == 0:
                break
            time.sleep(0.2)
        time.sleep(3.0)
        rss_end = sampler.rss()
        sampler.stop()
        alive = proc.poll() is None
    finally:
        stop_server(proc)
    slack = max(RSS_SLACK_FRACTION * rss_start, RSS_SLACK_BYTES)
    checks = {
        "health always answered": not health_fails and alive,
        "no 500, no transport failure": not problems,
        "peak rss within start + 1 GiB": sampler.peak <= rss_start + PEAK_BOUND,
        "rss back to start": rss_end <= rss_start + slack,
    }
    return {
        "command": command_line("soak", sys.argv[1:]),
        "server": " ".join(cmd[2:]).replace("-m quantkit", "quantkit"),
        "clients": clients, "seconds": seconds, "max_queue": max_queue, "max_body": MAX_BODY, "seed": seed,
        "requests": sum(counts.values()), "by_kind_and_status": dict(sorted(counts.items())),
        "problems": problems[:20], "health": {"polls": len(lat), "failures": health_fails[:20],
                                              "max_s": round(max(lat), 3) if lat else None},
        "rss": {"start": rss_start, "peak": sampler.peak, "end": rss_end, "bound": rss_start + PEAK_BOUND,
                "slack": int(slack)},
        "checks": checks,
    }


def write_report(reports: Path, d: dict[str, Any]) -> None:
    """bench-soak.json, and the soak section of bench-serve.md (replaced in place, the rest kept)."""
    write_atomic(reports / "bench-soak.json", json.dumps(d, indent=1) + "\n")
    mb = 1e6
    r = d["rss"]
    lines = [SECTION[0], "", "## Soak: hang-ups, oversized bodies and foreign hosts mixed in", "",
             f"Command: `{d['command']}`  ",
             f"Server: `{d['server']}` (loopback, its own process)  ",
             f"{d['clients']} clients for {d['seconds']:.0f} s, {d['requests']} requests; kinds weighted "
             + ", ".join(f"{k} {w}" for k, w in KINDS.items()) + f" (body limit {d['max_body'] / mb:.0f} MB; "
             "too_long = a 7.99 MB body whose text cannot fit the context, refused before tokenizing).", "",
             *[f"- {'PASS' if ok else 'FAIL'}: {name}" for name, ok in d["checks"].items()], "",
             "| RSS start MB | peak MB | end MB | stated bound MB | /health polls | /health max s |",
             "|---:|---:|---:|---:|---:|---:|",
             f"| {r['start'] / mb:.0f} | {r['peak'] / mb:.0f} | {r['end'] / mb:.0f} | {r['bound'] / mb:.0f} | "
             f"{d['health']['polls']} | {d['health']['max_s']} |", "",
             "| kind and status | count |", "|---|---:|",
             *[f"| {k} | {v} |" for k, v in d["by_kind_and_status"].items()], "", SECTION[1]]
    section = "\n".join(lines) + "\n"
    write_section(reports / "bench-serve.md", section, SECTION)


def cli(
    reports: Path = shared("reports", Path("reports")),
    workdir: Path = shared("workdir", Path("/tmp/quantkit-bench-serve")),
    model: Path = shared("model", None),
    clients: int = typer.Option(16, "--clients", parser=COUNT, help="concurrent clients"),
    seconds: float = typer.Option(120, "--seconds", parser=SECONDS, help="how long the soak runs"),
    max_queue: int = typer.Option(8, "--max-queue", parser=COUNT, help="the server's --max-queue"),
) -> None:
    """Soak `quantkit serve`: clients, hang-ups, oversized bodies, foreign hosts; /health and RSS watched.

    Writes bench-soak.json and its section of bench-serve.md."""
    guard_reports(reports, "soak")
    d = run_soak(model, workdir, clients, seconds, max_queue)
    write_report(reports, d)
    for name, ok in d["checks"].items():
        print(f"{'PASS' if ok else 'FAIL'} {name}")
    r = d["rss"]
    print(f"{d['requests']} requests; RSS {r['start'] / 1e6:.0f} -> peak {r['peak'] / 1e6:.0f} -> "
          f"{r['end'] / 1e6:.0f} MB; wrote {reports / 'bench-serve.md'}")
    if not all(d["checks"].values()):
        raise typer.Exit(1)


def main(argv: list[str] | None = None) -> int:
    return run_command(cli, argv, "soak")


if __name__ == "__main__":
    sys.exit(main())
