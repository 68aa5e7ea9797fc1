"""One vocabulary across commands (issue 29): `-c/--context` with `64k` everywhere, `--max-tokens` the one
generation cap, `--scheme` the one name of a quantization recipe (`--recipe FILE` a JSON file); the old
spellings still work, with a one-line notice, for one release."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer

from quantkit.cli import _register, app
from quantkit.cli.options import CONTEXT

from helpers.cli import run_cli


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
    for name in ("plan", "gpus", "quantize", "generate", "chat"):
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


# --- One meaning per flag (issue 46) ------------------------------------------------------------------------
# Every flag that two commands (or more) spell: the kinds of value it may take (the parser's name, or the
# annotation's: a sweep `4k,32k` is text, a single value `tokens`) and words every help text of it carries
# (any one of them; an option without help is judged by its kind alone). A new shared flag, or a flag that
# starts meaning something else in one command, fails here until this table says so.
MEANINGS: dict[str, tuple[set[str], tuple[str, ...]]] = {
    "--calib-tokens": ({"integer"}, ("calibration tokens",)),
    "--clients": ({"integer", "str"}, ("clients",)),  # bench serve: one count, or a list of them
    "--context": ({"tokens", "str"}, ("context", "tokens")),
    "--experts": ({"integer"}, ("experts per layer",)),
    "--experts-per-token": ({"integer"}, ("experts each token",)),
    "--imatrix": ({"Path"}, ("imatrix",)),
    "--json": ({"flag"}, ("json",)),
    "--layers": ({"integer"}, ("layers",)),
    "--max-queue": ({"integer"}, ("--max-queue", "wait")),
    "--max-tokens": ({"integer"}, ("generate", "generated", "max_tokens")),
    "--model": ({"str", "Path"}, ("checkpoint",)),
    "--mtp": ({"integer"}, ("draft",)),
    "--mtp-layer": ({"flag"}, ("mtp layer",)),
    "--no-mtp-layer": ({"flag"}, ("mtp layer",)),
    "--out": ({"Path"}, ("write", "output", "save", "profile file")),
    "--overwrite": ({"flag"}, ("replace",)),
    "--parallel": ({"integer"}, ("decode",)),  # plan budgets the slots serve decodes together
    "--plan": ({"Path"}, ("plan --out",)),
    "--prompt-cache-dir": ({"Path"}, ("folder",)),
    "--prompt-cache-disk-size": ({"str"}, ("bytes", "size")),
    "--prompt-cache-size": ({"str"}, ("memory", "bytes")),
    "--ram": ({"str"}, ("ram",)),
    "--resume": ({"flag"}, ("interrupted",)),
    "--scheme": ({"str", "list of list"}, ("quantiz", "scheme", "one of")),
    "--seed": ({"integer"}, ("seed",)),
    "--system": ({"str"}, ("system prompt",)),
    "--temperature": ({"number"}, ("greedy",)),
    "--think": ({"flag"}, ("reason",)),
    "--no-think": ({"flag"}, ("reason",)),
    "--threads": ({"int"}, ("threads",)),
    "--top-k": ({"integer"}, ("off",)),
    "--top-p": ({"number"}, ("nucleus",)),
    "--verify": ({"str"}, ("check",)),
    "--vocab": ({"integer"}, ("vocabulary",)),
    "--world": ({"str"}, ("domain",)),
}

# The commands a user runs, then the developer tools, as `quantkit --help` lists them
USER = ["plan", "quantize", "verify", "chat", "generate", "serve", "export", "inspect", "gpus", "stats"]
DEV = ["bench", "tiny-model", "profile-host"]


def _kind(p) -> str:
    if p.is_flag:
        return "flag"
    td = p.type_descriptor
    parser = getattr(td.parameter_info, "parser", None)
    kind = parser.__name__ if parser else getattr(td.annotation, "__name__", str(td.annotation))
    return ("list of " if p.multiple else "") + kind


def _visible_flags() -> dict[str, list[tuple[str, str, str]]]:
    """flag -> [(command path, kind, help)] over every visible command and group (`bench`'s shared options)."""
    import typer.main

    _register()
    seen: dict[str, list[tuple[str, str, str]]] = {}

    def walk(cmd, path: list[str]) -> None:
        for p in cmd.params if path else []:
            if p.param_type_name != "option" or p.hidden:
                continue
            for o in (*p.opts, *p.secondary_opts):
                if o.startswith("--") and o != "--help":
                    seen.setdefault(o, []).append((" ".join(path), _kind(p), " ".join((p.help or "").split())))
        for name, sub in (getattr(cmd, "commands", None) or {}).items():
            if not sub.hidden:
                walk(sub, [*path, name])

    walk(typer.main.get_command(app), [])
    return seen


def test_every_flag_two_commands_share_has_one_meaning():
    seen = _visible_flags()
    assert len(seen) > 80  # the walk reached every command
    shared = {f: uses for f, uses in seen.items() if len({c for c, _, _ in uses}) > 1}
    unlisted = sorted(set(shared) - set(MEANINGS))
    assert not unlisted, f"flags spelled by two commands with no meaning in MEANINGS: {unlisted}"
    for flag, uses in shared.items():
        kinds, words = MEANINGS[flag]
        for command, kind, help_text in uses:
            assert kind in kinds, f"{command} {flag}: a {kind}, elsewhere {kinds}"
            assert not help_text or any(w in help_text.lower() for w in words), \
                f"{command} {flag}: {help_text!r} says none of {words}"


def test_the_spellings_with_two_meanings_are_gone():
    cmds = _commands()
    seen = _visible_flags()
    # --top-k samples (generate, chat); experts per token is --experts-per-token
    assert {c for c, _, _ in seen["--top-k"]} == {"generate", "chat"}
    assert {c for c, _, _ in seen["--experts-per-token"]} == {"tiny-model", "bench engines"}
    # --mtp N is drafts per step wherever it is; the layer in a written file is --mtp-layer/--no-mtp-layer
    assert all(k == "integer" for _, k, _ in seen["--mtp"])
    assert {c for c, _, _ in seen["--mtp-layer"]} == {"tiny-model", "quantize", "export gguf"}
    # a prompt cache is sized in bytes; plan's count of snapshots has its own name
    assert "--prompt-snapshots" in cmds["plan"] and cmds["plan"]["--prompt-cache"].hidden
    # one way to name a quantization: --scheme NAME|FILE, --method, --bits as a shorthand
    q = cmds["quantize"]
    assert {"--scheme", "--method", "--bits"} <= {f for f, p in q.items() if not p.hidden}
    for old in ("--format", "--uniform", "--group-size", "--recipe", "--no-mtp", "--keep-mtp"):
        assert q[old].hidden, old
    # --experts counts experts; --max-tokens caps generation
    assert cmds["export gguf"]["--experts"].hidden and "--expert-type" in cmds["export gguf"]
    assert cmds["stats"]["--max-tokens"].hidden and "--calib-tokens" in cmds["stats"]
    # profile-host times this host; `calibrate` is its hidden old name
    assert "profile-host" in cmds and "calibrate" in cmds and _root_command("calibrate").hidden


def _root_command(name: str):
    import typer.main

    _register()
    return typer.main.get_command(app).commands[name]


@pytest.mark.parametrize("args,notice,then", [
    (["stats", "MISSING", "--out", "OUT/s.safetensors", "--max-tokens", "64"], "--max-tokens is now --calib-tokens",
     "MISSING"),
    (["export", "gguf", "MISSING", "OUT/x.gguf", "-t", "mixed", "--experts", "q8_0"], "--experts is now --expert-type",
     "MISSING"),
    (["export", "gguf", "MISSING", "OUT/x.gguf", "--no-mtp"], "--no-mtp is now --no-mtp-layer", "MISSING"),
    (["calibrate", "--model", "MISSING", "--out", "OUT/p.json"], "quantkit calibrate is now quantkit profile-host",
     "MISSING"),
    (["bench", "decode", "--prompt", "8", "--threads", "0"], "--prompt is now --prompt-tokens", "--threads 0"),
    (["bench", "serve", "--decode", "8"], "--decode is now --new-tokens",
     "bench serve does not take --new-tokens"),
    (["bench", "engines", "--checkpoint", "MISSING", "--threads", "0"], "--checkpoint is now --model", "--threads 0"),
    (["bench", "engines", "--top-k", "0"], "--top-k is now --experts-per-token", "--experts-per-token"),
])
def test_an_old_spelling_prints_one_notice_then_does_what_the_new_one_does(tmp_path: Path, capsys, monkeypatch,
                                                                         args, notice, then):
    args = [a.replace("MISSING", str(tmp_path / "missing")).replace("OUT", str(tmp_path)) for a in args]
    code, _, err = run_cli(args, capsys, monkeypatch)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    notices = [ln for ln in lines if ln.startswith("notice:")]
    assert len(notices) == 1 and notice in notices[0] and "next release" in notices[0], err
    errors = [ln for ln in lines if ln.startswith("error:")]
    assert code == 2 and len(errors) == 1 and then.replace("MISSING", "missing") in errors[0], err
    assert len(lines) == 2 and "Traceback" not in err


def test_old_quantize_spellings_still_choose_the_recipe(tiny_model_mtp: Path, tmp_path: Path, capsys, monkeypatch):
    recipe = tmp_path / "r.json"
    for args, says, old in (
        (["--format", "nf4"], "recipe quality-nf4", "--format"),
        (["--uniform"], "recipe uniform-int4", "--uniform"),
        (["--group-size", "32"], "recipe quality-int4-g32", "--group-size"),
        (["--no-mtp"], "MTP layer dropped", "--no-mtp"),
    ):
        code, out, err = run_cli(["quantize", str(tiny_model_mtp), "--dry-run", *args], capsys, monkeypatch)
        notices = [ln for ln in err.splitlines() if ln.startswith("notice:")]
        assert code == 0 and says in " ".join(out.split()), (args, out, err)
        assert len(notices) == 1 and f"{old} is now" in notices[0], err
    # --scheme FILE reads a JSON recipe, as --recipe FILE did
    code, out, err = run_cli(["quantize", str(tiny_model_mtp), "--dry-run", "--scheme", "int8"], capsys, monkeypatch)
    assert code == 0
    recipe.write_text('{"name": "mine", "base": "int8", "rules": {}}')
    code, out, err = run_cli(["quantize", str(tiny_model_mtp), "--dry-run", "--scheme", str(recipe)], capsys,
                             monkeypatch)
    assert code == 0 and "recipe mine" in " ".join(out.split()) and not err.strip(), (out, err)
    code, out, err = run_cli(["quantize", str(tiny_model_mtp), "--dry-run", "--recipe", str(recipe)], capsys,
                             monkeypatch)
    assert code == 0 and "recipe mine" in " ".join(out.split()) and err.count("notice:") == 1, err


def test_plans_old_prompt_cache_count_still_counts(capsys, monkeypatch):
    code, out, err = run_cli(["plan", "--prompt-cache", "5", "--ram", "64GiB"], capsys, monkeypatch)
    assert code == 0 and "prompt cache (5 snapshots)" in out
    assert err.count("notice:") == 1 and "--prompt-cache is now --prompt-snapshots" in err
    code, out, err = run_cli(["plan", "--prompt-snapshots", "3", "--ram", "64GiB"], capsys, monkeypatch)
    assert code == 0 and "prompt cache (3 snapshots)" in out and "notice" not in err


def test_tiny_models_old_spellings_still_shape_the_model(tmp_path: Path, capsys, monkeypatch):
    import json

    code, out, err = run_cli(["tiny-model", tmp_path / "t", "--layers", "2", "--top-k", "1", "--mtp"], capsys,
                             monkeypatch)
    assert code == 0, err
    cfg = json.loads((tmp_path / "t" / "config.json").read_text())
    tc = cfg.get("text_config", cfg)
    assert tc["num_experts_per_tok"] == 1 and tc.get("mtp_num_hidden_layers", 0) == 1
    notices = [ln for ln in err.splitlines() if ln.startswith("notice:")]
    assert sorted(n.split()[1] for n in notices) == ["--mtp", "--top-k"], err


def test_bench_shares_its_common_options_once():
    from quantkit.cli.bench_options import BENCHES, FLAGS, OLD_SPELLINGS

    cmds = _commands()
    bench = _root_command("bench")
    shared = {o for p in bench.params for o in p.opts if o != "--help"}
    assert {"--reports", "--workdir", "--threads", "--reps", "--layers", "--experts", "--vocab"} <= shared
    total = len(shared)
    for name, opts in cmds.items():
        if name.startswith("bench "):
            mine = {o for o, p in opts.items() if o.startswith("--") and o != "--help"}
            assert not mine & shared, (name, mine & shared)  # declared once, on the group
            assert not mine & set(OLD_SPELLINGS), (name, mine & set(OLD_SPELLINGS))  # one spelling per shape
            total += len({id(p) for o, p in opts.items() if o != "--help"})
            assert name.split()[1] in BENCHES and set(BENCHES[name.split()[1]]) <= set(FLAGS)
    assert total < 105 // 2 + 1, total  # fewer than half of the 105 before issue 46


@pytest.mark.parametrize("given,want", [
    (["engines", "--threads", "2", "--isa", "avx2"], ["--threads", "2", "engines", "--isa", "avx2"]),
    (["--reps", "3", "decode", "--layers=2", "--configs", "int4"], ["--reps", "3", "--layers=2", "decode",
                                                                    "--configs", "int4"]),
    (["serve", "--model", "M", "--clients", "4"], ["--model", "M", "serve", "--clients", "4"]),
    (["decode", "--configs", "--layers", "--", "--layers", "1"], ["decode", "--configs", "--layers", "--",
                                                                 "--layers", "1"]),
    (["nosuch", "--layers", "2"], ["nosuch", "--layers", "2"]),
])
def test_shared_bench_options_move_in_front_of_the_benchs_name(given, want):
    """A value of the bench's own option is never taken for a shared option, nor anything after `--`."""
    from quantkit.cli.bench_options import hoist

    assert hoist(given, _root_command("bench"), None) == want


def test_a_benchs_help_names_the_shared_options_it_takes(capsys, monkeypatch):
    code, out, _ = run_cli(["bench", "decode", "--help"], capsys, monkeypatch)
    flat = " ".join(out.split())
    assert code == 0 and "--threads (auto)" in flat and "--layers (4)" in flat and "--new-tokens (16)" in flat
    assert "--model" not in flat  # decode generates the checkpoints it runs


def test_user_commands_come_before_the_developer_tools():
    import typer.main

    _register()
    root = typer.main.get_command(app)
    listed = [n for n in root.list_commands(None) if not root.commands[n].hidden]
    assert listed == USER + DEV
    assert all(root.commands[n].rich_help_panel != "Developer tools" for n in USER)
    assert all(root.commands[n].rich_help_panel == "Developer tools" for n in DEV)
