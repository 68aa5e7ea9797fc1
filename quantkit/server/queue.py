"""The server's line of requests: jobs, admission and shutdown (`JobLine`); quantkit/server/scheduler.py's
`BatchScheduler` is the one line, its worker thread running the batch loop over `slots` rows.

Each job carries a cancel flag: the HTTP layer sets it when the client goes away or a stop string is seen, a
waiting job is then skipped and a running one ends at its next token. Events reach the request's coroutine
through its own asyncio queue.

Admission, the one 429 bound (`JobLine.admit`): a request is admitted before its body is read and holds its
place (a `Ticket`) until it ends. With `slots` requests decoding at once and `max_waiting` (--max-queue), a
request is admitted while the requests holding no slot, it included, are at most `max_waiting` plus the free
slots: `slots` run and `max_waiting` wait, however fast the worker seats them, and a request about to take a free slot is not counted as waiting. `stats.waiting` is the
requests that find no free slot (at most `max_waiting`), `stats.running` the slots in use. A request's `n`
choices are one request; each choice takes its own slot.

`drain` (the server's shutdown) refuses new requests and ends every waiting and running one at once: each
gets `Closed` (its answer: a 503, or a stream's error event) and the worker stops its job at the next token or
prefill chunk.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from quantkit.runtime.generate import SamplingParams
from quantkit.server.backend import Prompt


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
class Closed:
    """The server is shutting down: this job was ended before its answer was complete."""


class Ticket:
    """One admitted request's place (`JobLine.admit`): given back by `JobLine.release`, or by the queue once
    `jobs` jobs carrying it have ended, whichever comes first."""

    def __init__(self, jobs: int = 1):
        self.jobs = jobs  # jobs still to end
        self.seated = 0  # of its jobs, those holding a slot
        self.released = False


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
    ticket: Ticket | None = None  # the request's place (None: `submit` admits it)

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
    slots: int = 1  # requests decoded together at most
    waiting: int = 0  # admitted requests that find no free slot (at most max_waiting)
    running: int = 0  # slots in use: jobs being prefilled or decoded
    admitted: int = 0  # requests held: being read or rendered, waiting, or generating
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    rejected: int = 0
    generated_tokens: int = 0
    last_cancelled_tokens: int | None = None  # tokens a cancelled job had made when it stopped

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class JobLine:
    """The scheduler's line: waiting jobs, one worker thread, admission (the module docstring;
    `QueueFull` past it), the slots in use and a drain that ends everything. A subclass fills `stats` (with its
    `slots`), then calls `_start`; its worker takes a job from the line with its slot (`_take`) and gives the
    slot back when the job's last event is out (`_ended`)."""

    stats: QueueStats

    def _start(self, name: str) -> None:
        self._line: collections.deque[Job] = collections.deque()
        self._cv = threading.Condition()
        self._closed = False
        self._holders: dict[int, Job] = {}  # jobs holding a slot (being prefilled or decoded), by id()
        self._unseated = 0  # admitted requests none of whose jobs holds a slot
        self._held = 0  # admitted requests not yet given back
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def _work(self) -> None:
        raise NotImplementedError

    @property
    def accepting(self) -> bool:
        return not self._closed and self._thread.is_alive()

    def _check_open(self) -> None:
        if self._closed or not self._thread.is_alive():
            raise QueueClosed("the server is shutting down")

    # ---- admission: the one bound ----
    def admit(self, jobs: int = 1) -> Ticket:
        """A place for one request (QueueFull when `max_waiting` requests already find no free slot)."""
        with self._cv:
            self._check_open()
            waiting = self._unseated - self._free()
            if waiting + 1 > self.stats.max_waiting:
                self.stats.rejected += 1
                raise QueueFull(f"{waiting} requests are already waiting for one of the {self.stats.slots} "
                                f"slot{'s' if self.stats.slots > 1 else ''} (--max-queue {self.stats.max_waiting}); "
                                "retry later")
            self._held += 1
            self._unseated += 1
            self._count()
            return Ticket(jobs)

    def release(self, ticket: Ticket) -> None:
        """Give a request's place back (its answer is over; again is harmless)."""
        with self._cv:
            self._release(ticket)
            self._count()

    def _release(self, t: Ticket) -> None:
        if not t.released:
            t.released = True
            self._held -= 1
            if t.seated == 0:
                self._unseated -= 1

    def _free(self) -> int:
        return self.stats.slots - len(self._holders)

    def _count(self) -> None:
        """`stats` from the counts (under the lock)."""
        self.stats.running = len(self._holders)
        self.stats.waiting = max(0, self._unseated - self._free())
        self.stats.admitted = self._held

    def submit(self, job: Job) -> None:
        self._enqueue([job])

    def _enqueue(self, jobs: list[Job]) -> None:
        """A request's jobs, in order, at the end of the line: under the first's ticket (the app's `admit`),
        or admitted here (`QueueFull`)."""
        with self._cv:
            self._check_open()
            ticket = jobs[0].ticket or self.admit(len(jobs))
            for j in jobs:
                j.ticket = ticket
            self._line.extend(jobs)
            self._cv.notify()

    # ---- the worker's side (under the lock) ----
    def _take(self) -> Job:
        """The first job of the line, with a slot (the caller saw both)."""
        job = self._line.popleft()
        self._holders[id(job)] = job
        t = job.ticket
        assert t is not None
        if t.seated == 0 and not t.released:
            self._unseated -= 1
        t.seated += 1
        self._count()
        return job

    def _ended(self, job: Job) -> None:
        """`job`'s last event is out: its slot is free, and its request's place too once its last job ended."""
        t = job.ticket
        assert t is not None
        if self._holders.pop(id(job), None) is not None:
            t.seated -= 1
            if t.seated == 0 and not t.released:
                self._unseated += 1
        t.jobs -= 1
        if t.jobs <= 0:
            self._release(t)
        self._count()

    # ---- shutdown ----
    def drain(self) -> None:
        """Refuse new requests and end every waiting and running job now: each gets `Closed` at once, the
        worker stops it at its next token or prefill chunk. Returns without waiting for the worker."""
        with self._cv:
            self._closed = True
            for job in [*self._line, *self._holders.values()]:
                if not job.cancel.is_set():  # (one already stopped gets its Done from the worker)
                    job.stop()
                    job._put(Closed())
            self._cv.notify_all()

    def close(self, timeout: float = 10.0) -> bool:
        """`drain`, then wait for the worker to end (False: it did not within `timeout` seconds)."""
        self.drain()
        self._thread.join(timeout)
        return not self._thread.is_alive()
