"""Validated numeric options for the Typer CLI: every number a user types is checked here, at the boundary,
once: finite (no nan, no inf), an integer where one is meant, inside its range, and the range is in the error
message (`Invalid value for '--temperature': 'nan' is not a finite number in [0, 100]`). Commands declare
`typer.Option(0.6, "--temperature", parser=TEMPERATURE)`; the rest of quantkit may assume sane values.

`0` never silently means "default": an option whose default is "unset" is declared with `None`.

One vocabulary across commands (tests/cli/test_cli_vocabulary.py holds every flag to one meaning): `-c/--context`
takes `64k` everywhere (`tokens`), `--max-tokens` is the one generation cap, `--scheme NAME|FILE` names a
quantization (a recipe's name or a JSON recipe file), `--mtp N` is always tokens drafted per step while
`--mtp-layer/--no-mtp-layer` says whether a written file carries the layer, `--experts` counts experts. An old
spelling keeps working for one release with a one-line notice (`renamed`, `notice`)."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import typer

from quantkit.cli import err_console
from quantkit.errors import QuantkitError
from quantkit.planner.hardware import MAX_NODES
from quantkit.planner.slots import MAX_SLOTS


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


# the default model's max_position_embeddings: `262k` means it (262 x 1024 overshoots it by the 1000/1024
# difference), as `plan -c` reads it
DEFAULT_MAX_CONTEXT = 262144


def tokens(lo: int = 1, hi: int = 1 << 24) -> Callable[[str], float | int]:
    """A parser for a token count: `4096` or `64k` (k = 1024; `262k` = 262144, the model's maximum)."""
    base = number(lo, hi, integer=True)

    def parse(text: str | int) -> float | int:
        raw = str(text).strip().lower()
        m = re.fullmatch(r"(\d+)\s*k", raw)
        if m:
            n = int(m.group(1))
            raw = str(DEFAULT_MAX_CONTEXT if n * 1024 > DEFAULT_MAX_CONTEXT >= n * 1000 else n * 1024)
        try:
            return base(raw)
        except typer.BadParameter:
            raise typer.BadParameter(f"{str(text).strip()!r} is not a token count in [{_fmt(lo)}, {_fmt(hi)}] "
                                     "(write 4096 or 64k)") from None

    parse.__name__ = "tokens"
    return parse


def renamed(value: Any, old_value: Any, new: str, old: str, default: Any = None) -> Any:
    """The option's value whichever name gave it: the old spelling works for one release, with a notice."""
    if old_value is None:
        return default if value is None else value
    if value is not None:
        raise QuantkitError(f"{old} is the old name of {new}: give {new} only")
    notice(old, new)
    return old_value


def notice(old: str, new: str) -> None:
    """The one line an old spelling prints (stderr): what to write instead, and that the old one is going."""
    err_console.print(f"[yellow]notice:[/] {old} is now {new}; the old name goes in the next release",
                      highlight=False, soft_wrap=True, markup=True)


# `--mtp N`: tokens the MTP layer drafts per step (speculative decoding); 0 = the MTP layer is not used
MTP_DRAFT = number(0, 3, integer=True)
MTP_HELP = ("tokens the model's MTP layer drafts per step, 0-3 (0: off) [default: auto, the count that measures "
            "fastest here, none where drafting does not pay]")
TEMPERATURE = number(0, 100)
TOP_P = number(0, 1, lo_open=True)
TOP_K = count(0, 1 << 31)
SEED = count(0, (1 << 63) - 1)
MAX_TOKENS = count(1, 1 << 24)
CONTEXT = tokens()
GROUP_SIZE = count(1, 1 << 16)
PORT = count(0, 65535)
TFLOPS = number(0, 1e7, lo_open=True)
# The bound of a plain count (steps, passes, layers, experts, clients, requests, snapshots, sequences): what a
# command loops over or allocates per unit, so no option may be unbounded. A million is beyond any real use of
# each option that takes one; counts that multiply the work have tighter bounds of their own (NODES).
MAX_COUNT = 1 << 20
COUNT = count(1, MAX_COUNT)
COUNT0 = count(0, MAX_COUNT)
# `serve --max-n`: every choice of a request is a sequence decoded at once; OpenAI's API takes n up to 128
MAX_N_CHOICES = count(1, 128)
# `stats --chunk-size`: a calibration sequence, 16 tokens at least (quantize/calib_data.py), at most a context
CHUNK = tokens(16, 1 << 18)
# `plan --nodes`: the planner's bound (quantkit/planner/hardware.py says why; the GPUs in all have one too)
NODES = count(1, MAX_NODES)
# `plan --parallel` and `serve --parallel`: one range, the slots the server decodes together (quantkit/planner/slots.py)
PARALLEL = count(1, MAX_SLOTS)
SECONDS = number(1, 86400)
FRACTION = number(0, 1, lo_open=True)
