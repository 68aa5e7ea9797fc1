"""Quantized copies of the session's tiny models, made once per session with the real quantizer."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path


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


_CACHE: dict[tuple[str, str], Path] = {}


_ROOT: list[Path] = []
