"""One model, one worker thread, a bounded line of requests.

The model is loaded once and generates for one request at a time on a worker thread (the runtime's
caches are per sequence and torch releases the GIL in its kernels, so the event loop stays responsive).
Requests wait in a FIFO of at most `max_waiting`; one more is refused at once with `QueueFull` (the app
answers 429 with Retry-After) instead of piling up. Each job carries a cancel flag: the HTTP layer sets
it when the client goes away or a stop string is seen, a waiting job is then skipped and a running one
ends at its next token. Events reach the request's coroutine through its own asyncio queue.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from quantkit.runtime.generate import SamplingParams
from quantkit.server.backend import Backend, Prompt


class QueueFull(Exception):
    """No room in the line of waiting requests."""


class QueueClosed(Exception):
    """The server is shutting down (or its worker died)."""


@dataclass
class Done:
    finish_reason: str  # "stop" (end of turn or stop string), "length" (max_tokens) or "cancelled"
    prompt_tokens: int
    completion_tokens: int
    queue_s: float
    prompt_s: float  # start of generation -> first token (prefill + first sampling)
    decode_s: float  # first token -> last token
    cached_tokens: int = 0  # prompt tokens restored from the prompt cache
    drafts: dict[str, int] | None = None  # speculative decoding's {"draft", "drafted", "accepted"} (None: off)


@dataclass
class Failed:
    message: str


@dataclass
class Job:
    prompt: Prompt
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)
    stop_reason: str = "cancelled"
    # the `n` choices of one prompt share one object here: a scheduler with slots prefills it once for them all
    group: object | None = None

    def stop(self, reason: str = "cancelled") -> None:
        """End this job: "cancelled" (client gone) or "stop" (a stop string ended the answer)."""
        if not self.cancel.is_set():
            self.stop_reason = reason
            self.cancel.set()

    def _put(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.cancel.set()


@dataclass
class QueueStats:
    max_waiting: int
    waiting: int = 0
    running: int = 0
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    rejected: int = 0
    generated_tokens: int = 0
    last_cancelled_tokens: int | None = None  # tokens a cancelled job had made when it stopped

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class JobLine:
    """What both schedulers share: a line of waiting jobs, one worker thread, a 429 (`QueueFull`) past
    `stats.max_waiting` requests and a close that cancels everything. A subclass fills `stats`, then calls
    `_start`; it says how many requests wait (`_waiting`) and which jobs run (`_running_jobs`)."""

    stats: QueueStats

    def _start(self, name: str) -> None:
        self._line: collections.deque[Job] = collections.deque()
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def _work(self) -> None:
        raise NotImplementedError

    def _waiting(self) -> int:
        """Requests in the line (under the lock)."""
        return len(self._line)

    def _running_jobs(self) -> list[Job]:
        raise NotImplementedError

    @property
    def accepting(self) -> bool:
        return not self._closed and self._thread.is_alive()

    def submit(self, job: Job) -> None:
        with self._cv:
            if self._closed or not self._thread.is_alive():
                raise QueueClosed("the server is shutting down")
            if (waiting := self._waiting()) >= self.stats.max_waiting:
                self.stats.rejected += 1
                raise QueueFull(f"{waiting} requests are already waiting (--max-queue "
                                f"{self.stats.max_waiting}); retry later")
            self._line.append(job)
            self.stats.waiting = self._waiting()
            self._cv.notify()

    def close(self, timeout: float = 10.0) -> None:
        """Refuse new jobs, cancel the waiting and running ones, and wait for the worker to end."""
        with self._cv:
            self._closed = True
            for job in [*self._line, *self._running_jobs()]:
                job.stop()
            self._cv.notify_all()
        self._thread.join(timeout)


class GenerationQueue(JobLine):
    def __init__(self, backend: Backend, max_waiting: int = 8):
        if max_waiting < 1:
            raise ValueError("max_waiting must be >= 1")
        self.backend = backend
        self.stats = QueueStats(max_waiting=max_waiting)
        self._current: Job | None = None
        self._start("quantkit-generate")

    def _running_jobs(self) -> list[Job]:
        return [self._current] if self._current else []

    def _next(self) -> Job | None:
        with self._cv:
            while not self._line and not self._closed:
                self._cv.wait()
            if not self._line:
                return None
            job = self._line.popleft()
            self.stats.waiting = len(self._line)
            self.stats.running = 1
            self._current = job
            return job

    def _work(self) -> None:
        while True:
            job = self._next()
            if job is None:
                return
            try:
                self._run(job)
            finally:
                with self._cv:
                    self.stats.running = 0
                    self._current = None

    def _run(self, job: Job) -> None:
        start = time.perf_counter()
        queue_s = start - job.submitted
        n, first, last, cached, drafts = 0, None, start, 0, None
        if self._closed:
            job.stop()
        try:
            if not job.cancel.is_set():
                # closed explicitly so the backend's own cleanup (its lock, its cache) runs now
                with contextlib.closing(self.backend.generate(job.prompt, job.params, job.cancel)) as events:
                    for ev in events:
                        cached = ev.cached_tokens
                        drafts = ev.drafts.to_dict() if ev.drafts is not None else drafts
                        if ev.token is None:  # the runtime's closing summary: the Done below replaces it
                            continue
                        n += 1
                        last = time.perf_counter()
                        if first is None:
                            first = last
                        job._put(ev)
                        if job.cancel.is_set() or n >= job.params.max_new_tokens:
                            break
        except Exception as e:  # a failed generation answers its request; the server keeps serving
            with self._cv:
                self.stats.failed += 1
            job._put(Failed(f"generation failed: {type(e).__name__}: {e}"))
            return
        if job.cancel.is_set():
            reason = job.stop_reason
        else:
            reason = "length" if n >= job.params.max_new_tokens else "stop"
        with self._cv:
            self.stats.generated_tokens += n
            if reason == "cancelled":
                self.stats.cancelled += 1
                self.stats.last_cancelled_tokens = n
            else:
                self.stats.completed += 1
        first = first if first is not None else last
        job._put(Done(reason, len(job.prompt.ids), n, queue_s, first - start, last - first, cached, drafts))
