"""The Typer app. Each command group lives in its own module here and registers itself on `app`;
the commands only parse arguments and render results."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer
import typer.core
from rich.console import Console, ConsoleDimensions

from quantkit.cli.signals import EXIT_CODE as TERMINATED_EXIT
from quantkit.cli.signals import Terminated
from quantkit.errors import QuantkitError
from quantkit.termtext import escaped

try:  # typer >= 0.2x carries its own copy of click; its exceptions are those raised
    from typer._click.exceptions import ClickException, NoArgsIsHelpError, UsageError
except ImportError:  # pragma: no cover - typer on the PyPI click
    from click.exceptions import ClickException, NoArgsIsHelpError, UsageError

# `quantkit --help` lists the commands a user runs first, in the order of the job (plan, quantize, run, export),
# then the developer tools in their own panel (DEV_PANEL); a command missing here is listed after these.
USER_COMMANDS = ("plan", "quantize", "verify", "chat", "generate", "serve", "export", "inspect", "gpus", "stats")
DEV_COMMANDS = ("bench", "tiny-model", "profile-host")
DEV_PANEL = "Developer tools"


# One name per kind of positional argument, whatever a command calls its parameter: what `--help` shows, set
# where every command is built (`_house_style`), so a new command's arguments follow without a copy.
POSITIONAL = {"model": "MODEL", "model_dir": "MODEL", "src": "MODEL", "folder": "MODEL",
              "out": "OUT", "out_dir": "OUT", "stats_file": "STATS"}
# ... and one value name per shared option whose type says less than its help (`-c 32k` is not an <int>)
OPTION_METAVARS = {"--context": "TOKENS"}
ROOT_HELP = "Plan, quantize and run Qwen-AgentWorld-35B-A3B on the hardware you own."


def _model_path(ctx: Any, param: Any, value: Any) -> Any:
    """Every MODEL argument passes here first: a GGUF file is told in one line what quantkit runs instead."""
    if value is not None and str(value):
        from quantkit.checkpoint.reader import refuse_gguf  # lazy: only a command being run pays for it

        refuse_gguf(value)
    return value


def _house_style(cmd: Any) -> Any:
    """One help style on a built command (and a group's commands): the positional names of POSITIONAL and the
    value names of OPTION_METAVARS, the GGUF check on MODEL, and help text printed as written (rich would read
    `[default: auto]` as markup)."""
    if cmd is None or getattr(cmd, "_quantkit_styled", False):
        return cmd
    from rich.markup import escape

    cmd._quantkit_styled = True
    for sub in (getattr(cmd, "commands", None) or {}).values():
        _house_style(sub)
    for attr in ("help", "short_help"):
        if getattr(cmd, attr, None):
            setattr(cmd, attr, escape(getattr(cmd, attr)))
    for p in cmd.params:
        if getattr(p, "help", None):
            p.help = escape(p.help)
        shared = next((OPTION_METAVARS[o] for o in p.opts if o in OPTION_METAVARS), None)
        if shared and p.metavar is None:
            p.metavar = shared
        if p.param_type_name == "argument" and p.name in POSITIONAL:
            p.metavar = POSITIONAL[p.name]
            if p.metavar == "MODEL" and p.callback is None:
                p.callback = _model_path
    return cmd


class _OrderedGroup(typer.core.TyperGroup):
    def list_commands(self, ctx: Any) -> list[str]:
        order = {n: i for i, n in enumerate((*USER_COMMANDS, *DEV_COMMANDS))}
        names = super().list_commands(ctx)
        return sorted(names, key=lambda n: order.get(n, len(order)))

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        return _house_style(super().get_command(ctx, cmd_name))


app = typer.Typer(
    name="quantkit",
    cls=_OrderedGroup,
    help=ROOT_HELP,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version() -> str:
    from quantkit import __version__

    return f"quantkit {__version__}"


def _print_version(value: bool) -> None:
    if value:
        print(_version())
        raise typer.Exit()


@app.callback(help=ROOT_HELP)
def _root(version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                       help="print quantkit's version and exit")) -> None:
    pass
# Where the output is not a terminal (a pipe, a log, CI) and COLUMNS does not say otherwise: tables are not cut
# and text is not re-wrapped at rich's 80-column guess; one line stays one line.
PIPE_WIDTH = 4096


class PlainConsole(Console):
    """The CLI's console. Text is printed as given: markup is off unless a call passes `markup=True` (a path or
    a hint such as `pip install "quantkit[engines]"` keeps its brackets), and where the output is not a
    terminal nothing is cut or re-wrapped (PIPE_WIDTH, soft wrap)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(markup=False, **kw)
        if kw.get("width") is None:
            self._width = None  # rich reads COLUMNS once here; read it when printing (it may be set after import)

    def _piped(self) -> bool:
        return not self.is_terminal and self._width is None and "COLUMNS" not in self._environ

    @property
    def size(self) -> ConsoleDimensions:
        dims = Console.size.fget(self)  # type: ignore[attr-defined]
        return ConsoleDimensions(PIPE_WIDTH, dims.height) if self._piped() else dims

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        Console.size.fset(self, new_size)  # type: ignore[attr-defined]

    @property
    def soft_wrap(self) -> bool:
        return self._soft_wrap or self._piped()

    @soft_wrap.setter
    def soft_wrap(self, value: bool) -> None:
        self._soft_wrap = value


console = PlainConsole()
err_console = PlainConsole(stderr=True)

# Command modules register on `app` when imported; keep this list in one place.
_COMMAND_MODULES = ["plan", "quantize", "stats", "runtime", "serve", "export", "tiny", "bench", "calibrate"]


# The module each command lives in: `quantkit quantize ...` imports that module alone (every module costs its
# imports on every run, and torch's dominate start-up). tests/cli/test_cli_lazy.py holds this map to the modules.
COMMAND_MODULE = {"plan": "plan", "gpus": "plan", "inspect": "plan", "tiny-model": "tiny", "quantize": "quantize",
                  "verify": "quantize", "stats": "stats", "chat": "runtime", "generate": "runtime",
                  "export": "export", "serve": "serve", "bench": "bench", "profile-host": "calibrate",
                  "calibrate": "calibrate"}  # calibrate: profile-host's old name, hidden


def _register(command: str | None = None) -> None:
    """Import the command modules (each registers its commands on `app`): only `command`'s when it names one
    and that module gives the app two commands or more (with one, Typer would run it without its name)."""
    import importlib

    mod = COMMAND_MODULE.get(command or "")
    if mod is not None:
        importlib.import_module(f"quantkit.cli.{mod}")
        if len(app.registered_commands) + len(app.registered_groups) >= 2:
            return
    for mod in _COMMAND_MODULES:
        importlib.import_module(f"quantkit.cli.{mod}")


def quiet_gc_while(load: Callable[..., Any], *args: Any) -> None:
    """Run `load` (the imports of a command: torch and its modules) with the cyclic garbage collector off, then
    freeze what it made: the collector's passes over those few hundred thousand objects cost about a tenth of
    torch's import and again, each full pass, during a run; they hold no garbage cycles worth the scans."""
    import gc

    if gc.get_freeze_count():  # frozen once already (main() called again in one process, as tests do)
        load(*args)
        return
    was = gc.isenabled()
    gc.disable()
    try:
        load(*args)
    finally:
        gc.freeze()
        if was:
            gc.enable()


def print_table(table: Any, to: Console | None = None) -> None:
    """A table with its title on a line of its own, never wrapped: rich wraps a title to the table's width, which
    breaks a long path or sentence over lines in a log."""
    out = to or console
    if table.title:
        out.print(table.title, style="italic", highlight=False, soft_wrap=True)
        table.title = None
    out.print(table)


def fail(message: str, code: int = 2) -> None:
    """Print one clean error line and exit non-zero."""
    error_line(message)
    raise typer.Exit(code)


def error_line(message: str) -> None:
    """Print ONE `error: ...` line on stderr, the one way every error line is written: whitespace (a newline in
    a path, click's wrapped text) folded to spaces, control bytes written out (`\\x1b`: a path or value a user
    gave cannot drive the terminal) and brackets printed as they are (never read as rich markup)."""
    from rich.markup import escape

    text = " ".join(escaped(str(message)).split())
    err_console.print(f"[bold red]error:[/] {escape(text)}", highlight=False, soft_wrap=True, markup=True)


def _help_cache() -> Path | None:
    """Where `quantkit --help`'s text is kept for this CLI's sources and this terminal width (None: no cache)."""
    import hashlib
    import shutil

    here = Path(__file__).parent
    h = hashlib.sha256(str(shutil.get_terminal_size().columns).encode())
    try:
        for f in sorted([*here.glob("*.py"), here.parent / "__init__.py"]):
            st = f.stat()
            h.update(f"{f.name}:{st.st_mtime_ns}:{st.st_size};".encode())
    except OSError:
        return None
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "quantkit" / "help"
    return root / f"root-{h.hexdigest()[:16]}.txt"


def _root_help(args: list[str]) -> None:
    """`quantkit` and `quantkit --help`: the command list without importing the commands' modules (torch: the
    slow part of start-up) when it was rendered before for the same sources and terminal width; rendered and
    kept otherwise."""
    cache = _help_cache()
    try:
        text = cache.read_text() if cache is not None else None
    except OSError:
        text = None
    if text is None:
        import contextlib
        import io

        import typer.main

        _register()
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            typer.main.get_command(app).main(["--help"], prog_name="quantkit", standalone_mode=False)
        text = buf.getvalue()
        if cache is not None:
            with contextlib.suppress(OSError):
                from quantkit.fileio import write_atomic  # lazy: only a help-cache miss writes a file

                write_atomic(cache, text)
    sys.stdout.write(text)
    sys.exit(0 if args else 2)  # bare `quantkit` is a usage error, as before


def main() -> None:
    """Run the CLI. Every failure a user can cause ends in ONE `error:` line and a non-zero exit: a
    QuantkitError (exit 2), a bad option or argument (click's usage error, exit 2), an OSError that escaped
    a command (the file and the system's reason, exit 1). Tracebacks are for quantkit's own bugs only."""
    if sys.argv[1:] in ([], ["--help"], ["-h"]):
        _root_help(sys.argv[1:])
    if sys.argv[1:] == ["--version"]:  # without importing a command (torch)
        print(_version())
        sys.exit(0)
    quiet_gc_while(_register, sys.argv[1] if len(sys.argv) > 1 else None)
    try:
        rc = app(standalone_mode=False, prog_name="quantkit")
    except QuantkitError as e:
        error_line(str(e))
        sys.exit(2)
    except NoArgsIsHelpError as e:
        print(e.format_message())
        sys.exit(2)
    except UsageError as e:
        hint = f" (see `{' '.join(['quantkit', *e.ctx.command_path.split()[1:]])} --help`)" if e.ctx else ""
        error_line(e.format_message() + hint)
        sys.exit(e.exit_code)
    except ClickException as e:
        error_line(e.format_message())
        sys.exit(e.exit_code)
    except (KeyboardInterrupt, typer.Abort):
        err_console.print("interrupted")
        sys.exit(130)
    except Terminated:  # SIGTERM under sigterm_raises (chat, generate): unwound, nothing half-written
        err_console.print("terminated")
        sys.exit(TERMINATED_EXIT)
    except OSError as e:
        where = f"{e.filename}: " if e.filename else ""
        error_line(f"{where}{e.strerror or e}")
        sys.exit(1)
    sys.exit(rc if isinstance(rc, int) else 0)
