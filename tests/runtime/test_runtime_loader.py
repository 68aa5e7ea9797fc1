"""Loading: skeleton on meta filled from safetensors, placement from a plan or planned here, and every
bad input refused with one line (exit 2, no traceback) through the CLI."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from quantkit.errors import QuantkitError
from quantkit.runtime import Placement, load_model
from quantkit.runtime.kernels import Kernel
from quantkit.runtime.qexperts import QuantExperts

from helpers.cli import (
    one_line_error,
    run_cli,  # noqa: F401
)
from helpers.runtime import quantized

pytestmark = pytest.mark.usefixtures("one_thread")


def test_every_matrix_is_a_kernel_of_its_recipe_format(tiny_model):
    q = quantized(tiny_model, "quality")
    rt = load_model(q)
    m = rt.model
    layer0, layer3 = m.layers[0], m.layers[3]
    for k in (layer0.mixer.qkv, layer0.mixer.out, layer3.mixer.q, layer3.mixer.o, layer0.moe.shared_down, m.head):
        assert isinstance(k, Kernel) and k.format == "int8"
    assert all(isinstance(layer.moe.experts, QuantExperts) and layer.moe.experts.format == "int4"
               for layer in m.layers)
    from quantkit.kernels import cpu as cpu_kernel

    # quantkit's CPU kernel where it is built (tests/kernels/test_cpu_kernel.py), else torch's packed ops
    int4, int8 = (("quantkit qk int4", "quantkit qk int8") if cpu_kernel.available()
                  else ("_weight_int4pack_mm_for_cpu", "_weight_int8pack_mm"))
    assert any(int4 in r for r in rt.report.routes)
    assert any(int8 in r for r in rt.report.routes)
    # resident bytes: the packed weights plus the bf16 rest, less than the bf16 checkpoint
    src = sum(p.stat().st_size for p in Path(tiny_model).glob("*.safetensors"))
    assert 0 < rt.memory()["cpu"] < src


def test_bf16_checkpoint_loads_both_layouts_identically(tiny_model, tiny_model_transformers_layout):
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    a = load_model(tiny_model).logits(ids)
    b = load_model(tiny_model_transformers_layout).logits(ids)
    assert torch.equal(a, b)


def test_runtime_bf16_matches_transformers(tiny_model):
    from quantkit.testing.tiny import load_reference_model

    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]])
    ref = load_reference_model(tiny_model, torch.bfloat16)
    with torch.no_grad():
        want = ref(ids).logits.float()
    got = load_model(tiny_model).logits(ids)
    assert float((got - want).norm() / want.norm()) < 2e-2
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_expert_split_placement_gives_the_same_logits(tiny_model):
    q = quantized(tiny_model, "quality")
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3]])
    whole = load_model(q, placement=Placement.single(4, 8)).logits(ids)
    split = Placement(["cpu"] * 4, [[("cpu", [0, 2, 4, 6]), ("cpu", [1, 3, 5, 7])] for _ in range(4)])
    rt = load_model(q, placement=split)
    assert [len(layer.moe.experts.groups) for layer in rt.model.layers] == [2, 2, 2, 2]
    assert torch.equal(rt.logits(ids), whole)


def _plan(tiny_model: Path, tmp_path: Path, capsys, monkeypatch, *extra: str) -> Path:
    out = tmp_path / "plan.json"
    code, _o, err = run_cli(["plan", "--model", tiny_model, "--scheme", "quality", "--out", out, *extra],
                            capsys, monkeypatch)
    assert code == 0, err
    return out


def test_plan_file_from_quantkit_plan(tiny_model, tmp_path, capsys, monkeypatch):
    plan = _plan(tiny_model, tmp_path, capsys, monkeypatch)
    rt = load_model(quantized(tiny_model, "quality"), plan=plan)
    assert rt.placement.source.startswith("plan ")
    assert rt.context == json.loads(plan.read_text())["settings"]["context"]


@pytest.fixture
def q_copy(tiny_model, tmp_path) -> Path:
    dst = tmp_path / "q"
    shutil.copytree(quantized(tiny_model, "quality"), dst)
    return dst


def test_bad_folder_fails_verification(q_copy, capsys, monkeypatch):
    shard = sorted(q_copy.glob("model-*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF  # same size, different bytes: only the hash sees it
    shard.write_bytes(bytes(data))
    one_line_error(*run_cli(["generate", q_copy, "--prompt", "hi"], capsys, monkeypatch), "fails verification")
    shard.write_bytes(bytes(data[:-100]))
    one_line_error(*run_cli(["generate", q_copy, "--prompt", "hi", "--verify", "quick"], capsys, monkeypatch),
                    "fails verification")


def test_unknown_quantization_version(q_copy, capsys, monkeypatch):
    cfg = json.loads((q_copy / "config.json").read_text())
    cfg["quantization_config"]["version"] = 99
    (q_copy / "config.json").write_text(json.dumps(cfg))
    one_line_error(*run_cli(["generate", q_copy, "--prompt", "hi", "--verify", "off"], capsys, monkeypatch),
                    "version 99", "unknown")


def _refuse_loading(monkeypatch):
    import quantkit.runtime.loader as loader

    def boom(*_a, **_k):
        raise AssertionError("loading started")

    monkeypatch.setattr(loader, "build_model", boom)


def test_plan_that_does_not_fit_is_refused_before_loading(tiny_model, tmp_path, capsys, monkeypatch):
    plan = _plan(tiny_model, tmp_path, capsys, monkeypatch)
    d = json.loads(plan.read_text())
    cpu = next(x for x in d["devices"] if x["id"] == "cpu")
    cpu["used"]["experts"] = 50 * 10**12  # 50 TB of experts in RAM
    plan.write_text(json.dumps(d))
    _refuse_loading(monkeypatch)
    one_line_error(*run_cli(["generate", quantized(tiny_model, "quality"), "--prompt", "hi", "--plan", plan],
                             capsys, monkeypatch), "only", "free", "this recipe fits")
    d["layers"][0]["device"] = "cuda:0"
    d["non_expert"]["lm_head"] = "cuda:0"
    plan.write_text(json.dumps(d))
    one_line_error(*run_cli(["generate", quantized(tiny_model, "quality"), "--prompt", "hi", "--plan", plan],
                             capsys, monkeypatch), "cuda:0")


def test_plan_for_another_model(tiny_model, tmp_path, capsys, monkeypatch):
    other = tmp_path / "other.json"
    code, _o, err = run_cli(["plan", "--scheme", "quality", "--ram", "512GB", "--out", other], capsys, monkeypatch)
    assert code == 0, err  # a plan for the default model (the 35B), not the tiny one
    _refuse_loading(monkeypatch)
    one_line_error(*run_cli(["generate", quantized(tiny_model, "quality"), "--prompt", "hi", "--plan", other],
                             capsys, monkeypatch), "was made for model", "quantkit plan")


def test_prompt_longer_than_context_and_empty_prompt(tiny_model, capsys, monkeypatch):
    q = quantized(tiny_model, "quality")
    long = "the agent world model predicts the next observation " * 20
    one_line_error(*run_cli(["generate", q, "--prompt", long, "--context", "64"], capsys, monkeypatch),
                    "the context holds 64")
    _refuse_loading(monkeypatch)
    one_line_error(*run_cli(["generate", q, "--prompt", "   "], capsys, monkeypatch), "empty prompt")


def test_recipe_on_a_quantized_folder_and_unknown_recipe(tiny_model):
    with pytest.raises(QuantkitError, match="already quantized"):
        load_model(quantized(tiny_model, "quality"), recipe="int4")
    with pytest.raises(QuantkitError, match="unknown scheme"):
        load_model(tiny_model, recipe="int3")


def test_quantized_embedding_and_lm_head(tiny_model):
    """Uniform recipes quantize the embedding too: rows are gathered then dequantized."""
    from quantkit.runtime.loader import QuantEmbedding

    for recipe in ("int4", "nf4", "mxfp4", "int8"):
        rt = load_model(quantized(tiny_model, recipe))
        assert isinstance(rt.model.embed, QuantEmbedding)
        ids = torch.tensor([[1, 5, 700]])
        e = rt.model.embed(ids)
        assert e.shape == (1, 3, 64) and torch.isfinite(e).all()


def test_loaded_model_keeps_no_shard_mapped_and_reads_match_safetensors(tmp_path, monkeypatch):
    """The loader reads shards with plain reads (Checkpoint.read): once loaded, no page of a shard is mapped into
    the process (a memory map left behind counted the folder a second time in RSS), and slabs equal
    safetensors' own reads. Experts are prepared a few at a time (SLAB_EXPERTS) with the same logits."""
    import quantkit.runtime.loader as loader
    from quantkit.checkpoint.reader import Checkpoint
    from quantkit.recipe import get_recipe
    from quantkit.testing.tiny import make_tiny_model

    out = make_tiny_model(tmp_path / "q", layers=4, experts=8, top_k=2, hidden=128, intermediate=64,
                          quantized=get_recipe("quality"))
    ck = Checkpoint.open(out)
    for n in ck.names():
        assert torch.equal(ck.read(n), ck.get(n)), n
        if "experts" in n:
            assert torch.equal(ck.read(n, slice(3, 7), drop_cache=True), ck.get(n, slice(3, 7))), n
    ck.close()
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    whole = load_model(out).logits(ids)
    shards = [str(p.resolve()) for p in out.glob("*.safetensors")]
    maps = Path("/proc/self/maps")
    if maps.exists():
        assert not any(s in maps.read_text() for s in shards)
    monkeypatch.setattr(loader, "SLAB_EXPERTS", 3)  # runs of 3, 3, 2 experts
    dropped: list[list[Path]] = []
    monkeypatch.setattr(loader, "total_ram", lambda: 4)  # the folder is then "over a quarter of RAM"
    real_drop = loader.drop_page_cache
    monkeypatch.setattr(loader, "drop_page_cache", lambda files: (dropped.append(files), real_drop(files)))
    assert torch.equal(load_model(out).logits(ids), whole)
    assert dropped == [sorted(out.glob("*.safetensors"))]
