"""The progress of the long jobs (quantize, export, stats): a rich bar on a terminal (tensors done, bytes/s,
elapsed and ETA); where the output is not a terminal (`quantize ... > log 2>&1`, CI), a plain line every few
seconds with the same figures, and one at the end, so a log shows the job moving. A job that counts steps, not
tensors (a model's load, `profile-host`), reports through `step_status` the same way: a status line rewritten in
place on a terminal, a plain line every few seconds elsewhere."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

PLAIN_EVERY_S = 5.0


def _clock(s: float) -> str:
    s = int(s)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class RichProgress:
    """quantkit.progress.Progress onto one rich task (or plain lines, see the module docstring)."""

    def __init__(self, progress: Progress, what: str, every_s: float = PLAIN_EVERY_S):
        self.p = progress
        self.what = what
        self.task = None
        self.total = 0
        self.done = 0
        self.plain = not progress.console.is_terminal
        self.every_s = every_s
        self.nbytes = self.bytes_done = 0
        self.t0 = self.last = 0.0

    def start(self, tensors: int, nbytes: int) -> None:
        self.total = tensors
        self.done = 0
        self.nbytes, self.bytes_done = nbytes, 0
        self.t0 = time.monotonic()
        self.last = float("-inf")
        self.task = self.p.add_task(self.what, total=nbytes, tensors=f"0/{tensors}", name="")

    def advance(self, name: str, nbytes: int, tensor_done: bool) -> None:
        if tensor_done:
            self.done += 1
        self.bytes_done += nbytes
        short = name.removeprefix("model.language_model.")
        self.p.update(self.task, advance=nbytes, tensors=f"{self.done}/{self.total}", name=short)
        if self.plain:
            now = time.monotonic()
            if now - self.last >= self.every_s or (self.done == self.total and tensor_done):
                self.last = now
                self._line(short, now)

    def _line(self, name: str, now: float) -> None:
        el = now - self.t0
        frac = self.bytes_done / self.nbytes if self.nbytes else self.done / max(self.total, 1)
        rate = self.bytes_done / el / 1e6 if el > 0 else 0.0
        eta = f", ETA {_clock(el * (1 - frac) / frac)}" if 0 < frac < 1 else ""
        self.p.console.print(f"{self.what}: {self.done}/{self.total} tensors, {frac:.1%}, {rate:.0f} MB/s, "
                             f"{_clock(el)} elapsed{eta} ({name})", highlight=False, soft_wrap=True)


def tensor_progress(console: Console) -> Progress:
    """A transient bar (it clears when the job ends; the result table follows)."""
    return Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[tensors]} tensors"),
                    TextColumn("{task.percentage:>5.1f}%"), TransferSpeedColumn(), TimeElapsedColumn(),
                    TimeRemainingColumn(), TextColumn("[dim]{task.fields[name]}"), console=console,
                    transient=True)


@contextmanager
def step_status(console: Console, what: str, every_s: float = PLAIN_EVERY_S) -> Iterator[Callable[[str], None]]:
    """`with step_status(err_console, "loading X") as say: ... say("layer 3/40")`: on a terminal a status line
    (`loading X: layer 3/40`) that clears when the step ends; elsewhere (a log) a plain line every `every_s`
    seconds while the step runs, with its latest step and the time so far, even through a stretch that reports
    nothing. A step that ends (or fails) sooner prints nothing, so an error stays its one line."""
    if console.is_terminal:
        with console.status(what) as st:
            yield lambda step: st.update(f"{what}: {step}")
        return
    latest = [""]
    done = threading.Event()
    t0 = time.monotonic()

    def beat() -> None:
        while not done.wait(every_s):
            step = f": {latest[0]}" if latest[0] else ""
            console.print(f"{what}{step} ({_clock(time.monotonic() - t0)} elapsed)", highlight=False,
                          soft_wrap=True)

    thread = threading.Thread(target=beat, name="quantkit-progress", daemon=True)
    thread.start()
    try:
        yield lambda step: latest.__setitem__(0, step)
    finally:
        done.set()
        thread.join()
