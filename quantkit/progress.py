"""The progress callback the long-running jobs (quantize, export) report to; the CLI renders it with rich."""

from __future__ import annotations

from typing import Protocol


class Progress(Protocol):
    def start(self, tensors: int, nbytes: int) -> None: ...
    def advance(self, name: str, nbytes: int, tensor_done: bool) -> None: ...


class NoProgress:
    """Reports nowhere (library use, tests)."""

    def start(self, tensors: int, nbytes: int) -> None:
        pass

    def advance(self, name: str, nbytes: int, tensor_done: bool) -> None:
        pass
