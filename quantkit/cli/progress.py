"""The rich progress bar of the long jobs (quantize, export): tensors done, bytes/s, elapsed and ETA."""

from __future__ import annotations

from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)


class RichProgress:
    """quantkit.progress.Progress onto one rich task."""

    def __init__(self, progress: Progress, what: str):
        self.p = progress
        self.what = what
        self.task = None
        self.total = 0
        self.done = 0

    def start(self, tensors: int, nbytes: int) -> None:
        self.total = tensors
        self.done = 0
        self.task = self.p.add_task(self.what, total=nbytes, tensors=f"0/{tensors}", name="")

    def advance(self, name: str, nbytes: int, tensor_done: bool) -> None:
        if tensor_done:
            self.done += 1
        self.p.update(self.task, advance=nbytes, tensors=f"{self.done}/{self.total}",
                      name=name.removeprefix("model.language_model."))


def tensor_progress(console: Console) -> Progress:
    """A transient bar (it clears when the job ends; the result table follows)."""
    return Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[tensors]} tensors"),
                    TextColumn("{task.percentage:>5.1f}%"), TransferSpeedColumn(), TimeElapsedColumn(),
                    TimeRemainingColumn(), TextColumn("[dim]{task.fields[name]}"), console=console,
                    transient=True)
