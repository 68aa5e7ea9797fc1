"""The Typer app. Each command group lives in its own module here and registers itself on `app`;
the commands only parse arguments and render results."""

from __future__ import annotations

import sys

import typer
from rich.console import Console

from quantkit.errors import QuantkitError

app = typer.Typer(
    name="quantkit",
    help="Plan, quantize and run Qwen-AgentWorld-35B-A3B on the hardware you own.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
console = Console()
err_console = Console(stderr=True)

# Command modules register on `app` when imported; keep this list in one place.
_COMMAND_MODULES = ["plan", "tiny", "quantize", "runtime", "export", "serve", "bench", "calibrate"]


def _register() -> None:
    import importlib

    for mod in _COMMAND_MODULES:
        importlib.import_module(f"quantkit.cli.{mod}")


def fail(message: str, code: int = 2) -> None:
    """Print one clean error line and exit non-zero."""
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def main() -> None:
    _register()
    try:
        app()
    except QuantkitError as e:
        err_console.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except KeyboardInterrupt:
        err_console.print("interrupted")
        sys.exit(130)
