"""Hostile inputs, round 4 (issue 43), the command line: session metadata of the wrong JSON type, control bytes
in paths on error lines, names up to the file system's limit, messages that name options as spelled today
(never a device as an output), calibration chats with an unknown role, chat's "does not fit" line, bounds on
every count a user gives, strict custom GPU specs and --gguf-type where it does nothing. Each case asserts one
`error:` line (or, for chat, one line and no raw warning), the exit code, and that nothing was written."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from quantkit.errors import QuantkitError
from quantkit.fileio import NAME_MAX, TEMP_ROOM, clean_leftovers, pid_temp_name, temp_name, temp_stem
from quantkit.planner.hardware import MAX_GPUS, build_hardware, parse_gpu_arg

from helpers.cli import run_cli
from helpers.probe import count, expect_one_line

BIG = str(2**40)


def _listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# --- 1. a chat session file whose metadata has the wrong JSON type -------------------------------------------

def _session_file(path: Path, meta: dict) -> bytes:
    """A safetensors file with no tensors and `meta` as its metadata, as JSON (any type: forged by hand)."""
    header = json.dumps({"__metadata__": meta}).encode()
    data = len(header).to_bytes(8, "little") + header
    path.write_bytes(data)
    return data


CONVERSATION = json.dumps({"quantkit_chat": 1, "system": None, "messages": [], "thinking": True})


@pytest.mark.parametrize("field,value,needle", [
    ("identity", {"model": "x", "weights": "y"}, "'identity' is a JSON object"),
    ("identity", ["model"], "'identity' is a JSON array"),
    ("identity", 5, "'identity' is a JSON number"),
    ("identity", '["model"]', "its identity is not"),
    ("identity", '{"model": {"a": 1}}', "its identity is not"),
    ("conversation", {"messages": []}, "'conversation' is a JSON object"),
    ("ids", [1, 2], "'ids' is a JSON array"),
    ("quantkit_session", 1, "'quantkit_session' is a JSON number"),
])
def test_session_metadata_of_the_wrong_json_type_is_refused(field, value, needle, tiny_model, tmp_path, capsys,
                                                            monkeypatch):
    meta = {"quantkit_session": "1", "identity": "{}", "conversation": CONVERSATION, "ids": "[]", "kinds": "[]",
            "sha256": ""}
    meta[field] = value
    path = tmp_path / "s.qks"
    before = _session_file(path, meta)
    code, out, err = run_cli(["chat", tiny_model, "--session", path, "--prompt-cache-size", "64MB"], capsys,
                             monkeypatch)
    line = expect_one_line(code, out, err, needle, exit_code=2)
    assert str(path) in line
    assert path.read_bytes() == before and _listing(tmp_path) == ["s.qks"]


# --- 2. control bytes in a path are written out on the error line ---------------------------------------------

def test_error_lines_escape_control_bytes_in_paths(tmp_path, capsys, monkeypatch):
    red = tmp_path / "x\x1b[31mred\x1b]0;title\x07\rz"
    cases = [
        (["plan", "--profile", red / "p.json"], "cannot read"),
        (["inspect", red / "config.json"], None),
        (["plan", "--gpu", "rtx4090", "--routing", red], "--routing"),
        (["plan", "--gpu", "rtx4090", "--model", tmp_path / "\x1b[2J" / "config.json"], None),
    ]
    for args, needle in cases:
        code, out, err = run_cli(args, capsys, monkeypatch)
        line = expect_one_line(code, out, err, needle)
        assert not any(ord(c) < 32 or 0x7f <= ord(c) <= 0x9f for c in err.replace("\n", "")), repr(err)
        assert "\\x1b[" in line, line  # written out: the user sees which name it was
    assert _listing(tmp_path) == []


def test_error_lines_print_brackets_in_paths_as_they_are(tmp_path, capsys, monkeypatch):
    odd = tmp_path / "a[/]b[bold]c" / "p.json"  # rich markup, were it read as such: an error inside the error
    code, out, err = run_cli(["plan", "--profile", odd], capsys, monkeypatch)
    line = expect_one_line(code, out, err, "a[/]b[bold]c")
    assert str(odd) in line


# --- 3. a name up to the file system's limit is accepted ------------------------------------------------------

@pytest.mark.parametrize("name", ["p" * 245 + ".json", "é" * 122 + ".json", "q" * 250 + ".json"],
                         ids=["250-bytes", "utf8-249-bytes", "255-bytes"])
def test_output_names_up_to_the_limit_are_written(name, tmp_path, capsys, monkeypatch):
    count()
    assert len(os.fsencode(name)) <= NAME_MAX
    out = tmp_path / name
    for _ in range(2):  # the second replaces the first (its own plan file)
        code, _o, err = run_cli(["plan", "--gpu", "rtx4090", "--ram", "64GiB", "--out", out], capsys, monkeypatch)
        assert code == 0, err
        assert "error" not in err
        assert _listing(tmp_path) == [name]  # no temporary left beside it
    assert json.loads(out.read_text())["scheme"]


def test_a_name_over_the_limit_is_one_line_before_any_work(tmp_path, capsys, monkeypatch):
    out = tmp_path / ("p" * 251 + ".json")
    code, o, err = run_cli(["plan", "--gpu", "rtx4090", "--out", out], capsys, monkeypatch)
    expect_one_line(code, o, err, "longer than this file system allows (255)", exit_code=2)
    assert _listing(tmp_path) == []


def test_temporaries_of_a_long_name_fit_and_are_cleaned(tmp_path):
    count()
    for name in ("a" * 255, "é" * 127, "short.json", "b" * 230, "b" * 231):
        p = tmp_path / name
        for t in (temp_name(p), pid_temp_name(p), pid_temp_name(p, "old")):
            assert len(os.fsencode(t.name + "probe")) <= NAME_MAX, t.name
        fits = len(os.fsencode(name)) + 1 + TEMP_ROOM <= NAME_MAX  # a short name is kept as it is
        assert (temp_stem(name) == name) == fits
    long = tmp_path / ("c" * 254)
    other = tmp_path / ("c" * 253 + "d")  # same head, another name: its own stem
    assert temp_stem(long.name) != temp_stem(other.name)
    dead = long.with_name(f".{temp_stem(long.name)}.tmp-{2**22 + 12345}")  # no such pid
    dead.write_bytes(b"half")
    temp_name(long).write_bytes(b"half")
    assert sorted(clean_leftovers(long)) == sorted([dead, temp_name(long)])
    assert _listing(tmp_path) == []


# --- 4. messages name the option and value as given, never a device as an output -----------------------------

def test_stats_inputs_that_are_devices_or_missing_name_the_option(tiny_model, tmp_path, capsys, monkeypatch):
    cases = [
        (["plan", "--routing", "/dev/zero"], "--routing /dev/zero: is not a regular file"),
        (["plan", "--routing", tmp_path / "none.st"], f"--routing {tmp_path / 'none.st'}: no such file"),
        (["plan", "--routing", tmp_path], "is a folder"),
        (["plan", "--routing", tmp_path / "none.st", "--routing-heldout", "x"], "--routing"),
        (["quantize", tiny_model, "--out", tmp_path / "q", "--method", "gptq", "--stats", "/dev/zero"],
         "--stats /dev/zero: is not a regular file"),
    ]
    for args, needle in cases:
        code, out, err = run_cli(args, capsys, monkeypatch)
        line = expect_one_line(code, out, err, needle)
        assert "--out /dev/zero" not in line and "--out " + str(tmp_path) not in line, line
    assert _listing(tmp_path) == []


# --- 5. a calibration chat with an unknown role -------------------------------------------------------------

def test_calibration_chat_with_an_unknown_role_names_it(tiny_model, tmp_path, capsys, monkeypatch):
    data = tmp_path / "data.jsonl"
    good = {"messages": [{"role": "user", "content": "ls"}, {"role": "assistant", "content": "a.txt"}]}
    bad = {"messages": [{"role": "magus", "content": "abracadabra " * 400}]}
    data.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    code, out, err = run_cli(["stats", tiny_model, "--data", data, "--out", tmp_path / "s"], capsys, monkeypatch)
    line = expect_one_line(code, out, err, "role 'magus'", exit_code=2)
    assert "line 2" in line and "calibration tokens" not in line
    assert _listing(tmp_path) == ["data.jsonl"]


# --- 6. chat's "does not fit" line: today's option, no raw transformers warning before it ----------------------

def test_chat_does_not_fit_line_names_max_tokens_and_no_raw_warning(tiny_model, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(tiny_model, model)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["model_max_length"] = 512  # below the message: transformers warns when it tokenizes it
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    r = subprocess.run([sys.executable, "-m", "quantkit", "chat", model, "--context", "1024", "-n", "32",
                        "--prompt-cache-size", "0"], input="word " * 2000 + "\n", capture_output=True, text=True,
                       env={**os.environ, "COLUMNS": "400", "OMP_NUM_THREADS": "1"}, timeout=300)
    count()
    both = r.stdout + r.stderr
    assert r.returncode == 0 and "Traceback" not in both, r.stderr[-2000:]
    lines = [ln for ln in both.splitlines() if "does not fit" in ln]
    assert len(lines) == 1 and "-n/--max-tokens" in lines[0], both[-2000:]
    assert "--max-new-tokens" not in both
    assert "Token indices" not in both and "[transformers]" not in both, both[-2000:]


# --- 7. every count a user gives is bounded before any work ------------------------------------------------

@pytest.mark.parametrize("args,needle", [
    (["plan", "--gpu", "rtx4090", "--nodes", "1000000000", "--export", "vllm"], "--nodes"),
    (["plan", "--gpu", "rtx4090", "--nodes", "1025"], "--nodes"),
    (["plan", "--gpu", "8xh100", "--nodes", "1024"], f"at most {MAX_GPUS} in all"),
    (["plan", "--gpu", "65xh100"], "between 1 and 64"),
    (["plan", "--gpu", "64xh100,8xh100"], "72 GPUs per node"),
    (["plan", "--gpu", "64xh100", "--gpu", "h100"], "65 GPUs per node"),
    (["plan", "--gpu", "rtx4090", "--batch", BIG], "--batch"),
    (["plan", "--gpu", "rtx4090", "--prefill-chunk", BIG], "--prefill-chunk"),
    (["plan", "--gpu", "rtx4090", "--n-cpu-moe", BIG], "--n-cpu-moe"),
    (["plan", "--gpu", "rtx4090", "--context", ",".join(["4k"] * 65)], "give at most 64"),
    (["calibrate", "--working-set", "1TB"], "--working-set 1TB"),
    (["calibrate", "--passes", BIG], "--passes"),
    (["calibrate", "--steps", BIG], "--steps"),
    (["serve", "M", "--max-n", "100000"], "--max-n"),
    (["stats", "M", "--out", "O", "--chunk-size", "1000000000"], "--chunk-size"),
    (["tiny-model", "O", "--layers", BIG], "--layers"),
    (["tiny-model", "O", "--experts", BIG], "--experts"),
    (["bench", "serve", "--clients", BIG], "--clients"),
])
def test_every_count_is_bounded_before_any_work(args, needle, tmp_path, capsys, monkeypatch):
    args = [tmp_path / "m" if a == "M" else tmp_path / "o" if a == "O" else a for a in args]
    if args[0] == "plan":
        args += ["--out", tmp_path / "p.json"]
    code, out, err = run_cli(args, capsys, monkeypatch)
    expect_one_line(code, out, err, needle, exit_code=2)
    assert _listing(tmp_path) == []


def test_the_planner_bounds_nodes_and_gpus_itself():
    count()
    for nodes, gpus in ((10**9, ["rtx4090"]), (0, ["rtx4090"]), (2, ["64xh100"] * 2), (1024, ["2xh100"])):
        with pytest.raises(QuantkitError):
            build_hardware(gpus, "64GiB", None, nodes)
    assert len(build_hardware(["8xh100"], "64GiB", None, 128).gpus) == 8


# --- 8. custom GPU specs parsed strictly; --gguf-type where it does nothing -----------------------------------

@pytest.mark.parametrize("bw", ["inf", "nan", "-5", "0", "1e400", "1e6", "-inf", "936x"])
def test_custom_gpu_bandwidth_must_be_finite_and_positive(bw, tmp_path, capsys, monkeypatch):
    code, out, err = run_cli(["plan", "--gpu", f"custom:24GiB,{bw}", "--out", tmp_path / "p.json"], capsys,
                             monkeypatch)
    line = expect_one_line(code, out, err, f"bandwidth {bw!r} must be a finite number of GB/s above 0", exit_code=2)
    assert "unknown GPU" not in line
    assert _listing(tmp_path) == []


def test_custom_gpu_specs_that_are_right_still_parse():
    count()
    assert [g.bandwidth_gbs for g in parse_gpu_arg("custom:24GiB,936")] == [936.0]
    assert [g.bandwidth_gbs for g in parse_gpu_arg("custom:24GiB,1e3GB/s")] == [1000.0]
    two = parse_gpu_arg("custom:24GiB,2x3090")  # a count after a custom card is a card, not a bandwidth
    assert len(two) == 3 and two[0].family == "custom" and two[1].id == two[2].id != two[0].id


@pytest.mark.parametrize("extra,needle", [
    (["--export", "vllm"], "applies to --export llama.cpp only, not --export vllm"),
    ([], "add --export llama.cpp"),
])
def test_gguf_type_where_it_does_nothing_is_refused(extra, needle, tmp_path, capsys, monkeypatch):
    code, out, err = run_cli(["plan", "--gpu", "rtx4090", "--gguf-type", "q4_k_m", *extra, "--out",
                              tmp_path / "p.json"], capsys, monkeypatch)
    expect_one_line(code, out, err, needle, exit_code=2)
    assert _listing(tmp_path) == []
