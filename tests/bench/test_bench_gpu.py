"""`python -m benchmarks.gpu` (benchmarks/gpu.py) without a GPU: the one-line refusal, the plans onto a
simulated GPU of given memory, the graph run on the cuda-graph route for the all-GPU plan only, the checks and
the report from synthetic runs. The GPU runs themselves need a CUDA device (scripts/gpu-check.sh)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import gpu as bg
from quantkit.checkpoint.spec import load_config, spec_from_config
from quantkit.errors import QuantkitError
from quantkit.planner.hardware import GIB, find_gpu
from quantkit.recipe import get_recipe

from helpers.cli import run_driver


def test_without_cuda_the_command_says_so_in_one_line_and_does_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    work = tmp_path / "work"
    code, out, err = run_driver("gpu", ["--workdir", work, "--reports", tmp_path / "reports"], capsys, monkeypatch)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("error: no CUDA GPU: ") and "scripts/gpu-check.sh" in err
    assert not work.exists() and not (tmp_path / "reports").exists()  # nothing generated first


def test_an_unknown_recipe_is_refused_before_anything_else(tmp_path, capsys, monkeypatch):
    code, _, err = run_driver("gpu", ["--scheme", "int3", "--workdir", tmp_path / "w"], capsys, monkeypatch)
    assert code == 2 and err.count("\n") == 1 and "int3" in err


def _spec(tiny_model):
    return spec_from_config(load_config(tiny_model / "config.json"), name="tiny")


def test_plans_onto_a_simulated_gpu_give_both_placements(tiny_model, tmp_path):
    from quantkit.planner.fit import check_plan
    from quantkit.runtime.loader import load_plan_file

    spec = _spec(tiny_model)
    gpu = find_gpu("h200").with_memory(8.0)
    cpu, alone, split = bg.plan_placements(spec, get_recipe("int4"), gpu, ram_bytes=64 * GIB, context=256)
    assert [p.name for p in (cpu, alone, split)] == ["cpu", "gpu", "gpu+cpu"]
    assert cpu.plan.where == "cpu" and set(cpu.planned_bytes) == {"cpu"}
    assert alone.plan.where == "gpu" and alone.plan.experts_on_cpu == 0 and alone.gpu_limit_bytes is None
    total = spec.config.num_hidden_layers * spec.config.num_experts
    assert split.plan.where == "gpu+cpu" and 0 < split.plan.experts_on_cpu < total
    # about half the expert bytes left the card (whole experts, so not exactly)
    assert abs(split.plan.experts_on_cpu / total - 0.5) <= 1 / spec.config.num_experts + 1e-9
    assert split.gpu_limit_bytes < gpu.memory_bytes
    assert split.planned_bytes["cuda:0"] < alone.planned_bytes["cuda:0"] and split.planned_bytes["cpu"] > 0
    d = split.to_dict()
    assert d["experts_on_cpu"] == split.plan.experts_on_cpu and d["experts_total"] == total
    # the saved plans load back and pass the loader's own check on a machine with room
    for p in (cpu, alone, split):
        f = tmp_path / f"{p.name}.json"
        p.plan.save(f)
        back = load_plan_file(f)
        check_plan(back, spec, tiny_model, str(f), {"cuda:0": 100 * GIB, "cpu": 100 * GIB}, lambda: None)
        assert back.expert_ranges == p.plan.expert_ranges


def test_plans_refuse_a_gpu_too_small_or_a_share_out_of_range(tiny_model):
    spec = _spec(tiny_model)
    with pytest.raises(QuantkitError, match="does not fit .* alone"):
        bg.plan_placements(spec, get_recipe("int4"), find_gpu("h200").with_memory(0.5), 64 * GIB)
    for share in (0.0, 1.5):
        with pytest.raises(QuantkitError, match="--cpu-share"):
            bg.plan_placements(spec, get_recipe("int4"), find_gpu("h200"), 64 * GIB, cpu_share=share)


def test_a_share_of_one_leaves_every_expert_in_ram(tiny_model):
    spec = _spec(tiny_model)
    *_, split = bg.plan_placements(spec, get_recipe("int4"), find_gpu("h200").with_memory(8.0), 64 * GIB,
                                   context=256, cpu_share=1.0)
    c = spec.config
    assert split.plan.experts_on_cpu == c.num_hidden_layers * c.num_experts
    assert all(d != "cpu" for d in split.plan.layer_device)  # the dense layers stay on the card


class _Rt:
    def __init__(self, name: str, notes: list[str]):
        self.name, self.report = name, type("R", (), {"notes": notes})()

    def route(self):
        return {"name": self.name}


def test_load_runtime_asks_for_the_graph_route_and_refuses_a_placement_it_cannot_hold(tmp_path):
    calls = []

    def loader(path, plan=None, *, verify="auto", **kw):
        calls.append((verify, kw))
        return _Rt("cuda-graph" if kw.get("forced_route") == "cuda-graph" and "ok" in str(plan) else "torch",
                   ["route 'cuda-graph': needs every layer on one CUDA device; using torch"])

    assert bg.load_runtime(tmp_path, tmp_path / "ok.json", True, loader=loader).name == "cuda-graph"
    with pytest.raises(QuantkitError, match="^route 'cuda-graph': needs every layer on one CUDA device") as e:
        bg.load_runtime(tmp_path, tmp_path / "split.json", True, loader=loader)
    assert "\n" not in str(e.value)
    assert bg.load_runtime(tmp_path, tmp_path / "p.json", False, loader=loader).name == "torch"
    assert bg.load_runtime(tmp_path, tmp_path / "p.json", None, loader=loader).name == "torch"  # CPU: the same load
    assert calls == [("quick", {"forced_route": "cuda-graph"})] * 2 + [("quick", {})] * 2


def test_run_loads_the_all_gpu_plan_with_and_without_graphs(tmp_path, monkeypatch, tiny_model):
    """`run` loads each placement once and the all-GPU one again on the cuda-graph route (a graph cannot hold
    gpu+cpu's hand-off to the CPU experts); the report checks graphs on and off give the same tokens."""
    spec = _spec(tiny_model)
    placements = bg.plan_placements(spec, get_recipe("int4"), find_gpu("h200").with_memory(8.0), 64 * GIB,
                                    context=256)
    monkeypatch.setattr(bg, "detect_cuda", lambda: bg.CudaInfo("NVIDIA H200", 140 * GIB, 1, "2.x", "12.8"))
    monkeypatch.setattr(bg, "ensure_checkpoint", lambda *a, **k: tiny_model)
    monkeypatch.setattr(bg, "detected_gpu", lambda: find_gpu("h200"))
    monkeypatch.setattr(bg, "plan_placements", lambda *a, **k: placements)
    asked = []

    def fake_run(folder, plan_file, p, graphs, prompt, decode):
        asked.append((p.name, graphs))
        return bg.DecodeRun(p.name, graphs, list(range(decode)), 10.0, 100.0, 1.0, planned_bytes=p.planned_bytes)

    monkeypatch.setattr(bg, "run_placement", fake_run)
    res = bg.run(tmp_path / "reports", tmp_path / "work", prompt_len=4, decode=8, log=lambda _s: None)
    assert asked == [("cpu", False), ("gpu", False), ("gpu", True), ("gpu+cpu", False)]
    assert res.skipped == [] and res.checks["gpu: graphs on and off give the same tokens"]


def test_agreement_counts_the_shared_leading_tokens():
    assert bg.agreement([1, 2, 3, 4], [1, 2, 3, 4]) == 4
    assert bg.agreement([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert bg.agreement([1, 2], [5]) == 0


def _runs() -> list[bg.DecodeRun]:
    ref = list(range(100, 132))
    late = ref[:20] + [7] * 12  # parts from the CPU after 20 tokens: reported, not failed
    plan_gpu = {"cuda:0": 2_000_000_000}
    plan_split = {"cuda:0": 1_000_000_000, "cpu": 900_000_000}
    return [
        bg.DecodeRun("cpu", False, ref, 40.0, 300.0, 3.0, {}, {}, {"cpu": 1_800_000_000}, {"cpu": 1_900_000_000}),
        bg.DecodeRun("gpu", False, ref, 250.0, 4000.0, 4.0, {"cuda:0": 1_700_000_000}, {"cuda:0": 1_500_000_000},
                     {"cuda:0": 1_400_000_000}, plan_gpu),
        bg.DecodeRun("gpu", True, ref, 600.0, 4000.0, 5.0, {"cuda:0": 2_300_000_000}, {"cuda:0": 1_600_000_000},
                     {"cuda:0": 1_400_000_000}, plan_gpu),
        bg.DecodeRun("gpu+cpu", False, late, 90.0, 900.0, 4.0, {"cuda:0": 900_000_000}, {"cuda:0": 1_200_000_000},
                     {"cuda:0": 700_000_000, "cpu": 800_000_000}, plan_split),
        bg.DecodeRun("gpu+cpu", True, [], planned_bytes=plan_split,
                     error="CUDA-graph decode is not ported to the new model yet (quantkit.runtime.load_model has no "
                           "graph route)"),
    ]


def test_checks_judge_agreement_graphs_and_memory():
    c = bg.checks(_runs(), decode=32)
    assert c["cpu: ran"] and c["gpu: ran"] and c["gpu, graphs: ran"] and not c["gpu+cpu, graphs: ran"]
    assert c["gpu: graphs on and off give the same tokens"]
    assert "gpu+cpu: graphs on and off give the same tokens" not in c  # one side failed: nothing to compare
    assert c["gpu, graphs: first 8 greedy tokens agree with the CPU"]
    assert c["gpu+cpu: first 8 greedy tokens agree with the CPU"]  # parted at token 20
    assert c["gpu: cuda:0 load peak within the plan (+10%)"] and c["gpu: cuda:0 decode peak within the plan (+10%)"]
    assert not c["gpu, graphs: cuda:0 load peak within the plan (+10%)"]  # 2.3 GB against 2.0 GB planned
    assert c["gpu, graphs: cuda:0 decode peak within the plan (+10%)"]
    assert c["gpu+cpu: cuda:0 load peak within the plan (+10%)"]
    assert not c["gpu+cpu: cuda:0 decode peak within the plan (+10%)"]  # 1.2 GB against 1.0 GB planned
    runs = _runs()
    runs[2].tokens = runs[2].tokens[:3] + [0] * 29
    c = bg.checks(runs, decode=32)
    assert not c["gpu: graphs on and off give the same tokens"]
    assert not c["gpu, graphs: first 8 greedy tokens agree with the CPU"]


def _result() -> bg.GpuBenchResult:
    runs = _runs()
    placements = [{"name": "cpu", "summary": "CPU only", "where": "cpu", "planned_bytes": {"cpu": 1_900_000_000},
                   "gpu_limit_bytes": None, "experts_on_cpu": 256, "experts_total": 256},
                  {"name": "gpu", "summary": "GPU", "where": "gpu", "planned_bytes": {"cuda:0": 2_000_000_000},
                   "gpu_limit_bytes": None, "experts_on_cpu": 0, "experts_total": 256},
                  {"name": "gpu+cpu", "summary": "GPU + 128/256 experts in RAM (0.8 GB)", "where": "gpu+cpu",
                   "planned_bytes": {"cuda:0": 1_000_000_000, "cpu": 900_000_000}, "gpu_limit_bytes": 2 * GIB,
                   "experts_on_cpu": 128, "experts_total": 256}]
    return bg.GpuBenchResult(
        command="python -m benchmarks.gpu --layers 4", machine={"gpu": "NVIDIA H200", "gpu_memory_bytes": 140 * GIB,
                                                          "gpus": 1, "torch": "2.13.0", "cuda": "12.8",
                                                          "cpu": "Test CPU", "cores": 16, "threads": 16},
        checkpoint={"layers": 4, "experts": 64, "top_k": 8, "hidden": 2048, "vocab": 832, "folder": "/tmp/q"},
        recipe="int4", prompt_tokens=32, decode_tokens=32, placements=placements, runs=runs,
        checks=bg.checks(runs, 32), seconds=212.0)


def test_report_from_synthetic_runs(tmp_path):
    from quantkit.bench import write_reports

    d = _result().to_dict()
    assert [r["agree_with_cpu"] for r in d["runs"]] == [32, 32, 32, 20, None]
    md = bg.render_md(d)
    rows = {ln.split(" | ")[0].lstrip("| "): ln for ln in md.splitlines() if ln.startswith("| ")}
    assert "| 600.0 | 4000.0 | 5.0 | 32/32 |" in rows["gpu, graphs"]
    assert "cuda:0 load 2.30 / decode 1.60 GB peak, 2.00 GB planned (115%, 80%)" in rows["gpu, graphs"]
    assert "| 20/32 |" in rows["gpu+cpu"] and "cpu 0.80 GB weights / 0.90 GB planned" in rows["gpu+cpu"]
    assert "failed: CUDA-graph decode is not ported" in rows["gpu+cpu, graphs"]
    assert "| gpu+cpu | GPU + 128/256 experts in RAM (0.8 GB) | cpu 0.90 GB, cuda:0 1.00 GB | 2.00 GiB (cut) |" in md
    assert "| gpu | GPU | cuda:0 2.00 GB | the card's own |" in md
    assert "- FAIL gpu+cpu, graphs: ran" in md and "- PASS gpu: graphs on and off give the same tokens" in md
    assert "NVIDIA H200 (140 GiB" in md and "`python -m benchmarks.gpu --layers 4`" in md
    write_reports(tmp_path, "bench-gpu", d, md)
    back = json.loads((tmp_path / "bench-gpu.json").read_text())
    assert back["runs"][1]["decode_peak_bytes"] == {"cuda:0": 1_500_000_000} and back["checks"] == d["checks"]
    assert (tmp_path / "bench-gpu.md").read_text() == md


def test_the_cpu_reference_run_loads_its_saved_plan_and_decodes_greedily(tiny_model, tmp_path):
    """The CPU side of a run, end to end: the saved plan loads through the adapter (no graph switch on a
    CPU plan) and the runtime's own generation gives the greedy tokens, twice the same."""
    from helpers.runtime import quantized

    folder = quantized(tiny_model, "int4")
    spec = spec_from_config(load_config(folder / "config.json"), name="tiny")
    cpu, *_ = bg.plan_placements(spec, get_recipe("int4"), find_gpu("h200").with_memory(8.0), 64 * GIB, context=256)
    plan = tmp_path / "plan-cpu.json"
    cpu.plan.save(plan)
    prompt = bg.fixed_prompt(8, spec.config.vocab_size)
    a = bg.run_placement(folder, plan, cpu, False, prompt, 6)
    b = bg.run_placement(folder, plan, cpu, False, prompt, 6)
    assert not a.error, a.error
    assert len(a.tokens) == 6 and a.tokens == b.tokens and a.decode_tok_s > 0 and a.load_s > 0
    assert a.load_peak_bytes == a.decode_peak_bytes == {}  # no CUDA device in this plan
    assert a.resident_bytes["cpu"] > 0 and a.planned_bytes == cpu.planned_bytes
    bad = bg.run_placement(folder, tmp_path / "missing.json", cpu, False, prompt, 6)
    assert bad.error and "missing.json" in bad.error and not bad.tokens  # a QuantkitError becomes the run's error


def test_any_failure_of_one_run_is_recorded_in_one_line(tmp_path, monkeypatch):
    def boom(*_a, **_k):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")

    monkeypatch.setattr(bg, "load_runtime", boom)
    p = bg.PlannedPlacement("cpu", None)  # never read: the load fails first
    monkeypatch.setattr(bg.PlannedPlacement, "planned_bytes", property(lambda self: {"cpu": 1}))
    r = bg.run_placement(tmp_path, tmp_path / "p.json", p, False, [1, 2], 4)
    assert r.error == "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB" and not r.tokens
