"""`quantkit plan / gpus / inspect` through the real entry point (quantkit.cli.main), bad input included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quantkit.checkpoint.spec import default_config_path, load_config
from quantkit.planner.placement import Plan

from helpers.cli import run_cli, run_main


def test_plan_rtx4090_shows_card_figures_and_a_fitting_plan(capsys, monkeypatch) -> None:
    code, out, err = run_cli(["plan", "--gpu", "rtx4090"], capsys, monkeypatch)
    assert code == 0, err
    for figure in ("74.0", "37.0", "18.5"):
        assert figure in out
    assert "Recommended:" in out and "no --ram given" in out  # RAM detected and said so
    code, out, _ = run_cli(["plan", "--gpu", "rtx4090", "--ram", "64GB", "--json"], capsys, monkeypatch)
    d = json.loads(out)
    rows = {r["scheme"]: r for r in d["schemes"]}
    assert [rows[s]["card_estimate_gb"] for s in ("fp16", "int8", "int4", "fp4")] == [74.0, 37.0, 18.5, 18.5]
    for key in ("scheme", "card_estimate_gb", "total_gb", "fits", "placement", "max_context",
                "est_decode_tok_s", "est_prefill_tok_s"):
        assert key in rows["quality"]
    rec = rows[d["recommended"]]
    assert rec["fits"] and rec["placement"]["where"] == "gpu"


def test_plan_16gb_card_puts_experts_on_cpu_and_saves_the_plan(capsys, monkeypatch, tmp_path: Path) -> None:
    out_file = tmp_path / "plan.json"
    code, out, err = run_cli(["plan", "--gpu", "rtx4060ti-16gb", "--ram", "64GB", "--json", "--out", str(out_file),
                              "--export", "llama.cpp"], capsys, monkeypatch)
    assert code == 0, err
    d = json.loads(out)
    rec = next(r for r in d["schemes"] if r["scheme"] == d["recommended"])
    assert rec["fits"] and rec["placement"]["experts_on_cpu"] > 0
    plan = Plan.from_json(out_file.read_text())
    assert plan.scheme == d["recommended"] and plan.experts_on_cpu == rec["placement"]["experts_on_cpu"]
    # llama.cpp's line is solved on the GGUF's own bytes (K-quant experts at 4.5-5.5 bits, its logits buffer), not on
    # quantkit's int4 g128 plan: more layers' experts go to the CPU, and the line fits the card by its bytes
    lc = d["export"]["llama_cpp"]
    n_cpu = len(lc["cpu_expert_layers"])
    assert f"--n-cpu-moe {n_cpu}" in d["export"]["command"] and n_cpu > plan.cpu_expert_layers
    assert lc["fits"] and lc["gpu_totals"][0] <= lc["budgets"][0] == 15 * 2**30


def test_plan_fp16_on_rtx3060_fails_and_says_what_fits(capsys, monkeypatch) -> None:
    code, out, err = run_cli(["plan", "--gpu", "rtx3060", "--ram", "16GB", "--scheme", "fp16"], capsys, monkeypatch)
    assert code == 2
    assert "fp16 does not fit" in err and "what fits" in err and "quality" in err and "--ram" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_context_sweep_and_vllm_export(capsys, monkeypatch) -> None:
    code, out, err = run_cli(["plan", "--gpu", "8xh100", "--nodes", "2", "--ram", "512GB", "-s", "bf16",
                              "--context", "4k,32k,128k,262k", "--json", "--export", "vllm"], capsys, monkeypatch)
    assert code == 0, err
    d = json.loads(out)
    assert d["contexts"] == [4096, 32768, 131072, 262144]
    assert [r["context"] for r in d["schemes"]] == d["contexts"]
    assert "--pipeline-parallel-size 2" in d["export"]["command"]
    assert "--max-model-len 4096" in d["export"]["command"]


def test_gpus_and_inspect(capsys, monkeypatch) -> None:
    code, out, err = run_cli(["gpus", "--json", "--ram", "32GB"], capsys, monkeypatch)
    assert code == 0, err
    d = {g["gpu"]: g["schemes"] for g in json.loads(out)["gpus"]}
    assert len(d) >= 30
    assert d["rtx4090"]["quality"]["runs"] == "gpu"
    assert d["rtx4060ti-16gb"]["quality"]["runs"] == "offload" and d["rtx4060ti-16gb"]["quality"]["ram_gib"] > 0
    assert d["rtx3050-8gb"]["bf16"]["runs"] == "no"
    assert d["h200"]["bf16"]["runs"] == "gpu"
    code, out, err = run_cli(["inspect", "--json"], capsys, monkeypatch)
    assert code == 0, err
    d = json.loads(out)
    assert d["text_params"] == 34_660_610_688
    assert d["roles"]["routed_expert"]["params"] == 32_212_254_720
    code, out, _ = run_cli(["inspect", str(default_config_path())], capsys, monkeypatch)
    assert code == 0 and "routed_expert" in out and "linear_attention" in out


def _bad_config(tmp_path: Path, mutate) -> Path:
    cfg = load_config(default_config_path())
    mutate(cfg)
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    return p


@pytest.mark.parametrize(
    "args,needle",
    [
        (["plan", "--gpu", "rtx4099"], "did you mean"),
        (["plan", "--gpu", "rtx4060ti"], "ambiguous"),
        (["plan", "--gpu", "rtx4090", "--context", "0"], "positive"),
        (["plan", "--gpu", "rtx4090", "--context", "300000"], "maximum of 262144"),
        (["plan", "--gpu", "rtx4090", "--context", "lots"], "does not parse"),
        (["plan", "--gpu", "rtx4090", "--ram", "sixty-four"], "--ram 'sixty-four' is not a size"),
        (["plan", "--gpu", "rtx4090", "--cpu-bandwidth", "fast"], "CPU bandwidth"),
        (["plan", "--gpu", "rtx4090", "--scheme", "int3"], "unknown scheme"),
        (["plan", "--gpu", "rtx4090", "--cache-dtype", "fp2"], "cache dtype"),
        (["plan", "--gpu", "rtx4090", "--export", "tgi"], "--export"),
    ],
)
def test_bad_input_one_line(args, needle, capsys, monkeypatch) -> None:
    code, _, err = run_cli(args, capsys, monkeypatch)
    assert code == 2 and needle in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "mutate,needle",
    [
        (lambda c: c["text_config"].pop("num_experts"), "text_config.num_experts"),
        (lambda c: c.update(model_type="llama"), "model_type 'llama'"),
        (lambda c: c["text_config"].update(layer_types=["full_attention"]), "text_config.layer_types"),
        (lambda c: c["text_config"].update(hidden_size="2048"), "text_config.hidden_size"),
    ],
)
def test_bad_config_names_the_field(mutate, needle, tmp_path, capsys, monkeypatch) -> None:
    path = _bad_config(tmp_path, mutate)
    code, _, err = run_cli(["plan", "--gpu", "rtx4090", "--model", str(path)], capsys, monkeypatch)
    assert code == 2 and needle in err and str(path) in err, err
    assert len(err.strip().splitlines()) == 1


def test_invalid_json_and_empty_checkpoint_folder(tmp_path, capsys, monkeypatch) -> None:
    p = tmp_path / "config.json"
    p.write_text("{not json")
    code, _, err = run_cli(["inspect", str(p)], capsys, monkeypatch)
    assert code == 2 and "not valid JSON" in err
    empty = tmp_path / "ckpt"
    empty.mkdir()
    (empty / "pytorch_model.bin").write_bytes(b"\0")
    code, _, err = run_cli(["plan", "--gpu", "rtx4090", "--model", str(empty)], capsys, monkeypatch)
    assert code == 2 and "safetensors" in err and len(err.strip().splitlines()) == 1


def test_console_script_error_has_no_traceback() -> None:
    r = run_main("plan", "--gpu", "rtx4099")
    assert r.returncode == 2 and "unknown GPU 'rtx4099'" in r.stderr and "Traceback" not in r.stderr


def test_plan_cpu_only_and_a_card_outside_the_catalog(capsys, monkeypatch) -> None:
    code, out, err = run_cli(["plan", "--gpu", "none", "--ram", "64", "--json"], capsys, monkeypatch)
    assert code == 0, err
    d = json.loads(out)
    rec = next(r for r in d["schemes"] if r["scheme"] == d["recommended"])
    assert d["hardware"]["gpus"] == [] and rec["fits"] and rec["placement"]["where"] == "cpu"
    code, out, err = run_cli(["plan", "--gpu", "custom:24GiB,936", "--ram", "64", "--json"], capsys, monkeypatch)
    assert code == 0, err
    d = json.loads(out)
    assert d["hardware"]["gpus"][0]["memory_gib"] == 24 and d["hardware"]["gpus"][0]["bandwidth_gbs"] == 936
    # the same card as the catalog's RTX 3090 (24 GiB, 936 GB/s) decodes at the same estimated speed
    _, ref, _ = run_cli(["plan", "--gpu", "rtx3090", "--ram", "64", "--json"], capsys, monkeypatch)
    tps = {r["scheme"]: r["est_decode_tok_s"] for r in d["schemes"]}
    ref_tps = {r["scheme"]: r["est_decode_tok_s"] for r in json.loads(ref)["schemes"]}
    assert tps["int4"] == pytest.approx(ref_tps["int4"], rel=0.05)
    code, _, err = run_cli(["plan", "--gpu", "custom:0", "--ram", "64"], capsys, monkeypatch)
    assert code == 2 and err.count("error:") == 1 and "VRAM" in err


def test_the_recommendation_is_the_fastest_at_or_above_the_quality_floor(capsys, monkeypatch) -> None:
    """RTX 3060 + 64 GB: int8 (about half the speed of the 4-bit schemes) was recommended over them."""
    from quantkit.recipe import QUALITY_RANK

    def plan(*extra):
        code, out, err = run_cli(["plan", "--gpu", "rtx3060", "--ram", "64", "--json", *extra], capsys, monkeypatch)
        assert code == 0, err
        d = json.loads(out)
        return d["recommended"], {r["scheme"]: r for r in d["schemes"] if r["fits"]}

    rec, rows = plan()
    floor = QUALITY_RANK["quality"]
    eligible = {s: r["est_decode_tok_s"] for s, r in rows.items() if QUALITY_RANK[s] >= floor}
    assert rec != "int8" and rows[rec]["est_decode_tok_s"] == max(eligible.values())
    rec, rows = plan("--min-quality", "int4")
    assert rows[rec]["est_decode_tok_s"] == max(r["est_decode_tok_s"] for s, r in rows.items()
                                                if QUALITY_RANK[s] >= QUALITY_RANK["int4"])
    code, _, err = run_cli(["plan", "--gpu", "rtx3060", "--min-quality", "int3"], capsys, monkeypatch)
    assert code == 2 and "unknown scheme 'int3'" in err


def test_inspect_a_quantized_folder_shows_the_bytes_on_disk(tiny_model: Path, tmp_path: Path, capsys, monkeypatch):
    import struct

    q = tmp_path / "q4"
    assert run_main("quantize", tiny_model, "--bits", "4", "--out", q, timeout=600).returncode == 0
    code, out, err = run_cli(["inspect", str(q), "--json"], capsys, monkeypatch)
    assert code == 0, err
    d = json.loads(out)
    data = 0  # every shard's tensor bytes: file size minus the 8-byte length and the JSON header
    for f in q.glob("*.safetensors"):
        with f.open("rb") as fh:
            data += f.stat().st_size - 8 - struct.unpack("<Q", fh.read(8))[0]
    assert d["stored_bytes"] == data
    bf16 = sum(r["bytes"] for r in d["roles"].values())
    assert d["stored_bytes"] < 0.6 * bf16  # 4-bit experts: far below the bf16 original
    assert d["roles"]["routed_expert"]["stored_bytes"] < 0.35 * d["roles"]["routed_expert"]["bytes"]
    code, out, _ = run_cli(["inspect", str(tiny_model), "--json"], capsys, monkeypatch)
    assert "stored_bytes" not in json.loads(out)  # a source checkpoint: as published
    code, out, _ = run_cli(["inspect", str(q)], capsys, monkeypatch)
    assert "stored GB" in out and "bytes on disk" in " ".join(out.split())
