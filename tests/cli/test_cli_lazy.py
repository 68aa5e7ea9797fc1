"""`quantkit <command>` imports only the module of that command (cli.COMMAND_MODULE), and the quantizer's path
does not import the runtime's engine, the server or the benches: start-up is part of every quantize run."""

from __future__ import annotations

import subprocess
import sys

import quantkit.cli as cli


def test_command_map_names_the_module_of_every_command():
    cli._register()
    seen = {}
    for c in cli.app.registered_commands:
        seen[c.name or c.callback.__name__.replace("_", "-")] = c.callback.__module__
    for g in cli.app.registered_groups:
        seen[g.name] = g.typer_instance.registered_commands[0].callback.__module__
    assert set(seen) == set(cli.COMMAND_MODULE)
    for name, module in seen.items():
        assert module == f"quantkit.cli.{cli.COMMAND_MODULE[name]}", name


def _modules_after(*argv: str) -> tuple[set[str], str]:
    code = ("import sys, json\nsys.argv = ['quantkit', *sys.argv[1:]]\nimport quantkit.cli as c\n"
            "try:\n    c.main()\nexcept SystemExit:\n    pass\nprint(json.dumps(sorted(sys.modules)))")
    p = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, check=True)
    import json

    return set(json.loads(p.stdout.strip().splitlines()[-1])), p.stdout


def test_quantize_imports_only_what_it_runs():
    mods, out = _modules_after("quantize", "--help")
    assert "--scheme" in out and "--method" in out  # the command's own help, not the root's
    for heavy in ("quantkit.runtime.engine", "quantkit.runtime.loader", "quantkit.server", "quantkit.bench",
                  "quantkit.export.gguf", "quantkit.export.launch", "quantkit.cli.bench", "quantkit.cli.serve"):
        assert not any(m == heavy or m.startswith(heavy + ".") for m in mods), heavy


def test_a_one_command_module_still_runs_by_name(tmp_path):
    mods, out = _modules_after("tiny-model", "--help")  # tiny's module has one command: every module registers
    assert "tiny-model" in out and "quantkit.cli.plan" in mods


def test_the_command_imports_run_without_the_collector_and_stay_frozen():
    code = ("import gc, sys\nsys.argv = ['quantkit', 'quantize', '--help']\nimport quantkit.cli as c\n"
            "seen = []\nreal = c._register\nc._register = lambda *a: seen.append(gc.isenabled()) or real(*a)\n"
            "try:\n    c.main()\nexcept SystemExit:\n    pass\nprint(seen, gc.isenabled(), gc.get_freeze_count() > 10000)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert p.stdout.strip().splitlines()[-1] == "[False] True True"
