"""The small command line the drivers here share: the options they had as `quantkit bench NAME` (same flags,
parsers and help), their reports folder guarded as the package's benches guard theirs, and the house rule for
bad input (one `error:` line, a non-zero exit, nothing written).

A driver declares its function with `shared(...)` options and its own, and ends with
`sys.exit(run_command(command, argv, "NAME"))`; `python -m benchmarks.NAME --help` lists them."""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from quantkit.cli import ClickException, UsageError, err_console, error_line
from quantkit.cli.options import COUNT, COUNT0
from quantkit.errors import QuantkitError
from quantkit.fileio import atomic_write_json
from quantkit.outputs import guard_output, json_with_keys
from quantkit.threads import resolve_threads

ROOT = Path(__file__).resolve().parents[1]

# option name -> (flag, parser, help): the options the benches shared on the old `quantkit bench` group
SHARED: dict[str, tuple[str, Callable[[str], Any] | None, str]] = {
    "reports": ("--reports", None, "where the bench writes bench-NAME.{md,json,png}"),
    "workdir": ("--workdir", None, "generated checkpoints and files go here"),
    "threads": ("--threads", None, "CPU threads (default: every physical core)"),
    "reps": ("--reps", COUNT, "timed repetitions per point (the best is kept)"),
    "rounds": ("--rounds", COUNT, "interleaved rounds over every engine or configuration (the best is kept)"),
    "layers": ("--layers", COUNT, "decoder layers of the generated checkpoint"),
    "experts": ("--experts", COUNT, "routed experts per layer of the generated checkpoint"),
    "vocab": ("--vocab", COUNT, "vocabulary rows of the generated checkpoint (248320: the real model's)"),
    "model": ("--model", None, "a checkpoint or quantized folder to run instead of generating one"),
    "prompt_tokens": ("--prompt-tokens", COUNT, "prompt tokens (the prefill timed)"),
    "new_tokens": ("--new-tokens", COUNT, "greedy tokens generated per run"),
}


def shared(name: str, default: Any, *, zero: bool = False) -> Any:
    """The typer option `name` of SHARED with this driver's default (None: the driver's own choice, shown as
    auto). `zero`: a count that may be 0 (`--reps 0` where a bench has an untimed mode)."""
    flag, parser, text = SHARED[name]
    if zero:
        parser = COUNT0
    kw: dict[str, Any] = {"help": text, "show_default": default is not None}
    if parser is not None:
        kw["parser"] = parser
    return typer.Option(default, flag, **kw)


def llama_option(default: bool = True) -> Any:
    return typer.Option(default, "--llama/--no-llama", help="run llama.cpp beside quantkit")


def guard_reports(reports: Path, name: str) -> Path:
    """The files bench-NAME.{md,json,png} in `reports` go through the output guard before the bench runs: a
    file of that name that a bench did not write (its JSON records the command) is never replaced."""
    owned = json_with_keys("command")
    for ext in (".md", ".json", ".png"):
        guard_output(reports / f"bench-{name}{ext}", overwrite=True, create_parents=True, flag="--reports ",
                     owned=lambda p: owned(p if p.suffix == ".json" else p.with_suffix(".json")))
    return reports


def write_json(path: Path, data: Any) -> None:
    """A bench's JSON written atomically, its folder made first (the guard allowed a missing one; a long run must
    not end on it), as `write_atomic` does for the markdown."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, data)


def threads(n: int | None) -> int:
    """--threads checked (one line for 0 or more than this machine has); default every physical core."""
    return resolve_threads(n)


def command_line(name: str, argv: list[str]) -> str:
    """How the report records the run: the driver and the arguments it was given."""
    return " ".join(["python -m benchmarks." + name, *map(shlex.quote, argv)])


def child_env() -> dict[str, str]:
    """The environment of a driver's own child processes (`python -m benchmarks.NAME WORKER ...`): this
    checkout's root on the path, whatever folder the driver was started from."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else "")}


def run_command(command: Callable[..., Any], argv: list[str] | None, name: str) -> int:
    """Run `command` as `python -m benchmarks.NAME` on `argv` (default: the process's); the exit code. A bad
    option, a QuantkitError or an OSError is one `error:` line, as in quantkit's own CLI."""
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command()(command)
    prog = f"python -m benchmarks.{name}"
    try:
        rc = app(args=argv, prog_name=prog, standalone_mode=False)
    except QuantkitError as e:
        error_line(str(e))
        return 2
    except UsageError as e:
        error_line(f"{e.format_message()} (see `{prog} --help`)")
        return e.exit_code
    except ClickException as e:
        error_line(e.format_message())
        return e.exit_code
    except (KeyboardInterrupt, typer.Abort):
        err_console.print("interrupted")
        return 130
    except OSError as e:
        error_line(f"{e.filename}: {e.strerror or e}" if e.filename else str(e.strerror or e))
        return 1
    return rc if isinstance(rc, int) else 0
