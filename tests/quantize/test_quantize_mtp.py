"""The MTP layer through the quantizer, the planner and the exporters: kept by default (each tensor by the rule
of its decoder-layer role), dropped with --no-mtp, budgeted by `plan` unless --mtp 0, exported without a crash."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import quantkit.cli
import quantkit.quantize.run as qz
from quantkit.checkpoint.quantized import QuantizedFolder
from quantkit.checkpoint.reader import spec_from_path
from quantkit.checkpoint.spec import Role
from quantkit.formats import QuantSpec, stored_bytes
from quantkit.planner.budget import RunSettings, compute_budget
from quantkit.quantize.manifest import JOURNAL_NAME, Manifest
from quantkit.recipe import Recipe

from helpers.cli import interrupt_quantizer_after, run_cli
from helpers.quantize import main_cli, qconfig, stored

quantkit.cli._register()
runner = CliRunner()
E0 = "mtp.layers.0.mlp.experts.0."


def cli(*args: object):
    return runner.invoke(quantkit.cli.app, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def q_mtp(tiny_model_mtp: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_model_mtp quantized by default, int4 at group 32 so no tensor falls back (planned bytes = stored)."""
    out = tmp_path_factory.mktemp("mtp") / "q"
    r = cli("quantize", tiny_model_mtp, "--out", out, "--group-size", "32")
    assert r.exit_code == 0, r.output
    assert "MTP layer kept" in r.output
    return out


def test_default_keeps_the_mtp_layer_quantized_by_its_roles(q_mtp: Path) -> None:
    qc = qconfig(q_mtp)
    fmts = {n: d["format"] for n, d in qc["tensors"].items()}
    assert qc["mtp"] == "kept"
    for p in ("gate_proj", "up_proj", "down_proj"):  # routed experts like the trunk's routed experts
        assert fmts[f"{E0}{p}.weight"] == "int4" and qc["tensors"][f"{E0}{p}.weight"]["group_size"] == 32
    for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
              "mlp.shared_expert.gate_proj", "mlp.shared_expert.down_proj"):
        assert fmts[f"mtp.layers.0.{n}.weight"] == "int8", n  # attention and shared expert like the trunk's
    assert fmts["mtp.fc.weight"] == "int8"  # a dense projection
    st = stored(q_mtp)
    for n in ("mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
              "mtp.layers.0.input_layernorm.weight", "mtp.layers.0.mlp.gate.weight",
              "mtp.layers.0.mlp.shared_expert_gate.weight"):
        assert n in st and n not in qc["tensors"], n  # norms and routers kept as stored
    cfg = json.loads((q_mtp / "config.json").read_text())["text_config"]
    assert cfg["mtp_num_hidden_layers"] == 1
    assert Manifest.read(q_mtp).options["keep_mtp"] is True
    md = (q_mtp / "quantkit-report.md").read_text()
    assert "- MTP: kept, " in md and json.loads((q_mtp / "quantkit-report.json").read_text())["mtp"] == "kept"
    assert cli("verify", q_mtp).exit_code == 0
    roles = {t.role for t in QuantizedFolder.open(q_mtp).tensors() if t.name.startswith("mtp.")}
    assert roles == {Role.MTP}


def test_other_recipes_reach_the_mtp_layer_too(tiny_model_mtp: Path, tmp_path: Path) -> None:
    out = tmp_path / "q8"
    assert cli("quantize", tiny_model_mtp, "--out", out, "--scheme", "int8").exit_code == 0
    qc = qconfig(out)
    assert qc["tensors"][f"{E0}gate_proj.weight"]["format"] == "int8"
    assert qc["tensors"]["mtp.fc.weight"]["format"] == "int8"


def test_no_mtp_drops_it_and_the_old_flag_is_a_notice(tiny_model_mtp: Path, tiny_model: Path, tmp_path: Path,
                                                        capsys, monkeypatch) -> None:
    out = tmp_path / "drop"
    code, so, err = run_cli(["quantize", tiny_model_mtp, "--out", out, "--no-mtp"], capsys, monkeypatch)
    assert code == 0, err
    assert not any(k.startswith("mtp.") for k in stored(out)) and qconfig(out)["mtp"] == "dropped"
    assert json.loads((out / "config.json").read_text())["text_config"]["mtp_num_hidden_layers"] == 0
    assert "- MTP: dropped (--no-mtp-layer)" in (out / "quantkit-report.md").read_text()
    assert Manifest.read(out).options["keep_mtp"] is False
    assert cli("verify", out).exit_code == 0
    # --keep-mtp: one notice, the layer kept as by default
    code, so, err = run_cli(["quantize", tiny_model_mtp, "--dry-run", "--keep-mtp"], capsys, monkeypatch)
    assert code == 0 and "MTP layer kept" in so
    notice = [line for line in err.splitlines() if "--keep-mtp" in line]
    assert len(notice) == 1 and "kept by default" in notice[0]
    code, so, err = run_cli(["quantize", tiny_model_mtp, "--dry-run", "--keep-mtp", "--no-mtp"], capsys, monkeypatch)
    assert code == 2 and "exclude each other" in err and len(err.strip().splitlines()) == 1
    code, so, err = run_cli(["quantize", tiny_model_mtp, "--dry-run", "--no-mtp"], capsys, monkeypatch)
    assert code == 0 and "MTP layer dropped" in so
    # a source without an MTP layer: nothing to keep, and the manifest says so as runs always did
    out = tmp_path / "none"
    assert cli("quantize", tiny_model, "--out", out, "--scheme", "int8").exit_code == 0
    assert qconfig(out)["mtp"] == "absent" and Manifest.read(out).options["keep_mtp"] is False
    assert "- MTP: absent" in (out / "quantkit-report.md").read_text()


@pytest.mark.parametrize("first,then,needle", [
    ([], ["--no-mtp"], "kept the MTP layer; resume it without --no-mtp"),
    # a run begun when dropping was the default (= --no-mtp now), resumed under the new default
    (["--no-mtp"], [], "dropped the MTP layer (--no-mtp-layer, the old default); resume it with --no-mtp-layer"),
])
def test_resume_with_another_mtp_choice_is_refused(tiny_model_mtp: Path, tmp_path: Path, monkeypatch,
                                                   first: list[str], then: list[str], needle: str) -> None:
    out = tmp_path / "q"
    args = ["quantize", tiny_model_mtp, "--out", out, "--max-shard-size", "60KB"]
    orig = interrupt_quantizer_after(monkeypatch, 20)
    assert main_cli(*args, *first).exit_code == 130
    monkeypatch.setattr(qz, "_quantize_tensor", orig)
    assert json.loads((out / JOURNAL_NAME).read_text())["done"]
    r = main_cli(*args, *then, "--resume")
    assert r.exit_code == 2 and needle in r.output
    assert len([ln for ln in r.output.splitlines() if ln.startswith("error:")]) == 1
    r = cli(*args, *first, "--resume")  # the same choice resumes
    assert r.exit_code == 0 and "reused" in r.output
    assert qconfig(out)["mtp"] == ("dropped" if first else "kept")


def _stored_mtp_bytes(folder: Path) -> int:
    q = QuantizedFolder.open(folder)
    return sum(q.stored_bytes(t.name) for t in q.tensors() if t.role == Role.MTP)


def test_planner_counts_the_stored_mtp_bytes(q_mtp: Path) -> None:
    spec = spec_from_path(str(q_mtp))
    recipe = Recipe.from_dict(qconfig(q_mtp)["recipe"])
    with_mtp = compute_budget(spec, recipe, RunSettings(include_mtp=True))
    without = compute_budget(spec, recipe, RunSettings())
    assert with_mtp.mtp_weights == _stored_mtp_bytes(q_mtp) > 0
    q = QuantizedFolder.open(q_mtp)
    assert with_mtp.weights == sum(q.stored_bytes(t.name) for t in q.tensors())  # the whole folder, exactly
    assert with_mtp.weights - without.weights == with_mtp.mtp_weights
    kv = with_mtp.kv_cache - without.kv_cache  # the MTP layer's attention KV, per token of context
    assert kv > 0 and kv * len(spec.config.full_attention_layers) == without.kv_cache
    # the runtime holds the layer's int8 attention, fc and shared expert as int4 (checkpoint/draft.py), at group 128 or
    # the largest that divides the row
    dense = [t for t in q.tensors() if t.role == Role.MTP and t.spec is not None and t.spec.format == "int8"]
    assert {t.name.split(".")[-2] for t in dense} == {"fc", *(f"{n}_proj" for n in "qkvo"), "gate_proj", "up_proj",
                                                      "down_proj"}
    group = {t.name: next(g for g in (128, 64, 32) if t.shape[1] % g == 0) for t in dense}
    saving = sum(q.stored_bytes(t.name) - stored_bytes(QuantSpec("int4", group[t.name]), t.shape) for t in dense)
    assert with_mtp.mtp_copy_saving == saving > 0
    assert with_mtp.mtp == with_mtp.mtp_weights - saving + kv


def _plan(folder: Path, capsys, monkeypatch, *extra: str) -> tuple[int, dict | str]:
    code, out, err = run_cli(["plan", "--model", folder, "--gpu", "none", "--ram", "64", "--json", *extra],
                             capsys, monkeypatch)
    return code, (json.loads(out) if code == 0 else err)


def test_plan_budgets_the_mtp_layer_unless_mtp_0(q_mtp: Path, tiny_model_mtp: Path, tmp_path: Path,
                                                  capsys, monkeypatch) -> None:
    code, d = _plan(q_mtp, capsys, monkeypatch)
    assert code == 0, d
    assert d["plan"]["settings"]["include_mtp"] is True
    assert d["plan"]["components"]["weights.mtp"] == _stored_mtp_bytes(q_mtp)
    assert any("MTP layer" in n for n in d["notes"])
    for n in ("1", "3"):
        code, d2 = _plan(q_mtp, capsys, monkeypatch, "--mtp", n)
        assert code == 0 and d2["plan"]["components"] == d["plan"]["components"]
    code, d0 = _plan(q_mtp, capsys, monkeypatch, "--mtp", "0")
    assert code == 0 and d0["plan"]["settings"]["include_mtp"] is False
    assert "weights.mtp" not in d0["plan"]["components"]
    assert d0["plan"]["total_bytes"] < d["plan"]["total_bytes"] and not any("MTP" in n for n in d0["notes"])
    for bad in ("4", "-1", "x"):
        code, err = _plan(q_mtp, capsys, monkeypatch, "--mtp", bad)
        assert code == 2 and "--mtp" in err and len(err.strip().splitlines()) == 1, err
    # a folder quantized with --no-mtp has no MTP layer: nothing budgeted, and --mtp 1 is refused
    drop = tmp_path / "drop"
    assert cli("quantize", tiny_model_mtp, "--out", drop, "--no-mtp").exit_code == 0
    code, dd = _plan(drop, capsys, monkeypatch)
    assert code == 0 and dd["plan"]["settings"]["include_mtp"] is False
    code, err = _plan(drop, capsys, monkeypatch, "--mtp", "1")
    assert code == 2 and "has no MTP layer" in err and len(err.strip().splitlines()) == 1


def test_a_kept_mtp_layer_exports(q_mtp: Path, tmp_path: Path) -> None:
    from quantkit.export.compressed_tensors import export_vllm
    from quantkit.export.gguf import export_gguf

    v = export_vllm(q_mtp, tmp_path / "vllm")
    idx = json.loads((tmp_path / "vllm" / "model.safetensors.index.json").read_text())["weight_map"]
    assert f"{E0}gate_proj.weight_packed" in idx
    assert json.loads((tmp_path / "vllm" / "config.json").read_text())["text_config"]["mtp_num_hidden_layers"] == 1
    assert not any("MTP" in n for n in v.notes)
    g = export_gguf(q_mtp, tmp_path / "m.gguf", "mixed")  # as llama.cpp's NextN block (test_export_gguf_llama.py)
    assert not g.skipped and {t.name for t in g.tensors if t.source.role == Role.MTP} >= {
        "blk.4.nextn.eh_proj.weight", "blk.4.ffn_gate_exps.weight", "blk.4.attn_q.weight"}
    assert [n for n in g.notes if "MTP" in n] == [
        "MTP layer exported as llama.cpp's NextN block blk.4 (llama-server --spec-type draft-mtp drafts with it; "
        "without that flag llama.cpp does not load it)"]
    g = export_gguf(q_mtp, tmp_path / "n.gguf", "mixed", mtp=False)
    assert all(n.startswith("mtp.") for n in g.skipped) and not any(".nextn." in t.name for t in g.tensors)
    assert [n for n in g.notes if "MTP" in n] == ["MTP layer not exported (--no-mtp-layer, as llama.cpp's converter "
                                                  "with --no-mtp)"]
