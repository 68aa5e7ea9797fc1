"""One vocabulary across commands (issue 29): `-c/--context` with `64k` everywhere, `--max-tokens` the one
generation cap, `--scheme` the one name of a quantization recipe (`--recipe FILE` a JSON file); the old
spellings still work, with a one-line notice, for one release."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer

from quantkit.cli import _register, app
from quantkit.cli.options import CONTEXT

from conftest import run_cli


def _commands():
    import typer.main

    _register()
    root = typer.main.get_command(app)
    out = {}
    for name, cmd in root.commands.items():
        subs = getattr(cmd, "commands", None)
        for sub_name, sub in (subs or {name: cmd}).items():
            out[f"{name} {sub_name}" if subs else name] = {o: p for p in sub.params for o in p.opts}
    return out


def test_context_takes_64k_and_the_model_maximum():
    assert CONTEXT("64k") == 65536 and CONTEXT("4096") == 4096 and CONTEXT(" 32K ") == 32768
    assert CONTEXT("262k") == 262144  # the model's maximum, as `plan -c 262k` reads it
    with pytest.raises(typer.BadParameter, match="64k"):
        CONTEXT("lots")


def test_every_command_spells_the_shared_options_the_same():
    cmds = _commands()
    with_context = [n for n, opts in cmds.items() if "--context" in opts]
    assert {"plan", "gpus", "generate", "chat", "serve", "bench serve"} <= set(with_context)
    for name in with_context:
        assert "-c" in cmds[name], f"{name}: --context without -c"
    for name in ("generate", "chat", "serve"):
        assert "--max-tokens" in cmds[name] and cmds[name]["--max-tokens"].opts[-1] in ("-n", "--max-tokens")
    for name in ("plan", "gpus", "quantize", "generate", "chat", "bench gpu"):
        assert "--scheme" in cmds[name], name
    for name, opts in cmds.items():  # old spellings stay, hidden
        for old in ("--max-new-tokens", "--default-max-tokens"):
            assert old not in opts or opts[old].hidden, (name, old)
        if name != "quantize":  # quantize --recipe is the JSON file
            assert "--recipe" not in opts or opts["--recipe"].hidden, name


@pytest.mark.parametrize("args,notice", [
    (["generate", "MISSING", "--max-new-tokens", "8", "-p", "hi"], "--max-new-tokens is now --max-tokens"),
    (["chat", "MISSING", "--recipe", "int4"], "--recipe is now --scheme"),
    (["serve", "MISSING", "--default-max-tokens", "8"], "--default-max-tokens is now --max-tokens"),
])
def test_old_spellings_work_with_a_notice(tmp_path: Path, capsys, monkeypatch, args, notice):
    args = [str(tmp_path / "missing") if a == "MISSING" else a for a in args]
    code, _, err = run_cli(args, capsys, monkeypatch)
    assert notice in err and code == 2 and err.count("error:") == 1  # then the missing folder, in one line
    assert "Traceback" not in err


def test_old_and_new_name_together_is_one_line(tmp_path: Path, capsys, monkeypatch):
    code, _, err = run_cli(["generate", str(tmp_path), "-n", "4", "--max-new-tokens", "8", "-p", "x"], capsys,
                           monkeypatch)
    assert code == 2 and "--max-new-tokens is the old name of --max-tokens" in err


def test_quantize_scheme_names_the_plan_recipes(tiny_model: Path, capsys, monkeypatch):
    code, out, err = run_cli(["quantize", str(tiny_model), "--scheme", "int4", "--dry-run"], capsys, monkeypatch)
    assert code == 0, err
    assert "recipe int4:" in " ".join(out.split())
    for args, needle in ((["--scheme", "int4", "--bits", "8"], "drop --bits"),
                         (["--recipe", "int4"], "write --scheme int4"),
                         (["--scheme", "int3"], "unknown scheme 'int3'")):
        code, _, err = run_cli(["quantize", str(tiny_model), "--dry-run", *args], capsys, monkeypatch)
        assert code == 2 and needle in err and err.count("error:") == 1, (args, err)
