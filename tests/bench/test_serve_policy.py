"""benchmarks/serve_policy.py: the tok/s each MTP policy gives at 2 and 4 slots, from step and verify times."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import serve_policy as sp


def test_each_policy_is_tokens_over_the_time_that_makes_them():
    # step_batch(B) = 10 ms + 5 ms a row: a verify of 2 tokens for S rows costs step_batch(2S) plus S drafts
    times = {f"step_batch_{b}": 0.010 + 0.005 * b for b in range(1, sp.MAX_ROWS + 1)}
    got = {p["slots"]: p for p in sp.policies(times)}
    assert got[2]["no_drafts_tok_s"] == pytest.approx(2 / 0.020)
    draft = 2 * sp.DRAFT_STEPS * 0.015
    assert got[2]["drafts_tok_s"] == pytest.approx(2 * (1 + sp.ACCEPTANCE) / (0.030 + draft))
    assert got[4]["drafts_tok_s"] == pytest.approx(4 * (1 + sp.ACCEPTANCE) / (0.050 + 2 * draft))
    assert all(p["better"] == ("drafts" if p["drafts_tok_s"] > p["no_drafts_tok_s"] else "no drafts")
               for p in got.values())


def test_a_batch_that_doubles_its_time_past_four_rows_makes_drafts_lose_at_four_slots():
    times = {f"step_batch_{b}": 0.025 + 0.003 * b + (0.025 if b > 4 else 0) for b in range(1, sp.MAX_ROWS + 1)}
    got = {p["slots"]: p["better"] for p in sp.policies(times)}
    assert got == {2: "drafts", 4: "no drafts"}


def test_the_draft_cost_comes_from_the_mtp_reports_figures():
    report = (Path(__file__).resolve().parents[2] / "reports" / "bench-mtp.md").read_text()
    assert f"1 draft at {sp.ACCEPTANCE}: {sp.ONE_DRAFT_SPEEDUP}x" in report
    # the verify table's row of 2 tokens: "| 2 | 28.4 ms | 1.10x |"
    assert any(line.startswith("| 2 |") and line.endswith(f"| {sp.VERIFY_2_STEPS:.2f}x |") and " ms " in line
               for line in report.splitlines())
    assert f"**{sp.ACCEPTANCE}**" in report  # the trained layer's measured acceptance
    assert 0 < sp.DRAFT_STEPS < 0.5  # a draft costs a fraction of a step, as one MTP layer does beside the model's
