"""Shared helpers of the runtime tests (no tests here): quantized copies of the session's tiny models,
made once per session with the real quantizer, and the CLI entry point run in process."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

import pytest

from quantkit.threads import torch_threads

from conftest import run_cli  # noqa: F401  (re-exported to the runtime tests)

_CACHE: dict[tuple[str, str], Path] = {}
_ROOT: list[Path] = []


def quantized(src: Path, recipe: str) -> Path:
    """`src` quantized with a built-in recipe (int8, int4, nf4, fp4, mxfp4, quality) by quantkit.quantize.run."""
    from quantkit.checkpoint.reader import Checkpoint
    from quantkit.quantize.run import QuantizeOptions, run_quantize
    from quantkit.recipe import get_recipe

    key = (str(src), recipe)
    if key not in _CACHE:
        if not _ROOT:
            _ROOT.append(Path(tempfile.mkdtemp(prefix="qk-runtime-tests-")))
            atexit.register(shutil.rmtree, _ROOT[0], True)
        out = _ROOT[0] / f"{Path(src).parent.name}-{Path(src).name}-{recipe}"
        with Checkpoint.open(src) as ck:
            run_quantize(ck, out, QuantizeOptions(get_recipe(recipe)))
        _CACHE[key] = out
    return _CACHE[key]


@pytest.fixture
def one_thread():
    """Small models run faster on one thread, and a shared CI box is not oversubscribed by OpenMP."""
    with torch_threads(1):
        yield
