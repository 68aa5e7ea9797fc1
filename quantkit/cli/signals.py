"""SIGTERM (what systemd, Docker and Kubernetes send to stop a process) as an exception in the main thread.

Python's default for SIGTERM ends the process on the spot: no `finally`, a temporary left where a write was
cut. Under `sigterm_raises()` it raises `Terminated` instead (a BaseException, so no `except Exception` or
Ctrl-C handler swallows it): `chat` and `generate` unwind (their files are written atomically, a cut write's
temporary removed) and `quantkit.cli.main` ends them with one line and exit 143 (128 + SIGTERM, as a shell
reports it); `serve` hands it to uvicorn, whose stop is its normal end (exit 0).
"""

from __future__ import annotations

import contextlib
import functools
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

EXIT_CODE = 128 + signal.SIGTERM


class Terminated(BaseException):
    """The process was sent SIGTERM."""


def _raise(signum: int, frame: FrameType | None) -> None:
    raise Terminated


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """SIGTERM raises `Terminated` in the main thread while inside (elsewhere: nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def on_sigterm_raise(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A command run under `sigterm_raises` (its signature kept for Typer)."""
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with sigterm_raises():
            return fn(*args, **kwargs)
    return run
