"""Helpers for the hostile-input probes (tests/test_probe_*.py, tests/cli/test_faults.py).

`expect_one_line` asserts what every bad input must get: a non-zero exit, ONE `error:` line naming the
problem, no traceback. `tree_digest` fingerprints a source folder so a probe can assert it is byte-identical
afterwards. `limited_dir` makes a read-only or full location inside the test: a tiny tmpfs when root (CI runs
as root, where permission bits stop nothing), permission bits otherwise (a full disk cannot be faked without
a mount: those cases skip). Every probe calls `count()`; conftest prints the total at the end of the run."""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

CASES = {"n": 0}


def count(n: int = 1) -> None:
    CASES["n"] += n


def expect_one_line(code: int, out: str, err: str, needle: str | None = None, exit_code: int | None = None) -> str:
    count()
    text = (err or "").strip()
    assert "Traceback" not in err + out, err[-2000:]
    assert code != 0, (out, err)
    if exit_code is not None:
        assert code == exit_code, (code, err)
    lines = [ln for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error:")]
    assert len(errors) == 1, text
    if needle is not None:
        assert needle in errors[0], errors[0]
    return errors[0]


def tree_digest(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder` (symlinks by target), by relative path."""
    out = {}
    for p in sorted(Path(folder).rglob("*")):
        if p.is_file():
            out[str(p.relative_to(folder))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _mount(target: Path, opts: str) -> bool:
    if os.geteuid() != 0:
        return False
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(target)], capture_output=True)
    return r.returncode == 0


@contextlib.contextmanager
def limited_dir(base: Path, kind: str) -> Iterator[Path]:
    """A folder under `base` that cannot be written ("readonly") or is full ("full")."""
    d = base / f"limited-{kind}"
    d.mkdir()
    mounted = _mount(d, "ro,size=64k" if kind == "readonly" else "size=64k")
    try:
        if kind == "full":
            if not mounted:
                pytest.skip("a full file system needs a tmpfs mount (root)")
            fd = os.open(d / "filler", os.O_WRONLY | os.O_CREAT)
            try:
                with contextlib.suppress(OSError):
                    while True:
                        os.write(fd, b"\0" * 4096)
            finally:
                os.close(fd)
        elif not mounted:
            if os.geteuid() == 0:
                pytest.skip("a read-only location needs a tmpfs mount when root")
            d.chmod(0o555)
        yield d
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(d)], capture_output=True)
        else:
            d.chmod(0o755)
