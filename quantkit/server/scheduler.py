"""`BatchScheduler`: the server's one queue, N slots decoded together (`quantkit serve --parallel N`).

`JobLine`'s contract (quantkit/server/queue.py: `submit`, `admit`, `drain`, `close`, `stats`, `accepting`; a
bounded FIFO of waiting requests, 429 beyond it; each job's cancel flag; events and a last `Done` or `Failed`
through the job's asyncio queue), with up to `slots` requests generating at once: one worker thread runs
a `BatchGenerator` (quantkit/runtime/batch.py) over the backend's runtime. Waiting requests take the free slots
between two steps, all of them before the next step (a burst decodes together); a prompt is prefilled chunk
by chunk inside the running slots' steps (runtime/batch_prompts.py; with serve's default `--prefill rows`, a
shared start once), so a long prompt holds them up for one chunk at most; each step is one forward over the next
token of every decoding slot, the waiting prompts' chunks and its MTP drafts where the batch drafts them
(runtime/batch_drafts.py: one slot drafts as `generate` does, several where the larger step still pays); a slot
is freed at the step after its request ends (stop, length, cancel, client gone). `--parallel 1`
runs here too: one slot.
The `n` choices of one prompt (`submit_group`) are prefilled once: each choice that finds a free slot decodes
from a copy of the first one's prompt state.
Every request's tokens are the ones it gets served alone (tests/runtime/test_batch_decode.py,
tests/server/test_server_scheduler.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from quantkit.planner.slots import check_slots
from quantkit.runtime.batch import BatchGenerator
from quantkit.runtime.generate import TokenEvent
from quantkit.server.backend import Backend
from quantkit.server.queue import Done, Failed, Job, JobLine, QueueStats


@dataclass
class SlotStats(QueueStats):
    batch_size: int = 0  # rows in the last batch step
    peak_batch: int = 0  # the most rows a step has run

    @property
    def idle(self) -> int:
        return self.slots - self.running


@dataclass
class _Slot:
    job: Job
    start: float
    tokens: int = 0
    first: float | None = None
    last: float = 0.0
    cached: int = 0
    drafts: dict[str, int] | None = None  # the MTP counts of its response


class BatchScheduler(JobLine):
    def __init__(self, backend: Backend, max_waiting: int = 8, slots: int = 2):
        if max_waiting < 1:
            raise ValueError("max_waiting must be >= 1")
        check_slots(slots)
        runtime = getattr(backend, "runtime", None)
        if runtime is None:
            raise ValueError("a batch scheduler needs a backend on quantkit's runtime (RuntimeBackend)")
        self.backend = backend
        self.stats = SlotStats(max_waiting=max_waiting, slots=slots)
        self._batch = BatchGenerator(runtime, max_rows=slots)
        self._slots: dict[int, _Slot] = {}  # by BatchGenerator row
        self._start("quantkit-batch")

    def submit_group(self, jobs: list[Job]) -> None:
        """The choices of one request, in order, as one request (one place: `admit`); each choice of one prompt
        (`Job.group`) that finds a free slot then takes a copy of the first one's prefilled state
        (`BatchGenerator.fork`)."""
        self._enqueue(jobs)

    # ---- the worker ----
    def _next(self) -> Job | None:
        """A waiting job with a free slot (blocking while nothing runs), or None."""
        with self._cv:
            while not self._line and not self._holders and not self._closed:
                self._cv.wait()
            if not self._line or self._free() <= 0:
                return None
            return self._take()

    def _work(self) -> None:
        while True:
            # every waiting request that has a free slot is seated before the next step: a burst decodes together
            while (job := self._next()) is not None:
                self._admit(job)
            with self._cv:
                if self._closed and not self._holders and not self._line:
                    return
            if len(self._batch):
                self._guarded(lambda: self._deliver(self._batch.step()))

    def _admit(self, job: Job) -> None:
        """The job's prompt into a free slot: a batch row whose prompt is prefilled inside the next steps."""
        row = self._seat(job, lambda: self._batch.add(
            ids=job.prompt.ids, sampling=job.params, cancel=job.cancel, enable_thinking=job.prompt.opens_reasoning))
        if row is not None:
            self._fork_siblings(job, row)

    def _seat(self, job: Job, make_row: Callable[[], int]) -> int | None:
        """`job`, holding its slot (`_take`), into a batch row through `make_row` (a prefill, or a fork of a
        sibling's prompt state): its row, or None where it ended first (cancelled, the server closing) or
        `make_row` failed for it alone."""
        start = time.perf_counter()
        if self._closed:
            job.stop()
        if job.cancel.is_set():
            self._finish(_Slot(job, start, last=start), None)
            return None
        try:
            row = make_row()
        except Exception as e:  # this request fails alone; the running slots go on
            self._fail([job], e)
            return None
        with self._cv:
            self._slots[row] = _Slot(job, start, last=start)
        return row

    def _fork_siblings(self, job: Job, row: int) -> None:
        """The next waiting choices of `job`'s prompt, into free slots, each in a copy of `row`'s prompt state."""
        while job.group is not None and row in self._batch.rows:  # not when its prefill was cancelled
            with self._cv:
                if not self._line or self._line[0].group is not job.group or self._free() <= 0:
                    return
                sib = self._take()
            self._seat(sib, lambda sib=sib: self._batch.fork(row, sib.params, cancel=sib.cancel))

    def _deliver(self, events: list[tuple[int, TokenEvent]]) -> None:
        """A step's events to their jobs; an ended row's `Done`, its slot freed."""
        self.stats.batch_size = len({r for r, ev in events if ev.response is None})  # rows (a verify gives several)
        self.stats.peak_batch = max(self.stats.peak_batch, self.stats.batch_size)
        for row, ev in events:
            s = self._slots.get(row)
            if s is None:
                continue
            s.cached = ev.cached_tokens
            if ev.response is not None:
                s.drafts = ev.response.mtp
                err = self._batch.errors.pop(row, None)
                if err is not None:
                    with self._cv:
                        self._slots.pop(row, None)
                    self._fail([s.job], err)
                else:
                    self._finish(s, row)
                continue
            s.tokens += 1
            s.last = time.perf_counter()
            s.first = s.first if s.first is not None else s.last
            s.job._put(ev)

    def _finish(self, s: _Slot, row: int | None) -> None:
        job = s.job
        if job.cancel.is_set():
            reason = job.stop_reason
        else:
            reason = "length" if s.tokens >= job.params.max_new_tokens else "stop"
        with self._cv:
            if row is not None:
                self._slots.pop(row, None)
            self.stats.generated_tokens += s.tokens
            if reason == "cancelled":
                self.stats.cancelled += 1
                self.stats.last_cancelled_tokens = s.tokens
            else:
                self.stats.completed += 1
            self._ended(job)  # the slot is free before its client has the answer
        first = s.first if s.first is not None else s.last
        job._put(Done(reason, len(job.prompt.ids), s.tokens, s.start - job.submitted, first - s.start, s.last - first,
                      s.cached, s.drafts))

    def _guarded(self, fn: Any) -> None:
        """A failed step fails every running request (their states are no longer known good); the server keeps
        serving the next ones from a fresh batch."""
        try:
            fn()
        except Exception as e:
            jobs = [s.job for s in self._slots.values()]
            with self._cv:
                self._slots.clear()
            self._batch = BatchGenerator(self._batch.rt, max_rows=self.stats.slots)
            self._fail(jobs, e)

    def _fail(self, jobs: list[Job], e: Exception) -> None:
        """`jobs` (each holding its slot) end with `Failed`."""
        with self._cv:
            self.stats.failed += len(jobs)
            for job in jobs:
                self._ended(job)
        for job in jobs:
            job._put(Failed(f"generation failed: {type(e).__name__}: {e}"))
