"""The first hour of a new user (issue 54), each confusion held to its fix: a GGUF is pointed the right way, output
in a pipe is whole and literal, counts and sizes read one way, the context is the plan's for this machine and is
said, `generate` shows thinking apart, `verify` and `export vllm` say what is true, `plan` agrees with itself and
ends with the next command, long steps show progress."""

from __future__ import annotations

import importlib.util
import io
import json
import re
import time
from pathlib import Path

import pytest
from rich.table import Table

from quantkit.checkpoint.reader import spec_from_path
from quantkit.cli import PIPE_WIDTH, PlainConsole
from quantkit.cli.progress import step_status
from quantkit.errors import QuantkitError
from quantkit.planner.fit import DEFAULT_CONTEXT_CAP, default_context
from quantkit.planner.hardware import build_hardware
from quantkit.planner.placement import RECIPES
from quantkit.runtime.chat import Chat, ChatSession, fmt_bytes
from quantkit.runtime.generate import SamplingParams
from quantkit.termtext import plural
from quantkit.threads import busy_note

from helpers.chat import scripted_input
from helpers.cli import one_line_error, run_cli
from helpers.runtime import quantized

ROOT = Path(__file__).resolve().parents[2]


# ---- 3. a GGUF given where a model goes ------------------------------------------------------------------
@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory) -> list[Path]:
    d = tmp_path_factory.mktemp("gguf")
    named = d / "tiny.gguf"
    named.write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(64))
    unnamed = d / "model.bin"  # known by its first bytes, whatever its name
    unnamed.write_bytes(named.read_bytes())
    return [named, unnamed]


@pytest.mark.parametrize("args", [
    ["inspect", "F"], ["generate", "F", "-p", "hi"], ["chat", "F"], ["serve", "F"], ["quantize", "F", "--out", "O"],
    ["verify", "F"], ["export", "gguf", "F", "O.gguf"], ["export", "vllm", "F", "O"], ["stats", "F", "--out", "O"],
    ["gpus", "--model", "F"], ["profile-host", "--model", "F"],
])
def test_a_gguf_anywhere_a_model_goes_is_one_line_pointing_the_right_way(args, gguf_files, tmp_path, capsys,
                                                                        monkeypatch):
    for f in gguf_files:
        argv = [str(f) if a == "F" else str(tmp_path / a) if a.startswith("O") else a for a in args]
        code, out, err = run_cli(argv, capsys, monkeypatch)
        one_line_error(code, out, err, f"{f} is a GGUF file", "safetensors", "hf download",
                       f"llama-server -m {f}", "--export llama.cpp")
        assert not any(tmp_path.iterdir())  # nothing written


def test_the_runtime_api_says_the_same(gguf_files):
    from quantkit.runtime import load_model

    with pytest.raises(QuantkitError, match="llama-server -m"):
        load_model(gguf_files[0])


# ---- 4. output that is not a terminal; text printed literally; one style of counts and sizes -------------
def test_a_pipe_is_neither_cut_nor_rewrapped_and_text_keeps_its_brackets():
    buf = io.StringIO()
    c = PlainConsole(file=buf, _environ={})
    assert c.width == PIPE_WIDTH
    long = "word " * 60 + 'pip install "quantkit[engines]" and pip install -e ".[engines]"'
    c.print(long)
    t = Table()
    for i in range(12):
        t.add_column(f"column_{i}_with_a_long_name")
    t.add_row(*[f"value_{i}_which_is_long_too" for i in range(12)])
    c.print(t)
    lines = buf.getvalue().splitlines()
    assert lines[0] == long.rstrip()  # one line, brackets kept
    assert "…" not in buf.getvalue() and "value_11_which_is_long_too" in buf.getvalue()
    assert PlainConsole(file=io.StringIO(), _environ={"COLUMNS": "90"}).width == 90  # an explicit width wins


def test_counts_and_sizes_read_one_way(tiny_model, tmp_path, capsys, monkeypatch):
    assert plural(1, "shard") == "1 shard" and plural(2, "shard") == "2 shards"
    assert plural(1, "entry", "entries") == "1 entry" and plural(0, "entry", "entries") == "0 entries"
    assert fmt_bytes(5_418_000_000) == "5.42 GB"  # chat's /stats in the units serve's banner uses
    code, out, err = run_cli(["quantize", tiny_model, "--scheme", "quality", "--out", tmp_path / "q"], capsys,
                             monkeypatch)
    assert code == 0, err
    assert f"{tmp_path / 'q'}: 1 shard" in out and "1 shards" not in out
    code, out, _ = run_cli(["verify", tmp_path / "q"], capsys, monkeypatch)
    assert code == 0 and "OK: 1 shard," in out


def test_export_gguf_install_hint_is_printed_as_written(tiny_model, tmp_path, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "llama_cpp" else real(n, *a))
    code, out, err = run_cli(["export", "gguf", tiny_model, tmp_path / "t.gguf"], capsys, monkeypatch)
    assert code == 0, err
    assert 'pip install "quantkit[engines]"' in out and 'pip install -e ".[engines]"' in out


# ---- 2. the context: the plan's arithmetic for this machine and --parallel, said at start ----------------
def test_default_context_is_plans_max_context_capped(capsys, monkeypatch):
    spec = spec_from_path(None)
    for ram in ("24GiB", "28GiB", "256GiB"):
        code, out, err = run_cli(["plan", "--gpu", "none", "--ram", ram, "--scheme", "quality", "--json"], capsys,
                                 monkeypatch)
        assert code == 0, err
        plans_max = json.loads(out)["schemes"][0]["max_context"]
        hw = build_hardware(["none"], ram)
        one = default_context(spec, RECIPES["quality"], hw)
        assert one.tokens == min(DEFAULT_CONTEXT_CAP, plans_max), ram
        assert ("capped at 32,768" in one.why) == (plans_max > DEFAULT_CONTEXT_CAP)
        four = default_context(spec, RECIPES["quality"], hw, slots=4)
        assert four.tokens <= one.tokens and ("4 conversations" in four.why)
    tight = default_context(spec, RECIPES["quality"], build_hardware(["none"], "24GiB"), slots=4)
    assert tight.tokens < default_context(spec, RECIPES["quality"], build_hardware(["none"], "24GiB")).tokens


def test_serve_says_its_context_and_loads_with_progress(tiny_model, capsys, monkeypatch):
    import uvicorn

    q = quantized(tiny_model, "quality")
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: None)  # start-up only
    code, out, err = run_cli(["serve", q, "--port", "0", "--prompt-cache-size", "2GB"], capsys, monkeypatch)
    assert code == 0, err
    assert "error" not in err  # a load shorter than a progress line's interval prints none
    banner = next(line for line in out.splitlines() if line.startswith("serving "))
    assert "(context 32,768 tokens (default: capped at 32,768;" in banner
    assert "prompt cache 2.00 GB)" in banner and "MiB" not in banner
    code, out, err = run_cli(["serve", q, "--port", "0", "-c", "8k"], capsys, monkeypatch)
    assert code == 0 and "context 8,192 tokens (as given (-c))" in out


def test_serve_notes_a_prompt_cache_too_small_for_its_slots(tiny_model, tmp_path, capsys, monkeypatch):
    """Fewer conversation states in the prompt cache than 2 a slot (where a turn resumes), no disk tier: one note
    naming the sizes and the two options; with room enough, or a disk tier to fall back on, none."""
    import uvicorn

    from quantkit.checkpoint.spec import parse_text_config
    from quantkit.planner.budget import states_held

    q = quantized(tiny_model, "quality")
    _held, per = states_held(parse_text_config(json.loads((Path(q) / "config.json").read_text())), 1)
    assert per > 0
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: None)  # start-up only
    small = ["serve", q, "--port", "0", "--parallel", "4", "--prompt-cache-size", f"{7 * per}B"]
    code, _out, err = run_cli(small, capsys, monkeypatch)
    assert code == 0, err
    note = [ln for ln in err.splitlines() if ln.startswith("note: the prompt cache")]
    assert len(note) == 1 and "about 7 conversation states" in note[0] and "2 for each of 4 slots" in note[0]
    assert "--prompt-cache-size SIZE or --prompt-cache-dir DIR" in note[0]
    for more in (["--prompt-cache-size", f"{8 * per}B"], ["--prompt-cache-dir", str(tmp_path / "pc")]):
        code, _out, err = run_cli([*small, *more], capsys, monkeypatch)
        assert code == 0 and "note: the prompt cache" not in err, (more, err)


def test_chat_stats_after_a_resume_count_the_resumed_conversation(tiny_model, one_thread):
    from quantkit.runtime import load_model

    rt = load_model(quantized(tiny_model, "quality"))
    session = ChatSession(messages=[{"role": "user", "content": "hello there"},
                                    {"role": "assistant", "content": "hi"}])
    out = io.StringIO()
    Chat(rt, session, SamplingParams(temperature=0, max_new_tokens=4), PlainConsole(file=out, _environ={}),
         scripted_input(["/stats"])).run()
    used = rt.count_tokens(session.conversation())
    assert used > 0 and f"context: {used:,}/32,768 tokens used, 2 messages" in out.getvalue()
    assert "context 32,768 tokens (default: " in out.getvalue()


# ---- 1. generate shows thinking apart --------------------------------------------------------------------
def test_generate_writes_the_answer_on_stdout_and_the_thinking_apart(tiny_model, capsys, monkeypatch):
    q = quantized(tiny_model, "quality")
    code, out, err = run_cli(["generate", q, "-p", "hello", "-n", "8", "--seed", "0"], capsys, monkeypatch)
    assert code == 0, err
    assert "<think>" not in out + err and "thinking:" in err
    if not out.strip():  # the budget ended inside the thinking: said, with what to do
        assert "went to thinking" in err and "--no-think" in err
    code, out, err = run_cli(["generate", q, "-p", "hello", "-n", "8", "--seed", "0", "--no-think"], capsys,
                             monkeypatch)
    assert code == 0 and out.strip() and "thinking:" not in err
    code, out, err = run_cli(["generate", q, "-p", "hello", "-n", "2", "--seed", "0", "--json"], capsys, monkeypatch)
    d = json.loads(out)
    assert code == 0 and (d["text"] or "went to thinking" in err)


# ---- 7. messages that say what is true -------------------------------------------------------------------
def test_verify_on_a_checkpoint_that_is_not_quantkits_does_not_suggest_resume(tiny_model, tmp_path, capsys,
                                                                               monkeypatch):
    code, out, err = run_cli(["verify", tiny_model], capsys, monkeypatch)
    one_line_error(code, out, err, "not a folder written by `quantkit quantize`", "quantkit quantize")
    assert "--resume" not in err
    half = tmp_path / "half"
    half.mkdir()
    (half / ".quantkit-progress.json").write_text('{"done": [], "files": []}')
    code, out, err = run_cli(["verify", half], capsys, monkeypatch)
    one_line_error(code, out, err, "interrupted", "--resume")


def test_export_vllm_says_why_experts_were_requantized(tiny_model, tmp_path, capsys, monkeypatch):
    code, out, err = run_cli(["export", "vllm", quantized(tiny_model, "quality"), tmp_path / "v"], capsys, monkeypatch)
    assert code == 0, err
    rows = dict((how, int(n)) for n, how in re.findall(r"(\d+)\s+int4-experts\s+(\w+)", out))
    # the tiny model's experts are stored at groups 64 and 32 (its rows are shorter than 128); the export has one
    assert rows.get("requantized") and rows.get("reused"), out
    assert (f"note: {rows['requantized']} of the int4 expert tensors were requantized: stored at group 64, not the "
            "export's one group size 32") in out


def test_generate_with_scheme_on_a_quantized_folder_names_scheme(tiny_model, capsys, monkeypatch):
    code, out, err = run_cli(["generate", quantized(tiny_model, "quality"), "-p", "hi", "--scheme", "int4"], capsys,
                             monkeypatch)
    one_line_error(code, out, err, "--scheme")
    assert "--recipe" not in err


# ---- 6. plan agrees with itself and ends with the next command -------------------------------------------
def _plan(capsys, monkeypatch, *args: str) -> str:
    code, out, err = run_cli(["plan", *args], capsys, monkeypatch)
    assert code == 0, err
    return out


def test_plan_table_and_recommended_line_agree(capsys, monkeypatch):
    out = _plan(capsys, monkeypatch, "--gpu", "rtx4090", "--ram", "64GiB")
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\s*(\w+) \*?\s+[\d.]+\s+[\d.]+\s+\S+\s+.+?\s{2,}(\S+)"
                                                           r"\s+(?:\d+|-)\s+(?:\d+|-)\s*$", out, re.M)}
    assert rows, out
    for cell in rows.values():  # one number style in the column
        assert cell == "-" or re.fullmatch(r"\d+k|\d{1,3}", cell), cell
    rec = re.search(r"Recommended: (\w+) .*?max context (\S+?)[ ;(\n]", out, re.S)
    assert rec and rows[rec.group(1)] == rec.group(2), (rows, rec.group(0) if rec else out)
    assert out.rstrip().splitlines()[-1].startswith("next: ")


def test_plan_for_2x3090_says_a_short_context_fits_as_its_max_context_does(capsys, monkeypatch):
    """bf16 on two 3090s needs about 22 GB of RAM beside them: at each RAM size its fits and max ctx agree."""
    seen = set()
    for ram in ("23.3GiB", "23.5GiB", "23.7GiB"):
        out = _plan(capsys, monkeypatch, "--gpu", "2x3090", "--ram", ram)
        row = re.search(r"^\s*bf16\s+[\d.]+\s+[\d.]+\s+(\S+)\s+.+?\s{2,}(\S+)\s+(?:\d+|-)\s+(?:\d+|-)\s*$", out, re.M)
        assert row, out
        fits, max_ctx = row.groups()
        if fits == "yes":
            assert max_ctx.endswith("k") and int(max_ctx[:-1]) >= 4
        elif fits == "no":
            assert max_ctx == "-"
        else:  # fits only at a context shorter than the 4k asked, and says the same figure as max ctx
            tokens = int(max_ctx[:-1]) * 1024 if max_ctx.endswith("k") else int(max_ctx)
            assert fits == f"≤{max_ctx}" and tokens < 4096
        seen.add(fits[0])
    assert seen == {"y", "n", "≤"}
    code, _, err = run_cli(["plan", "--gpu", "2x3090", "--ram", "23.5GiB", "--scheme", "bf16"], capsys, monkeypatch)
    assert code == 2 and "0.0 GB more" not in err and re.search(r"[\d.]+ [MG]B more than the", err)
    assert re.search(r"bf16 with --ram \d+GiB", err)  # the RAM the planner counts in GiB, said in GiB


def test_every_plan_ends_with_the_next_command(tiny_model, tmp_path, capsys, monkeypatch):
    out = _plan(capsys, monkeypatch, "--gpu", "none", "--ram", "64GiB")
    assert out.splitlines()[-1].startswith("next: hf download Qwen/Qwen-AgentWorld-35B-A3B")
    out = _plan(capsys, monkeypatch, "--model", str(tiny_model), "--gpu", "none", "--ram", "64GiB")
    assert out.splitlines()[-1] == f"next: quantkit quantize {tiny_model} --scheme quality --out {tiny_model}-quality"
    q = quantized(tiny_model, "quality")
    out = _plan(capsys, monkeypatch, "--model", str(q), "--gpu", "none", "--ram", "64GiB", "--out",
                str(tmp_path / "p.json"))
    assert out.splitlines()[-1].startswith(f"next: quantkit chat {q} --plan {tmp_path / 'p.json'}")
    out = _plan(capsys, monkeypatch, "--gpu", "rtx4090", "--ram", "64GiB", "--export", "llama.cpp")
    assert out.splitlines()[-1].startswith("next: quantkit export gguf")
    d = json.loads(_plan(capsys, monkeypatch, "--gpu", "none", "--ram", "64GiB", "--json"))
    assert d["next"].startswith("hf download")


# ---- 5. progress and a busy host -------------------------------------------------------------------------
def test_a_step_in_a_log_shows_how_it_goes_and_a_short_one_prints_nothing():
    buf = io.StringIO()
    c = PlainConsole(file=buf, _environ={})
    with step_status(c, "loading /m") as say:  # over before its first line is due
        say("layer 1/4")
    assert buf.getvalue() == ""
    with step_status(c, "loading /m", every_s=0.01) as say:
        say("layer 2/4")
        deadline = time.monotonic() + 30
        while "layer 2/4" not in buf.getvalue() and time.monotonic() < deadline:
            time.sleep(0.01)
    lines = buf.getvalue().splitlines()
    assert lines and all(re.fullmatch(r"loading /m(: layer 2/4)? \(\d+:\d\d:\d\d elapsed\)", ln) for ln in lines), lines
    assert "loading /m: layer 2/4" in buf.getvalue()


def test_a_busy_host_is_warned_about():
    assert busy_note(0.2, 2.1, 2, 2) is None  # its own two threads on a quiet 2-CPU host
    assert busy_note(1.5, 0.0, 2, 2) and "busy" in busy_note(0.1, 4.5, 2, 2)


@pytest.mark.slow
def test_profile_host_in_a_log_shows_progress(tiny_model, tmp_path, capsys, monkeypatch):
    code, out, err = run_cli(["profile-host", "--model", quantized(tiny_model, "quality"), "--passes", "1",
                              "--steps", "2", "--prefill-tokens", "16", "--out", tmp_path / "p.json"], capsys,
                             monkeypatch)
    assert code == 0, err
    assert err.splitlines()[0].startswith("profiling this host for quality: each part timed 1 time,")


def test_setup_says_what_it_installs_before_the_long_step():
    script = (ROOT / "scripts" / "setup.sh").read_text().splitlines()
    torch_at = next(i for i, line in enumerate(script) if "pip install" in line and "torch==" in line)
    assert "echo" in script[torch_at - 1] and "torch" in script[torch_at - 1]
    assert " -q " not in script[torch_at]  # pip's own progress stays visible
