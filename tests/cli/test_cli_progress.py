"""Long jobs report progress where their output is not a terminal (a log file, CI): plain lines every few
seconds with tensors, percent, MB/s, elapsed and ETA, and one at the end."""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console

from quantkit.cli.progress import RichProgress, tensor_progress

from helpers.cli import run_main


def _run(every_s: float, terminal: bool) -> str:
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=terminal, width=200)
    with tensor_progress(console) as p:
        rp = RichProgress(p, "quantizing", every_s=every_s)
        rp.start(3, 3000)
        for i in range(3):
            rp.advance(f"model.language_model.layers.{i}.w", 500, False)
            rp.advance(f"model.language_model.layers.{i}.w", 500, True)
    return buf.getvalue()


def test_plain_lines_when_not_a_terminal():
    lines = [ln for ln in _run(0, False).splitlines() if ln.startswith("quantizing:")]
    assert len(lines) == 6 and "3/3 tensors, 100.0%" in lines[-1] and "(layers.2.w)" in lines[-1]
    assert "1/3 tensors, 33.3%" in lines[1] and "ETA" in lines[1] and "MB/s" in lines[1]
    rare = [ln for ln in _run(3600, False).splitlines() if ln.startswith("quantizing:")]
    assert len(rare) == 2 and "0/3 tensors" in rare[0] and "3/3 tensors" in rare[1]  # the first and the end
    assert not [ln for ln in _run(0, True).splitlines() if ln.startswith("quantizing:")]  # a terminal: the bar


def test_quantize_into_a_log_shows_progress(tiny_model: Path, tmp_path: Path):
    r = run_main("quantize", tiny_model, "--bits", "4", "--out", tmp_path / "q", timeout=600)
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("quantizing:")]
    assert lines and "100.0%" in lines[-1] and "tensors" in lines[-1]
