"""benchmarks/serve_mtp.py: each row's drafts come from the oracle of its own prompt, and the summary's ratios are
the best (and median) rounds of each side."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from benchmarks import serve_mtp as sm


class _Cache:
    def __init__(self, serial: int, n: int):
        self.serial, self.n = serial, n


def test_each_row_drafts_its_own_prompts_continuation():
    """Two prompts of different lengths: an MTP cache holding n - 1 prompt pairs at its first draft is the row of
    the n-token prompt, and its drafts (every one right at acceptance 1) are that prompt's continuation."""

    def real(model, tokens, hidden, cache):
        cache.n += len(tokens)
        return 0, hidden[-1:]

    seqs = {4: [1, 2, 3, 4, 50, 51, 52, 53], 6: [1, 2, 3, 4, 5, 6, 70, 71, 72]}
    oracles = sm.RowOracles(real, seqs, 1.0, seed=0)
    model, h = SimpleNamespace(vocab=100), torch.zeros(1, 8)
    a, b = _Cache(1, 3), _Cache(2, 5)  # the 4- and the 6-token prompt's pairs
    assert oracles(model, [50], h, a)[0] == 51 and oracles(model, [70], h, b)[0] == 71
    assert oracles(model, [51], h, a)[0] == 52 and oracles(model, [71], h, b)[0] == 72
    with pytest.raises(KeyError):  # a row of no known prompt
        oracles(model, [9], h, _Cache(3, 9))


def test_the_summary_compares_the_best_and_the_median_rounds():
    def side(*xs):
        return [{"tok_s": x} for x in xs]

    d = {"measured": {"one": {"generate": side(10, 20, 30), "generate_fixed": side(40, 20, 10),
                              "serve": side(30, 33, 36)},
                      "two": {"drafts": side(12, 24), "no_drafts": side(10, 10)}}}
    s = sm.summarise(d)
    assert s["one_client"]["ratio"] == pytest.approx(36 / 30) and s["one_client"]["ratio_median"] == 33 / 20
    assert s["one_client"]["ratio_fixed"] == pytest.approx(36 / 40)
    assert s["two_slots"]["ratio"] == pytest.approx(2.4) and s["two_slots"]["ratio_median"] == pytest.approx(1.8)
