"""One help style (issue 54): `--version`, `-h` beside `--help`, one positional name per kind of argument, a
description for every option, help printed as written (no `[default: ...]` eaten as markup), and help texts
that say what the command does today. Walks every command, so a new one is held to the same."""

from __future__ import annotations

import re

import pytest
import typer.main

from quantkit import __version__
from quantkit.cli import POSITIONAL, _house_style, _register, app

from helpers.cli import run_cli

BOX = re.compile(r"[\s│╭╮╰╯─┃━┏┓┗┛]+")
KINDS = set(POSITIONAL.values())


def _commands() -> dict[str, object]:
    _register()
    root = _house_style(typer.main.get_command(app))
    out = {}
    for name, cmd in root.commands.items():
        if getattr(cmd, "hidden", False):
            continue
        for sub_name, sub in (getattr(cmd, "commands", None) or {name: cmd}).items():
            out[f"{name} {sub_name}" if sub_name != name else name] = sub
    return out


COMMANDS = _commands()


def _flat(text: str) -> str:
    return BOX.sub("", text)


def test_version_and_short_help(capsys, monkeypatch):
    code, out, _ = run_cli(["--version"], capsys, monkeypatch)
    assert code == 0 and out.strip() == f"quantkit {__version__}"
    code, out, _ = run_cli(["serve", "-h"], capsys, monkeypatch)
    assert code == 0 and "Usage: quantkit serve" in out and "--max-queue" in out


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_option_is_described_and_printed_as_written(name, capsys, monkeypatch):
    cmd = COMMANDS[name]
    code, out, err = run_cli([*name.split(), "--help"], capsys, monkeypatch)
    assert code == 0, err
    flat = _flat(out)
    for p in cmd.params:
        if getattr(p, "hidden", False):
            continue
        if p.param_type_name == "argument":
            assert p.metavar in KINDS, f"{name}: argument {p.name} shows as {p.metavar}, not one of {KINDS}"
            assert f"{{{p.metavar}}}" in out or f"[{p.metavar}]" in out, out  # the usage line names it
        flag = p.opts[0]
        assert p.help, f"{name} {flag}: no description"
        written = p.help.replace("\\[", "[")  # as the source wrote it (the CLI escapes brackets for rich)
        assert _flat(written) in flat, f"{name} {flag}: its help is not printed as written: {written!r}"


def test_the_same_kind_of_argument_has_the_same_name():
    seen = {p.name: p.metavar for c in COMMANDS.values() for p in c.params if p.param_type_name == "argument"}
    model_inputs = {"model", "model_dir", "src", "folder"}
    assert {seen[n] for n in model_inputs & set(seen)} == {"MODEL"}
    assert {seen[n] for n in {"out", "out_dir"} & set(seen)} == {"OUT"}
    for name in ("inspect", "quantize", "verify", "generate", "chat", "serve", "stats", "export gguf",
                 "export vllm"):
        assert [p.metavar for p in COMMANDS[name].params if p.param_type_name == "argument"][0] == "MODEL", name


def test_context_shows_that_it_takes_tokens_like_32k(capsys, monkeypatch):
    for name, cmd in COMMANDS.items():
        for p in cmd.params:
            if "--context" in p.opts:
                assert p.metavar == "TOKENS", name
    _, out, _ = run_cli(["chat", "--help"], capsys, monkeypatch)
    assert "TOKENS" in out and "<int>" not in re.search(r"--context.*", out).group(0)


def test_help_texts_say_what_the_commands_do_today(capsys, monkeypatch):
    def help_of(name: str, flag: str) -> str:
        return next(p.help for p in COMMANDS[name].params if flag in p.opts)

    assert "behind the running one" not in help_of("serve", "--max-queue")
    assert "--parallel" in help_of("serve", "--max-queue")
    assert "total" in help_of("chat", "--verify")  # auto looks at the folder's total, not each shard
    assert "[default: auto" in help_of("serve", "--mtp")
    _, out, _ = run_cli(["serve", "--help"], capsys, monkeypatch)
    assert "[default:auto,thecountthatmeasuresfastesthere" in _flat(out)  # not eaten as markup
    for name in ("chat", "serve", "generate"):
        assert "4096" not in help_of(name, "--context") and "32k" in help_of(name, "--context")
