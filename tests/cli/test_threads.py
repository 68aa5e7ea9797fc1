"""`--threads` on chat, generate, serve and the benches: every physical core by default, one-line errors
for 0 or more CPUs than this process has, applied to torch's pool (which the CPU kernel shares)."""

from __future__ import annotations

import pytest
import torch

from quantkit.errors import QuantkitError
from quantkit.threads import available_cpus, physical_cores, resolve_threads, set_threads

from helpers.cli import run_main


def test_default_is_physical_cores_and_bounds_are_checked():
    assert 1 <= physical_cores() <= available_cpus()
    assert resolve_threads(None) == physical_cores()
    assert resolve_threads(1) == 1 and resolve_threads(available_cpus()) == available_cpus()
    for bad in (0, -2, available_cpus() + 1):
        with pytest.raises(QuantkitError, match=f"--threads {bad}: use 1 to {available_cpus()}"):
            resolve_threads(bad)


def test_set_threads_applies_to_torch():
    before = torch.get_num_threads()
    try:
        assert set_threads(1) == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("args, n", [
    (["generate", "/nonexistent", "--prompt", "hi"], "0"),
    (["generate", "/nonexistent", "--prompt", "hi"], "100000"),
    (["chat", "/nonexistent"], "0"),
    (["serve", "/nonexistent"], "100000"),
    (["bench", "decode", "--workdir", "/nonexistent"], "0"),
    (["bench", "engines", "--workdir", "/nonexistent"], "100000"),
], ids=lambda a: a if isinstance(a, str) else " ".join(a[:2]))
def test_bad_threads_is_one_line_before_any_work(args, n):
    p = run_main(*args, "--threads", n, timeout=120)
    assert p.returncode == 2, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: --threads " + n), p.stderr
