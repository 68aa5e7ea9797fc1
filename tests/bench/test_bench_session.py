"""`python -m benchmarks.session` end to end on the tiny model (3 turns): the report's structure and the facts that do
not depend on speed (reuse from the second turn on, same tokens with and without reuse, llama.cpp beside us)."""

from __future__ import annotations

import json

import pytest

from benchmarks.session import run

pytestmark = pytest.mark.usefixtures("one_thread")


def test_session_bench_report(tiny_model, tmp_path):
    pytest.importorskip("llama_cpp")
    d = run(tmp_path / "reports", tmp_path / "work", turns=3, obs_tokens=30, new_tokens=3, checkpoint=tiny_model,
            threads=1, baseline_every=2, log=lambda *_: None)
    rows = d["turns"]
    assert [r["turn"] for r in rows] == [1, 2, 3]
    assert rows[0]["reuse_reused"] == 0 and all(r["reuse_reused"] > 0 for r in rows[1:])
    assert all(r["reuse_prefilled"] + r["reuse_reused"] == r["prompt_tokens"] for r in rows)
    assert rows[1]["no_reuse_ttft_s"] is None and rows[2]["llama.cpp_ttft_s"] is not None  # sampled baselines
    assert rows[2]["no_reuse_prefilled"] == rows[2]["prompt_tokens"]
    assert d["checks"]["same tokens with and without reuse, every turn measured both ways"]
    saved = json.loads((tmp_path / "reports" / "bench-session.json").read_text())
    assert saved["turns"] == rows
    md = (tmp_path / "reports" / "bench-session.md").read_text()
    assert "llama.cpp: TTFT s" in md and (tmp_path / "reports" / "bench-session.png").stat().st_size > 1000
