"""The checkpoint reader: both layouts, canonical tensors, expert slabs, FP8, the HF cache, bad input."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from quantkit.checkpoint.reader import Checkpoint, check_finite, resolve_model, spec_from_path
from quantkit.checkpoint.spec import load_config, spec_from_config
from quantkit.errors import QuantkitError

from helpers.cli import run_cli

GU = "model.language_model.layers.1.mlp.experts.gate_up_proj"
DN = "model.language_model.layers.1.mlp.experts.down_proj"


def copy_ckpt(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ---- reading ----
def test_both_layouts_give_identical_canonical_tensors(tiny_model: Path, tiny_model_transformers_layout: Path) -> None:
    a, b = Checkpoint.open(tiny_model), Checkpoint.open(tiny_model_transformers_layout)
    assert (a.layout, b.layout) == ("published", "transformers")
    assert all(n.startswith("model.language_model.") or n == "lm_head.weight" for n in a.names())
    assert any(".mlp.experts.3.gate_proj.weight" in n for n in b.names())  # really per expert on disk
    ca, cb = a.canonical(), b.canonical()
    assert [(t.name, t.shape, t.dtype, t.role) for t in ca] == [(t.name, t.shape, t.dtype, t.role) for t in cb]
    for t in ca:
        x, y = a.load(t.name), b.load(t.name)
        assert x.dtype == y.dtype == torch.bfloat16 and torch.equal(x, y), t.name
    assert a.load(GU).shape == (8, 64, 64) and a.load(DN).shape == (8, 64, 32)


def test_fused_experts_are_gate_then_up_per_expert(tiny_model_transformers_layout: Path) -> None:
    ck = Checkpoint.open(tiny_model_transformers_layout)
    gu = ck.load(GU)
    src = "model.layers.1.mlp.experts.5."
    assert torch.equal(gu[5, :32], ck.get(src + "gate_proj.weight"))
    assert torch.equal(gu[5, 32:], ck.get(src + "up_proj.weight"))
    assert torch.equal(ck.load(DN)[5], ck.get(src + "down_proj.weight"))


@pytest.mark.parametrize("fixture", ["tiny_model", "tiny_model_transformers_layout"])
def test_expert_slabs_equal_slices_of_the_whole(fixture: str, request) -> None:
    ck = Checkpoint.open(request.getfixturevalue(fixture))
    for name in (GU, DN):
        whole = ck.load(name)
        parts = [ck.load(name, experts=slice(e, min(e + 3, 8))) for e in range(0, 8, 3)]
        assert [p.shape[0] for p in parts] == [3, 3, 2]
        assert torch.equal(torch.cat(parts), whole)
        assert torch.equal(ck.load(name, experts=slice(6, None)), whole[6:])
    with pytest.raises(QuantkitError, match="not a stack of experts"):
        ck.load("lm_head.weight", experts=slice(0, 2))
    with pytest.raises(QuantkitError, match="contiguous"):
        ck.load(GU, experts=slice(0, 8, 2))


def test_headers_names_and_lazy_get(tiny_model: Path) -> None:
    ck = Checkpoint.open(tiny_model)
    assert len(ck.files) > 1 and all(f.suffix == ".safetensors" for f in ck.files)
    assert ck.header(GU) == ((8, 64, 64), "bfloat16")
    assert ck.config["model_type"] == "qwen3_5_moe"
    t = ck.get("model.language_model.norm.weight")
    assert t.shape == (64,) and t.dtype == torch.bfloat16
    with pytest.raises(QuantkitError, match="no tensor named"):
        ck.get("nope")
    with pytest.raises(QuantkitError, match="no tensor named"):
        ck.load("model.layers.0.mlp.gate.weight")  # a source name of the other layout is not canonical


def test_mtp_tensors_pass_through_per_expert(tiny_model_mtp: Path) -> None:
    ck = Checkpoint.open(tiny_model_mtp)
    names = [t.name for t in ck.canonical()]
    assert "mtp.fc.weight" in names and "mtp.layers.0.mlp.experts.7.down_proj.weight" in names
    assert not any(n.startswith("mtp.") and n.endswith("gate_up_proj") for n in names)
    assert names == [t.name for t in spec_from_config(ck.config).tensors]


def test_single_file_checkpoint(tiny_model: Path, tmp_path: Path) -> None:
    ck = Checkpoint.open(tiny_model)
    d = tmp_path / "one"
    d.mkdir()
    shutil.copy(tiny_model / "config.json", d)
    save_file({t.name: ck.load(t.name) for t in ck.canonical()}, str(d / "model.safetensors"))
    one = Checkpoint.open(d)
    assert [t.name for t in one.canonical()] == [t.name for t in ck.canonical()]
    assert torch.equal(one.load(GU), ck.load(GU))
    assert Checkpoint.open(d / "model.safetensors").load(DN).shape == (8, 64, 32)


# ---- FP8 sources ----
def _fp8_checkpoint(tiny_model: Path, folder: Path, block: list[int] | None = (16, 16), with_scales: bool = True,
                    ) -> tuple[Path, dict[str, torch.Tensor]]:
    """The tiny model with every 2D/3D projection stored as F8_E4M3 + weight_scale_inv blocks."""
    ck = Checkpoint.open(tiny_model)
    folder.mkdir()
    cfg = load_config(tiny_model / "config.json")
    if block is not None:
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": list(block)}
    (folder / "config.json").write_text(json.dumps(cfg))
    out: dict[str, torch.Tensor] = {}
    expect: dict[str, torch.Tensor] = {}
    b0, b1 = block or (16, 16)
    for t in ck.canonical():
        w = ck.load(t.name).float()
        if t.name.endswith("q_proj.weight") or t.name in (GU, DN):
            lead, (o, i) = w.shape[:-2], w.shape[-2:]
            blocks = w.reshape(*lead, -(-o // b0), b0, -(-i // b1), b1)
            scale = blocks.abs().amax(dim=(-3, -1)) / 448
            q = (blocks / scale[..., :, None, :, None]).to(torch.float8_e4m3fn)
            out[t.name] = q.reshape(w.shape)
            if with_scales:
                out[t.name + "_scale_inv"] = scale
            expect[t.name] = (q.float() * scale[..., :, None, :, None]).reshape(w.shape).to(torch.bfloat16)
        else:
            out[t.name] = ck.load(t.name)
    save_file(out, str(folder / "model.safetensors"))
    return folder, expect


def test_fp8_block_scaled_source_is_dequantized(tiny_model: Path, tmp_path: Path) -> None:
    folder, expect = _fp8_checkpoint(tiny_model, tmp_path / "fp8")
    ck = Checkpoint.open(folder)
    canon = {t.name: t for t in ck.canonical()}
    assert not any(n.endswith("_scale_inv") for n in canon)
    for name, want in expect.items():
        assert canon[name].dtype == "bfloat16"
        got = ck.load(name)
        assert got.dtype == torch.bfloat16 and torch.equal(got, want), name
    # close to the bf16 original (FP8 e4m3 has 3 mantissa bits) and slabs agree with the whole
    orig = Checkpoint.open(tiny_model).load(GU).float()
    assert (ck.load(GU).float() - orig).norm() / orig.norm() < 0.05
    assert torch.equal(ck.load(GU, experts=slice(2, 5)), ck.load(GU)[2:5])
    assert [t.name for t in ck.spec().tensors] == [t.name for t in spec_from_config(ck.config).tensors]


def test_fp8_without_scales_or_block_size_is_refused(tiny_model: Path, tmp_path: Path) -> None:
    no_scale, _ = _fp8_checkpoint(tiny_model, tmp_path / "a", with_scales=False)
    with pytest.raises(QuantkitError, match="FP8.*without.*scale_inv"):
        Checkpoint.open(no_scale).canonical()
    no_block, _ = _fp8_checkpoint(tiny_model, tmp_path / "b", block=None)
    with pytest.raises(QuantkitError, match="weight_block_size"):
        Checkpoint.open(no_block).canonical()


def test_unsupported_dtype_is_refused(tiny_model: Path, tmp_path: Path) -> None:
    d = tmp_path / "int"
    d.mkdir()
    shutil.copy(tiny_model / "config.json", d)
    save_file({"model.language_model.norm.weight": torch.zeros(64, dtype=torch.int32)}, str(d / "model.safetensors"))
    with pytest.raises(QuantkitError, match="dtype int32"):
        Checkpoint.open(d).canonical()
    cfg = load_config(d / "config.json")
    cfg["quantization_config"] = {"quant_method": "gptq"}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(QuantkitError, match="already quantized"):
        Checkpoint.open(d).spec()


def test_check_finite() -> None:
    check_finite("w", torch.ones(4))
    check_finite("codes", torch.tensor([1, 2], dtype=torch.int8))
    with pytest.raises(QuantkitError, match=r"^layer\.w: 2 NaN/Inf"):
        check_finite("layer.w", torch.tensor([1.0, float("nan"), float("inf")], dtype=torch.bfloat16))


# ---- bad input ----
class _Boom:
    """Unpickling this creates a marker file: proof that a loader ran pickle."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_pickle_weights_are_refused_never_unpickled(tiny_model: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    d = tmp_path / "pt"
    d.mkdir()
    shutil.copy(tiny_model / "config.json", d)
    marker = tmp_path / "unpickled"
    (d / "pytorch_model.bin").write_bytes(pickle.dumps(_Boom(str(marker))))
    with pytest.raises(QuantkitError, match="never unpickles.*safetensors"):
        Checkpoint.open(d)
    (d / "config.json").unlink()
    with pytest.raises(QuantkitError, match="never unpickles"):
        spec_from_path(str(d))
    code, out, err = run_cli(["inspect", str(d)], capsys, monkeypatch)
    assert code == 2 and "never unpickles" in err and "Traceback" not in err + out
    assert not marker.exists()


def test_folder_without_safetensors(tmp_path: Path, capsys, monkeypatch) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(QuantkitError, match=f"no safetensors in {empty}"):
        Checkpoint.open(empty)
    with pytest.raises(QuantkitError, match="no safetensors in"):
        spec_from_path(str(empty))
    code, _, err = run_cli(["inspect", str(empty)], capsys, monkeypatch)
    assert code == 2 and "no safetensors in" in err and len(err.strip().splitlines()) == 1
    with pytest.raises(QuantkitError, match="no such file"):
        Checkpoint.open(tmp_path / "missing")


def _rewrite_index(folder: Path, fn) -> None:
    idx = folder / "model.safetensors.index.json"
    data = json.loads(idx.read_text())
    fn(data["weight_map"])
    idx.write_text(json.dumps(data))


def test_index_naming_files_outside_the_folder_is_refused(tiny_model: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside.safetensors"
    shutil.copy(tiny_model / "model-00001-of-00004.safetensors", outside)
    cases = {
        "absolute": lambda wm: wm.update(dict.fromkeys(wm, str(outside))),
        "dotdot": lambda wm: wm.update(dict.fromkeys(wm, "../outside.safetensors")),
    }
    for label, fn in cases.items():
        d = copy_ckpt(tiny_model, tmp_path / label)
        _rewrite_index(d, fn)
        with pytest.raises(QuantkitError, match="refuses shard"):
            Checkpoint.open(d)
    d = copy_ckpt(tiny_model, tmp_path / "symlink")
    first = d / "model-00001-of-00004.safetensors"
    first.unlink()
    os.symlink(outside, first)
    with pytest.raises(QuantkitError, match="links outside"):
        Checkpoint.open(d)
    # a symlink that stays inside the folder is fine
    d2 = copy_ckpt(tiny_model, tmp_path / "inside")
    (d2 / "blob").mkdir()
    os.replace(d2 / "model-00002-of-00004.safetensors", d2 / "blob" / "x")
    os.symlink(d2 / "blob" / "x", d2 / "model-00002-of-00004.safetensors")
    assert Checkpoint.open(d2).load(GU).shape == (8, 64, 64)


def test_missing_shard_and_index_mismatch(tiny_model: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    d = copy_ckpt(tiny_model, tmp_path / "missing")
    (d / "model-00003-of-00004.safetensors").unlink()
    with pytest.raises(QuantkitError, match="model-00003-of-00004.safetensors, which is missing"):
        Checkpoint.open(d)
    code, _, err = run_cli(["inspect", str(d)], capsys, monkeypatch)
    assert code == 2 and "which is missing" in err
    d = copy_ckpt(tiny_model, tmp_path / "mismatch")
    _rewrite_index(d, lambda wm: wm.update({GU: "model-00001-of-00004.safetensors"} if wm[GU] != (
        "model-00001-of-00004.safetensors") else {GU: "model-00002-of-00004.safetensors"}))
    with pytest.raises(QuantkitError, match="does not hold it"):
        Checkpoint.open(d)


def test_truncated_shard_is_named(tiny_model: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    d = copy_ckpt(tiny_model, tmp_path / "trunc")
    shard = d / "model-00002-of-00004.safetensors"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(QuantkitError, match=r"model-00002-of-00004.safetensors: truncated shard"):
        Checkpoint.open(d)
    code, _, err = run_cli(["quantize", str(d), "--bits", "8", "--out", str(tmp_path / "q")], capsys, monkeypatch)
    assert code == 2 and "truncated shard" in err and "Traceback" not in err
    with open(shard, "r+b") as f:
        f.truncate(4)
    with pytest.raises(QuantkitError, match="truncated safetensors file"):
        Checkpoint.open(d)


def test_corrupt_headers_are_named(tiny_model: Path, tmp_path: Path) -> None:
    src = tiny_model / "model-00001-of-00004.safetensors"
    raw = src.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    bad = {
        "length": struct.pack("<Q", 1 << 40) + raw[8:],
        "json": raw[:8] + b"{" + b" " * (n - 1) + raw[8 + n:],
        "notobject": struct.pack("<Q", 2) + b"[]" + raw[8 + n:],
    }
    key = next(k for k in header if k != "__metadata__")
    h2 = dict(header)
    h2[key] = {**header[key], "shape": [3, 3, 3, 3, 3]}
    body = json.dumps(h2).encode()
    bad["offsets"] = struct.pack("<Q", len(body)) + body + raw[8 + n:]
    h3 = dict(header)
    h3[key] = {**header[key], "dtype": "F4"}
    body = json.dumps(h3).encode()
    bad["dtype"] = struct.pack("<Q", len(body)) + body + raw[8 + n:]
    msgs = {"length": "header length", "json": "not valid JSON", "notobject": "not a JSON object",
            "offsets": "do not match shape", "dtype": "dtype F4"}
    for label, data in bad.items():
        d = copy_ckpt(tiny_model, tmp_path / label)
        (d / src.name).write_bytes(data)
        with pytest.raises(QuantkitError, match=msgs[label]) as ei:
            Checkpoint.open(d)
        assert src.name in str(ei.value)


# ---- model ids from the local HF cache ----
def _fake_hf_cache(root: Path, tiny_model: Path, repo: str = "acme/tiny-qwen") -> Path:
    """The layout huggingface_hub writes: models--org--name/{blobs,refs/main,snapshots/<rev>/ -> blobs}."""
    rev = "0123456789abcdef0123456789abcdef01234567"
    base = root / ("models--" + repo.replace("/", "--"))
    (base / "blobs").mkdir(parents=True)
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text(rev)
    snap = base / "snapshots" / rev
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(tiny_model.iterdir())):
        blob = base / "blobs" / f"{i:040x}"
        shutil.copy(f, blob)
        os.symlink(os.path.relpath(blob, snap), snap / f.name)
    return snap


def test_hf_id_resolves_from_the_local_cache_offline(tiny_model: Path, tmp_path: Path, monkeypatch,
                                                    capsys) -> None:
    snap = _fake_hf_cache(tmp_path / "hub", tiny_model)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model("acme/tiny-qwen").resolve() == snap.resolve()
    ck = Checkpoint.open(resolve_model("acme/tiny-qwen"))  # shards link into ../../blobs: allowed
    assert torch.equal(ck.load(GU), Checkpoint.open(tiny_model).load(GU))
    assert spec_from_path("acme/tiny-qwen").exact
    code, out, err = run_cli(["inspect", "acme/tiny-qwen"], capsys, monkeypatch)
    assert code == 0, err
    with pytest.raises(QuantkitError, match="not in the local HF cache; download it with `hf download acme/other`"):
        resolve_model("acme/other")
    code, _, err = run_cli(["inspect", "acme/other"], capsys, monkeypatch)
    assert code == 2 and "not in the local HF cache" in err
    with pytest.raises(QuantkitError, match="no such file or folder"):
        resolve_model("./not/here/at/all")


def test_hf_snapshot_links_outside_blobs_are_refused(tiny_model: Path, tmp_path: Path, monkeypatch) -> None:
    snap = _fake_hf_cache(tmp_path / "hub", tiny_model)
    elsewhere = tmp_path / "elsewhere.safetensors"
    shutil.copy(tiny_model / "model-00001-of-00004.safetensors", elsewhere)
    link = snap / "model-00001-of-00004.safetensors"
    link.unlink()
    os.symlink(elsewhere, link)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(QuantkitError, match="links outside"):
        Checkpoint.open(resolve_model("acme/tiny-qwen"))


@pytest.mark.parametrize("dtype,bad", [(d, b) for d in (torch.float32, torch.bfloat16, torch.float16)
                                       for b in (float("nan"), float("inf"), float("-inf"))]
                         + [(torch.float8_e4m3fn, float("nan"))])  # e4m3fn has no infinities
def test_check_finite_names_the_tensor_and_counts(dtype, bad):
    t = torch.randn(4, 64).to(dtype)
    check_finite("ok", t)
    check_finite("empty", torch.empty(0, dtype=dtype))
    t[1, 7] = t[3, 0] = bad
    with pytest.raises(QuantkitError, match=r"^w\.x: 2 NaN/Inf values"):
        check_finite("w.x", t)
