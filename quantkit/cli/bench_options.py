"""The options every `quantkit bench` shares, declared once on the `bench` group (issue 46): where the reports
and the generated files go, threads, repetitions, the shape of the generated checkpoint, a model to run instead,
the prompt and generated token counts. Each bench names the shared options it takes and its own defaults
(`command`); a shared option a bench does not take is refused in one line, not ignored.

They are written before or after the bench's name alike (`quantkit bench engines --threads 2` is
`quantkit bench --threads 2 engines`): the group moves them in front before parsing. The benches' old spellings
(`--prompt`, `--decode`, `--checkpoint`, ...) are rewritten here too, each with its one-line notice, so that the
commands the reports record keep running for one release."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import typer
import typer.core

from quantkit.cli.options import notice
from quantkit.errors import QuantkitError

# parameter name of the group's callback -> its flag
FLAGS = {"reports": "--reports", "workdir": "--workdir", "threads": "--threads", "reps": "--reps",
         "rounds": "--rounds", "layers": "--layers", "experts": "--experts", "vocab": "--vocab",
         "model": "--model", "prompt_tokens": "--prompt-tokens", "new_tokens": "--new-tokens"}

# a bench's old spelling -> the one now (bench-wide: one name per concept across the benches)
OLD_SPELLINGS = {"--prompt": "--prompt-tokens", "--decode": "--new-tokens", "--checkpoint": "--model",
                 "--top-k": "--experts-per-token"}

# bench name -> {parameter: default} of the shared options it takes ("reports" always)
BENCHES: dict[str, dict[str, Any]] = {}
_MIN_REPS: dict[str, int] = {}


def _rewrite_old(args: list[str]) -> list[str]:
    out: list[str] = []
    for i, a in enumerate(args):
        if a == "--":
            return out + args[i:]
        flag, eq, value = a.partition("=")
        new = OLD_SPELLINGS.get(flag)
        if new is not None:
            notice(flag, new)
            a = new + eq + value
        out.append(a)
    return out


def _takes_value(command: Any) -> dict[str, bool]:
    """Each option flag of `command` -> whether the next argument is its value."""
    return {o: not (p.is_flag or p.count) for p in command.params if getattr(p, "opts", None) and
            p.param_type_name == "option" for o in (*p.opts, *p.secondary_opts)}


def hoist(args: list[str], group: Any, ctx: Any) -> list[str]:
    """`args` with the group's options that follow the bench's name moved in front of it."""
    args = _rewrite_old(list(args))
    mine = _takes_value(group)
    i = 0
    while i < len(args) and args[i].startswith("-") and args[i] != "--":
        flag, eq, _ = args[i].partition("=")
        i += 1 + (mine.get(flag, False) and not eq)
    if i >= len(args) or args[i] == "--":
        return args
    name = args[i]
    sub = group.get_command(ctx, name)
    if sub is None:
        return args
    theirs = _takes_value(sub)
    moved: list[str] = []
    rest: list[str] = []
    j = i + 1
    while j < len(args):
        a = args[j]
        if a == "--":
            rest += args[j:]
            break
        flag, eq, _ = a.partition("=")
        if flag in mine and flag not in theirs:
            n = 1 + (mine[flag] and not eq)
            moved += args[j:j + n]
        else:
            n = 1 + (theirs.get(flag, False) and not eq)
            rest += args[j:j + n]
        j += n
    return [*args[:i], *moved, name, *rest]


class BenchGroup(typer.core.TyperGroup):
    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        return super().parse_args(ctx, hoist(args, self, ctx))


def _shown(value: Any) -> str:
    if value is None:
        return "auto"
    if value is True or value is False:
        return "on" if value else "off"
    return str(value)


def command(app: typer.Typer, name: str, min_reps: int = 1, **defaults: Any) -> Callable[[Any], Any]:
    """Register `quantkit bench NAME`, taking the shared options in `defaults` (parameter=default; None: the
    bench's own choice). Its help lists them with these defaults."""
    unknown = set(defaults) - set(FLAGS)
    if unknown:
        raise ValueError(f"bench {name}: not shared options: {sorted(unknown)}")
    BENCHES[name] = {"reports": Path("reports"), **defaults}
    _MIN_REPS[name] = min_reps
    listed = ", ".join(f"{FLAGS[k]} ({_shown(v)})" for k, v in BENCHES[name].items())
    epilog = f"Shared bench options it takes, with its defaults (see `quantkit bench --help`): {listed}."
    return app.command(name, epilog=epilog)


def shared(ctx: typer.Context) -> SimpleNamespace:
    """The shared options of the running bench: the given ones, else its defaults. One it does not take, given,
    is an error naming what it does take."""
    name = ctx.info_name or ""
    takes = BENCHES[name]
    given = {k: v for k, v in (ctx.parent.params if ctx.parent else {}).items() if v is not None}
    extra = [FLAGS[k] for k in given if k not in takes]
    if extra:
        raise QuantkitError(f"bench {name} does not take {', '.join(extra)} (its shared options: "
                            f"{', '.join(FLAGS[k] for k in takes)})")
    values = {k: given.get(k, v) for k, v in takes.items()}
    if "reps" in values and values["reps"] < _MIN_REPS[name]:
        raise QuantkitError(f"--reps {values['reps']}: bench {name} needs at least {_MIN_REPS[name]}")
    return SimpleNamespace(**values)
