"""Hostile inputs to every command (issue 14): bad numbers, bad sizes, outputs over or inside a source,
read-only and full locations, endless or huge files, manifests that point outside their folder, absurd
configs. Each case asserts one `error:` line, the exit code, no traceback, and that the source is
byte-identical afterwards. The number of cases is printed at the end of the run (conftest)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import typer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quantkit import sizes
from quantkit.cli import options
from quantkit.errors import QuantkitError
from quantkit.fileio import read_json_bounded
from quantkit.termtext import printable

from helpers.cli import run_cli
from helpers.probe import count, expect_one_line, limited_dir, tree_digest

BIG = str(2**80)
NUMBERS = ["nan", "inf", "-inf", "abc", "1e400"]
# (command prefix, option, bad values beyond NUMBERS): every one must fail at the CLI boundary
NUMERIC = [
    (["plan"], "--cpu-tflops", ["0", "-1"]),
    (["plan"], "--nodes", ["0", "-1", "1.5", BIG]),
    (["plan"], "--batch", ["0", "-3"]),
    (["plan"], "--prefill-chunk", ["0"]),
    (["gpus"], "--context", ["0", "-1"]),
    (["generate", "M"], "--temperature", ["-0.1", "101"]),
    (["generate", "M"], "--top-p", ["0", "1.5", "-1"]),
    (["generate", "M"], "--top-k", ["-1", BIG]),
    (["generate", "M"], "--seed", ["-1", BIG]),
    (["generate", "M"], "--max-new-tokens", ["0", "-5"]),
    (["generate", "M"], "--context", ["0", "-1"]),
    (["chat", "M"], "--temperature", ["-1"]),
    (["chat", "M"], "--seed", [BIG]),
    (["chat", "M"], "--max-new-tokens", ["0"]),
    (["serve", "M"], "--port", ["-1", "65536"]),
    (["serve", "M"], "--max-queue", ["0", "-1"]),
    (["serve", "M"], "--default-max-tokens", ["0", "-5"]),
    (["serve", "M"], "--context", ["0"]),
    (["quantize", "M", "--out", "O"], "--group-size", ["0", "-1"]),
    (["quantize", "M", "--out", "O"], "--bits", ["0", "3", "16"]),
    (["export", "vllm", "M", "O"], "--group-size", ["0", "-1"]),
    (["tiny-model", "O"], "--layers", ["0", "-1"]),
    (["tiny-model", "O"], "--hidden", ["0"]),
    (["tiny-model", "O"], "--seed", ["-1", BIG]),
    (["profile-host"], "--passes", ["0"]),
]
SIZES = [
    (["plan"], "--ram", ["nan", "-1GB", "0", "lots", "1e400GB", "64XB", ""]),
    (["plan"], "--gpu-reserve", ["nan", "-1", "x"]),
    (["serve", "M"], "--max-body", ["0", "nan", "-8MB", "eight"]),
    (["quantize", "M", "--out", "O"], "--max-shard-size", ["0", "lots", "inf"]),
    (["profile-host"], "--working-set", ["1KB", "nan"]),
]
CASES = [(pre, opt, v) for pre, opt, vals in NUMERIC for v in NUMBERS + vals] + \
        [(pre, opt, v) for pre, opt, vals in SIZES for v in vals]


@pytest.mark.parametrize("prefix,option,value", CASES, ids=[f"{' '.join(p)} {o} {v!r}" for p, o, v in CASES])
def test_bad_number_is_one_line(prefix, option, value, capsys, monkeypatch):
    code, out, err = run_cli([*prefix, f"{option}={value}"], capsys, monkeypatch)
    expect_one_line(code, out, err, option, exit_code=2)


@pytest.mark.parametrize("args,needle", [
    (["serve", "M", "--log-level", "bogus"], "--log-level"),
    (["serve", "M", "--host", "not_a_host.."], "--host"),
    (["serve", "M", "--host", "a b"], "--host"),
    (["serve", "M", "--api-key", " "], "--api-key"),
    (["plan", "--context", "0"], "context 0"),
    (["plan", "--context", "-5"], "context -5"),
    (["plan", "--context", "4k,0"], "context 0"),
    (["plan", "--nodes"], "--nodes"),
    (["plan", "--no-such-option"], "--no-such-option"),
    (["export", "gguf", "M", "O", "--type", "q3_x"], "--type"),
])
def test_bad_option_is_one_line(args, needle, tmp_path, capsys, monkeypatch):
    args = [str(tmp_path) if a == "M" else a for a in args]
    code, out, err = run_cli(args, capsys, monkeypatch)
    expect_one_line(code, out, err, needle)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.one_of(st.floats(allow_nan=True, allow_infinity=True).filter(lambda x: not 0 <= x <= 100),
                 st.text(alphabet="0123456789.e-+naifx ", max_size=12)))
def test_temperature_outside_its_range_is_refused(capsys, monkeypatch, x):
    """Generated: any value the parser accepts is finite and in [0, 100]; all others are one line."""
    try:
        v = options.TEMPERATURE(str(x))
    except typer.BadParameter:
        code, out, err = run_cli(["generate", "M", "--temperature", str(x)], capsys, monkeypatch)
        expect_one_line(code, out, err, "--temperature", exit_code=2)
        return
    count()
    assert 0 <= v <= 100


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=16))
def test_size_parser_gives_a_size_or_one_error(text):
    count()
    try:
        n = sizes.parse_size(text, "--ram")
    except QuantkitError as e:
        assert "--ram" in str(e) and "\n" not in str(e)
        return
    assert isinstance(n, int) and 1 <= n <= sizes.MAX_SIZE


@pytest.mark.parametrize("text,want", [("2GB", 2 * 10**9), ("2GiB", 2 << 30), ("512k", 512_000), ("1.5MiB", 3 << 19),
                                       ("8MB", 8 * 10**6), ("1000", 1000)])
def test_one_size_rule(text, want):
    assert sizes.parse_size(text) == want


@settings(max_examples=80, deadline=None)
@given(st.text())
def test_printable_leaves_no_control_bytes(s):
    count()
    out = printable(s)
    assert not any((ord(c) < 32 and c not in "\n\t") or 0x7f <= ord(c) <= 0x9f for c in out)


def test_printable_removes_escape_sequences_whole():
    assert printable("a\x1b[31mred\x1b[0m\x1b]0;title\x07b\rc\x9b") == "aredbc"


# --- outputs: never inside or over a source, never deleting what quantkit did not write ----------------------

@pytest.fixture()
def src(tiny_model: Path):
    before = tree_digest(tiny_model)
    yield tiny_model
    assert tree_digest(tiny_model) == before, "the source changed"


def _foreign(tmp_path: Path) -> Path:
    d = tmp_path / "mine"
    d.mkdir()
    (d / "precious.txt").write_text("not quantkit's")
    return d


def test_outputs_inside_or_over_the_source_are_refused(src, tmp_path, capsys, monkeypatch):
    shard = sorted(src.glob("*.safetensors"))[0]
    cases = [
        (["quantize", src, "--out", tmp_path / "q", "--report", src / "config.md"], "overlaps the source"),
        (["quantize", src, "--out", tmp_path / "q", "--report", src / "r.json"], "overlaps the source"),
        (["quantize", src, "--out", src], "overlaps the source"),
        (["quantize", src, "--out", src / "sub"], "overlaps the source"),
        (["quantize", src, "--out", src, "--overwrite"], "overlaps the source"),
        (["export", "vllm", src, src, "--overwrite"], "overlaps the source"),
        (["export", "vllm", src, src / "sub"], "overlaps the source"),
        (["export", "gguf", src, shard, "--overwrite"], "overlaps the source"),
        (["export", "gguf", src, src / "x.gguf"], "overlaps the source"),
        (["plan", "--model", src, "--out", src / "config.json"], "overlaps the source"),
    ]
    for args, needle in cases:
        code, out, err = run_cli(args, capsys, monkeypatch)
        expect_one_line(code, out, err, needle)
    assert not (tmp_path / "q").exists()


def test_overwrite_never_deletes_what_quantkit_did_not_write(src, tmp_path, capsys, monkeypatch):
    mine = _foreign(tmp_path)
    text = tmp_path / "notes.txt"
    text.write_text("keep me")
    cases = [
        (["export", "vllm", src, mine, "--overwrite"], "not a quantkit output"),
        (["export", "vllm", src, mine], "exists; pass --overwrite"),
        (["tiny-model", mine, "--overwrite"], "not a quantkit output"),
        (["quantize", src, "--out", mine, "--overwrite"], "not a quantkit output"),
        (["export", "gguf", src, text, "--overwrite"], "not a quantkit output"),
        (["export", "gguf", src, mine], "is a folder"),
        (["plan", "--out", text], "not a quantkit output"),
    ]
    for args, needle in cases:
        code, out, err = run_cli(args, capsys, monkeypatch)
        expect_one_line(code, out, err, needle)
    assert (mine / "precious.txt").read_text() == "not quantkit's" and text.read_text() == "keep me"


@pytest.mark.parametrize("kind", ["readonly", "full"])
def test_unwritable_or_full_locations_fail_before_the_work(kind, src, tmp_path, capsys, monkeypatch):
    with limited_dir(tmp_path, kind) as d:
        cases = [
            (["quantize", src, "--out", d / "q"], "--out"),
            (["quantize", src, "--out", tmp_path / "q", "--report", d / "r.md"], "--report"),
            (["export", "gguf", src, d / "t.gguf"], str(d / "t.gguf")),
            (["export", "vllm", src, d / "v"], str(d / "v")),
            (["tiny-model", d / "t", "--layers", "2", "--hidden", "32"], str(d / "t")),
            (["plan", "--out", d / "p.json"], "--out"),
            (["profile-host", "--out", d / "prof.json", "--passes", "1"], "--out"),
        ]
        for args, needle in cases:
            code, out, err = run_cli(args, capsys, monkeypatch)
            expect_one_line(code, out, err, needle)
        assert not (tmp_path / "q").exists()  # the --report check came before any work
        left = [p.name for p in d.iterdir() if p.name != "filler"]
        assert left == [], left


def test_a_killed_runs_leftovers_are_removed_by_the_next_run(tmp_path, capsys, monkeypatch):
    out = tmp_path / "t"
    dead = tmp_path / f".{out.name}.tmp-{2**22 + 12345}"  # no such pid (above the default pid_max)
    dead.mkdir()
    (dead / "shard.safetensors").write_bytes(b"half")
    stale = tmp_path / f".{out.name}.tmp"
    stale.write_bytes(b"half")
    code, _, err = run_cli(["tiny-model", out, "--layers", "2", "--hidden", "32"], capsys, monkeypatch)
    count()
    assert code == 0, err
    assert not dead.exists() and not stale.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t"]


# --- files a user names are read with a bound -----------------------------------------------------------

@pytest.fixture(scope="module")
def huge(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("huge") / "huge.json"
    with open(p, "wb") as f:  # sparse: 100 MB that take no disk
        f.truncate(100 << 20)
    return p


@pytest.mark.parametrize("endless", ["/dev/zero", "huge"])
def test_endless_or_huge_files_are_refused_with_a_bound(endless, huge, src, tmp_path, capsys, monkeypatch):
    f = str(huge) if endless == "huge" else endless
    cases = [
        ["plan", "--profile", f],
        ["plan", "--model", f],
        ["inspect", f],
        ["quantize", src, "--out", tmp_path / "q", "--recipe", f],
        ["chat", src, "--load", f],
    ]
    for args in cases:
        code, out, err = run_cli(args, capsys, monkeypatch)
        # a device is refused as such (issue 26), a regular file by its size
        expect_one_line(code, out, err, "not a regular file" if endless == "/dev/zero" else "larger than")


def test_bounded_reader_reads_at_most_the_limit(tmp_path):
    count()
    with pytest.raises(QuantkitError, match="not a regular file"):
        read_json_bounded("/dev/zero", "plan", limit=1 << 20)
    p = tmp_path / "ok.json"
    p.write_text('{"a": 1}')
    assert read_json_bounded(p, "x") == {"a": 1}
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(QuantkitError):
        read_json_bounded(deep, "x")


# --- wrong answers ----------------------------------------------------------------------------------------

def test_absurd_config_is_refused_fast(tmp_path, capsys, monkeypatch):
    from quantkit.checkpoint.spec import default_config_path

    cfg = json.loads(default_config_path().read_text())
    for key, val in [("num_hidden_layers", 200_000), ("num_experts", 10**9), ("vocab_size", 2**40),
                     ("mtp_num_hidden_layers", 10**6), ("max_position_embeddings", -1)]:
        bad = json.loads(json.dumps(cfg))
        bad["text_config"][key] = val
        bad["text_config"].pop("layer_types", None)
        p = tmp_path / f"{key}.json"
        p.write_text(json.dumps(bad))
        for cmd in (["plan", "--model", p], ["inspect", p]):
            code, out, err = run_cli(cmd, capsys, monkeypatch)
            expect_one_line(code, out, err, key)


@pytest.fixture(scope="module")
def quantized(tiny_model: Path, tmp_path_factory) -> Path:
    from quantkit.checkpoint.reader import Checkpoint
    from quantkit.quantize.run import QuantizeOptions, run_quantize
    from quantkit.recipe import build_recipe

    out = tmp_path_factory.mktemp("probe-q") / "q"
    run_quantize(Checkpoint.open(tiny_model), out, QuantizeOptions(recipe=build_recipe(8, "int", None, False, [], None)))
    return out


def _verify_fails(folder: Path, needle: str, capsys, monkeypatch) -> None:
    code, out, err = run_cli(["verify", folder, "--quick"], capsys, monkeypatch)
    count()
    assert code == 1 and "Traceback" not in err and needle in err, err
    assert "OK" not in out


def test_verify_refuses_entries_outside_the_folder(quantized, tmp_path, capsys, monkeypatch):
    from quantkit.quantize.manifest import MANIFEST_NAME

    for how in ("dotdot", "absolute", "symlink"):
        q = tmp_path / how / "q"
        shutil.copytree(quantized, q)
        man = json.loads((q / MANIFEST_NAME).read_text())
        name = sorted(man["shards"])[0]
        if how == "symlink":
            outside = tmp_path / how / "outside.safetensors"
            os.replace(q / name, outside)
            os.symlink(outside, q / name)
            _verify_fails(q, "links outside", capsys, monkeypatch)
            continue
        other = "../" + name if how == "dotdot" else str((q / name).resolve())
        shutil.copy(q / name, q.parent / name)
        man["shards"][other] = man["shards"].pop(name)
        (q / MANIFEST_NAME).write_text(json.dumps(man))
        _verify_fails(q, "refuses shard path", capsys, monkeypatch)


def test_chat_slash_load_and_plan_files_are_read_with_a_bound(huge):
    import io

    from rich.console import Console

    from quantkit.runtime import SamplingParams
    from quantkit.runtime.chat import Chat, ChatSession
    from quantkit.runtime.loader import load_plan_file

    buf = io.StringIO()
    chat = Chat(None, ChatSession(), SamplingParams(), Console(file=buf, width=200))
    for f in ("/dev/zero", str(huge)):
        count(2)
        chat._load(f)
        why = "not a regular file" if f == "/dev/zero" else "larger than"
        assert why in buf.getvalue() and chat.s.messages == []
        with pytest.raises(QuantkitError, match=why):
            load_plan_file(f)


def test_chat_prints_no_terminal_control_bytes():
    import io

    from rich.console import Console

    from quantkit.runtime import SamplingParams
    from quantkit.runtime.chat import Chat, ChatSession

    count()
    buf = io.StringIO()
    Chat(None, ChatSession(), SamplingParams(), Console(file=buf, width=200)).say("x\x1b]0;pwned\x07\x1b[2Jy")
    assert buf.getvalue().strip() == "xy"


_segment = st.sampled_from(["..", ".", "src", "out", "x", "link", "config.json", "a b", "sub"])


@settings(max_examples=150, deadline=None)
@given(st.lists(_segment, min_size=1, max_size=5), st.sampled_from(["file", "folder"]), st.booleans())
def test_generated_output_paths_never_land_in_the_source(tmp_path_factory, parts, kind, overwrite):
    """Generated paths (with `..`, `.` and a symlink into the source): the guard refuses, or the output
    lies outside the source and was not there before or is quantkit's own."""
    from quantkit.outputs import guard_output

    base = tmp_path_factory.getbasetemp() / "gen-paths"
    src = base / "src"
    if not src.exists():
        (src / "sub").mkdir(parents=True)
        (src / "config.json").write_text("{}")
        (base / "link").symlink_to(src)
    out = base.joinpath(*parts)
    count()
    try:
        guard_output(out, sources=[src], kind=kind, overwrite=overwrite, create_parents=True)
    except QuantkitError as e:
        assert "\n" not in str(e)
        return
    r = out.resolve()
    assert r != src.resolve() and src.resolve() not in r.parents and r not in src.resolve().parents
