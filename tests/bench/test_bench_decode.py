"""The pure pieces of `quantkit bench decode` (quantkit/bench/decode.py): the bytes one decode step reads,
checked against the real tensors of a loaded model and of transformers' cache; the ratios, the target
verdicts and the report rendered from a fixed result; the plot. Nothing here times anything."""

from __future__ import annotations

import json

import pytest
import torch

from quantkit.bench import decode as bd

from helpers.runtime import quantized

pytestmark = pytest.mark.usefixtures("one_thread")


def _expected_step_bytes(named: list[tuple[str, int]], cfg, top_k: int) -> int:
    """From tensor names and sizes alone: everything once, except routed experts (top_k of E) and the
    embedding (one row)."""
    total = 0
    for name, nbytes in named:
        if ".mlp.experts." in name:
            total += nbytes * top_k // cfg.num_experts
        elif "embed_tokens" in name:
            total += nbytes // cfg.vocab_size
        else:
            total += nbytes
    return total


def test_step_bytes_of_transformers_model_match_its_tensors(tiny_model):
    from quantkit.testing.tiny import load_reference_model

    model = load_reference_model(tiny_model, torch.bfloat16)
    cfg = model.config
    named = [(n, p.numel() * p.element_size()) for n, p in model.named_parameters()]
    assert any(".mlp.experts." in n for n, _ in named)
    assert bd.step_bytes(model, cfg.num_experts_per_tok) == _expected_step_bytes(named, cfg, cfg.num_experts_per_tok)


def _held_vectors(m) -> int:
    """Bytes of the fp32 vectors quantkit's model holds where the checkpoint stores bf16 (norm scales as
    (1 + w), conv taps, A, dt bias): the only bytes its step count may differ by from the stored tensors."""
    from quantkit.runtime.model.qwen3_5_moe import Attention

    total = m.final.numel() * 4
    for L in m.layers:
        vs = [L.pre, L.post] + ([L.mixer.qk_scale] if isinstance(L.mixer, Attention) else
                                [L.mixer.conv_taps, L.mixer.neg_a, L.mixer.dt_bias, L.mixer.norm_w])
        total += sum(v.numel() * v.element_size() for v in vs)
    return total


def test_step_bytes_of_quantkit_model(tiny_model):
    from quantkit.runtime import load_model
    from quantkit.runtime.model.qwen3_5_moe import Model
    from quantkit.testing.tiny import load_reference_model

    ref = load_reference_model(tiny_model, torch.bfloat16)
    k = ref.config.num_experts_per_tok
    bf16 = load_model(tiny_model, recipe="bf16").model
    assert isinstance(bf16, Model)
    # the same bf16 weights: the same bytes per step, whichever runs them, but for the small vectors
    # quantkit's model holds in fp32
    assert bd.step_bytes(bf16, k) >= bd.step_bytes(ref, k)
    assert bd.step_bytes(bf16, k) - bd.step_bytes(ref, k) <= _held_vectors(bf16)

    rt = load_model(quantized(tiny_model, "int4"))
    m = rt.model
    cfg = m.cfg.text
    resident = sum(rt.report.bytes_by_device.values())
    experts = sum(L.moe.experts.nbytes for L in m.layers)
    assert bd.step_bytes(m, cfg.num_experts) - bd.step_bytes(m, 0) == experts  # top_k of E of each layer's
    emb_bytes = m.embed.nbytes if hasattr(m.embed, "nbytes") else m.embed.numel() * m.embed.element_size()
    # every weight the loader placed, minus the experts not routed to and all but one embedding row
    want = resident - experts + experts * k // cfg.num_experts - emb_bytes + emb_bytes // cfg.vocab_size
    assert abs(bd.step_bytes(m, k) - want) <= _held_vectors(m) + 2 * cfg.num_hidden_layers  # + integer division
    assert bd.step_bytes(m, k) < bd.step_bytes(ref, k) / 2  # int4 reads well under half of bf16


def test_cache_bytes_match_transformers_cache(tiny_model):
    from transformers import DynamicCache

    from quantkit.testing.tiny import load_reference_model

    model = load_reference_model(tiny_model, torch.bfloat16)
    cfg = model.config
    n = 7
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=torch.arange(1, n + 1)[None], cache=cache, use_cache=True)
    real = 0
    for layer, kind in zip(cache.layers, cfg.layer_types, strict=True):
        if kind == "linear_attention":
            for states in (layer.conv_states, layer.recurrent_states):
                real += 2 * sum(t.numel() * t.element_size() for t in states.values())  # read + written
        else:
            kv = layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
            real += kv * (n + 1) // n  # n positions read, one more written
    assert bd.cache_bytes_per_step(cfg, n) == real
    assert bd.cache_bytes_per_step(cfg, 2 * n) > bd.cache_bytes_per_step(cfg, n)


def test_cache_bytes_match_quantkit_cache(tiny_model):
    """quantkit's HybridCache holds the same: KV buffers of n + 1 positions (n read, one written), conv
    windows and recurrent states (each read and written)."""
    from quantkit.runtime import load_model

    m = load_model(tiny_model, recipe="bf16").model
    n = 7
    cache = m.new_cache(n + 1)
    with torch.inference_mode():
        m.forward(list(range(1, n + 1)), cache)
    states = sum(t.numel() * t.element_size() for t in [*cache.conv.values(), *cache.state.values()])
    assert cache.capacity == n + 1 and states > 0
    assert bd.cache_bytes_per_step(bd.text_config(m), n) == cache.nbytes() + states
    wbytes, cbytes = bd.decode_bytes(m, n, 2)
    assert wbytes == bd.step_bytes(m, m.cfg.text.num_experts_per_tok)
    assert cbytes == bd.cache_bytes_per_step(m.cfg.text, n + 1)


def _rows() -> dict:
    def row(dec, pre, planner=None, step=100e6):
        r = {"prefill_tok_s": pre, "decode_tok_s": dec, "peak_rss": 2.0e9, "peak_rss_rounds": [2.5e9, 2.0e9],
             "rss_after": 1.5e9, "step_bytes": step,
             "bound_tok_s": 20e9 / step, "routes": {"x": 1}, "decode_tok_s_rounds": [dec * 0.9, dec],
             "decode_steps": 16, "probe_gbs": 10.0}
        if planner is not None:
            r["planner_decode_tok_s"], r["planner_prefill_tok_s"] = planner, pre * 2
            r["generic_planner_decode_tok_s"] = planner * 3
        return r

    return {
        "transformers-bf16": row(10.0, 100.0, step=500e6),
        "int4": row(25.0, 150.0, planner=30.0, step=130e6),
        "int8": row(15.0, 120.0, planner=25.0, step=250e6),
        "nf4": {"error": "RuntimeError: boom"},
    }


def test_ratios_and_targets():
    rows = _rows()
    bd.add_ratios(rows)
    assert rows["int4"]["vs_transformers"] == pytest.approx(2.5)
    assert rows["transformers-bf16"]["vs_transformers"] == pytest.approx(1.0)
    assert rows["int4"]["planner_error"] == pytest.approx(0.2)
    assert rows["int8"]["planner_error"] == pytest.approx(25 / 15 - 1)
    assert rows["int4"]["planner_prefill_error"] == pytest.approx(1.0)
    assert rows["int4"]["generic_planner_error"] == pytest.approx(90 / 25 - 1)
    assert "vs_transformers" not in rows["nf4"]
    # int4: 25 tok/s x 130 MB = 3.25 GB/s of a 20 GB/s best probe, and of the 10 GB/s read after its decode
    assert rows["int4"]["of_bound"] == pytest.approx(25 / (20e9 / 130e6))
    assert rows["int4"]["of_own_probe"] == pytest.approx(25 * 130e6 / 10e9)
    t = bd.targets(rows)
    assert t["int4_of_bound"] == pytest.approx(0.1625) and t["bound_met"] is False
    fast = _rows()
    fast["int4"]["decode_tok_s"] = 100.0  # 13 GB/s: 65% of the 20 GB/s bound
    bd.add_ratios(fast)
    assert bd.targets(fast)["bound_met"] is True and bd.targets({})["bound_met"] is None
    assert t["speedup_met"] is True and t["int4_vs_transformers_bf16"] == pytest.approx(2.5)
    assert t["planner_within_25pct"] == {"int4": True, "int8": False}
    assert t["planner_met"] is False
    slow = _rows()
    slow["int4"]["decode_tok_s"] = 19.0  # 1.9x: below the 2x target
    bd.add_ratios(slow)
    assert bd.targets(slow)["speedup_met"] is False
    assert bd.targets({})["speedup_met"] is None and bd.targets({})["planner_met"] is False


def _result(rows: dict) -> dict:
    bd.add_ratios(rows)
    return {
        "command": "quantkit bench decode --layers 4", "seconds": 200.0, "bench_seconds": 150.0,
        "machine": {"cpu": "Test CPU", "cores": 2, "torch": "2.x", "threads": 2, "read_bandwidth_gbs": 20.0,
                    "loadavg_before": [1.0, 1.0, 1.0], "loadavg_after": [2.0, 1.0, 1.0]},
        "checkpoint": {"layers": 4, "experts": 64, "top_k": 8, "hidden": 2048, "moe_intermediate": 512,
                       "vocab": 832, "bf16_bytes": 1.9e9},
        "prompt_tokens": 128, "decode_steps": 16, "reps": 1, "rounds": 2,
        "targets": bd.targets(rows), "rows": rows,
    }


def _table_rows(md: str) -> dict[str, list[str]]:
    """Markdown table rows keyed by their first cell."""
    out = {}
    for line in md.splitlines():
        if line.startswith("| ") and not line.startswith("|--"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            out.setdefault(cells[0], cells[1:])
    return out


def test_render_md_shows_every_row_of_the_result():
    """The report is a view of the structured result: every config's figures, a failure as such, the plot."""
    d = _result(_rows())
    md = bd.render_md(d)
    table = _table_rows(md)
    for name, r in d["rows"].items():
        assert name in table, name
        if "error" in r:
            assert r["error"] in " ".join(table[name])
            continue
        cells = table[name]
        assert f"{r['prefill_tok_s']:.1f}" in cells and f"{r['decode_tok_s']:.2f}" in cells, (name, cells)
        if "planner_decode_tok_s" in r:
            assert f"{r['planner_decode_tok_s']:.1f}" in cells and f"{r['planner_error']:+.0%}" in cells
        assert cells[2] == f"{r['vs_transformers']:.1f}x"
        assert cells[8:10] == [f"{r['of_bound']:.0%}", f"{r['of_own_probe']:.0%}"], (name, cells)
    assert "- int4 decode at least 60% of the read-bandwidth bound: **MISSED**, 16% of the bound at the run's " \
           "best probe (20.0 GB/s); 32% of the 10.0 GB/s read right after its best round's decode." in md
    assert "- int4 decode at least 2x transformers bf16: **met**, 2.50x (25.00 vs 10.00 tok/s)." in md
    assert "+conv" not in md and "linear_attn" not in md and "lean" not in md
    assert d["command"] in md and "(bench-decode.png)" in md
    assert "## Notes on this run" not in md
    d["notes"] = ["one", "two"]
    assert bd.render_md(d).endswith("## Notes on this run\n\n- one\n- two\n")


def test_render_md_shows_the_calibration_the_estimate_came_from():
    from quantkit.planner.host_costs import RuntimeProfile

    p = RuntimeProfile(host={"cpu": "Test CPU"}, dims={}, layer_ops_s={"linear_attention": 1e-3, "full_attention": 7e-4},
                       matmul_s={"int4-g128": {"1024x2048": 67e-6, "2048x512": 37e-6}, "bf16": {"1x2048": 4e-6}},
                       shell_s=4e-4, argmax_s={"832": 6e-6}, seconds=12.0, details={"working_set_bytes": 256 << 20},
                       moe_s={"int4-g128": {"1024x2048+2048x512": 4.2e-4}}, expert_loop_s=3e-4)
    d = _result(_rows())
    assert "bf16" not in _table_rows(bd.render_md(d))  # no calibration table without a calibration
    d["calibration"] = s = bd.profile_summary(p)
    assert s["layer_ops_ms"] == {"linear_attention": 1.0, "full_attention": 0.7}
    md = bd.render_md(d)
    table = _table_rows(md)
    assert table["1x2048"] == ["4", "-"] and table["2048x512"] == ["-", "37"]
    assert s["moe_us"] == {"int4-g128": {"1024x2048+2048x512": 420.0}} and s["expert_loop_ms"] == 0.3
    assert "int4-g128 1024x2048+2048x512 0.42 ms" in md and "unfused experts' loop 0.30 ms" in md


@pytest.mark.slow
def test_plot_writes_png(tmp_path):
    d = _result(_rows())
    bd.plot(d, tmp_path / "p.png")
    data = (tmp_path / "p.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_timed_decode_runs_quantkit_model_as_generation_does(tiny_model):
    """quantkit configurations time their own model's forward over its HybridCache, one token per step on
    the route chosen at load: the greedy tokens are the same on every route, and the transformers
    reference's (its own forward over a DynamicCache)."""
    from quantkit.runtime import load_model
    from quantkit.testing.tiny import load_reference_model

    m = load_model(tiny_model, recipe="bf16").model
    prompt = list(range(5, 25))
    t_pre, steps, toks = bd.timed(m, prompt, 6)
    assert t_pre > 0 and len(steps) == 6 and len(toks) == 7 and all(s > 0 for s in steps)
    for route in ("torch", "fused", "stack"):
        m.set_route(route)  # one this machine cannot run falls back to the best one
        assert bd.timed(m, prompt, 6)[2] == toks, m.route.name
    _, ref_steps, ref_toks = bd.timed(load_reference_model(tiny_model, torch.bfloat16), prompt, 6)
    assert len(ref_steps) == 6 and ref_toks == toks


def test_layer_overhead_times_every_path_and_the_report_shows_them(tiny_model):
    cfg = json.loads((tiny_model / "config.json").read_text())
    ov = bd.layer_overhead(cfg, rounds=1)
    assert set(ov) == {"torch", "fused"}
    for path in ov.values():
        assert set(path) == {"full_attention", "linear_attention", "shell"} and all(v > 0 for v in path.values())
    d = _result(_rows())
    assert "Per-layer decode overhead" not in bd.render_md(d)
    d["layer_overhead_ms"] = ov
    md = bd.render_md(d)
    table = _table_rows(md)
    assert table["quantkit's model, torch route"] == [f"{ov['torch'][k]:.3f}" for k in
                                                      ("full_attention", "linear_attention", "shell")]
    assert table["quantkit's model, the kernel's fused ops per layer"][0] == f"{ov['fused']['full_attention']:.3f}"
    assert "transformers' forward" not in table and "lean" not in md


def test_run_one_reads_the_bandwidth_right_after_its_decode(tiny_model):
    r = bd.run_one("quantkit", tiny_model, 8, 4, 1)
    assert r["decode_tok_s"] > 0 and r["step_bytes"] > 0 and r["step_route"]
    assert r["probe_gbs"] > 0  # the share `of its probe` is taken against this read
    rows = {"int4": {**r, "bound_tok_s": 1e9}}
    bd.add_ratios(rows)
    assert rows["int4"]["of_own_probe"] == pytest.approx(r["decode_tok_s"] * r["step_bytes"] / (r["probe_gbs"] * 1e9))


def test_render_md_shows_the_spells_when_polled():
    from quantkit.bench import spells

    d = _result(_rows())
    polled = {"step_bytes": 130e6, "samples": [{"read_before_gbs": 10.0, "read_after_gbs": 10.0, "decode_tok_s": 50.0},
                                               {"read_before_gbs": 20.0, "read_after_gbs": 20.0, "decode_tok_s": 80.0}]}
    d["spells"] = {"config": "int4", "seconds": 60.0, **spells.summarize(polled)}
    md = bd.render_md(d)
    assert "spell by spell: slow 65% (10.0 GB/s), fast 52% (20.0 GB/s) (section below)." in md
    assert "## int4 decode in the machine's bandwidth spells" in md and "| fast | 1 | 20.0 | 80.0 | 52% |" in md
    d["spells"] = None
    assert "spells" not in bd.render_md(d)


def test_forced_avx2_row_is_judged_against_the_bound_too(monkeypatch):
    """`int4-avx2` (the int4 folder with the kernel forced to AVX2) gets its own bound verdict, and is in the
    default run only where AVX2 is a lower level than this CPU's."""
    rows = _rows()
    rows["int4-avx2"] = {**rows["int4"], "decode_tok_s": 100.0}  # 13 GB/s of a 20 GB/s bound: 65%
    bd.add_ratios(rows)
    t = bd.targets(rows)
    assert t["int4_avx2_of_bound"] == pytest.approx(0.65) and t["bound_avx2_met"] is True
    assert t["bound_met"] is False and bd.targets(_rows())["bound_avx2_met"] is None
    from quantkit.kernels import cpu as cpu_kernel

    for isa, has in (("avx512", True), ("avx2", False), ("generic", False), ("none", False)):
        monkeypatch.setattr(cpu_kernel, "isa", lambda isa=isa: isa)
        assert ("int4-avx2" in bd.default_configs()) is has, isa
        for avx2_table in ("avx2vnni", "avx2"):
            monkeypatch.setattr(cpu_kernel, "best_table", lambda level, t=avx2_table: t)
            assert ("int4-avx2-plain" in bd.default_configs()) is (has and avx2_table == "avx2vnni")
