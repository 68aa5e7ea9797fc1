"""docs/python.md's examples run as written: each ```python block, on the tiny model quantized as the README's
"Try it now" does, with the doc's /tmp/tiny-q4 pointed at that folder."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from helpers.runtime import quantized

DOC = Path(__file__).resolve().parents[2] / "docs" / "python.md"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)


def test_the_doc_has_its_examples():
    blocks = _blocks()
    assert len(blocks) == 2 and all("/tmp/tiny-q4" in b for b in blocks)


@pytest.mark.parametrize("i", range(2))
def test_each_example_runs_as_written(tiny_model, i, capsys, one_thread):
    folder = quantized(tiny_model, "quality")
    code = _blocks()[i].replace('"/tmp/tiny-q4"', repr(str(folder)))
    scope: dict = {}
    exec(compile(code, f"{DOC}:block{i}", "exec"), scope)
    out = capsys.readouterr().out
    if i == 0:
        assert scope["resp"].finish_reason in ("stop", "length") and scope["resp"].generation_tokens > 0
        assert out.rstrip().endswith(f"{scope['resp'].finish_reason} {scope['resp'].generation_tokens}")
    else:
        ended = [line.split() for line in out.splitlines() if line.strip()]
        assert sorted(int(r) for r, *_ in ended) == sorted(scope["texts"])  # every row ended, once
        budgets = {scope["a"]: 12, scope["b"]: 8, scope["c"]: 8}  # the fork inherits b's max_new_tokens
        for r, reason, n in ended:
            assert reason in ("stop", "length")
            assert int(n) <= budgets[int(r)]
