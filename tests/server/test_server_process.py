"""`quantkit serve` as a deployment runs it, in a subprocess on port 0: bursts of concurrent requests on an idle
and on a busy server (`--parallel N --max-queue M` admits N running plus M waiting, whatever the timing, and the
N seated together decode together), and a stop by SIGTERM or SIGINT with requests running, waiting and still
being sent (each ends in OpenAI shape at once; exit 0, no traceback; the disk prompt cache keeps what was
computed). The same rules in process, the worker held: tests/server/test_server_admission.py."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers.probe import count
from helpers.server import ServeProcess

WAIT_S = 120
CONTEXT = 65536  # answers that outlast the test: they end only when hung up or stopped
BODY = {"model": "q4", "messages": [{"role": "user", "content": "hi"}], "max_tokens": CONTEXT - 200,
        "ignore_eos": True, "temperature": 0}


class Burst:
    """`k` streamed requests sent at once (they wait at a barrier), each held open once its status is in;
    leaving the block hangs them all up."""

    def __init__(self, url: str, k: int):
        self.codes: list[Any] = [None] * k
        self.refusals: list[tuple[dict, dict]] = []  # (error object, headers) of each one refused
        self._hang_up = threading.Event()
        barrier = threading.Barrier(k)

        def one(i: int) -> None:
            try:
                with httpx.Client(timeout=WAIT_S) as c:
                    barrier.wait(WAIT_S)
                    with c.stream("POST", url + "/v1/chat/completions", json={**BODY, "stream": True}) as r:
                        if r.status_code != 200:
                            r.read()
                            self.refusals.append((r.json()["error"], dict(r.headers)))
                        self.codes[i] = r.status_code
                        self._hang_up.wait(WAIT_S)
            except Exception as e:  # noqa: BLE001 - reported by the test as this request's outcome
                self.codes[i] = repr(e)

        self.threads = [threading.Thread(target=one, args=(i,)) for i in range(k)]

    def __enter__(self) -> Burst:
        for t in self.threads:
            t.start()
        deadline = time.monotonic() + WAIT_S
        while any(c is None for c in self.codes):
            assert time.monotonic() < deadline, self.codes
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hang_up.set()
        for t in self.threads:
            t.join(WAIT_S)


def _idle(s: ServeProcess) -> None:
    s.wait_for(lambda q: q["admitted"] == 0 and q["running"] == 0, "the hung-up requests did not end")


def _refused_once(b: Burst, admitted: int) -> None:
    assert sorted(b.codes, key=str) == [200] * admitted + [429], b.codes
    err, headers = b.refusals[0]
    assert err["type"] == "rate_limit_error" and err["code"] == "queue_full" and headers["retry-after"] == "1"


@pytest.mark.slow
def test_a_burst_is_admitted_up_to_the_slots_and_the_line(q4: Path, tmp_path: Path):
    with ServeProcess(q4, tmp_path / "serve.log", "--parallel", 4, "--max-queue", 2, "--context", CONTEXT) as s:
        with Burst(s.url, 6) as b:  # idle, N + M at once: all admitted, the N seated together decode together
            assert b.codes == [200] * 6
            q = s.wait_for(lambda q: q["peak_batch"] == 4, "four slots never decoded together")
            assert (q["running"], q["waiting"], q["admitted"], q["rejected"]) == (4, 2, 6, 0), q
        _idle(s)
        with Burst(s.url, 7) as b:  # idle, N + M + 1 at once: exactly one refused
            _refused_once(b, 6)
        _idle(s)
        with Burst(s.url, 30) as b:  # a fleet starting at once: N + M admitted, no more
            assert b.codes.count(200) == 6 and b.codes.count(429) == 24, b.codes
        _idle(s)
        with Burst(s.url, 2):  # busy: two decoding, then a burst that fills the two free slots and the line
            s.wait_for(lambda q: q["running"] == 2 and q["batch_size"] == 2, "the first two did not start")
            with Burst(s.url, 5) as b:
                _refused_once(b, 4)
            assert s.health()["queue"]["peak_batch"] == 4
        _idle(s)
        assert s.health()["queue"]["rejected"] == 1 + 24 + 1
    count(4)
    assert "Traceback" not in s.log()


@pytest.mark.slow
def test_one_at_a_time_admits_the_one_running_and_the_line(q4: Path, tmp_path: Path):
    with ServeProcess(q4, tmp_path / "serve.log", "--parallel", 1, "--max-queue", 2, "--context", CONTEXT) as s:
        with Burst(s.url, 3) as b:
            assert b.codes == [200] * 3
            q = s.wait_for(lambda q: q["running"] == 1, "nothing ran")
            assert (q["waiting"], q["admitted"]) == (2, 3), q
        _idle(s)
        with Burst(s.url, 4) as b:
            _refused_once(b, 3)
    count(2)


def _send(url: str, body: dict, out: dict, key: str) -> None:
    """POST `body`; out[key] = (status, the non-empty lines of the answer)."""
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=WAIT_S) as r:
            out[key] = (r.status_code, [ln for ln in r.iter_lines() if ln])
    except Exception as e:  # noqa: BLE001 - reported by the test as this request's outcome
        out[key] = (None, [repr(e)])


def _ends_cleanly(lines: list[str]) -> None:
    """A stream cut by the stop: whole chunks, then an OpenAI error event or a finish_reason chunk, then [DONE]."""
    assert lines and lines[-1] == "data: [DONE]", lines[-3:]
    chunks = [json.loads(ln.removeprefix("data: ")) for ln in lines[:-1]]  # none cut mid-chunk
    last = chunks[-1]
    if "error" in last:
        assert last["error"]["type"] == "service_unavailable" and last["error"]["code"] == "shutting_down", last
    else:
        assert last["choices"] and last["choices"][0]["finish_reason"], last


@pytest.mark.slow
@pytest.mark.parametrize("sig, parallel", [(signal.SIGTERM, 2), (signal.SIGINT, 1)])
def test_a_stop_ends_every_request_and_exits_cleanly(q4: Path, tmp_path: Path, sig: int, parallel: int):
    """Two streams and a plain request generating or waiting, and a body still being sent: on SIGTERM/SIGINT each
    gets its end at once (a stream: an error event then [DONE]; the plain one and the body: a 503 in OpenAI shape),
    the process exits 0 with no traceback and uvicorn never reaches its graceful timeout, and the prompt cache on
    disk keeps the prompts prefilled (a restart finds them)."""
    cache = tmp_path / "prompt-cache"
    out: dict = {}
    with ServeProcess(q4, tmp_path / "serve.log", "--parallel", parallel, "--max-queue", 3, "--context", CONTEXT,
                      "--prompt-cache-dir", cache) as s:
        threads = [threading.Thread(target=_send, args=(s.url, {**BODY, "stream": True}, out, "stream-1")),
                   threading.Thread(target=_send, args=(s.url, BODY, out, "plain")),
                   threading.Thread(target=_send, args=(s.url, {**BODY, "stream": True}, out, "stream-2"))]
        for t in threads:
            t.start()
        s.wait_for(lambda q: q["admitted"] == 3 and q["running"] == parallel, "the requests did not start")
        slow = socket.create_connection(("127.0.0.1", s.port))  # a body still on its way
        slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 500\r\n\r\n{\"model\": ")
        s.wait_for(lambda q: q["admitted"] == 4, "the slow body was not admitted")
        code = s.stop(sig)
        for t in threads:
            t.join(WAIT_S)
        slow.settimeout(WAIT_S)
        answer = slow.recv(4096)
        slow.close()
        log = s.log()
    count(5)
    assert code == 0, log
    for key in ("stream-1", "stream-2"):
        status, lines = out[key]
        assert status == 200, (key, lines)
        _ends_cleanly(lines)
    status, lines = out["plain"]
    assert status == 503, lines
    err = json.loads("".join(lines))["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "service_unavailable"
    assert answer.startswith(b"HTTP/1.1 503") and b'"shutting_down"' in answer, answer
    assert "Traceback" not in log and "CancelledError" not in log and "graceful shutdown exceeded" not in log, log
    assert log.rstrip().endswith("server stopped"), log
    if sig == signal.SIGTERM:
        with ServeProcess(q4, tmp_path / "again.log", "--context", CONTEXT, "--prompt-cache-dir", cache) as again:
            assert again.health()["prompt_cache"]["disk"]["entries"] >= 1
            again.stop(signal.SIGTERM)
