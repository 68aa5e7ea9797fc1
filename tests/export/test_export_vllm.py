"""`quantkit export vllm`: compressed-tensors pack-quantized, proven by compressed-tensors' own decompression
(its model-free `CompressedTensorsDequantizer`, which also fails on any quantized tensor its config does not
target) and by transformers loading the folder through its compressed-tensors integration."""

from __future__ import annotations

import glob
import json
from pathlib import Path

import pytest
import torch

from quantkit.checkpoint.reader import Checkpoint
from quantkit.checkpoint.spec import Role
from quantkit.export.compressed_tensors import export_vllm, pack_int32
from quantkit.formats import QuantSpec, get_format
from quantkit.quantize.run import QuantizeOptions, run_quantize
from quantkit.recipe import INT8, Recipe

from helpers.cli import run_cli

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32  # noqa: E402
from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import (  # noqa: E402
    CompressedTensorsDequantizer,
)

LM = "model.language_model."
# what --rest int8 quantizes (in_proj_a/b, lm_head, routers and gates stay bf16)
INT8_SUFFIXES = tuple(f"self_attn.{p}_proj.weight" for p in "qkvo") + tuple(
    f"linear_attn.{p}.weight" for p in ("in_proj_qkv", "in_proj_z", "out_proj")) + tuple(
    f"shared_expert.{p}_proj.weight" for p in ("gate", "up", "down"))


def ct_dense(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the export as compressed-tensors itself dequantizes it (fp32)."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(glob.glob(str(folder / "*.safetensors"))):
        tensors.update(load_file(f))
    return CompressedTensorsDequantizer(folder, dtype=torch.float32).validate(tensors)


def our_int4(w: torch.Tensor, g: int) -> torch.Tensor:
    spec = QuantSpec("int4", g, True)
    f = get_format("int4")
    return f.dequantize(f.quantize(w, spec), spec, tuple(w.shape), torch.float32)


def our_int8(w: torch.Tensor) -> torch.Tensor:
    f = get_format("int8")
    return f.dequantize(f.quantize(w, INT8), INT8, tuple(w.shape), torch.float32)


def bf16_round(x: torch.Tensor) -> torch.Tensor:
    # compressed-tensors multiplies codes by the bf16 scale in bf16: the exact product, rounded once
    return x.to(torch.bfloat16).float()


@pytest.mark.parametrize("rest", ["bf16", "int8"])
def test_compressed_tensors_reads_back_our_dequantization(tiny_model: Path, tmp_path: Path, rest: str) -> None:
    out = tmp_path / f"vllm-{rest}"
    res = export_vllm(tiny_model, out, rest=rest)
    assert res.group_size == 32  # the tiny experts' rows are 64 and 32 long: the largest group dividing both
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    assert qc["config_groups"]["group_0"]["weights"]["symmetric"] is True
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()
    dense = ct_dense(out)
    src = Checkpoint.open(tiny_model)
    n_int8 = 0
    for t in src.canonical():
        w = src.load(t.name).float()
        if t.role == Role.ROUTED_EXPERT:
            pre = t.name.rsplit(".", 1)[0]
            for e in range(t.shape[0]):
                want = bf16_round(our_int4(w[e], 32))
                if t.name.endswith("gate_up_proj"):
                    got = torch.cat([dense[f"{pre}.{e}.gate_proj.weight"], dense[f"{pre}.{e}.up_proj.weight"]])
                else:
                    got = dense[f"{pre}.{e}.down_proj.weight"]
                assert torch.equal(got, want), f"{t.name} expert {e}"
            assert t.name not in dense  # unfused: no fused stack left
            continue
        got = dense[t.name].float()
        if rest == "int8" and t.name.endswith(INT8_SUFFIXES):
            assert torch.equal(got, bf16_round(our_int8(w))), t.name
            n_int8 += 1
        else:
            assert torch.equal(got, w), t.name  # bf16 kept bit for bit
    assert n_int8 == (25 if rest == "int8" else 0)  # 3x(qkv,z,out) + 1x(q,k,v,o) + 4x3 shared


def test_pack_matches_compressed_tensors() -> None:
    g = torch.Generator().manual_seed(0)
    for bits in (4, 8):
        x = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (5, 64), generator=g, dtype=torch.int8)
        assert torch.equal(pack_int32(x, bits), pack_to_int32(x, bits))


def test_quantkit_codes_are_reused_not_requantized(tiny_model: Path, tmp_path: Path) -> None:
    """A quantkit folder with int4 g32 experts and int8 attention exports its own codes: compressed-tensors'
    decompression equals our dequantization of the STORED parts, bit for bit."""
    recipe = Recipe("t", {Role.ROUTED_EXPERT: QuantSpec("int4", 32, True), Role.ATTENTION: INT8,
                          Role.LINEAR_ATTENTION: INT8, Role.SHARED_EXPERT: INT8})
    q = tmp_path / "q"
    run_quantize(Checkpoint.open(tiny_model), q, QuantizeOptions(recipe))
    out = tmp_path / "v"
    res = export_vllm(q, out, rest="int8")
    hows = {(t.kind, t.how) for t in res.tensors}
    assert ("int4-experts", "reused") in hows and ("int8", "reused") in hows
    assert not any(t.how in ("quantized", "requantized") for t in res.tensors)
    dense = ct_dense(out)
    from quantkit.export.source import ExportSource

    s = ExportSource.open(q)
    for t in s.tensors():
        if t.spec is None:
            continue
        ours = bf16_round(s.dense(t.name))
        if t.role == Role.ROUTED_EXPERT:
            pre = t.name.rsplit(".", 1)[0]
            for e in range(t.shape[0]):
                if t.name.endswith("gate_up_proj"):
                    got = torch.cat([dense[f"{pre}.{e}.gate_proj.weight"], dense[f"{pre}.{e}.up_proj.weight"]])
                else:
                    got = dense[f"{pre}.{e}.down_proj.weight"]
                assert torch.equal(got, ours[e]), f"{t.name} expert {e}"
        else:
            assert torch.equal(dense[t.name].float(), ours), t.name


@pytest.mark.parametrize("source,rest", [("bf16", "bf16"), ("bf16", "int8"), ("int4-g32", "int8")])
def test_mtp_experts_are_quantized_per_expert_like_the_routed_experts(source: str, rest: str, tiny_model_mtp: Path,
                                                                      tmp_path: Path) -> None:
    """vLLM's MTP drafter takes its MoE with the trunk's scheme: every MTP expert is its own int4 module at the
    trunk experts' group size (scales as wide), in the experts' config group, and comes back as our int4 of it;
    from a quantkit int4 folder its codes are reused as the trunk's are."""
    import re

    from safetensors import safe_open

    from quantkit.export.compressed_tensors import EXPERT_TARGET

    src = tiny_model_mtp
    if source == "int4-g32":
        src = tmp_path / "q"
        with Checkpoint.open(tiny_model_mtp) as ck:
            run_quantize(ck, src, QuantizeOptions(Recipe("e", {Role.ROUTED_EXPERT: QuantSpec("int4", 32)})))
    out = tmp_path / "mtp"
    res = export_vllm(src, out, rest=rest)
    idx = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert not any(n.startswith("mtp.") and ".experts." in n and n.endswith(".weight") for n in idx)
    dense = ct_dense(out)  # raises if any packed tensor is not targeted by the config
    hdr = {}
    for f in sorted(glob.glob(str(out / "*.safetensors"))):
        with safe_open(f, "pt") as h:
            hdr.update({k: h.get_slice(k).get_shape() for k in h.keys()})  # noqa: SIM118 (safe_open has no __iter__)
    groups = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]
    expert_group = groups["group_0"]
    assert expert_group["weights"]["group_size"] == res.group_size and expert_group["weights"]["num_bits"] == 4
    with Checkpoint.open(tiny_model_mtp) as ck:
        for e in range(8):
            for p in ("gate", "up", "down"):
                mtp, trunk = f"mtp.layers.0.mlp.experts.{e}.{p}_proj", f"{LM}layers.0.mlp.experts.{e}.{p}_proj"
                assert hdr[f"{mtp}.weight_scale"] == hdr[f"{trunk}.weight_scale"], (e, p)  # the trunk's group
                assert hdr[f"{mtp}.weight_packed"] == hdr[f"{trunk}.weight_packed"], (e, p)
                if rest == "int8":  # module-name targets: the experts' group takes it, not the int8 one
                    assert re.match(EXPERT_TARGET[3:], mtp) and not re.match(groups["group_1"]["targets"][0][3:], mtp)
                if source == "bf16":
                    want = bf16_round(our_int4(ck.load(f"{mtp}.weight").float(), res.group_size))
                    assert torch.equal(dense[f"{mtp}.weight"], want), (e, p)
    how = {t.source.name: t.how for t in res.tensors}
    mtp_experts = [n for n in how if n.startswith("mtp.") and ".experts." in n]
    assert len(mtp_experts) == 24
    want_how = "reused" if source == "int4-g32" else "quantized"
    assert {how[n] for n in mtp_experts} == {how[f"{LM}layers.0.mlp.experts.down_proj"]} == {want_how}
    if rest == "int8":
        assert "mtp.fc.weight_packed" in idx and hdr["mtp.fc.weight_scale"][1] == 1  # a dense projection: int8


def test_transformers_loads_the_export(tiny_model: Path, tmp_path: Path) -> None:
    """transformers (5.x) loads it with its compressed-tensors integration: the experts come back dense,
    equal to compressed-tensors' own decompression, and the model runs."""
    import transformers
    from transformers import Qwen3_5MoeForConditionalGeneration

    from quantkit.testing.tiny import load_reference_model, probe_ids

    out = tmp_path / "v"
    export_vllm(tiny_model, out)
    transformers.logging.set_verbosity_error()
    m, info = Qwen3_5MoeForConditionalGeneration.from_pretrained(str(out), dtype=torch.float32,
                                                                 output_loading_info=True, local_files_only=True)
    missing = [k for k in info["missing_keys"] if not k.startswith("model.visual.")]
    assert not missing and not info["unexpected_keys"], (missing, info["unexpected_keys"])
    dense = ct_dense(out)
    lm = m.model.language_model
    for L in range(len(lm.layers)):
        ex = lm.layers[L].mlp.experts
        for e in range(ex.gate_up_proj.shape[0]):
            p = f"{LM}layers.{L}.mlp.experts.{e}."
            assert torch.equal(ex.gate_up_proj[e].float(),
                               torch.cat([dense[p + "gate_proj.weight"], dense[p + "up_proj.weight"]]))
            assert torch.equal(ex.down_proj[e].float(), dense[p + "down_proj.weight"])
    ids = probe_ids(2, 32)
    ref = load_reference_model(tiny_model)
    with torch.no_grad():
        got, want = m(input_ids=ids).logits, ref(input_ids=ids).logits
    assert torch.isfinite(got).all()
    agree = float((got.argmax(-1) == want.argmax(-1)).float().mean())
    assert agree >= 0.95, agree  # int4 g32 experts of the decisive model vs its bf16 weights


def test_bad_inputs_one_line_each(tiny_model: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    code, _, err = run_cli(["export", "vllm", str(tmp_path / "nope"), str(tmp_path / "o")], capsys, monkeypatch)
    assert code == 2 and "no such checkpoint folder" in err and len(err.strip().splitlines()) == 1
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{}")
    (bad / "model.safetensors").write_bytes(b"\x00" * 4)
    code, _, err = run_cli(["export", "vllm", str(bad), str(tmp_path / "o")], capsys, monkeypatch)
    assert code == 2 and "truncated" in err and len(err.strip().splitlines()) == 1
    existing = tmp_path / "exists"
    existing.mkdir()
    (existing / "keep.txt").write_text("x")
    code, _, err = run_cli(["export", "vllm", str(tiny_model), str(existing)], capsys, monkeypatch)
    assert code == 2 and "--overwrite" in err and (existing / "keep.txt").read_text() == "x"
    code, _, err = run_cli(["export", "vllm", str(tiny_model), str(tmp_path / "g"), "--group-size", "128"],
                           capsys, monkeypatch)
    assert code == 2 and "does not divide" in err and not (tmp_path / "g").exists()
    code, _, err = run_cli(["export", "vllm", str(tiny_model), str(tmp_path / "r"), "--rest", "fp8"],
                           capsys, monkeypatch)
    assert code == 2 and "--rest" in err and not (tmp_path / "r").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporaries left behind
    code, out, _ = run_cli(["export", "vllm", str(tiny_model), str(tmp_path / "ok")], capsys, monkeypatch)
    assert code == 0 and "group 32" in out and (tmp_path / "ok" / "config.json").is_file()
