"""The decode route is visible: `generate --json` carries {"name", "isa", "table", "fused_ops", "one_call"}, chat's
/stats and the serve start line name it, and it follows QUANTKIT_CPU_ISA (forced in a fresh process, as a
user sets it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from quantkit.kernels import cpu as kernel_cpu
from quantkit.runtime import SamplingParams, load_model

from helpers.chat import run_chat
from helpers.cli import run_cli
from helpers.kernels import ISA_VALUES, forced_isa_table
from helpers.runtime import quantized

ROOT = Path(__file__).resolve().parents[2]


def test_generate_json_names_the_route(tiny_model, capsys, monkeypatch):
    q = quantized(tiny_model, "quality")
    code, out, err = run_cli(["generate", q, "--prompt", "hi", "--max-new-tokens", "2", "--json", "--no-think"],
                             capsys, monkeypatch)
    assert code == 0, err
    route = json.loads(out)["route"]
    assert set(route) == {"name", "isa", "table", "fused_ops", "one_call"}
    if kernel_cpu.available():
        table = kernel_cpu.module().table()
        assert route["isa"] == kernel_cpu.isa() and route["table"] == table
        assert route["fused_ops"] is True and route["one_call"] is True  # the tiny model is all on the CPU
        assert route["name"] == f"cpu-{table}-stack"
    else:
        assert route == {"name": "torch", "isa": "none", "table": "", "fused_ops": False, "one_call": False}


def test_the_torch_route_is_torch_ops(tiny_model):
    rt = load_model(tiny_model, recipe="int4", forced_route="torch")
    assert rt.route()["fused_ops"] is False and rt.route()["one_call"] is False
    assert rt.route_line().endswith("torch ops") and rt.route_line().startswith("route torch:")


def test_chat_stats_names_the_route(tiny_model):
    rt = load_model(tiny_model, recipe="int4")
    _chat, out = run_chat(rt, ["hello", "/stats"], SamplingParams(temperature=0, max_new_tokens=3))
    assert rt.route_line() in out and "route " in out


@pytest.mark.parametrize("level", ISA_VALUES)
def test_forced_isa_shows_in_the_route(tiny_model, level):
    """Every forced level (LEVEL-plain: without its extension) runs the whole fused, one-call step on that
    table: the switch as users set it, end to end; the model's math on each table is proven in-process
    (the `each_table` tests)."""
    table = forced_isa_table(level)
    q = quantized(tiny_model, "quality")
    p = subprocess.run([sys.executable, "-m", "quantkit", "generate", q, "--prompt", "hi", "--max-new-tokens", "2",
                        "--json", "--no-think"], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "QUANTKIT_CPU_ISA": level})
    assert p.returncode == 0, p.stderr
    want = {"name": f"cpu-{table}-stack", "isa": level.removesuffix("-plain"), "table": table,
            "fused_ops": True, "one_call": True}
    assert json.loads(p.stdout)["route"] == want
