"""`quantkit quantize --method gptq|imatrix --stats`: the issue's command line end to end, the method and
fallbacks in quantization_config, the held-out output error in the report, and resume after an
interruption to identical bytes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import quantkit.quantize.run as qz
from quantkit.quantize.manifest import JOURNAL_NAME, MANIFEST_NAME

from helpers.cli import interrupt_quantizer_after, run_cli


def _qk(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "quantkit", *map(str, args)], capture_output=True, text=True)


@pytest.mark.slow
def test_done_when_command_line(tmp_path):
    t, s, g = tmp_path / "t", tmp_path / "s", tmp_path / "g"
    for args in (("tiny-model", t), ("stats", t, "--out", s),
                 ("quantize", t, "--bits", "4", "--method", "gptq", "--stats", s, "--out", g),
                 ("verify", g), ("generate", g, "--prompt", "hi", "--max-new-tokens", "4")):
        r = _qk(*args)
        assert r.returncode == 0, (args, r.stderr[-2000:])
    qc = json.loads((g / "config.json").read_text())["quantization_config"]
    cal = qc["calibration"]
    assert cal["method"] == "gptq" and len(cal["data_fingerprint"]) == 64 and cal["tokens"] > 0
    assert isinstance(cal["rtn_fallbacks"], dict)
    rep = json.loads((g / "quantkit-report.json").read_text())
    roles = {r["role"]: r for r in rep["roles"]}
    assert 0 < roles["routed_expert"]["output_rel_error"] < 1


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if not p.name.startswith("quantkit-report")}


@pytest.mark.parametrize("method", ["gptq", "imatrix"])
def test_interrupted_calibrated_run_resumes_to_identical_bytes(tiny_model, tiny_stats, tmp_path, capsys,
                                                               monkeypatch, method):
    args = ["quantize", tiny_model, "--bits", "4", "--uniform", "--method", method, "--stats", tiny_stats,
            "--max-shard-size", "60KB"]
    ref, out = tmp_path / "ref", tmp_path / "out"
    code, _, err = run_cli([*args, "--out", ref], capsys, monkeypatch)
    assert code == 0, err
    orig = interrupt_quantizer_after(monkeypatch, 30)
    code, _, _ = run_cli([*args, "--out", out], capsys, monkeypatch)
    assert code == 130 and (out / JOURNAL_NAME).is_file() and not (out / MANIFEST_NAME).exists()
    monkeypatch.setattr(qz, "_quantize_tensor", orig)
    # other statistics options are refused on resume (the journal's key holds the method and data)
    code, _, err = run_cli([*args[:6], "rtn", *args[7:], "--out", out, "--resume"], capsys, monkeypatch)
    assert code == 2 and "different" in err
    code, _, err = run_cli([*args, "--out", out, "--resume"], capsys, monkeypatch)
    assert code == 0, err
    assert _files(out) == _files(ref)
    code, _, _ = run_cli(["verify", out], capsys, monkeypatch)
    assert code == 0
    shutil.rmtree(out)


def test_methods_rank_on_held_out_output_error(tiny_model, tiny_stats, tmp_path, capsys, monkeypatch):
    err = {}
    for method in ("rtn", "imatrix", "gptq"):
        out = tmp_path / method
        code, _, e = run_cli(["quantize", tiny_model, "--bits", "4", "--uniform", "--group-size", "32", "--method",
                              method, "--stats", tiny_stats, "--out", out], capsys, monkeypatch)
        assert code == 0, e
        rep = json.loads((out / "quantkit-report.json").read_text())
        err[method] = rep["total"]["output_rel_error"]
    assert err["gptq"] < err["imatrix"] < err["rtn"], err
