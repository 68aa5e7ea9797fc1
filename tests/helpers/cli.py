"""Running the CLI in process or as a subprocess, interrupting it, and checking its one-line errors."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TINY_KW = {"layers": 4, "experts": 8, "top_k": 2, "hidden": 64, "intermediate": 32, "seed": 0}


def run_cli(args: list, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> tuple[int, str, str]:
    """quantkit.cli.main() with `args` in this process (a QuantkitError is one `error:` line, exit 2):
    (exit code, stdout, stderr)."""
    from quantkit.cli import main

    monkeypatch.setattr(sys, "argv", ["quantkit", *map(str, args)])
    monkeypatch.setenv("COLUMNS", "200")
    code = 0
    try:
        main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    out = capsys.readouterr()
    return code, out.out, out.err


def run_driver(name: str, args: list, capsys: pytest.CaptureFixture[str],
               monkeypatch: pytest.MonkeyPatch) -> tuple[int, str, str]:
    """`python -m benchmarks.NAME *args` in this process (its `main`): (exit code, stdout, stderr)."""
    import importlib

    monkeypatch.setenv("COLUMNS", "200")
    code = importlib.import_module(f"benchmarks.{name}").main([*map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


def run_main(*args: object, timeout: float | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m quantkit *args` in a fresh process, stdout and stderr captured as text."""
    return subprocess.run([sys.executable, "-m", "quantkit", *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "200"}, timeout=timeout)


def interrupt_after(monkeypatch: pytest.MonkeyPatch, module: object, name: str, calls: int):
    """Make `module.name` raise KeyboardInterrupt (Ctrl-C) at its `calls`-th call; returns the original
    function, for a test that restores it."""
    orig = getattr(module, name)
    n = {"calls": 0}

    def interrupt_later(*a, **k):
        n["calls"] += 1
        if n["calls"] == calls:
            raise KeyboardInterrupt
        return orig(*a, **k)

    monkeypatch.setattr(module, name, interrupt_later)
    return orig


def interrupt_quantizer_after(monkeypatch: pytest.MonkeyPatch, calls: int):
    """The quantizer interrupted at its `calls`-th tensor (interrupt_after on its per-tensor function)."""
    import quantkit.quantize.run as qz

    return interrupt_after(monkeypatch, qz, "_quantize_tensor", calls)


def sigkill_mid_run(cmd: list, out: Path, first_file: str, attempts: int, jitter: float) -> bool:
    """Start `cmd` (a run writing folder `out`) and SIGKILL it a random moment (up to `jitter` s) after the file
    `first_file` (a glob) appears; again from scratch until a kill lands before the run's manifest is written
    (True), at most `attempts` times (False: every run finished first)."""
    import random
    import signal
    import time

    from quantkit.quantize.manifest import MANIFEST_NAME

    rnd = random.Random()
    for _attempt in range(attempts):
        shutil.rmtree(out, ignore_errors=True)
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 60
        while time.time() < deadline and p.poll() is None and not list(out.glob(first_file)):
            time.sleep(0.002)
        time.sleep(rnd.uniform(0, jitter))
        p.send_signal(signal.SIGKILL)
        p.wait()
        if not (out / MANIFEST_NAME).exists():
            return True
    return False


def one_line_error(code: int, out: str, err: str, *needles: str) -> None:
    """A refusal as users see it: exit 2, one `error:` line naming each of `needles`, no traceback."""
    assert code == 2, (out, err)
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    assert "Traceback" not in err + out
    for n in needles:
        assert n in " ".join(err.split()), err
