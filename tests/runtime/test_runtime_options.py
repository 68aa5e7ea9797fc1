"""RuntimeOptions (runtime/options.py): every switch filled in one place. Importing quantkit.runtime reads no
switch from the environment; a load reads it through `RuntimeOptions.from_env()` when given no options, and a
load given options follows them (the MXFP4 route, the CPU kernel's table, the one-token route)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from quantkit.kernels import cpu as cpu_kernel
from quantkit.kernels import cpu as kernel_cpu
from quantkit.runtime import load_model
from quantkit.runtime.options import RuntimeOptions

ROOT = Path(__file__).resolve().parents[2]
SWITCHES = ("QUANTKIT_ROUTE", "QUANTKIT_CPU_ISA", "QUANTKIT_MXFP4_ROUTE")

# a fresh process records every read of the switches while the runtime's modules import
_IMPORT_PROBE = """
import json, os

class Spy(dict):
    read = set()
    def _see(self, k):
        if k in SWITCHES:
            Spy.read.add(k)
    def __getitem__(self, k):
        self._see(k)
        return dict.__getitem__(self, k)
    def get(self, k, default=None):
        self._see(k)
        return dict.get(self, k, default)
    def __contains__(self, k):
        self._see(k)
        return dict.__contains__(self, k)

os.environ = Spy(os.environ)
import quantkit.runtime, quantkit.runtime.kernels, quantkit.runtime.cpu_kernel, quantkit.runtime.loader
import quantkit.runtime.model.route, quantkit.runtime.model.qwen3_5_moe, quantkit.runtime.engine
print(json.dumps({"read": sorted(Spy.read), "mxfp4_global": hasattr(quantkit.runtime.kernels, "MXFP4_ROUTE")}))
""".replace("SWITCHES", repr(SWITCHES))


def test_importing_the_runtime_reads_no_switch():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "QUANTKIT_MXFP4_ROUTE": "junk", "QUANTKIT_ROUTE": "junk",
           "QUANTKIT_CPU_ISA": "junk"}
    p = subprocess.run([sys.executable, "-c", _IMPORT_PROBE], capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got == {"read": [], "mxfp4_global": False}
    assert "junk" not in p.stderr


def test_from_env_reads_each_switch():
    opts = RuntimeOptions.from_env({"QUANTKIT_ROUTE": " Torch ", "QUANTKIT_CPU_ISA": "AVX2-plain",
                                    "QUANTKIT_MXFP4_ROUTE": "dequant"})
    assert (opts.route, opts.route_source, opts.cpu_isa, opts.mxfp4_route) == ("torch", "QUANTKIT_ROUTE",
                                                                                 "avx2-plain", "dequant")
    assert opts.isa_level == "avx2" and opts.plain and not opts.torch_only
    assert RuntimeOptions.from_env({}) == RuntimeOptions()
    assert RuntimeOptions.from_env({"QUANTKIT_CPU_ISA": "none"}).torch_only


def _mxfp4_routes(rt) -> set[str]:
    return {r for r in rt.report.routes if r.startswith("mxfp4: ")}


def test_a_load_takes_the_mxfp4_route_from_its_options(tiny_model, monkeypatch):
    monkeypatch.setenv("QUANTKIT_MXFP4_ROUTE", "dequant")
    from_env = load_model(tiny_model, recipe="mxfp4", forced_route="torch")
    assert _mxfp4_routes(from_env) == {"mxfp4: dequantize + F.linear"}
    given = load_model(tiny_model, recipe="mxfp4", forced_route="torch", options=RuntimeOptions())
    routes = _mxfp4_routes(given)
    assert routes and all(r.startswith("mxfp4: mxfp4 as exact int4 pair") for r in routes)
    assert given.report.options.mxfp4_route == "int4x2" and from_env.report.options.mxfp4_route == "dequant"


def test_a_load_takes_the_route_from_its_options(tiny_model, monkeypatch):
    monkeypatch.setenv("QUANTKIT_ROUTE", "warp-drive")  # options given: the environment is not read
    rt = load_model(tiny_model, recipe="int8", options=RuntimeOptions(route="torch"))
    assert rt.model.route.kind == "torch" and rt.report.notes == []


@pytest.mark.skipif(not cpu_kernel.available(), reason="the CPU kernel is not built on this machine")
def test_a_load_takes_the_cpu_table_from_its_options(tiny_model, monkeypatch):
    mod = cpu_kernel.module()
    before = mod.table()
    monkeypatch.setattr(kernel_cpu, "_asked", kernel_cpu._asked)
    monkeypatch.setattr(kernel_cpu, "loaded_table", kernel_cpu.loaded_table)
    try:
        rt = load_model(tiny_model, recipe="int4", options=RuntimeOptions(cpu_isa="generic"))
        assert mod.table() == "generic" and kernel_cpu.loaded_table == "generic"
        assert rt.route()["table"] == "generic" and rt.route()["isa"] == "generic"
    finally:
        mod.set_table(before)
