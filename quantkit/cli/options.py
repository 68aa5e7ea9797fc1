"""Validated numeric options for the Typer CLI: every number a user types is checked here, at the boundary,
once: finite (no nan, no inf), an integer where one is meant, inside its range, and the range is in the error
message (`Invalid value for '--temperature': 'nan' is not a finite number in [0, 100]`). Commands declare
`typer.Option(0.6, "--temperature", parser=TEMPERATURE)`; the rest of quantkit may assume sane values.

`0` never silently means "default": an option whose default is "unset" is declared with `None`."""

from __future__ import annotations

import math
from collections.abc import Callable

import typer


def _fmt(x: float | None) -> str:
    if x is None:
        return "inf"
    return f"{x:g}" if isinstance(x, float) and not float(x).is_integer() else f"{int(x):,}".replace(",", "_")


def number(lo: float | None = None, hi: float | None = None, *, integer: bool = False,
           lo_open: bool = False) -> Callable[[str], float | int]:
    """A parser for a finite number in [lo, hi] (lo excluded with `lo_open`); `integer` wants a whole number."""
    kind = "an integer" if integer else "a finite number"
    span = f"{'(' if lo_open else '['}{_fmt(lo) if lo is not None else '-inf'}, {_fmt(hi)}]"

    def parse(text: str | float | int) -> float | int:
        if isinstance(text, (int, float)) and not isinstance(text, bool):
            raw = str(text)
        else:
            raw = str(text).strip()
        try:
            value: float | int = int(raw, 10) if integer else float(raw)
        except (ValueError, OverflowError):
            raise typer.BadParameter(f"{raw!r} is not {kind} in {span}") from None
        if not integer and not math.isfinite(value):
            raise typer.BadParameter(f"{raw!r} is not {kind} in {span}")
        below = lo is not None and (value <= lo if lo_open else value < lo)
        if below or (hi is not None and value > hi):
            raise typer.BadParameter(f"{raw!r} is out of range: give {kind} in {span}")
        return value

    parse.__name__ = "integer" if integer else "number"
    return parse


def count(lo: int = 1, hi: int = 1 << 31) -> Callable[[str], float | int]:
    return number(lo, hi, integer=True)


TEMPERATURE = number(0, 100)
TOP_P = number(0, 1, lo_open=True)
TOP_K = count(0, 1 << 31)
SEED = count(0, (1 << 63) - 1)
MAX_TOKENS = count(1, 1 << 24)
CONTEXT = count(1, 1 << 24)
GROUP_SIZE = count(1, 1 << 16)
PORT = count(0, 65535)
TFLOPS = number(0, 1e7, lo_open=True)
COUNT = count(1)
COUNT0 = count(0)
SECONDS = number(1, 86400)
FRACTION = number(0, 1, lo_open=True)
