"""Quantized folders generated in the stored format (quantkit.testing.generated; `tiny-model --quantized`):
the same folder `quantkit quantize` writes (config, index, shard headers byte for byte), loadable and decodable,
verified, resumable after an interruption, refused with one line when disk or RAM is short. Small shapes only:
the full-size run is `python -m benchmarks.full_size` (docs/benchmarks.md)."""

from __future__ import annotations

import json
import struct
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from quantkit.checkpoint.reader import Checkpoint
from quantkit.checkpoint.spec import spec_from_config
from quantkit.errors import QuantkitError
from quantkit.quantize.manifest import Manifest
from quantkit.quantize.run import Interrupted, QuantizeOptions, run_quantize
from quantkit.quantize.verify import verify_folder
from quantkit.recipe import build_recipe, get_recipe
from quantkit.testing.tiny import FULL_SIZE, TinyOptions, full_config, make_tiny_model, text_config

from helpers.cli import TINY_KW, interrupt_after, one_line_error, run_cli

SMALL = {**TINY_KW, "hidden": 128, "intermediate": 64}  # int4 g128 applies (hidden 128), so both formats run


def _header(path: Path) -> bytes:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return f.read(n)


@pytest.mark.parametrize("scheme,mtp", [("quality", True), ("int4-g32", False)])
def test_generated_folder_is_what_quantize_writes(tmp_path, scheme, mtp):
    recipe = build_recipe(group_size=32) if scheme == "int4-g32" else get_recipe(scheme)
    src = make_tiny_model(tmp_path / "bf16", **SMALL, mtp=mtp)
    q = tmp_path / "quantized"
    run_quantize(Checkpoint.open(src), q, QuantizeOptions(recipe, max_shard_size=400_000))
    g = make_tiny_model(tmp_path / "generated", **SMALL, mtp=mtp, quantized=recipe, max_shard_size=400_000)
    assert json.loads((g / "config.json").read_text()) == json.loads((q / "config.json").read_text())
    assert (g / "model.safetensors.index.json").read_text() == (q / "model.safetensors.index.json").read_text()
    shards = sorted(p.name for p in q.glob("*.safetensors"))
    assert len(shards) > 1 and shards == sorted(p.name for p in g.glob("*.safetensors"))
    for sn in shards:
        assert _header(g / sn) == _header(q / sn), sn
        assert (g / sn).stat().st_size == (q / sn).stat().st_size
    res = verify_folder(g)
    assert res.ok, res.problems
    assert Manifest.read(g).source["generated"].startswith("quantkit tiny-model")


def test_generated_folder_loads_decodes_and_is_seeded(tmp_path):
    from quantkit.runtime import SamplingParams, load_model

    a = make_tiny_model(tmp_path / "a", **SMALL, quantized=get_recipe("quality"))
    b = make_tiny_model(tmp_path / "b", **SMALL, quantized=get_recipe("quality"))
    c = make_tiny_model(tmp_path / "c", **{**SMALL, "seed": 1}, quantized=get_recipe("quality"))
    ma, mb, mc = (Manifest.read(p).shards for p in (a, b, c))
    assert ma == mb and ma != mc
    rt = load_model(a)
    logits = rt.logits(torch.tensor([[1, 2, 3, 4, 5, 6]]))
    assert torch.isfinite(logits).all() and float(logits.std()) > 0
    resp = None
    for ev in rt.generate_ids([1, 2, 3, 4], sampling=SamplingParams(temperature=0.0, max_new_tokens=6),
                              thinking=False, stop_ids=set()):
        resp = ev.response or resp
    assert resp is not None and len(resp.token_ids) == 6
    # the stored codes are what the loader dequantizes: a kept tensor matches the generator's draw exactly
    from quantkit.testing.generated import init_tensor

    cfg = full_config(text_config(TinyOptions(**SMALL)))
    norm = "model.language_model.norm.weight"
    want = init_tensor(norm, (SMALL["hidden"],), 0, torch.bfloat16)
    assert torch.equal(rt.model.final, 1.0 + want.float())  # the model keeps the norm's (1 + w) in fp32
    assert spec_from_config(cfg).config.num_experts == SMALL["experts"]


def test_interrupted_generation_resumes_to_the_same_bytes(tmp_path, monkeypatch):
    import quantkit.testing.generated as gen

    whole = make_tiny_model(tmp_path / "whole", **SMALL, quantized=get_recipe("quality"), max_shard_size=300_000)
    orig = interrupt_after(monkeypatch, gen, "_write_tensor", 40)
    out = tmp_path / "cut"
    with pytest.raises(Interrupted, match="--resume"):
        make_tiny_model(out, **SMALL, quantized=get_recipe("quality"), max_shard_size=300_000)
    monkeypatch.setattr(gen, "_write_tensor", orig)
    assert not (out / "quantkit-manifest.json").exists() and not list(out.glob(".*.tmp"))
    done = list(out.glob("*.safetensors"))
    assert done  # some shards finished before the interruption
    with pytest.raises(QuantkitError, match="no quantkit-manifest.json"):
        verify_folder(out)
    from quantkit.runtime import load_model

    with pytest.raises(QuantkitError):
        load_model(out)
    with pytest.raises(QuantkitError, match="--resume"):  # the same command without --resume: refused, untouched
        make_tiny_model(out, **SMALL, quantized=get_recipe("quality"), max_shard_size=300_000)
    with pytest.raises(QuantkitError, match="different"):  # another seed is another run
        make_tiny_model(out, **{**SMALL, "seed": 3}, quantized=get_recipe("quality"), max_shard_size=300_000,
                        resume=True)
    written = {p: p.stat().st_mtime_ns for p in done}
    make_tiny_model(out, **SMALL, quantized=get_recipe("quality"), max_shard_size=300_000, resume=True)
    assert all(p.stat().st_mtime_ns == t for p, t in written.items())  # finished shards reused, not rewritten
    assert Manifest.read(out).shards == Manifest.read(whole).shards
    assert verify_folder(out).ok


def test_full_size_is_the_published_shape():
    real = json.loads((Path(__file__).parents[2] / "profiles/models/Qwen-AgentWorld-35B-A3B/config.json").read_text())
    ours = full_config(text_config(TinyOptions(**FULL_SIZE)))
    a, b = spec_from_config(real), spec_from_config(ours)
    assert [(t.name, t.shape, t.dtype) for t in a.tensors] == [(t.name, t.shape, t.dtype) for t in b.tensors]
    assert a.config.num_experts == 256 and a.config.num_hidden_layers == 40


def test_cli_full_size_small_override_writes_a_verified_folder(tmp_path, capsys, monkeypatch):
    out = tmp_path / "fs"
    code, stdout, err = run_cli(["tiny-model", out, "--full-size", "--layers", "1", "--experts", "4", "--vocab",
                                 "1024", "--quantized", "quality"], capsys, monkeypatch)
    assert code == 0, err
    cfg = json.loads((out / "config.json").read_text())["text_config"]
    # the MTP layer is kept, as `quantize` keeps it by default
    assert (cfg["hidden_size"], cfg["num_experts"], cfg["vocab_size"], cfg["mtp_num_hidden_layers"]) == (2048, 4, 1024, 1)
    code, stdout, err = run_cli(["verify", out], capsys, monkeypatch)
    assert code == 0 and "OK" in stdout


Usage = namedtuple("Usage", "available")


@pytest.mark.parametrize("args,patch,needles", [
    (["--full-size"], "disk", ["not enough free disk", "71.", "GB free"]),
    (["--full-size", "--quantized", "quality"], "disk", ["not enough free disk", "needs 20.", "GB free"]),
    (["--full-size", "--quantized", "quality"], "ram", ["GB of RAM", "1.66", "0.10 GB is available"]),
    (["--quantized", "nonsense"], None, ["nonsense"]),
    (["--full-size", "--hidden", "128"], None, ["--full-size"]),
    (["--resume"], None, ["--resume"]),
])
def test_cli_bad_inputs_one_line(tmp_path, capsys, monkeypatch, args, patch, needles):
    import psutil

    import quantkit.outputs as outputs

    if patch == "disk":
        monkeypatch.setattr(outputs, "free_disk", lambda p: 5_000_000_000)
    if patch == "ram":  # with disk enough, whatever this machine has free
        monkeypatch.setattr(outputs, "free_disk", lambda p: 10**15)
        monkeypatch.setattr(psutil, "virtual_memory", lambda: Usage(100_000_000))
    out = tmp_path / "x"
    code, stdout, err = run_cli(["tiny-model", out, *args], capsys, monkeypatch)
    one_line_error(code, stdout, err, *needles)
    assert not out.exists() or not any(out.iterdir())


def test_plan_of_a_generated_folder_is_its_own_recipe_with_its_stored_bytes(tmp_path, capsys, monkeypatch):
    out = make_tiny_model(tmp_path / "q", **SMALL, quantized=get_recipe("quality"))
    code, stdout, err = run_cli(["plan", "--model", out, "--gpu", "none", "--ram", "24GB", "--json"], capsys, monkeypatch)
    assert code == 0, err
    d = json.loads(stdout)
    assert [s["scheme"] for s in d["schemes"]] == ["quality"] and d["schemes"][0]["fits"]
    comp = d["schemes"][0]["components_bytes"]
    weights = sum(v for k, v in comp.items() if k.startswith("weights."))  # scales are inside, broken out apart
    stored = json.loads((out / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
    assert weights == stored
    code, stdout, err = run_cli(["plan", "--model", out, "--gpu", "none", "--ram", "1GB"], capsys, monkeypatch)
    one_line_error(code, stdout, err, "quality does not fit", "--ram")


def test_loader_refuses_a_plan_that_does_not_fit_before_reading_a_weight(tmp_path, monkeypatch):
    import quantkit.runtime.loader as loader

    out = make_tiny_model(tmp_path / "q", **SMALL, quantized=get_recipe("quality"))
    monkeypatch.setattr(loader, "available_bytes", lambda dev: 1 << 30)

    def no_read(*a, **k):
        raise AssertionError("a weight was read before the plan was checked")

    monkeypatch.setattr(loader.QuantizedFolder, "open", no_read)
    with pytest.raises(QuantkitError, match="does not fit this machine") as e:
        loader.load_model(out)
    assert "\n" not in str(e.value)


def test_a_long_prefill_returns_its_temporaries_to_the_system(tmp_path, monkeypatch):
    import quantkit.runtime.batch as batch
    import quantkit.runtime.generate as generate
    from quantkit.runtime import SamplingParams, load_model

    rt = load_model(make_tiny_model(tmp_path / "q", **SMALL, quantized=get_recipe("quality")), context=1024)
    calls = []
    monkeypatch.setattr(batch, "release_free_heap", lambda: calls.append(1))
    sp = SamplingParams(temperature=0.0, max_new_tokens=2)
    for n, want in ((generate.TRIM_AFTER_PREFILL - 1, 0), (generate.TRIM_AFTER_PREFILL, 1)):
        calls.clear()
        list(rt.generate_ids([5] * n, sampling=sp, thinking=False, stop_ids=set()))
        assert len(calls) == want, n


@pytest.mark.parametrize("writer", ["quantize", "generate"])
def test_a_run_killed_after_its_small_files_resumes(tiny_model, tmp_path, monkeypatch, writer):
    """Killed between the tokenizer/index/config and the manifest: the journal already lists those files, so
    --resume is not refused as a folder holding files quantkit did not write, and ends byte-identical."""
    import quantkit.quantize.run as qz
    import quantkit.testing.generated as gen

    def run(out: Path, resume: bool = False) -> Path:
        if writer == "quantize":
            mode = "resume" if resume else "new"
            run_quantize(Checkpoint.open(tiny_model), out, QuantizeOptions(get_recipe("quality"), mode=mode))
            return out
        return make_tiny_model(out, **SMALL, quantized=get_recipe("quality"), resume=resume)

    ref = run(tmp_path / "ref")
    real_seal = qz.seal_folder

    def killed(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(qz if writer == "quantize" else gen, "seal_folder", killed)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        run(out)
    assert (out / "tokenizer.json").is_file() and not (out / "quantkit-manifest.json").exists()
    monkeypatch.setattr(qz if writer == "quantize" else gen, "seal_folder", real_seal)
    run(out, resume=True)
    assert Manifest.read(out).shards == Manifest.read(ref).shards and verify_folder(out).ok
