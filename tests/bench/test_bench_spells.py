"""`quantkit bench decode --spells`: decode timed between two bandwidth reads, grouped by the machine's spell."""

from __future__ import annotations

import pytest

from quantkit.bench import spell_poll, spells


def _s(before: float, after: float, tok_s: float) -> dict:
    return {"read_before_gbs": before, "read_after_gbs": after, "decode_tok_s": tok_s}


def test_summarize_splits_slow_and_fast_spells_and_drops_a_changing_sample():
    result = {"step_bytes": 100e6, "samples": [
        _s(30, 32, 280), _s(31, 31, 300), _s(33, 31, 290),  # slow spell: ~31 GB/s
        _s(60, 58, 400), _s(59, 61, 380),  # fast spell: ~60 GB/s
        _s(31, 59, 500),  # the spell changed during this one: left out
    ]}
    s = spells.summarize(result)
    assert s["samples"] == 6 and set(s["spells"]) == {"slow", "fast"}
    slow, fast = s["spells"]["slow"], s["spells"]["fast"]
    assert slow["samples"] == 3 and fast["samples"] == 2
    assert slow["decode_tok_s"] == 290 and fast["decode_tok_s"] == 390
    assert slow["share_of_read"] == pytest.approx(290 * 100e6 / 32e9, abs=1e-4)  # median of 280/31, 300/31, 290/32
    assert fast["share_of_read"] == pytest.approx((400 * 100e6 / 59e9 + 380 * 100e6 / 60e9) / 2, abs=1e-4)
    md = "\n".join(spells.render("int4", s, 120))
    assert "| slow | 3 | 31.0 | 290.0 | 91% |" in md and "| fast | 2 |" in md and "--spells 120" in md


def test_summarize_one_steady_spell_and_none():
    s = spells.summarize({"step_bytes": 50e6, "samples": [_s(40, 42, 500), _s(44, 41, 520)]})
    assert list(s["spells"]) == ["steady"] and s["spells"]["steady"]["samples"] == 2
    assert spells.summarize({"step_bytes": 50e6, "samples": []})["spells"] == {}


def test_poll_decodes_between_reads(tiny_model):
    from helpers.runtime import quantized

    r = spell_poll.poll(quantized(tiny_model, "int4"), 0.5, 8, 4)
    assert r["step_bytes"] > 0 and len(r["samples"]) >= 1
    first = r["samples"][0]
    assert first["read_before_gbs"] > 0 and first["read_after_gbs"] > 0 and first["decode_tok_s"] > 0
