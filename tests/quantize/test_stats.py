"""`quantkit stats`: the statistics equal what they claim (computed directly), the all-expert MoE pass
keeps the model's output, runs resume per layer to identical bytes, and mismatched inputs are refused."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from quantkit.checkpoint.reader import Checkpoint
from quantkit.quantize.calib_data import load_tokens
from quantkit.quantize.stats import (
    LM,
    LayerSums,
    Stats,
    _build_layer,
    _moe_forward,
    _run_layer,
    _text_config,
    collect_stats,
)
from quantkit.runtime.engine import load_tokenizer

from helpers.cli import run_cli


def _inputs(tiny_model, n_chunks=3, t=32):
    ck = Checkpoint.open(tiny_model)
    cfg = _text_config(ck)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 700, (n_chunks, t), generator=g)
    hidden = F.embedding(ids, ck.load(f"{LM}embed_tokens.weight")).float()
    return ck, cfg, hidden


def test_hessians_equal_xtx_computed_directly_and_heldout_is_apart(tiny_model):
    ck, cfg, hidden = _inputs(tiny_model)
    layer = _build_layer(ck, cfg, 3)  # full attention
    seen: dict[str, list[torch.Tensor]] = {}
    for path in ("self_attn.q_proj", "self_attn.o_proj", "mlp.shared_expert.down_proj"):
        layer.get_submodule(path).register_forward_pre_hook(
            lambda m, a, p=path: seen.setdefault(p, []).append(a[0].reshape(-1, a[0].shape[-1]).clone()))
    acc = LayerSums()
    _run_layer(layer, 3, hidden, 2, cfg, acc)  # chunks 0, 1 calibrate; chunk 2 is held out
    for path, xs in seen.items():
        name = f"{LM}layers.3.{path}.weight"
        calib = torch.cat(xs[:-1]) if len(xs) > 1 else xs[0][: 2 * 32]
        held = xs[-1]
        assert calib.shape[0] == 64 and held.shape[0] == 32
        torch.testing.assert_close(acc.sums[f"{name}.hessian"], calib.T @ calib, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(acc.sums[f"{name}.heldout_hessian"], held.T @ held, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(acc.sums[f"{name}.in_sum2"], calib.square().sum(0))
        assert int(acc.sums[f"{name}.count"]) == 64


def test_all_expert_pass_keeps_the_routed_output_and_collects_per_expert_statistics(tiny_model):
    ck, cfg, hidden = _inputs(tiny_model, n_chunks=2)
    layer = _build_layer(ck, cfg, 0)
    x = layer.post_attention_layernorm(hidden)
    with torch.no_grad():
        acc = LayerSums()
        assert layer.mlp.experts.gate_up_proj.dtype == torch.bfloat16  # stacks stay as stored
        got = _moe_forward(layer.mlp, x, acc, f"{LM}layers.0.")
        layer.mlp.experts.float()  # what _moe_forward computes with, one expert at a time
        want = layer.mlp(x)  # transformers' own routed MoE block
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    flat = x.reshape(-1, x.shape[-1])
    gu, dn = f"{LM}layers.0.mlp.experts.gate_up_proj", f"{LM}layers.0.mlp.experts.down_proj"
    torch.testing.assert_close(acc.sums[f"{gu}.hessian"], flat.T @ flat, rtol=1e-5, atol=1e-4)
    _, _, chosen = layer.mlp.gate(flat)
    counts = acc.sums[f"{LM}layers.0.mlp.routing"]
    assert int(counts.sum()) == flat.shape[0] * cfg.num_experts_per_tok
    e = int(counts.argmax())
    routed = (chosen == e).any(-1)
    assert int(acc.sums[f"{gu}.count"][e]) == int(routed.sum())
    torch.testing.assert_close(acc.sums[f"{gu}.in_sum2"][e], flat[routed].square().sum(0), rtol=1e-5, atol=1e-5)
    g, u = F.linear(flat, layer.mlp.experts.gate_up_proj[e]).chunk(2, dim=-1)
    h = F.silu(g) * u  # every token, not only the routed ones
    torch.testing.assert_close(acc.sums[f"{dn}.hessian"][e], h.T @ h, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(acc.sums[f"{dn}.in_sum2"][e], h[routed].square().sum(0), rtol=1e-4, atol=1e-5)


def test_stats_file_holds_every_quantizable_linear_with_fingerprints(tiny_model, tiny_stats):
    s = Stats.open(tiny_stats)
    ck = Checkpoint.open(tiny_model)
    s.check_model(ck)
    assert int(s.meta["tokens"]) == 1792 and int(s.meta["heldout_tokens"]) == 256
    assert int(s.meta["chunk_size"]) == 128 and len(s.meta["data_fingerprint"]) == 64
    for t in ck.canonical():
        if t.role.value in ("routed_expert", "attention", "linear_attention", "shared_expert", "lm_head"):
            for kind in ("hessian", "heldout_hessian", "in_sum2", "count"):
                assert s.has(f"{t.name}.{kind}"), (t.name, kind)
    routing = s.routing()
    assert sorted(routing) == [0, 1, 2, 3]
    assert all(int(r.sum()) == 1792 * 2 for r in routing.values())
    assert all(int(r.sum()) == 256 * 2 for r in s.routing(heldout=True).values())


def test_an_interrupted_run_resumes_after_its_last_layer_to_identical_bytes(tiny_model, tiny_stats, tmp_path):
    tok = load_tokenizer(tiny_model)
    tokens = load_tokens(None, tok, chunk_size=128, max_tokens=2048)
    out = tmp_path / "s.stats"
    r = collect_stats(Checkpoint.open(tiny_model), tokens, out, stop_after=2)
    assert not out.exists() and (tmp_path / ".s.stats.partial" / "layer-0001.safetensors").is_file()
    r = collect_stats(Checkpoint.open(tiny_model), tokens, out)
    assert r.resumed_layers == 2 and not (tmp_path / ".s.stats.partial").exists()
    assert out.read_bytes() == tiny_stats.read_bytes()


def test_cli_default_corpus_then_refusals(tiny_model, tiny_model_mtp, tiny_stats, tmp_path, capsys, monkeypatch):
    out = tmp_path / "s"
    code, so, err = run_cli(["stats", tiny_model, "--out", out, "--calib-tokens", "1024", "--chunk-size", "128"],
                            capsys, monkeypatch)
    assert code == 0, err
    assert "quantkit-default" in so and "tokens" in so and Stats.open(out).tokens == 896
    code, so, err = run_cli(["stats", tiny_model, "--out", out], capsys, monkeypatch)
    assert code == 2 and "exists; pass --overwrite" in err
    # statistics of another model are refused by quantize, in one line
    code, so, err = run_cli(["quantize", tiny_model_mtp, "--method", "gptq", "--stats", tiny_stats, "--out",
                             tmp_path / "q"], capsys, monkeypatch)
    assert code == 2 and "another model" in err and "Traceback" not in err
    code, so, err = run_cli(["quantize", tiny_model, "--method", "gptq", "--out", tmp_path / "q"], capsys, monkeypatch)
    assert code == 2 and "needs --stats" in err
    bogus = tmp_path / "bogus.stats"
    bogus.write_bytes(b"not a stats file at all")
    code, so, err = run_cli(["quantize", tiny_model, "--method", "imatrix", "--stats", bogus, "--out",
                             tmp_path / "q"], capsys, monkeypatch)
    assert code == 2 and "not a quantkit statistics file" in err


def test_routing_coverage_ranks_pairs_by_calibration_counts(tiny_stats):
    from quantkit.quantize.stats import routing_coverage

    s = Stats.open(tiny_stats)
    half = routing_coverage(s, 0.5)
    allp = routing_coverage(s, 1.0)
    assert allp["in_sample"] == 1.0 and allp["held_out"] == 1.0
    c = torch.cat([v for v in s.routing().values()]).double()
    assert half["in_sample"] == float(c.sort(descending=True).values[:16].sum() / c.sum())
    assert 0.5 <= half["in_sample"] <= 1.0 and 0 < half["held_out"] <= 1.0


def test_transformers_layout_gives_the_same_statistics(tiny_model, tiny_model_transformers_layout, tiny_stats,
                                                       tmp_path):
    tokens = load_tokens(None, load_tokenizer(tiny_model), chunk_size=128, max_tokens=2048)
    out = tmp_path / "t.stats"
    collect_stats(Checkpoint.open(tiny_model_transformers_layout), tokens, out)
    a, b = Stats.open(tiny_stats), Stats.open(out)
    assert a.names == b.names
    for k in sorted(a.names):
        torch.testing.assert_close(a.get(k), b.get(k), rtol=1e-5, atol=1e-4)
