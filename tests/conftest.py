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
- `one_thread`: torch on one thread for the test; `q4`: the tiny model quantized to int4, once per module.

Plain helpers live in tests/helpers/ (`from helpers.cli import run_cli, run_main`); tests/<area>/ hold the
tests, and no test module imports another.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from quantkit.threads import torch_threads

from helpers.cli import TINY_KW
from helpers.kernels import KERNEL_TABLES, forced_table

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# `quantkit plan` reads this host's runtime profile (`quantkit calibrate`) from the cache: tests start without one
os.environ["QUANTKIT_CACHE"] = tempfile.mkdtemp(prefix="qk-test-cache-")
atexit.register(shutil.rmtree, os.environ["QUANTKIT_CACHE"], True)


@pytest.fixture
def one_thread():
    """Small models run faster on one thread, and a shared CI box is not oversubscribed by OpenMP."""
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def q4(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from quantkit.checkpoint.reader import Checkpoint
    from quantkit.quantize.run import QuantizeOptions, run_quantize
    from quantkit.recipe import build_recipe

    out = tmp_path_factory.mktemp("serve") / "q4"
    run_quantize(Checkpoint.open(tiny_model), out, QuantizeOptions(recipe=build_recipe(4, "int", None, False, [], None)))
    return out


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


@pytest.fixture(params=KERNEL_TABLES)
def kernel_table(request: pytest.FixtureRequest):
    from quantkit.kernels import cpu as cpu_kernel

    if cpu_kernel.module() is None:
        pytest.skip("the CPU kernel is not built on this machine")
    yield from forced_table(request.param)


@pytest.fixture(params=KERNEL_TABLES)
def each_table(request: pytest.FixtureRequest):
    """`kernel_table` for a test that also holds on torch's kernels (a whole model, a route comparison): each
    op table in turn, forced after load as well as before (every kernel call reads the table in use, so a
    model loaded once runs on the forced table); where the kernel is not built the test runs once, on torch's
    kernels, and its other tables are skipped."""
    from quantkit.kernels import cpu as cpu_kernel

    if cpu_kernel.module() is None:
        if request.param != KERNEL_TABLES[0]:
            pytest.skip("the CPU kernel is not built on this machine: torch's kernels run once")
        yield "none"
        return
    yield from forced_table(request.param)


def _probe_cases() -> int:
    try:
        from helpers.probe import CASES
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
    from quantkit.kernels import cpu as cpu_kernel

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


