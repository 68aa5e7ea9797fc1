"""Nothing lost outside chat (issue 26): every path a user names for writing goes through the one output guard
(quantkit/outputs.py): `stats --out`, `stats --imatrix`, `export imatrix`, `calibrate --out`, `plan --out`;
special files are refused for reading and writing (a FIFO never hangs a command); a symlinked output is
refused, not followed into an rmtree; a failed or concurrent `stats` leaves nothing behind."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

import pytest

from helpers.cli import run_cli
from helpers.probe import count, expect_one_line, limited_dir, tree_digest

STATS_ARGS = ["--calib-tokens", "1024", "--chunk-size", "128"]


@pytest.fixture()
def src(tiny_model: Path):
    before = tree_digest(tiny_model)
    yield tiny_model
    assert tree_digest(tiny_model) == before, "the source changed"


@pytest.fixture()
def notes(tmp_path: Path) -> Path:
    p = tmp_path / "notes.txt"
    p.write_text("not quantkit's")
    return p


def test_stats_out_never_replaces_an_unrelated_file(src, notes, capsys, monkeypatch):
    for extra, needle in (([], "exists; pass --overwrite"), (["--overwrite"], "not a quantkit output")):
        code, out, err = run_cli(["stats", src, "--out", notes, *STATS_ARGS, *extra], capsys, monkeypatch)
        expect_one_line(code, out, err, needle)
    assert notes.read_text() == "not quantkit's"
    assert [p.name for p in notes.parent.iterdir()] == ["notes.txt"]  # no work folder either


def test_stats_imatrix_inside_the_source_is_refused_before_the_run(src, tmp_path, capsys, monkeypatch):
    code, out, err = run_cli(["stats", src, "--out", tmp_path / "s", "--imatrix", src / "im.gguf", *STATS_ARGS],
                             capsys, monkeypatch)
    expect_one_line(code, out, err, "overlaps the source")
    assert not (tmp_path / "s").exists()  # refused before the statistics were collected


def test_stats_imatrix_never_replaces_an_unrelated_file(src, notes, tmp_path, capsys, monkeypatch):
    code, out, err = run_cli(["stats", src, "--out", tmp_path / "s", "--imatrix", notes, "--overwrite",
                              *STATS_ARGS], capsys, monkeypatch)
    expect_one_line(code, out, err, "--imatrix")
    assert notes.read_text() == "not quantkit's" and not (tmp_path / "s").exists()


def test_export_imatrix_never_replaces_a_shard_or_an_unrelated_file(tiny_stats, quantized_folder, notes, capsys,
                                                                    monkeypatch):
    shard = sorted(quantized_folder.glob("*.safetensors"))[0]
    before = tree_digest(quantized_folder)
    for target in (shard, notes):
        code, out, err = run_cli(["export", "imatrix", tiny_stats, target, "--overwrite"], capsys, monkeypatch)
        expect_one_line(code, out, err, "not a quantkit output")
    code, out, err = run_cli(["export", "imatrix", tiny_stats, tiny_stats, "--overwrite"], capsys, monkeypatch)
    expect_one_line(code, out, err, "overlaps the source")
    assert tree_digest(quantized_folder) == before and notes.read_text() == "not quantkit's"


@pytest.fixture(scope="module")
def quantized_folder(tiny_model: Path, tmp_path_factory) -> Path:
    from quantkit.checkpoint.reader import Checkpoint
    from quantkit.quantize.run import QuantizeOptions, run_quantize
    from quantkit.recipe import build_recipe

    out = tmp_path_factory.mktemp("guard-q") / "q"
    run_quantize(Checkpoint.open(tiny_model), out, QuantizeOptions(recipe=build_recipe(8, "int", None, False, [],
                                                                                         None)))
    return out


def test_calibrate_out_never_replaces_an_unrelated_file(notes, capsys, monkeypatch):
    code, out, err = run_cli(["profile-host", "--out", notes, "--passes", "1"], capsys, monkeypatch)
    expect_one_line(code, out, err, "not a quantkit output")
    assert notes.read_text() == "not quantkit's"


def test_plan_out_beside_a_source_config_is_refused(src, capsys, monkeypatch):
    code, out, err = run_cli(["plan", "--model", src / "config.json", "--out", src / "plan.json"], capsys, monkeypatch)
    expect_one_line(code, out, err, "overlaps the source")


def test_fifos_are_refused_for_reading_and_writing(src, tmp_path, capsys, monkeypatch):
    """Each would block forever in open() before the guard (a FIFO has no writer or reader)."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for args in (["quantize", src, "--out", tmp_path / "q", "--recipe", fifo],
                 ["export", "gguf", src, fifo, "--overwrite"],
                 ["plan", "--out", fifo],
                 ["stats", src, "--out", fifo, "--overwrite", *STATS_ARGS]):
        code, out, err = run_cli(args, capsys, monkeypatch)
        expect_one_line(code, out, err, "not a regular file")
    assert not (tmp_path / "q").exists()


def test_overwrite_through_a_symlink_is_refused_and_changes_nothing(src, quantized_folder, tmp_path, capsys,
                                                                    monkeypatch):
    link = tmp_path / "link"
    link.symlink_to(quantized_folder)
    before = tree_digest(quantized_folder)
    code, out, err = run_cli(["quantize", src, "--out", link, "--bits", "8", "--overwrite"], capsys, monkeypatch)
    expect_one_line(code, out, err, "symbolic link")
    assert link.is_symlink() and tree_digest(quantized_folder) == before


def test_stats_on_a_full_disk_is_one_line_and_leaves_nothing(src, tmp_path, capsys, monkeypatch):
    with limited_dir(tmp_path, "full") as d:
        code, out, err = run_cli(["stats", src, "--out", d / "s", *STATS_ARGS], capsys, monkeypatch)
        expect_one_line(code, out, err, "--out")
        assert [p.name for p in d.iterdir()] == ["filler"]


def test_a_write_failing_mid_run_removes_the_work_folder(tiny_model, tmp_path, monkeypatch):
    """A disk that fills during the run (after the guard's free-space check): one line, no `.NAME.partial`."""
    from quantkit.checkpoint.reader import Checkpoint
    from quantkit.errors import QuantkitError
    from quantkit.quantize import stats as stats_mod
    from quantkit.quantize.calib_data import load_tokens
    from quantkit.runtime.engine import load_tokenizer

    count()
    tokens = load_tokens(None, load_tokenizer(tiny_model), chunk_size=128, max_tokens=1024)

    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(stats_mod, "save_file", full)
    with pytest.raises(QuantkitError, match="No space left") as e:
        stats_mod.collect_stats(Checkpoint.open(tiny_model), tokens, tmp_path / "s")
    assert "\n" not in str(e.value)
    assert list(tmp_path.iterdir()) == []


def test_a_second_stats_run_to_the_same_out_is_refused_and_the_first_keeps_its_work(src, tmp_path, capsys,
                                                                                     monkeypatch):
    out = tmp_path / "s"
    work = tmp_path / ".s.partial"
    work.mkdir()
    (work / "state.json").write_text("{}")
    fd = os.open(work, os.O_RDONLY)  # the first run holds its work folder
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        code, so, err = run_cli(["stats", src, "--out", out, *STATS_ARGS], capsys, monkeypatch)
        expect_one_line(code, so, err, "another `quantkit stats` is writing it")
    finally:
        os.close(fd)
    assert (work / "state.json").read_text() == "{}" and not out.exists()
    code, so, err = run_cli(["stats", src, "--out", out, *STATS_ARGS], capsys, monkeypatch)  # once it is free
    count()
    assert code == 0, err
    assert out.is_file() and not work.exists()


# --- --overwrite deletes only what quantkit wrote -----------------------------------------------------------

@pytest.mark.parametrize("writer", ["quantize", "export-vllm", "tiny-model"])
def test_overwrite_refuses_an_own_folder_holding_a_file_the_user_added(writer, src, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    make = {"quantize": ["quantize", src, "--out", out, "--bits", "8"],
            "export-vllm": ["export", "vllm", src, out],
            "tiny-model": ["tiny-model", out, "--layers", "2", "--hidden", "32"]}[writer]
    code, _, err = run_cli(make, capsys, monkeypatch)
    assert code == 0, err
    (out / "my-notes.txt").write_text("added by hand")
    before = tree_digest(out)
    code, so, err = run_cli([*make, "--overwrite"], capsys, monkeypatch)
    expect_one_line(code, so, err, "holds files quantkit did not write (my-notes.txt)")
    assert tree_digest(out) == before
    (out / "my-notes.txt").unlink()
    code, _, err = run_cli([*make, "--overwrite"], capsys, monkeypatch)  # its own files alone: replaced
    count()
    assert code == 0, err


def test_a_folder_with_a_stray_tiny_sidecar_is_not_quantkits(tmp_path, capsys, monkeypatch):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "quantkit-tiny.json").write_text('{"generator": "quantkit tiny-model"}')
    (mine / "thesis.tex").write_text("years of work")
    code, out, err = run_cli(["tiny-model", mine, "--overwrite", "--layers", "2", "--hidden", "32"], capsys,
                             monkeypatch)
    expect_one_line(code, out, err, "thesis.tex")
    assert (mine / "thesis.tex").read_text() == "years of work"


def test_bench_reports_never_replace_a_file_no_bench_wrote(tmp_path, capsys, monkeypatch):
    mine = tmp_path / "bench-decode.md"
    mine.write_text("my own notes on decoding")
    code, out, err = run_cli(["bench", "decode", "--reports", tmp_path, "--workdir", tmp_path / "w"], capsys,
                             monkeypatch)
    expect_one_line(code, out, err, "not a quantkit output")
    assert mine.read_text() == "my own notes on decoding" and not (tmp_path / "w").exists()


def test_the_repositorys_own_bench_reports_may_be_replaced():
    """Every report a bench wrote (reports/ in this repository) passes the same guard."""
    from types import SimpleNamespace

    from quantkit.cli.bench import _guard_reports

    count()
    reports = Path(__file__).resolve().parents[2] / "reports"
    stems = {p.name.split(".")[0] for p in reports.glob("bench-*.md")}
    assert stems
    for stem in sorted(stems):
        _guard_reports(SimpleNamespace(info_name=stem.removeprefix("bench-")), reports)
