"""Shared session fixtures: tiny checkpoints of the real qwen3_5_moe architecture, built once per session.

They are shared by many test files: treat them as read-only (copy a folder before damaging it).
- `tiny_model`: published layout (multimodal config.json, `model.language_model.*`, fused experts,
  3 shards + index), decisive routing (see quantkit.testing.tiny.make_decisive), no MTP, 4 layers
  (3 linear-attention + 1 full), hidden 64, 8 experts, top-2, bf16, trained tokenizer + chat template.
- `tiny_model_transformers_layout`: the SAME weights written by transformers' save_pretrained
  (`model.layers.*`, per-expert experts): its canonical tensors equal `tiny_model`'s.
- `tiny_model_mtp`: published layout with the MTP layer (`mtp.*`, per-expert), not decisive.
- `kernel_table`: each op table of quantkit's CPU kernel (avx512bf16, avx512, avx2vnni, avx2, generic) at or below the
  level this run uses (QUANTKIT_CPU_ISA lowers it), forced in turn and restored; a table the CPU or the
  build lacks is skipped with that reason. This is how one run proves every ISA path (no rerun per ISA).
- `each_table`: the same for tests that also hold without the kernel (they then run once, on torch's).

Plain helpers the tests import (`from conftest import run_cli, run_main`):
- `run_cli`: the entry point quantkit.cli.main() in this process (monkeypatch applies), output captured;
- `run_main`: `python -m quantkit ...` in a fresh process, as users run it.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# `quantkit plan` reads this host's runtime profile (`quantkit calibrate`) from the cache: tests start without one
os.environ["QUANTKIT_CACHE"] = tempfile.mkdtemp(prefix="qk-test-cache-")
atexit.register(shutil.rmtree, os.environ["QUANTKIT_CACHE"], True)

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


def run_main(*args: object, timeout: float | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m quantkit *args` in a fresh process, stdout and stderr captured as text."""
    return subprocess.run([sys.executable, "-m", "quantkit", *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "200"}, timeout=timeout)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from quantkit.testing.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "published", decisive=True, **TINY_KW)


@pytest.fixture(scope="session")
def tiny_model_transformers_layout(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Path:
    from quantkit.testing.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "transformers", decisive=True,
                           layout="transformers", **TINY_KW)


@pytest.fixture(scope="session")
def tiny_model_mtp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from quantkit.testing.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "mtp", mtp=True, **TINY_KW)


@pytest.fixture(scope="session")
def tiny_stats(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Path:
    """`quantkit stats` of `tiny_model` on 2048 tokens of the default corpus (chunks of 128, 1/8 held out)."""
    from quantkit.checkpoint.reader import Checkpoint
    from quantkit.quantize.calib_data import load_tokens
    from quantkit.quantize.stats import collect_stats
    from quantkit.runtime.engine import load_tokenizer

    tokens = load_tokens(None, load_tokenizer(tiny_model), chunk_size=128, max_tokens=2048)
    out = tmp_path_factory.mktemp("stats") / "tiny.stats"
    collect_stats(Checkpoint.open(tiny_model), tokens, out)
    return out


KERNEL_TABLES = ("avx512bf16", "avx512", "avx2vnni", "avx2", "generic")


@pytest.fixture(params=KERNEL_TABLES)
def kernel_table(request: pytest.FixtureRequest):
    from quantkit.runtime import cpu_kernel

    if cpu_kernel.module() is None:
        pytest.skip("the CPU kernel is not built on this machine")
    yield from _forced_table(request.param)


@pytest.fixture(params=KERNEL_TABLES)
def each_table(request: pytest.FixtureRequest):
    """`kernel_table` for a test that also holds on torch's kernels (a whole model, a route comparison): each
    op table in turn, forced after load as well as before (every kernel call reads the table in use, so a
    model loaded once runs on the forced table); where the kernel is not built the test runs once, on torch's
    kernels, and its other tables are skipped."""
    from quantkit.runtime import cpu_kernel

    if cpu_kernel.module() is None:
        if request.param != KERNEL_TABLES[0]:
            pytest.skip("the CPU kernel is not built on this machine: torch's kernels run once")
        yield "none"
        return
    yield from _forced_table(request.param)


# every QUANTKIT_CPU_ISA value that names a table: the forced-switch tests run each in a fresh process (the
# fast tier keeps the plain levels below AVX512; the full run takes them all)
_slow = pytest.mark.slow
ISA_VALUES = (pytest.param("avx512", marks=_slow), pytest.param("avx512-plain", marks=_slow), "avx2",
              pytest.param("avx2-plain", marks=_slow), "generic")


def forced_isa_table(value: str) -> str:
    """The op table QUANTKIT_CPU_ISA=`value` runs on this machine. Skips the calling test where the CPU or the
    build cannot run that level, or where LEVEL-plain is the level's own table (no extension to leave out)."""
    from quantkit.runtime import cpu_kernel

    mod = cpu_kernel.module()
    level = value.removesuffix("-plain")
    if mod is None or cpu_kernel.ISA_LEVELS[level] > mod.detect_isa() or cpu_kernel.best_table(level) is None:
        pytest.skip(f"QUANTKIT_CPU_ISA={value}: this CPU or build cannot run it")
    if value == level:
        return cpu_kernel.best_table(level)
    if level not in mod.tables() or cpu_kernel.best_table(level) == level:
        pytest.skip(f"QUANTKIT_CPU_ISA={value}: {level} has no extension here, the same table as {level}")
    return level


def _forced_table(name: str):
    from quantkit.runtime import cpu_kernel

    mod = cpu_kernel.module()
    level = cpu_kernel.ISA_LEVELS[cpu_kernel.table_level(name)]
    if name not in mod.units():
        pytest.skip(f"{name}: this build has no such unit (the compiler could not build it)")
    if name not in mod.tables():
        pytest.skip(f"{name}: this CPU lacks it")
    order = mod.tables()
    if order.index(name) < order.index(cpu_kernel.loaded_table):
        pytest.skip(f"{name}: above the table this run uses ({cpu_kernel.loaded_table}; QUANTKIT_CPU_ISA)")
    before = mod.table()
    mod.set_table(name)
    assert mod.table() == name and mod.isa() == level
    yield name
    mod.set_table(before)


def _probe_cases() -> int:
    try:
        from probe_util import CASES
    except ImportError:
        return 0
    return CASES["n"]


class _WorkerProbes:
    """Under pytest-xdist each worker counts its own probes: the workers hand their counts back as they
    finish and the controller sums them."""

    def __init__(self) -> None:
        self.n = 0

    def pytest_testnodedown(self, node, error) -> None:
        self.n += getattr(node, "workeroutput", {}).get("probe_cases", 0)


def pytest_configure(config: pytest.Config) -> None:
    if config.pluginmanager.hasplugin("xdist") and not hasattr(config, "workerinput"):
        config.pluginmanager.register(_WorkerProbes(), "quantkit-worker-probes")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The fast tier (`-m "not slow"`) runs the `kernel_table` and `each_table` tests on the table this run uses;
    their copies on the lower tables are `slow`: the full run proves every table."""
    fixtures = ("kernel_table", "each_table")
    runs = [it for it in items if any(f in getattr(getattr(it, "callspec", None), "params", {}) for f in fixtures)]
    if not runs:
        return
    from quantkit.runtime import cpu_kernel

    top = cpu_kernel.loaded_table if cpu_kernel.module() is not None else KERNEL_TABLES[0]
    for it in runs:
        if any(it.callspec.params.get(f, top) != top for f in fixtures):
            it.add_marker(pytest.mark.slow)


def pytest_sessionfinish(session: pytest.Session) -> None:
    if hasattr(session.config, "workeroutput"):  # an xdist worker: the controller prints the sum
        session.config.workeroutput["probe_cases"] = _probe_cases()


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    """The hostile-input probes count their cases (parametrized ids and hypothesis examples alike)."""
    workers = config.pluginmanager.get_plugin("quantkit-worker-probes")
    n = _probe_cases() + (workers.n if workers is not None else 0)
    if n:
        terminalreporter.write_line(f"probe: {n} bad inputs and faults checked")


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
