"""benchmarks/ holds the drivers, peer comparisons and A/B scripts the reports were measured with, outside the
installed package. They run against a real checkpoint and machine, so the suite cannot run them; it keeps them
from rotting: every module of the `benchmarks` package imports and its command line answers --help, every
script still compiles against the Python it ships with, every shell script parses, and every C++ file compiles
against today's kernel headers. The drivers' pure parts have their own tests beside this one."""

from __future__ import annotations

import importlib
import platform
import py_compile
import shutil
import subprocess
from pathlib import Path

import pytest

from helpers.cli import run_driver
from helpers.probe import expect_one_line

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
CSRC = ROOT / "quantkit" / "kernels" / "csrc"


def files(suffix: str) -> list[Path]:
    return sorted(BENCH.rglob(f"*{suffix}"))


def ids(paths: list[Path]) -> list[str]:
    return [str(p.relative_to(BENCH)) for p in paths]


# the package's modules (python -m benchmarks.NAME); the folders beside them hold one-off scripts
MODULES = sorted(p.stem for p in BENCH.glob("*.py") if p.stem != "__init__")
DRIVERS = [m for m in MODULES if (BENCH / f"{m}.py").read_text().count("\ndef main(")]


def test_the_lab_left_the_package():
    """quantkit.bench keeps what `quantkit bench decode|engines|serve` run; a driver lives in one place only."""
    package = {p.stem for p in (ROOT / "quantkit" / "bench").glob("*.py")}
    assert {"decode", "engines", "serve"} <= package
    assert not (set(DRIVERS) & package - {"quantize"}), "a driver is in both quantkit/bench/ and benchmarks/"
    assert {"quantize", "soak", "mtp", "full_size", "gguf", "kernel", "session", "calibrated", "gpu",
            "prompt_cache"} <= set(DRIVERS)


@pytest.mark.parametrize("name", MODULES)
def test_module_imports(name: str):
    importlib.import_module(f"benchmarks.{name}")


@pytest.mark.parametrize("name", DRIVERS)
def test_driver_answers_help(name: str, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    mod = importlib.import_module(f"benchmarks.{name}")
    try:
        code = mod.main(["--help"])
    except SystemExit as e:  # argparse's --help exits
        code = e.code
    out = capsys.readouterr().out
    assert code == 0 and f"python -m benchmarks.{name}" in out and "--help" in out


def test_a_bad_option_is_one_line_and_nothing_runs(tmp_path, capsys, monkeypatch):
    code, out, err = run_driver("kernel", ["--reps", "0", "--reports", tmp_path / "r"], capsys, monkeypatch)
    expect_one_line(code, out, err, "--reps")
    assert "python -m benchmarks.kernel --help" in err and not (tmp_path / "r").exists()


# bad numbers the drivers' own options refuse before any work (the product's options: tests/cli/test_probe_cli*)
BAD = [("gpu", "--cpu-share", v) for v in ("0", "-0.5", "1.5", "nan", "inf", "abc")] + \
      [("mtp", "--draft-vocab", v) for v in (str(2**40), "-1", "abc")] + \
      [("soak", "--seconds", v) for v in ("0", "nan", str(2**80))] + \
      [("session", "--turns", v) for v in ("1", "abc")]


@pytest.mark.parametrize("name,option,value", BAD, ids=[f"{n} {o} {v}" for n, o, v in BAD])
def test_a_bad_number_is_one_line_before_any_work(name, option, value, tmp_path, capsys, monkeypatch):
    code, out, err = run_driver(name, [option, value, "--reports", tmp_path / "r", "--workdir", tmp_path / "w"],
                                capsys, monkeypatch)
    expect_one_line(code, out, err, option, exit_code=2)
    assert list(tmp_path.iterdir()) == []


def test_a_report_no_bench_wrote_is_never_replaced(tmp_path, capsys, monkeypatch):
    mine = tmp_path / "bench-quantize.md"
    mine.write_text("my own notes on quantizing")
    code, out, err = run_driver("quantize", ["--reports", tmp_path, "--workdir", tmp_path / "w"], capsys,
                                monkeypatch)
    expect_one_line(code, out, err, "not a quantkit output")
    assert mine.read_text() == "my own notes on quantizing" and not (tmp_path / "w").exists()


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
