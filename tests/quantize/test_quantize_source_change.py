"""Issue 43: `quantize` notices its source changing under it, and reads a model only where every command would.

- a source shard rewritten in place (same size, same inode, new bytes) between reading a shard and recording it,
  or before the manifest: one `error:` line naming the file, no manifest, nothing recorded done that was read
  from the changed file; `--resume` after restoring it gives the uninterrupted run's bytes;
- a single-file source cut short mid-run (it used to be memory-mapped: SIGBUS, exit 135): one line, not a signal;
- a config.json that `inspect` (and plan, verify, generate) refuse is refused by `quantize` with the same line,
  before anything is written;
- the messages of a full disk (in units that fit) and of a reformatted config.json (not "truncated").
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from helpers.cli import run_cli
from helpers.probe import count, expect_one_line, tree_digest

REPORTS = ("quantkit-report.md", "quantkit-report.json")  # wall-clock seconds: not byte-stable
GATE_UP = "model.language_model.layers.1.mlp.experts.gate_up_proj"


def _digest(out: Path) -> dict[str, str]:
    return {k: v for k, v in tree_digest(out).items() if k not in REPORTS}


def _quantize(src: Path, out: Path, *extra: str) -> list:
    return ["quantize", src, "--out", out, "--max-shard-size", "60KB", *extra]


def _rewrite_in_place(path: Path) -> None:
    """New bytes after the header, same size, same inode, a later modification time."""
    st = path.stat()
    with open(path, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        f.seek(8 + n)
        f.write(bytes(st.st_size - 8 - n))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    now = path.stat()
    assert (now.st_size, now.st_ino) == (st.st_size, st.st_ino) and now.st_mtime_ns != st.st_mtime_ns


def _restore(path: Path, data: bytes) -> None:
    with open(path, "r+b") as f:  # in place again: the inode is the run's, the times are new
        f.write(data)


def _reference(src: Path, tmp_path: Path, capsys, monkeypatch) -> dict[str, str]:
    """The uninterrupted run's bytes (from the same source path: the manifest records it)."""
    code, _, err = run_cli(_quantize(src, tmp_path / "ref"), capsys, monkeypatch)
    assert code == 0, err
    return _digest(tmp_path / "ref")


def _source_and_reference(tiny_model, tmp_path, capsys, monkeypatch) -> tuple[Path, Path, bytes, dict[str, str]]:
    """A copy of the tiny model, the shard holding GATE_UP with its bytes, and the digest of an uninterrupted run."""
    src = tmp_path / "src"
    shutil.copytree(tiny_model, src)
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    victim = src / index[GATE_UP]
    return src, victim, victim.read_bytes(), _reference(src, tmp_path, capsys, monkeypatch)


@pytest.mark.parametrize("when", ["before a shard is recorded", "before the manifest"])
def test_a_shard_rewritten_in_place_mid_run_is_named_and_resume_restores_the_bytes(
        when, tiny_model, tmp_path, capsys, monkeypatch):
    import quantkit.quantize.run as qz

    src, victim, original, reference = _source_and_reference(tiny_model, tmp_path, capsys, monkeypatch)
    out = tmp_path / "q"
    hit = {"n": 0}

    def rewrite_once() -> None:
        hit["n"] += 1
        if hit["n"] == 1:
            _rewrite_in_place(victim)

    if when == "before a shard is recorded":  # the first shard is written and hashed, not yet journaled
        real = qz._finish_and_hash

        def finish_then_rewrite(w, times):
            entry = real(w, times)
            rewrite_once()
            return entry

        monkeypatch.setattr(qz, "_finish_and_hash", finish_then_rewrite)
    else:  # every shard journaled; the folder's files and the report are next, the manifest last
        real_report = qz.write_report  # run.py's own binding: patching the report module would miss it

        def report_then_rewrite(*a, **k):
            rewrite_once()
            return real_report(*a, **k)

        monkeypatch.setattr(qz, "write_report", report_then_rewrite)
    code, stdout, err = run_cli(_quantize(src, out), capsys, monkeypatch)
    line = expect_one_line(code, stdout, err, victim.name)
    assert hit["n"] >= 1 and "rewritten in place" in line and "--resume" in line, line
    assert not (out / "quantkit-manifest.json").exists()
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]
    journal = json.loads((out / ".quantkit-progress.json").read_text())
    if when == "before a shard is recorded":
        assert journal["done"] == {}  # the shard read around the rewrite is not recorded
        assert not list(out.glob("model-*.safetensors"))
    monkeypatch.undo()

    _restore(victim, original)
    code, stdout, err = run_cli([*_quantize(src, out), "--resume"], capsys, monkeypatch)
    assert code == 0, err
    assert "reused" not in stdout  # the journal's shards were read from the file before it changed: redone
    assert _digest(out) == reference
    count()


def test_a_source_changed_between_runs_is_not_mixed_into_a_resume(tiny_model, tmp_path, capsys, monkeypatch):
    """Killed (Ctrl-C) mid-run, then the source rewritten with the same header: --resume redoes every shard instead
    of keeping shards read from the old bytes beside shards read from the new."""
    from helpers.cli import interrupt_quantizer_after

    src, victim, original, reference = _source_and_reference(tiny_model, tmp_path, capsys, monkeypatch)
    out = tmp_path / "q"
    interrupt_quantizer_after(monkeypatch, 40)
    code, _, err = run_cli(_quantize(src, out), capsys, monkeypatch)
    assert code == 130, err
    monkeypatch.undo()
    assert json.loads((out / ".quantkit-progress.json").read_text())["done"]
    _rewrite_in_place(victim)
    _restore(victim, original)
    code, stdout, err = run_cli([*_quantize(src, out), "--resume"], capsys, monkeypatch)
    assert code == 0 and "reused" not in stdout, err
    assert _digest(out) == reference
    count()


_CUT_MID_RUN = """
import os, sys
from quantkit.quantize import stream

path, at = sys.argv[1], int(sys.argv[2])
real_get, calls = stream.Reader.get, [0]

def get(self):
    # the block handed to the quantizer is in memory (or was mapped: then touching it past the cut is SIGBUS)
    item = real_get(self)
    calls[0] += 1
    if calls[0] == at:
        os.truncate(path, 4096)
    return item

stream.Reader.get = get
sys.argv = ["quantkit", *sys.argv[3:]]
from quantkit.cli import main
main()
"""


def test_a_single_file_source_cut_short_mid_run_is_one_line_not_sigbus(tiny_model, tmp_path):
    src = tmp_path / "single"
    src.mkdir()
    tensors = {}
    for shard in sorted(tiny_model.glob("*.safetensors")):
        tensors.update(load_file(shard))
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    for p in tiny_model.iterdir():
        if p.suffix != ".safetensors" and p.name != "model.safetensors.index.json":
            shutil.copy(p, src / p.name)
    whole = (src / "model.safetensors").read_bytes()
    ref, out = tmp_path / "ref", tmp_path / "q"
    r = subprocess.run([sys.executable, "-m", "quantkit", *map(str, _quantize(src, ref))], capture_output=True,
                       text=True, env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "-c", _CUT_MID_RUN, str(src / "model.safetensors"), "10",
                        *map(str, _quantize(src, out))], capture_output=True, text=True,
                       env={**os.environ, "COLUMNS": "200"})
    assert (src / "model.safetensors").stat().st_size == 4096, "the cut did not happen: the test proved nothing"
    assert r.returncode not in (135, -signal.SIGBUS), (r.returncode, r.stderr[-2000:])
    expect_one_line(r.returncode, r.stdout, r.stderr, "model.safetensors")
    assert not (out / "quantkit-manifest.json").exists()
    (src / "model.safetensors").write_bytes(whole)
    r = subprocess.run([sys.executable, "-m", "quantkit", *map(str, _quantize(src, out)), "--resume"],
                       capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    assert _digest(out) == _digest(ref)


# (field, value): what `plan`/`inspect`/`verify`/`generate` refuse; `full_attention_interval` without layer_types
HOSTILE_CONFIGS = [
    ("hidden_size", 0), ("hidden_size", -64), ("hidden_size", 1 << 40), ("hidden_size", 64.5),
    ("hidden_size", "64"), ("num_experts", 1), ("num_experts_per_tok", 0), ("num_hidden_layers", 0),
    ("vocab_size", 1 << 40), ("num_attention_heads", 0), ("num_attention_heads", 3), ("num_key_value_heads", 3),
    ("linear_num_key_heads", 3), ("head_dim", 0), ("head_dim", 16.5), ("moe_intermediate_size", 0),
    ("mtp_num_hidden_layers", -1), ("layer_types", ["full_attention"]), ("full_attention_interval", 0),
    ("shared_expert_intermediate_size", None),
]


@pytest.mark.parametrize("field,value", HOSTILE_CONFIGS, ids=[f"{f}={v!r}" for f, v in HOSTILE_CONFIGS])
def test_quantize_refuses_the_configs_every_other_command_refuses(field, value, tiny_model, tmp_path, capsys,
                                                                   monkeypatch):
    src = tmp_path / "src"
    shutil.copytree(tiny_model, src)
    cfg = json.loads((src / "config.json").read_text())
    if field == "full_attention_interval":
        del cfg["text_config"]["layer_types"]
    cfg["text_config"][field] = value
    (src / "config.json").write_text(json.dumps(cfg))
    before = tree_digest(src)
    code, stdout, err = run_cli(["inspect", src], capsys, monkeypatch)
    refused = expect_one_line(code, stdout, err, field)
    out = tmp_path / "q"
    code, stdout, err = run_cli(_quantize(src, out), capsys, monkeypatch)
    assert expect_one_line(code, stdout, err) == refused  # the same rule, the same line
    assert not out.exists() and tree_digest(src) == before


def test_a_full_disk_is_told_in_units_that_fit(tiny_model, tmp_path, capsys, monkeypatch):
    import quantkit.outputs as outputs

    real = shutil.disk_usage
    monkeypatch.setattr(outputs.shutil, "disk_usage", lambda p: real(p)._replace(free=10_000))
    out = tmp_path / "q"
    code, stdout, err = run_cli(_quantize(tiny_model, out), capsys, monkeypatch)
    line = expect_one_line(code, stdout, err, "not enough free disk")
    assert "0.00 GB" not in line and "10.0 KB free" in line and " MB," in line, line
    assert not out.exists()


def test_verify_says_a_reformatted_config_differs_not_truncated(tiny_model, tmp_path, capsys, monkeypatch):
    out = tmp_path / "q"
    code, _, err = run_cli(_quantize(tiny_model, out), capsys, monkeypatch)
    assert code == 0, err
    cfg = json.loads((out / "config.json").read_text())
    for indent in (None, 8):  # smaller and larger than the file quantize wrote, both valid JSON
        (out / "config.json").write_text(json.dumps(cfg, indent=indent))
        code, stdout, err = run_cli(["verify", out], capsys, monkeypatch)
        line = expect_one_line(code, stdout, err, "config.json: differs from the manifest")
        assert "truncated" not in line and "larger" not in line, line
