"""The llama.cpp line's own decode and prefill estimates (quantkit.export.llama_speed): the per-GPU-layer cost and
the PCIe efficiency fitted to the public data points, each point's error stated and held; `plan --n-cpu-moe N` fixes the line and the plan; a GGUF
given with --model gets its speed too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quantkit.export.llama_speed import DATA_POINTS, fit_gpu_layer_cost, implied_bandwidth, predict
from quantkit.planner.speed import SpeedModel

from helpers.cli import run_cli

# each point's error at the fit (predicted / reported - 1), as stated in the report of this change; the hosts'
# RAM is assumed at 96 GB/s (dual-channel DDR5-6000): the CPU-bound points move with it
STATED = {"RTX 5060 Ti": 0.24, "RTX 3060": -0.04, "RTX 3090, Q8_0": -0.40, "RTX 3090, Q4_K_M": -0.01,
          "RTX 5080": 0.39}


def test_the_per_gpu_layer_cost_is_the_fit_and_each_point_within_its_stated_error():
    cost, rows = fit_gpu_layer_cost()
    assert cost == pytest.approx(SpeedModel().gpu_layer_overhead_s)  # the default is the fit
    for p, tok_s in rows:
        err = tok_s / p.tok_s - 1
        want = next(v for k, v in STATED.items() if p.what.startswith(k))
        print(f"{p.what}: predicted {tok_s:.1f}, reported {p.tok_s}, error {err:+.0%}, host that would match "
              f"{implied_bandwidth(p, SpeedModel(gpu_layer_overhead_s=cost))}")
        assert abs(err - want) < 0.03, (p.what, err)
    gpu_only = next(t for p, t in rows if p.cpu_expert_layers == 0)
    assert gpu_only == pytest.approx(141.0, rel=0.05)  # the point no host assumption touches


def test_more_cpu_layers_or_slower_ram_are_slower():
    p = DATA_POINTS[0]
    assert predict(p, cpu_bandwidth_gbs=50) < predict(p) < predict(p, cpu_bandwidth_gbs=200)
    fewer = type(p)(**{**p.__dict__, "cpu_expert_layers": 4})
    assert predict(fewer) > predict(p)


def test_plan_n_cpu_moe_fixes_the_line_and_the_plan(capsys, monkeypatch):
    def plan(*extra):
        code, out, err = run_cli(["plan", "--gpu", "rtx3090", "--ram", "64", "--cpu-bandwidth", "96", "-s", "int8",
                                  "--export", "llama.cpp", "--json", *extra], capsys, monkeypatch)
        assert code == 0, err
        return json.loads(out)

    auto, fixed = plan(), plan("--n-cpu-moe", "22")
    assert "--n-cpu-moe 22" in fixed["export"]["command"]
    assert len(fixed["export"]["llama_cpp"]["cpu_expert_layers"]) == 22
    assert fixed["schemes"][0]["placement"]["cpu_expert_layers"] == 22
    assert 0 < fixed["export"]["est_decode_tok_s"] < auto["export"]["est_decode_tok_s"]  # more CPU: slower
    code, out, _ = run_cli(["plan", "--gpu", "rtx3090", "--ram", "64", "-s", "int8", "--export", "llama.cpp"],
                           capsys, monkeypatch)
    assert "tok/s estimated for this line" in " ".join(out.split())


def test_a_gguf_plan_has_a_speed(tiny_model: Path, tmp_path: Path, capsys, monkeypatch):
    from quantkit.export.gguf import export_gguf

    path = export_gguf(tiny_model, tmp_path / "t.gguf", "q8_0").path
    code, out, err = run_cli(["plan", "--model", str(path), "--gpu", "rtx4090", "--ram", "64", "--json"], capsys,
                             monkeypatch)
    assert code == 0, err
    assert json.loads(out)["export"]["est_decode_tok_s"] > 0
    code, out, err = run_cli(["plan", "--model", str(path), "--gpu", "rtx4090", "--n-cpu-moe", "1", "--json"],
                             capsys, monkeypatch)
    assert code == 0, err and json.loads(out)["export"]["llama_cpp"]["cpu_expert_layers"] == [0]


# each prefill point's error at the fit (predicted / reported - 1), as stated in llama_speed's docstring
PREFILL_STATED = {"RTX 3060": -0.04, "RTX 3090, Q8_0": -0.32, "RTX 5080": 0.40}


def test_the_pcie_efficiency_is_the_prefill_fit_and_each_point_within_its_stated_error():
    from quantkit.export.llama_speed import fit_pcie_efficiency

    eff, rows = fit_pcie_efficiency()
    assert eff == pytest.approx(SpeedModel().pcie_efficiency)  # the default is the fit
    for p, tok_s in rows:
        err = tok_s / p.tok_s - 1
        want = next(v for k, v in PREFILL_STATED.items() if p.point.what.startswith(k))
        print(f"{p.point.what}, -ub {p.ubatch}: predicted {tok_s:.0f}, reported {p.tok_s}, error {err:+.0%}")
        assert abs(err - want) < 0.03, (p.point.what, err)


def test_prefill_gains_from_larger_steps_and_loses_from_experts_in_ram():
    from dataclasses import replace

    from quantkit.export.llama_speed import PREFILL_POINTS, predict_prefill

    p = PREFILL_POINTS[0]  # every expert in RAM: each step streams them over PCIe once
    assert predict_prefill(replace(p, ubatch=2048)) > predict_prefill(p)
    assert predict_prefill(p, SpeedModel(pcie_efficiency=0.3)) < predict_prefill(p)
    fewer = replace(p, point=replace(p.point, cpu_expert_layers=10))
    assert predict_prefill(fewer) > predict_prefill(p)


def test_plan_prints_the_line_prefill_at_its_ub(capsys, monkeypatch):
    def plan(*extra):
        code, out, err = run_cli(["plan", "--gpu", "rtx3060", "--ram", "64", "-s", "int4", "--export", "llama.cpp",
                                  "--json", *extra], capsys, monkeypatch)
        assert code == 0, err
        return json.loads(out)["export"]

    small, big = plan(), plan("--prefill-chunk", "2048")
    assert "-ub" not in small["command"].split() and big["command"].split()[-2:] == ["-ub", "2048"]
    assert 0 < small["est_prefill_tok_s"] < big["est_prefill_tok_s"]
    code, out, _ = run_cli(["plan", "--gpu", "rtx3060", "--ram", "64", "-s", "int4", "--export", "llama.cpp"],
                           capsys, monkeypatch)
    assert "tok/s in steps of -ub 512" in " ".join(out.split())
