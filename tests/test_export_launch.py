"""`quantkit plan --export`: the launch line loads exactly what the printed `quantkit export` line writes."""

from __future__ import annotations

import json
import os
import shlex

import pytest

from quantkit.export.launch import GGUF_TYPES, launch_plan
from quantkit.model.spec import default_spec
from quantkit.planner.budget import RunSettings
from quantkit.planner.hardware import build_hardware
from quantkit.planner.placement import solve
from quantkit.recipe import RECIPES

from conftest import run_cli


@pytest.mark.parametrize("engine", ["llama.cpp", "vllm"])
def test_launch_line_loads_what_the_export_line_writes(engine, tiny_model, tmp_path, capsys, monkeypatch):
    if engine == "llama.cpp" and os.environ.get("QUANTKIT_REQUIRE_ENGINES") != "1":
        pytest.importorskip("llama_cpp", reason="quality's GGUF type is written by llama.cpp's quantizer")
    code, out, err = run_cli(["plan", "--model", str(tiny_model), "--gpu", "rtx4090", "-s", "quality", "--json",
                          "--export", engine], capsys, monkeypatch)
    assert code == 0, err
    d = json.loads(out)["export"]
    export = shlex.split(d["export_command"])
    assert export[:3] == ["quantkit", "export", "gguf" if engine == "llama.cpp" else "vllm"]
    assert export[3] == str(tiny_model)
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(export[1:], capsys, monkeypatch)
    assert code == 0, err
    written = tmp_path / export[4]
    launch = shlex.split(d["command"])
    if engine == "llama.cpp":
        assert written.is_file() and written.read_bytes()[:4] == b"GGUF"
        assert launch[0] == "llama-server" and launch[launch.index("-m") + 1] == export[4]
    else:
        cfg = json.loads((written / "config.json").read_text())
        assert cfg["quantization_config"]["format"] == "pack-quantized"
        assert launch[:3] == ["vllm", "serve", export[4]]


def test_each_scheme_gets_a_launch_for_each_engine():
    spec = default_spec()
    hw = build_hardware(["2xh100"], "256GB", None, 1, None)
    st = RunSettings(context=4096)
    for scheme in RECIPES:
        plan = solve(spec, RECIPES[scheme], st, hw)
        gg = launch_plan("llama.cpp", plan, hw, spec.name, "SRC")
        assert f"--type {GGUF_TYPES[scheme]}" in gg.export_command and "-m " + gg.export_command.split()[4] in gg.command
        vl = launch_plan("vllm", plan, hw, spec.name, "SRC")
        if scheme in ("bf16", "fp16", "int8"):
            assert vl.export_command is None and vl.command.startswith("vllm serve SRC ")
            assert ("--quantization fp8" in vl.command) == (scheme == "int8")
        else:
            assert vl.command.startswith(f"vllm serve {vl.export_command.split()[4]} ")


def test_llama_server_gives_each_slot_the_planned_context_and_both_lines_serve_tools():
    """`--batch 4 -c 64k` budgets 4 x 64k of KV: llama-server's -c is all slots together, so the line must say
    -c 262144 -np 4 (not -c 65536, which is 16k per slot), and the placement must hold 4 x 64k of KV."""
    from quantkit.export.llama_placement import LlamaSettings, kv_layer_bytes, model_from_spec

    spec = default_spec()
    hw = build_hardware(["rtx4090"], "128GB", None, 1, None)
    plan = solve(spec, RECIPES["int4"], RunSettings(context=65536, batch=4), hw)
    line = shlex.split(launch_plan("llama.cpp", plan, hw, spec.name, "SRC").command)
    assert line[line.index("-c") + 1] == str(4 * 65536) and line[line.index("-np") + 1] == "4"
    assert "--jinja" in line  # the GGUF's chat template: tool calls need it
    gm = model_from_spec(spec, "q4_0")
    one = kv_layer_bytes(gm, LlamaSettings(context=65536, parallel=1))
    assert kv_layer_bytes(gm, LlamaSettings(context=65536, parallel=4)) == 4 * one
    vl = shlex.split(launch_plan("vllm", plan, build_hardware(["2xh100"], "256GB", None, 1, None), spec.name,
                                 "SRC").command)
    assert vl[vl.index("--tool-call-parser") + 1] == "qwen3_coder" and "--enable-auto-tool-choice" in vl
    assert vl[vl.index("--reasoning-parser") + 1] == "qwen3"
