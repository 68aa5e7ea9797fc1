"""benchmarks/ holds the A/B drivers the reports were measured with. They run against a real checkpoint and
machine, so the suite cannot run them; it keeps them from rotting: every script still compiles against the
Python it ships with, every shell script parses, and every C++ file compiles against today's kernel headers."""

from __future__ import annotations

import platform
import py_compile
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
CSRC = ROOT / "quantkit" / "runtime" / "csrc"


def files(suffix: str) -> list[Path]:
    return sorted(BENCH.rglob(f"*{suffix}"))


def ids(paths: list[Path]) -> list[str]:
    return [str(p.relative_to(BENCH)) for p in paths]


def test_the_reports_hold_no_code():
    """reports/ holds results (markdown, JSON, pictures); the code that made them lives in benchmarks/."""
    code = [p for p in (ROOT / "reports").rglob("*") if p.is_file() and p.suffix in (".py", ".cpp", ".h", ".sh")]
    assert not code, f"move these to benchmarks/: {[str(p.relative_to(ROOT)) for p in code]}"


@pytest.mark.parametrize("path", files(".py"), ids=ids(files(".py")))
def test_python_compiles(path: Path, tmp_path: Path):
    py_compile.compile(str(path), cfile=str(tmp_path / "out.pyc"), doraise=True)


@pytest.mark.parametrize("path", files(".sh"), ids=ids(files(".sh")))
def test_shell_parses(path: Path):
    p = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


@pytest.mark.parametrize("path", files(".cpp"), ids=ids(files(".cpp")))
def test_cpp_compiles(path: Path):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("x86 intrinsics")
    p = subprocess.run([cxx, "-fsyntax-only", "-std=c++17", "-mavx2", "-mfma", f"-I{CSRC}", str(path)],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
