"""benchmarks/step_rows.py: a decode step of 1..16 rows in two trees, alternated, their logits compared."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import step_rows as sr

from helpers.cli import run_driver
from helpers.probe import expect_one_line

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_tree_against_itself_times_every_row_count_and_agrees_bit_for_bit(q4, tmp_path, capsys, monkeypatch):
    """Both workers are this tree: the run times every row count in both, in every kept round, and finds the two
    trees' logits the same at every step (what a speed-only change must keep)."""
    code, out, err = run_driver("step_rows", ["--peer", ROOT, "--model", q4, "--threads", "1", "--rounds", "2",
                                              "--reports", tmp_path], capsys, monkeypatch)
    assert code == 0, err
    d = json.loads((tmp_path / "bench-step-rows.json").read_text())
    assert d["logits_differ"] == [] and set(d["seconds"]) == {"this", "peer"}
    for name in ("this", "peer"):
        assert {b: len(v) for b, v in d["seconds"][name].items()} == {str(b): 2 for b in sr.ROWS}
        s = d["summary"][name]
        assert s["vs_4_rows"]["4"] == 1.0 and all(s["best_ms"][b] <= s["median_ms"][b] <= s["slowest_ms"][b]
                                                  for b in s["best_ms"])
    md = (tmp_path / "bench-step-rows.md").read_text()
    assert "the same bits" in md and "| this | ms, best |" in md and "| peer | tokens/s (B / best) |" in md


def test_a_peer_that_is_no_checkout_is_one_line_and_nothing_runs(tmp_path, capsys, monkeypatch):
    code, out, err = run_driver("step_rows", ["--peer", tmp_path / "nowhere", "--reports", tmp_path / "r",
                                              "--workdir", tmp_path / "w"], capsys, monkeypatch)
    expect_one_line(code, out, err, "--peer")
    assert list(tmp_path.iterdir()) == []
