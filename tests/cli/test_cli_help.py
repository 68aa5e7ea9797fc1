"""`quantkit --help` starts in well under a second once its text was rendered for these sources and this
terminal width (issue 29): the command modules (and torch) are not imported for it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

PROBE = ("import sys; sys.argv = ['quantkit'] + sys.argv[1:]\n"
         "from quantkit.cli import main\n"
         "try:\n    main()\nexcept SystemExit as e:\n    code = e.code\n"
         "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', code, file=sys.stderr)\n")


def _run(tmp: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp), "COLUMNS": "100"}
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, env=env, timeout=120)
    return r, time.perf_counter() - t0


def test_root_help_is_fast_once_rendered(tmp_path: Path):
    first, _ = _run(tmp_path, "--help")
    assert "Commands" in first.stdout and "serve" in first.stdout and first.stderr.strip().endswith("0")
    second, seconds = _run(tmp_path, "--help")
    assert second.stdout == first.stdout
    assert second.stderr.strip() == "NO-TORCH 0", second.stderr
    assert seconds < 1.5  # the interpreter's own start included; about 0.1 s of it is quantkit
    bare, _ = _run(tmp_path)
    assert bare.stdout == first.stdout and bare.stderr.strip() == "NO-TORCH 2"  # a usage error, as before
    assert len(list((tmp_path / "quantkit" / "help").iterdir())) == 1


def test_root_help_lists_the_users_commands_before_the_developer_tools(tmp_path: Path):
    """Issue 46: what a user runs first, in the order of the job; bench, tiny-model, profile-host in their own
    panel after them; `calibrate` (profile-host's old name) not listed."""
    r, _ = _run(tmp_path, "--help")
    lines = r.stdout.splitlines()
    first = {}
    for i, line in enumerate(lines):
        words = line.strip("│ ").split()
        if words and words[0] not in first:
            first[words[0]] = i
    user = ["plan", "quantize", "verify", "chat", "generate", "serve", "export", "inspect", "gpus", "stats"]
    dev = ["bench", "tiny-model", "profile-host"]
    panel = next(i for i, line in enumerate(lines) if "Developer tools" in line)
    assert [first[c] for c in user] == sorted(first[c] for c in user) and max(first[c] for c in user) < panel
    assert all(first[c] > panel for c in dev)
    assert "calibrate" not in first
