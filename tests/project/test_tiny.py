"""`quantkit tiny-model`: real-architecture checkpoints that transformers loads, a working tokenizer and
chat template, decisive routing that survives weight perturbation, realistic shapes, the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from quantkit.checkpoint.reader import Checkpoint
from quantkit.checkpoint.spec import spec_from_config
from quantkit.errors import QuantkitError
from quantkit.testing.tiny import (
    SIDECAR,
    TinyOptions,
    _built_model,
    build_model,
    cast_weights,
    load_reference_model,
    make_tiny_model,
    perturbation_check,
    probe_ids,
    router_margins,
    text_config,
)
from quantkit.testing.tokenizer import N_TOKENS
from quantkit.threads import torch_threads

from helpers.cli import run_cli


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny matmuls: one thread is several times faster than two on a busy 2-core machine."""
    with torch_threads(1):
        yield


def test_published_layout_on_disk(tiny_model: Path) -> None:
    cfg = json.loads((tiny_model / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3_5MoeForConditionalGeneration"] and cfg["model_type"] == "qwen3_5_moe"
    tc = cfg["text_config"]
    assert tc["model_type"] == "qwen3_5_moe_text"
    assert tc["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert tc["rope_parameters"]["partial_rotary_factor"] == 0.25 and tc["attn_output_gate"]
    assert tc["vocab_size"] >= N_TOKENS and tc["mtp_num_hidden_layers"] == 0
    idx = json.loads((tiny_model / "model.safetensors.index.json").read_text())
    shards = sorted(set(idx["weight_map"].values()))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    names = list(idx["weight_map"])
    assert names == [t.name for t in spec_from_config(cfg).tensors]
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in names and "lm_head.weight" in names
    assert idx["metadata"]["total_size"] == sum(
        t.numel() * 2 for t in (Checkpoint.open(tiny_model).load(n) for n in names))


def test_norms_are_zero_centred_except_linear_attn_norm(tiny_model: Path) -> None:
    ck = Checkpoint.open(tiny_model)
    zc = ck.load("model.language_model.layers.0.input_layernorm.weight").float()
    qn = ck.load("model.language_model.layers.3.self_attn.q_norm.weight").float()
    la = ck.load("model.language_model.layers.0.linear_attn.norm.weight").float()
    for w in (zc, qn):
        assert w.abs().mean() < 0.15 and w.std() > 0.01  # small random values around 0: x * (1 + w)
    assert (la - 1).abs().mean() < 0.15 and la.std() > 0.01  # around 1: x * w


@pytest.mark.parametrize("fixture", ["tiny_model", "tiny_model_transformers_layout"])
def test_transformers_loads_it_and_logits_equal_the_saved_model(fixture: str, request) -> None:
    from transformers import AutoModelForCausalLM, Qwen3_5MoeForCausalLM

    path = request.getfixturevalue(fixture)
    tc = text_config(TinyOptions(layers=4, experts=8, top_k=2, hidden=64, intermediate=32))
    saved, _ = _built_model(tc, 0, True)  # the in-memory model make_tiny_model wrote (same process)
    saved = cast_weights(saved, torch.bfloat16)
    ids = probe_ids()[:, :40]
    with torch.no_grad():
        want = saved(ids).logits
        ref = load_reference_model(path, dtype=torch.bfloat16)
        assert isinstance(ref, Qwen3_5MoeForCausalLM)
        assert torch.equal(ref(ids).logits, want)
        auto = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, local_files_only=True)
        assert type(auto) is Qwen3_5MoeForCausalLM
        assert torch.allclose(auto(ids).logits, want.float(), atol=0.1, rtol=0.05)  # fp32 from bf16 weights


def test_not_decisive_plain_model_logits_match_fresh_build(tmp_path: Path) -> None:
    p = make_tiny_model(tmp_path / "plain", layers=2, experts=4, hidden=32, intermediate=16, seed=3)
    tc = json.loads((p / "config.json").read_text())["text_config"]
    fresh = cast_weights(build_model(tc, 3), torch.bfloat16)  # independent of the per-process memo
    ids = probe_ids()[:1, :24]
    with torch.no_grad():
        assert torch.equal(load_reference_model(p, torch.bfloat16)(ids).logits, fresh(ids).logits)
    assert tc["layer_types"] == ["linear_attention", "full_attention"]


def test_mtp_checkpoint_loads_in_transformers_ignoring_mtp(tiny_model_mtp: Path) -> None:
    ck = Checkpoint.open(tiny_model_mtp)
    assert any(n.startswith("mtp.layers.0.mlp.experts.") for n in ck.names())
    model = load_reference_model(tiny_model_mtp)
    with torch.no_grad():
        assert torch.isfinite(model(probe_ids()[:1, :16]).logits).all()


def test_tokenizer_and_chat_template(tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model), local_files_only=True)
    cfg = json.loads((tiny_model / "config.json").read_text())
    assert len(tok) <= cfg["text_config"]["vocab_size"]
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>",
                                                     "</think>", "<tool_call>", "</tool_response>")}
    assert len(set(ids.values())) == len(ids) and min(ids.values()) >= 700
    assert ids["<|im_start|>"] == ids["<|endoftext|>"] + 1 and ids["</think>"] == ids["<|endoftext|>"] + 25
    gen = json.loads((tiny_model / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [ids["<|endoftext|>"], ids["<|im_end|>"]]
    assert cfg["text_config"]["eos_token_id"] == ids["<|endoftext|>"] and tok.eos_token == "<|im_end|>"
    text = "Hello world: ls -la /tmp && echo 12345 <think>x</think>"
    enc = tok.encode(text)
    assert tok.decode(enc) == text and ids["<think>"] in enc and len(enc) < len(text)

    msgs = [{"role": "system", "content": "You are a world model."}, {"role": "user", "content": "ls"}]
    on = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert on == ("<|im_start|>system\nYou are a world model.<|im_end|>\n<|im_start|>user\nls<|im_end|>\n"
                  "<|im_start|>assistant\n<think>\n")
    off = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    hist = msgs + [{"role": "assistant", "content": "<think>\nhmm\n</think>\n\nfile.txt"},
                   {"role": "user", "content": "cat file.txt"}]
    two = tok.apply_chat_template(hist, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>assistant\nfile.txt<|im_end|>\n" in two and "hmm" not in two  # old thinking dropped

    tools = [{"type": "function", "function": {"name": "read_file", "description": "Read a file",
                                               "parameters": {"type": "object",
                                                              "properties": {"path": {"type": "string"}}}}}]
    calls = msgs + [
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": "read_file", "arguments": {"path": "/tmp/a"}}}]},
        {"role": "tool", "content": "hello"}, {"role": "tool", "content": "again"}]
    t = tok.apply_chat_template(calls, tools=tools, tokenize=False, add_generation_prompt=True)
    sys_turn = t.split("<|im_end|>")[0]
    assert sys_turn.startswith("<|im_start|>system\nYou are a world model.\n\n# Tools")
    assert "<tools>\n" + json.dumps(tools[0]) + "\n</tools>" in sys_turn
    assert ("<tool_call>\n<function=read_file>\n<parameter=path>\n/tmp/a\n</parameter>\n</function>\n"
            "</tool_call><|im_end|>") in t
    assert ("<|im_start|>user\n<tool_response>\nhello\n</tool_response>\n<tool_response>\nagain\n"
            "</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n") in t
    assert tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False)[-1] == tok.encode("\n")[-1]


def test_decisive_routing_margin_is_recorded_and_holds_independently(tiny_model: Path) -> None:
    info = json.loads((tiny_model / SIDECAR).read_text())
    d = info["decisive"]
    assert info["options"]["decisive"] and d["check_2pct"]["top1_agreement"] >= 0.995
    assert all(g > 0.3 for g in d["router"]["min_rel_gap_per_layer"])
    # Re-measure from the checkpoint as transformers loads it, not from the generator's own model.
    model = load_reference_model(tiny_model, dtype=torch.float32)
    logits = router_logits(model)
    k = model.config.num_experts_per_tok
    for lg in logits:
        assert ((lg > 0).sum(-1) == k).all() and (lg[lg <= 0] == 0).all()  # exactly k experts positive, rest 0
    m = router_margins(logits, k)
    assert min(m["min_rel_gap_per_layer"]) > 0.3 and m["positions"] == 320
    chk = perturbation_check(model, rel_noise=0.02, seed=5)  # a different noise draw than the generator's
    assert chk["routing_identical"] and chk["greedy_identical"] and chk["top1_agreement"] >= 0.99
    assert perturbation_check(model, rel_noise=0.10, seed=5, gen_tokens=0)["routing_identical"]


def router_logits(model) -> list[torch.Tensor]:
    """Each layer's router output (fp32) on the probe prompts, as the model computes it."""
    logits: list[torch.Tensor] = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda _m, _i, out: logits.append(out[0].float()))
             for layer in model.model.layers]
    with torch.no_grad():
        model(probe_ids())
    for h in hooks:
        h.remove()
    return logits


def test_a_plain_random_model_is_not_decisive(tmp_path: Path) -> None:
    """The measurement discriminates: without --decisive, router gaps are near zero somewhere."""
    p = make_tiny_model(tmp_path / "plain")
    model = load_reference_model(p)
    logits = router_logits(model)
    assert min(router_margins(logits, 2)["min_rel_gap_per_layer"]) < 0.05
    assert "decisive" not in json.loads((p / SIDECAR).read_text())


def test_realistic_shapes(tmp_path: Path) -> None:
    p = make_tiny_model(tmp_path / "real", realistic=True, layers=1, experts=2, top_k=2)
    ck = Checkpoint.open(p)
    tc = ck.config["text_config"]
    assert (tc["hidden_size"], tc["moe_intermediate_size"], tc["head_dim"], tc["linear_num_value_heads"]) == (
        2048, 512, 256, 32)
    assert ck.header("model.language_model.layers.0.mlp.experts.gate_up_proj") == ((2, 1024, 2048), "bfloat16")
    assert [t.name for t in ck.spec().tensors] == [t.name for t in spec_from_config(ck.config).tensors]
    w = ck.load("model.language_model.layers.0.self_attn.q_proj.weight").float()
    assert 0.015 < float(w.std()) < 0.025
    model = load_reference_model(p, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.isfinite(model(probe_ids()[:1, :8]).logits).all()


def test_options_are_validated(tmp_path: Path) -> None:
    with pytest.raises(QuantkitError, match="layout"):
        make_tiny_model(tmp_path / "a", layout="gguf")
    with pytest.raises(QuantkitError, match="no MTP"):
        make_tiny_model(tmp_path / "b", layout="transformers", mtp=True)
    with pytest.raises(QuantkitError, match="experts <= hidden/2"):
        make_tiny_model(tmp_path / "c", experts=64, decisive=True)
    with pytest.raises(QuantkitError, match="top-k"):
        make_tiny_model(tmp_path / "d", experts=2, top_k=3)
    assert not any(tmp_path.iterdir())  # nothing half-written


def test_cli_writes_refuses_existing_and_overwrites(tmp_path: Path, capsys, monkeypatch) -> None:
    out = tmp_path / "cli"
    code, o, err = run_cli(["tiny-model", str(out), "--layers", "2", "--experts", "4", "--hidden", "32",
                            "--layout", "transformers"], capsys, monkeypatch)
    assert code == 0, err
    assert "wrote" in o and Checkpoint.open(out).layout == "transformers"
    code, _, err = run_cli(["tiny-model", str(out)], capsys, monkeypatch)
    assert code == 2 and "exists; pass --overwrite" in err and len(err.strip().splitlines()) == 1
    code, o, err = run_cli(["tiny-model", str(out), "--overwrite", "--layers", "2", "--mtp-layer"], capsys, monkeypatch)
    assert code == 0, err
    ck = Checkpoint.open(out)
    assert ck.layout == "published" and any(n.startswith("mtp.") for n in ck.names())
    assert [p.name for p in tmp_path.iterdir()] == ["cli"]  # no temp or old folders left beside it
    code, _, err = run_cli(["tiny-model", str(tmp_path / "x"), "--layout", "nope"], capsys, monkeypatch)
    assert code == 2 and "--layout 'nope'" in err
