"""benchmarks/generate_loop.py: one generation alone in two trees, alternated, their tokens compared."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.cli import run_driver
from helpers.probe import expect_one_line

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_tree_against_itself_times_every_round_and_agrees(q4, tmp_path, capsys, monkeypatch):
    """Both workers are this tree: every kept round has both trees' figures, the tokens are the same in each, and
    the report gives each tree's best and median and the ratios."""
    code, out, err = run_driver("generate_loop", ["--peer", ROOT, "--model", q4, "--threads", "1", "--rounds", "2",
                                                  "--reports", tmp_path], capsys, monkeypatch)
    assert code == 0, err
    d = json.loads((tmp_path / "bench-generate-loop.json").read_text())
    assert d["tokens_differ_in_rounds"] == [] and {k: len(v) for k, v in d["runs"].items()} == {"this": 2, "peer": 2}
    for s in d["summary"].values():
        assert s["ttft"]["best"] <= s["ttft"]["median"] and s["decode_tps"]["best"] >= s["decode_tps"]["median"] > 0
    md = (tmp_path / "bench-generate-loop.md").read_text()
    assert "the same in every round" in md and "| this |" in md and "This tree / its peer" in md


def test_a_peer_that_is_no_checkout_is_one_line_and_nothing_runs(tmp_path, capsys, monkeypatch):
    code, out, err = run_driver("generate_loop", ["--peer", tmp_path / "nowhere", "--reports", tmp_path / "r",
                                                  "--workdir", tmp_path / "w"], capsys, monkeypatch)
    expect_one_line(code, out, err, "--peer")
    assert list(tmp_path.iterdir()) == []
