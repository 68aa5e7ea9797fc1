"""Admission, the one 429 bound (quantkit/server/queue.py `JobLine.admit`), and the drain a stop runs, on the real
schedulers over the tiny int4 checkpoint. The worker is held inside its first prefill (or generation), so no timing
decides: with N slots and --max-queue M, N + M requests are admitted while the worker is still seating the first,
the next one is refused, the counts are the documented ones (running <= N, waiting <= M), the N seated together
decode together, and a drain answers every running and waiting request at once. A stop of the app served by
uvicorn (quantkit/server/serving.py) ends its requests before uvicorn waits for them. The same against a real
`quantkit serve` process, SIGTERM included: tests/server/test_server_process.py."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import httpx
import pytest

import quantkit.runtime.batch as batch_mod
from quantkit.runtime import load_model
from quantkit.runtime.generate import SamplingParams
from quantkit.server.app import ServerConfig, create_app
from quantkit.server.queue import Closed, Done, Failed, Job, JobLine, QueueClosed, QueueFull
from quantkit.server.runtime_backend import RuntimeBackend
from quantkit.server.scheduler import BatchScheduler

from helpers.probe import count
from helpers.runtime import quantized
from helpers.server import ServerThread

WAIT_S = 120
CONTEXT = 65536  # room for answers that outlast any test: they end only when stopped
LONG = 60000


@pytest.fixture(scope="module")
def backend(tiny_model):
    return RuntimeBackend(load_model(quantized(tiny_model, "int4"), context=CONTEXT), "tiny")


class Gate:
    """`fn`, whose first caller (the worker) waits inside until `open()`."""

    def __init__(self, fn: Any):
        self.fn, self.inside, self.opened = fn, threading.Event(), threading.Event()

    def __call__(self, *a: Any, **k: Any) -> Any:
        if not self.opened.is_set():
            self.inside.set()
            assert self.opened.wait(WAIT_S)
        return self.fn(*a, **k)

    def open(self) -> None:
        self.opened.set()


def _held(backend: RuntimeBackend, monkeypatch: pytest.MonkeyPatch, slots: int, max_waiting: int
          ) -> tuple[JobLine, Gate]:
    """The server's queue with `slots` slots, its worker to be held inside the first request's prefill by the
    gate returned."""
    gate = Gate(batch_mod.batch_prompts.start)
    monkeypatch.setattr(batch_mod.batch_prompts, "start", gate)
    return BatchScheduler(backend, max_waiting, slots), gate


def _job(backend: RuntimeBackend, loop: asyncio.AbstractEventLoop, tokens: int = 8) -> Job:
    prompt = backend.render([{"role": "user", "content": "name three colours"}], None, True)
    return Job(prompt, SamplingParams(max_new_tokens=tokens, temperature=0, ignore_eos=True), loop)


async def _end(job: Job) -> Any:
    """The job's last event (Done, Failed or Closed)."""
    while True:
        ev = await asyncio.wait_for(job.events.get(), WAIT_S)
        if isinstance(ev, Done | Failed | Closed):
            return ev


@pytest.mark.parametrize("slots, max_waiting", [(4, 2), (1, 2), (3, 5)])
def test_a_burst_takes_every_free_slot_and_the_line_while_the_worker_is_busy(backend, monkeypatch, one_thread,
                                                                            slots, max_waiting):
    """`--parallel N --max-queue M`: while the worker is still prefilling the first request of a burst, the other
    N + M - 1 are admitted (those about to take a free slot are not counted as waiting), one more is refused, and
    the N seated together run together."""
    queue, gate = _held(backend, monkeypatch, slots, max_waiting)
    room = slots + max_waiting

    async def main() -> tuple[dict, list]:
        loop = asyncio.get_running_loop()
        jobs = [_job(backend, loop) for _ in range(room + 1)]
        queue.submit(jobs[0])
        assert await asyncio.to_thread(gate.inside.wait, WAIT_S)  # the worker is inside the first one now
        for j in jobs[1:room]:
            queue.submit(j)
        held = queue.stats.as_dict()
        with pytest.raises(QueueFull, match=f"{max_waiting} requests are already waiting"):
            queue.submit(jobs[room])
        gate.open()
        return held, await asyncio.gather(*(_end(j) for j in jobs[:room]))
    try:
        held, ends = asyncio.run(main())
    finally:
        assert queue.close()
    count(2)
    assert (held["running"], held["waiting"], held["admitted"], held["rejected"]) == (1, max_waiting, room, 0), held
    assert all(isinstance(d, Done) and d.finish_reason == "length" and d.completion_tokens == 8 for d in ends), ends
    s = queue.stats
    assert s.rejected == 1 and s.completed == room
    assert (s.running, s.waiting, s.admitted) == (0, 0, 0)  # every place given back
    if slots > 1:
        assert s.peak_batch == slots  # the requests seated together decoded together


def test_a_request_leaving_gives_its_place_back(backend, monkeypatch, one_thread):
    """A waiting request whose client leaves (its job stopped, its place released) makes room for the next."""
    queue, gate = _held(backend, monkeypatch, 2, 1)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        first = _job(backend, loop)
        queue.submit(first)
        assert await asyncio.to_thread(gate.inside.wait, WAIT_S)
        ticket = queue.admit()  # an admitted request still being read (the app's place)
        queue.submit(_job(backend, loop))
        with pytest.raises(QueueFull):
            queue.admit()
        queue.release(ticket)  # its client left before sending the body
        late = _job(backend, loop)
        queue.submit(late)
        gate.open()
        assert isinstance(await _end(late), Done) and isinstance(await _end(first), Done)
    try:
        asyncio.run(main())
    finally:
        assert queue.close()
    count()
    assert (queue.stats.admitted, queue.stats.rejected) == (0, 1)


@pytest.mark.parametrize("slots", [1, 2])
def test_a_drain_ends_every_request_at_once(backend, monkeypatch, one_thread, slots):
    """While the worker is held inside the first request, `drain` ends it and the waiting ones at once (each gets
    Closed: the worker's progress does not decide), refuses new ones, and the worker then ends."""
    queue, gate = _held(backend, monkeypatch, slots, 2)

    async def main() -> list:
        loop = asyncio.get_running_loop()
        jobs = [_job(backend, loop, LONG) for _ in range(slots + 2)]
        queue.submit(jobs[0])
        assert await asyncio.to_thread(gate.inside.wait, WAIT_S)
        for j in jobs[1:]:
            queue.submit(j)
        queue.drain()
        ends = await asyncio.gather(*(_end(j) for j in jobs))
        with pytest.raises(QueueClosed):
            queue.submit(_job(backend, loop))
        with pytest.raises(QueueClosed):
            queue.admit()
        assert not queue.accepting
        gate.open()
        return ends
    try:
        ends = asyncio.run(main())
    finally:
        gate.open()
        assert queue.close()
    count()
    assert all(isinstance(e, Closed) for e in ends), ends
    assert (queue.stats.running, queue.stats.waiting, queue.stats.admitted) == (0, 0, 0)


def _lines(url: str, body: dict, out: dict, key: str) -> None:
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=WAIT_S) as r:
            out[key] = (r.status_code, [ln for ln in r.iter_lines() if ln])
    except Exception as e:  # noqa: BLE001 - reported by the test
        out[key] = (None, [repr(e)])


def _until(ok: Any, url: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not ok(q := httpx.get(url + "/health").json()["queue"]):
        assert time.monotonic() < deadline, q
        time.sleep(0.02)


def test_a_stop_ends_the_requests_before_uvicorn_waits_for_them(backend, one_thread):
    """`should_exit` (what SIGTERM sets) on the server quantkit runs: the running stream ends with an OpenAI error
    event then [DONE], the waiting plain request gets a 503 in OpenAI shape, and uvicorn (no graceful timeout
    here: it would wait for them to the end) stops at once."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": LONG,
            "ignore_eos": True, "temperature": 0}
    out: dict = {}
    s = ServerThread(create_app(backend, ServerConfig(max_queue=2, parallel=1))).__enter__()
    try:
        threads = [threading.Thread(target=_lines, args=(s.url, {**body, "stream": True}, out, "stream")),
                   threading.Thread(target=_lines, args=(s.url, body, out, "plain"))]
        threads[0].start()
        _until(lambda q: q["running"] == 1, s.url)
        threads[1].start()
        _until(lambda q: q["admitted"] == 2, s.url)
        s.server.should_exit = True
        s.thread.join(WAIT_S)
        assert not s.thread.is_alive(), "uvicorn went on waiting for the requests"
        for t in threads:
            t.join(WAIT_S)
    finally:
        s.__exit__(None, None, None)
    count(2)
    code, lines = out["stream"]
    assert code == 200 and lines[-1] == "data: [DONE]", lines[-3:]
    err = json.loads(lines[-2][6:])["error"]
    assert err["type"] == "service_unavailable" and err["code"] == "shutting_down" and "shutting down" in err["message"]
    assert all(json.loads(ln[6:]) for ln in lines[:-1])  # every chunk whole
    code, lines = out["plain"]
    assert code == 503, lines
    err = json.loads("".join(lines))["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "shutting_down"
