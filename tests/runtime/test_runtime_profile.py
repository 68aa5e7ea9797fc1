"""The planner's estimate for quantkit's own runtime (quantkit/planner/host_costs.py, speed.estimate_runtime):
which matrices a decode step runs through kernels, how a calibrated profile composes into per-layer
costs, and the one-line errors for profiles that do not apply. Pure arithmetic on hand-made profiles;
the measuring side is tests/quantize/test_calibrate.py."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from quantkit.checkpoint.spec import default_spec
from quantkit.errors import QuantkitError
from quantkit.formats import QuantSpec
from quantkit.planner.budget import RunSettings, compute_budget
from quantkit.planner.host_costs import (
    PROFILE_VERSION,
    RuntimeCosts,
    RuntimeProfile,
    default_profile_path,
    expert_pairs,
    fastest,
    host_id,
    kernel_matrices,
    load_profile,
    mismatch,
    model_dims,
    moe_key,
    moe_shape_key,
    needed,
    needed_moe,
    profile_for_plan,
    runtime_costs,
    shape_key,
    spec_key,
)
from quantkit.planner.speed import DeviceRates, Layout, estimate_runtime
from quantkit.recipe import get_recipe


def _fake_time(key: str, shape: tuple[int, int]) -> float:
    """A made-up kernel time that differs per format and shape, so a wrong lookup shows."""
    per = {"bf16": 4.0, "int8": 2.0, "int4-g128": 1.0, "int4-g32": 1.5}.get(key, 3.0)
    return 1e-6 + per * shape[0] * shape[1] * 1e-12


def _profile(spec, recipes, host=None, fused=()) -> RuntimeProfile:
    """A made-up profile; the expert formats whose moe key is in `fused` get a fused-call time (5 ms)."""
    mm = {k: {shape_key(s): _fake_time(k, s) for s in shapes} for k, (_q, shapes) in needed(spec, recipes).items()}
    moe = {k: {moe_shape_key(p[1], p[3]): 5e-3 for p in pairs} for k, pairs in needed_moe(spec, recipes).items()
           if k in fused}
    return RuntimeProfile(host=host or host_id(), dims=model_dims(spec.config), matmul_s=mm,
                          layer_ops_s={"linear_attention": 1e-3, "full_attention": 2e-3}, shell_s=5e-4,
                          argmax_s={str(spec.config.vocab_size): 1e-4}, moe_s=moe, expert_loop_s=4e-4)


def test_spec_keys_tell_apart_what_changes_kernel_speed():
    assert spec_key(None) == "bf16"
    assert spec_key(QuantSpec("int4", 128)) == "int4-g128"
    assert spec_key(QuantSpec("int4", 32, symmetric=False)) == "int4-g32-asym"
    assert spec_key(QuantSpec("int4", 128, clip_search=False)) == "int4-g128"  # a quantizer choice, same kernel
    assert spec_key(QuantSpec("int8")) == "int8"


def test_kernel_matrices_of_one_layer_are_the_runtimes_linears():
    spec = default_spec()
    c = spec.config
    mats = {t.name.split("layers.0.")[-1]: (q, s) for t, q, s in kernel_matrices(spec, get_recipe("int4"))
            if t.layer == 0}
    assert c.layer_types[0] == "linear_attention"
    # every nn.Linear of a Gated DeltaNet layer, the shared expert and its gate, one routed expert's two
    # matrices; not the router (transformers' own F.linear), the conv or the norms
    assert set(mats) == {"linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight", "linear_attn.in_proj_b.weight",
                         "linear_attn.in_proj_a.weight", "linear_attn.out_proj.weight",
                         "mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight",
                         "mlp.shared_expert.down_proj.weight", "mlp.shared_expert_gate.weight",
                         "mlp.experts.gate_up_proj", "mlp.experts.down_proj"}
    assert mats["mlp.experts.gate_up_proj"][1] == (2 * c.moe_intermediate_size, c.hidden_size)
    assert mats["mlp.shared_expert_gate.weight"][0] is None  # kept bf16 by every recipe
    assert mats["linear_attn.out_proj.weight"][0] == QuantSpec("int4", 128)
    heads = [(t.name, q) for t, q, _ in kernel_matrices(spec, get_recipe("int4")) if t.layer is None]
    assert [n for n, _ in heads] == ["lm_head.weight"]  # MTP is not run by the runtime


def test_runtime_costs_sum_the_layers_matrices_and_ops():
    spec = default_spec()
    c = spec.config
    r = get_recipe("quality")
    p = _profile(spec, [r])
    costs = runtime_costs(p, spec, r, "test")
    by_layer: dict[int, list] = {}
    for t in spec.tensors:
        if t.layer is not None and t.role.value != "mtp":
            by_layer.setdefault(t.layer, []).append(t)
    for L in (0, 3):
        # quality: every dense matrix int8 but the shared-expert gate (a norm-like vector) and in_proj_a/b
        # (recipe.KEPT_MATRICES), kept bf16; the router is transformers' own F.linear, timed with the
        # layer's ops; the conv is not a matrix
        kept = (".shared_expert_gate.", ".in_proj_a.", ".in_proj_b.")
        dense = sum(_fake_time("bf16" if any(k in t.name for k in kept) else "int8", t.shape)
                    for t in by_layer[L] if t.is_matrix and ".mlp.experts." not in t.name
                    and not t.name.endswith(".mlp.gate.weight"))
        ops = p.layer_ops_s[c.layer_types[L]]
        assert costs.layer_s[L] == pytest.approx(ops + dense, rel=1e-12)
        gu = _fake_time("int4-g128", (2 * c.moe_intermediate_size, c.hidden_size))
        dn = _fake_time("int4-g128", (c.hidden_size, c.moe_intermediate_size))
        # quality: experts int4 g128; unfused here: two kernel calls and the loop's ops, per expert
        assert costs.expert_s[L] == pytest.approx(gu + dn + 4e-4 / c.num_experts_per_tok, rel=1e-12)
        assert costs.fused[L] is False
    lm = _fake_time("int8", (c.vocab_size, c.hidden_size))  # quality: lm_head int8
    assert costs.head_s == pytest.approx(p.shell_s + lm + 1e-4, rel=1e-12)
    assert c.layer_types[3] == "full_attention" and costs.layer_s[3] != costs.layer_s[0]


def test_expert_pairs_and_moe_keys_name_what_one_fused_call_runs():
    spec = default_spec()
    c = spec.config
    pairs = expert_pairs(spec, get_recipe("quality"))
    assert sorted(pairs) == list(range(c.num_hidden_layers))
    i4 = QuantSpec("int4", 128)
    assert pairs[0] == (i4, (2 * c.moe_intermediate_size, c.hidden_size), i4, (c.hidden_size, c.moe_intermediate_size))
    assert moe_key(i4, i4) == "int4-g128" and moe_key(i4, QuantSpec("int8")) == "int4-g128+int8"
    assert moe_shape_key(pairs[0][1], pairs[0][3]) == f"{2 * c.moe_intermediate_size}x{c.hidden_size}+" \
        f"{c.hidden_size}x{c.moe_intermediate_size}"
    # every layer has the same experts: one pair to time per format
    assert needed_moe(spec, [get_recipe("int4"), get_recipe("quality"), get_recipe("bf16")]) == {
        "int4-g128": (pairs[0],), "bf16": ((None, pairs[0][1], None, pairs[0][3]),)}


def test_runtime_costs_compose_fused_experts_from_the_fused_call():
    """Where the profile has the fused call for the experts' format, a layer's top_k experts cost that
    call (each expert its 1/top_k share), not 2 x top_k kernel calls; other formats keep the old sum."""
    spec = default_spec()
    c = spec.config
    k = c.num_experts_per_tok
    r4, r8 = get_recipe("int4"), get_recipe("nf4")
    p = _profile(spec, [r4, r8], fused=("int4-g128",))
    fused = runtime_costs(p, spec, r4)
    assert fused.fused == [True] * c.num_hidden_layers
    assert fused.expert_s == [pytest.approx(5e-3 / k, rel=1e-12)] * c.num_hidden_layers
    unfused = runtime_costs(p, spec, r8)  # nf4: the runtime does not fuse it, so no moe entry
    gu = _fake_time("nf4-g64", (2 * c.moe_intermediate_size, c.hidden_size))
    dn = _fake_time("nf4-g64", (c.hidden_size, c.moe_intermediate_size))
    assert unfused.fused == [False] * c.num_hidden_layers
    assert unfused.expert_s[0] == pytest.approx(gu + dn + 4e-4 / k, rel=1e-12)
    # the rest of the step is composed the same way either way
    same = runtime_costs(replace(p, moe_s={}), spec, r4)
    assert fused.layer_s == same.layer_s and fused.head_s == same.head_s and same.fused == [False] * c.num_hidden_layers
    # on a CPU alone the estimate is exactly the parts: the fused call once per layer
    b = compute_budget(spec, r4, RunSettings(context=4096))
    s = estimate_runtime(b, _cpu_layout(spec), {"cpu": DeviceRates("cpu", "cpu", 50.0, 1.0)}, c, fused)
    step = sum(fused.layer_s) + c.num_hidden_layers * 5e-3 + fused.head_s
    assert s.decode_tok_s == pytest.approx(1 / step, rel=1e-12)
    assert fused.to_dict()["fused"] == [True] * c.num_hidden_layers


def test_a_profile_without_the_schemes_kernels_names_what_to_run():
    spec = default_spec()
    p = _profile(spec, [get_recipe("int4")])
    with pytest.raises(QuantkitError, match=r"no int8 .* kernel time; run `quantkit profile-host --scheme int8`"):
        runtime_costs(p, spec, get_recipe("int8"))
    p.argmax_s = {}
    with pytest.raises(QuantkitError, match="argmax"):
        runtime_costs(p, spec, get_recipe("int4"))
    p.layer_ops_s = {"linear_attention": 1e-3}
    with pytest.raises(QuantkitError, match="no full_attention layer cost"):
        runtime_costs(p, spec, get_recipe("int4"))


def _cpu_layout(spec, on: str = "cpu") -> Layout:
    c = spec.config
    return Layout([on] * c.num_hidden_layers, [{on: c.num_experts}] * c.num_hidden_layers, on, on)


def test_estimate_runtime_on_a_cpu_is_the_sum_of_the_parts():
    spec = default_spec()
    c = spec.config
    r = get_recipe("int4")
    costs = runtime_costs(_profile(spec, [r]), spec, r)
    b = compute_budget(spec, r, RunSettings(context=4096))
    rates = {"cpu": DeviceRates("cpu", "cpu", 50.0, 1.0)}
    s = estimate_runtime(b, _cpu_layout(spec), rates, c, costs)
    step = sum(costs.layer_s) + c.num_experts_per_tok * sum(costs.expert_s) + costs.head_s
    assert s.decode_tok_s == pytest.approx(1 / step, rel=1e-12)
    assert s.decode_ms_by_device == {"cpu": pytest.approx(step * 1e3)}
    # a full KV cache is read at 60% of the bandwidth on top: slower, by exactly that
    kv = b.kv_cache / (50e9 * 0.6)
    assert 1 / s.decode_tok_s_full_context == pytest.approx(step + kv, rel=1e-9)
    assert estimate_runtime(replace(b, settings=RunSettings(context=4096, batch=2)), _cpu_layout(spec), rates, c,
                            costs) is None  # calibrated at batch 1 only


def test_estimate_runtime_splits_experts_between_gpu_and_cpu():
    spec = default_spec()
    c = spec.config
    r = get_recipe("int4")
    costs = RuntimeCosts([1e-3] * c.num_hidden_layers, [2e-4] * c.num_hidden_layers, 5e-3)
    b = compute_budget(spec, r, RunSettings(context=4096))
    rates = {"cuda:0": DeviceRates("cuda:0", "gpu", 1000.0, 80.0, 25.0), "cpu": DeviceRates("cpu", "cpu", 50.0, 1.0)}
    half = c.num_experts // 2
    layout = Layout(["cuda:0"] * c.num_hidden_layers, [{"cuda:0": half, "cpu": c.num_experts - half}] * c.num_hidden_layers,
                    "cuda:0", "cuda:0")
    s = estimate_runtime(b, layout, rates, c, costs)
    # the CPU serves half the top-k experts of every layer, at the calibrated cost; nothing else
    assert s.decode_ms_by_device["cpu"] == pytest.approx(c.num_hidden_layers * c.num_experts_per_tok / 2 * 2e-4 * 1e3)
    assert 0 < s.decode_ms_by_device["cuda:0"] < s.decode_ms_by_device["cpu"]
    all_cpu = estimate_runtime(b, _cpu_layout(spec), rates, c, costs)
    assert s.decode_tok_s > all_cpu.decode_tok_s


def test_profile_files_round_trip_and_bad_ones_get_one_line(tmp_path):
    spec = default_spec()
    p = _profile(spec, [get_recipe("int4")])
    f = tmp_path / "p.json"
    f.write_text(p.to_json())
    assert load_profile(f) == p
    old = json.loads(p.to_json())
    old["version"] = 1
    for key in ("moe_s", "expert_loop_s"):
        del old[key]
    for text, want in (("{", "not valid JSON"), (json.dumps({"version": 99}), f"version {PROFILE_VERSION}"),
                       (json.dumps({"version": PROFILE_VERSION, "host": {}}), "malformed"),
                       (json.dumps(old), r"version 1, measured before quantkit timed its fused MoE call .*"
                                         r"run `quantkit profile-host` again")):
        f.write_text(text)
        with pytest.raises(QuantkitError, match=want) as e:
            load_profile(f)
        assert str(f) in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(QuantkitError, match="cannot read"):
        load_profile(tmp_path / "missing.json")


def test_mismatch_and_merge():
    spec = default_spec()
    c = spec.config
    here = host_id()
    p = _profile(spec, [get_recipe("int4")])
    assert mismatch(p, c, here) is None
    assert "another model shape" in mismatch(replace(p, dims={**p.dims, "num_experts": 64}), c, here)
    assert "cpu" in mismatch(replace(p, host={**here, "cpu": "Other CPU"}), c, here)
    assert "threads" in mismatch(replace(p, host={**here, "threads": here["threads"] + 1}), c, here)
    q = _profile(spec, [get_recipe("int8")], fused=("int8",))
    both = p.merged(q)
    assert set(both.matmul_s) == set(p.matmul_s) | set(q.matmul_s)
    assert both.moe_s == q.moe_s and both.expert_loop_s == q.expert_loop_s
    assert runtime_costs(both, spec, get_recipe("int8")).fused[0]
    runtime_costs(both, spec, get_recipe("int4"))
    runtime_costs(both, spec, get_recipe("int8"))


def test_fastest_of_several_calibrations_takes_each_part_at_its_fastest():
    """bench decode calibrates once per round and plans from each part's fastest time (as each decode is
    its best round): a part slow in one calibration and fast in another comes out fast, per entry."""
    spec = default_spec()
    p = _profile(spec, [get_recipe("int4")], fused=tuple(needed_moe(spec, [get_recipe("int4")])))
    assert p.moe_s
    key, shapes = next(iter(p.matmul_s.items()))
    sh = next(iter(shapes))
    slow = replace(p, matmul_s={k: {s: 2 * t for s, t in v.items()} for k, v in p.matmul_s.items()},
                   shell_s=2 * p.shell_s, seconds=5.0)
    fast_here = replace(slow, matmul_s={**slow.matmul_s, key: {**slow.matmul_s[key], sh: p.matmul_s[key][sh] / 4}},
                        layer_ops_s={k: v / 3 for k, v in p.layer_ops_s.items()}, seconds=7.0)
    got = fastest([slow, p, fast_here])
    assert got.matmul_s[key][sh] == p.matmul_s[key][sh] / 4
    assert all(got.matmul_s[k][s] == t for k, v in p.matmul_s.items() for s, t in v.items() if (k, s) != (key, sh))
    assert got.layer_ops_s == fast_here.layer_ops_s and got.shell_s == p.shell_s and got.moe_s == p.moe_s
    assert got.seconds == p.seconds + 12.0 and got.details["calibrations"] == 3
    assert runtime_costs(got, spec, get_recipe("int4")).fused[0]
    with pytest.raises(ValueError):
        fastest([])


def test_profile_for_plan(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    spec = default_spec()
    c = spec.config
    assert profile_for_plan(None, c, this_host=False) == (None, "", "")
    prof, src, note = profile_for_plan(None, c, this_host=True)
    assert prof is None and "quantkit profile-host" in note
    path = default_profile_path(c)
    assert path.parent == tmp_path / "cache" / "runtime-profiles"
    path.parent.mkdir(parents=True)
    p = _profile(spec, [get_recipe("int4")])
    path.write_text(p.to_json())
    prof, src, note = profile_for_plan(None, c, this_host=True)
    assert prof == p and str(path) in src and not note
    other = tmp_path / "other.json"
    other.write_text(replace(p, host={**p.host, "cpu": "Other CPU"}).to_json())
    with pytest.raises(QuantkitError, match=r"other.json: runtime profile does not apply: it was measured with cpu"):
        profile_for_plan(other, c, this_host=True)
    path.write_text(replace(p, host={**p.host, "cpu": "Other CPU"}).to_json())  # a stale default: ignored, said
    prof, _, note = profile_for_plan(None, c, this_host=True)
    assert prof is None and "ignored" in note
    old = json.loads(p.to_json())
    old["version"] = 1  # a default profile from before the fused MoE timing: ignored, with the re-run line
    path.write_text(json.dumps(old))
    prof, _, note = profile_for_plan(None, c, this_host=True)
    assert prof is None and "version 1" in note and "run `quantkit profile-host` again" in note


def test_solve_carries_the_runtime_estimate_into_the_plan_file():
    from quantkit.planner.hardware import Hardware, Host
    from quantkit.planner.placement import Plan, solve

    spec = default_spec()
    r = get_recipe("int4")
    hw = Hardware((), Host(ram_bytes=64 << 30))
    plan = solve(spec, r, RunSettings(context=4096), hw, profile=_profile(spec, [r]), profile_source="p.json")
    assert plan.fits and plan.runtime_speed is not None and plan.runtime_speed.source == "p.json"
    assert plan.runtime_speed.decode_tok_s < plan.speed.decode_tok_s  # these made-up parts are slower
    back = Plan.from_json(plan.to_json())
    assert back.runtime_speed.decode_tok_s == pytest.approx(plan.runtime_speed.decode_tok_s, abs=0.05)
    # a scheme the profile has no kernels for: no estimate, and the plan says what to run
    other = solve(spec, get_recipe("nf4"), RunSettings(context=4096), hw, profile=_profile(spec, [r]))
    assert other.runtime_speed is None and "quantkit profile-host --scheme nf4" in other.runtime_note


def _with_prefill(p: RuntimeProfile, spec, recipes, tokens: int = 512) -> RuntimeProfile:
    """`p` with made-up prefill figures: each dense kernel 100x its decode time, each layer's experts 30 ms."""
    return replace(p, prefill_tokens=tokens,
                   prefill_matmul_s={k: {s: 100 * t for s, t in v.items() if not s.startswith(str(spec.config.vocab_size))}
                                     for k, v in p.matmul_s.items()},
                   prefill_moe_s={k: {moe_shape_key(x[1], x[3]): 3e-2 for x in pairs}
                                  for k, pairs in needed_moe(spec, recipes).items()},
                   prefill_ops_s={"linear_attention": 2e-2, "full_attention": 5e-3}, prefill_shell_s=1e-3)


def test_runtime_prefill_is_the_sum_of_the_chunks_parts():
    spec = default_spec()
    c = spec.config
    r = get_recipe("quality")
    p = _with_prefill(_profile(spec, [r]), spec, [r])
    costs = runtime_costs(p, spec, r)
    decode = runtime_costs(replace(p, prefill_tokens=0), spec, r)
    assert costs.prefill_tokens == 512 and decode.prefill_tokens == 0 and decode.prefill_layer_s == []
    for L in (0, 3):
        # the dense kernels of the layer at the chunk's rows, its type's ops; the experts as one module call
        dense = sum(p.prefill_matmul_s[spec_key(q)][shape_key(s)] for t, q, s in kernel_matrices(spec, r)
                    if t.layer == L and t.role.value != "routed_expert")
        assert costs.prefill_layer_s[L] == pytest.approx(p.prefill_ops_s[c.layer_types[L]] + dense, rel=1e-12)
        assert costs.prefill_expert_s[L] == 3e-2
    lm = _fake_time("int8", (c.vocab_size, c.hidden_size))  # the head and argmax for the last token only
    assert costs.prefill_head_s == pytest.approx(1e-3 + lm + 1e-4, rel=1e-12)
    b = compute_budget(spec, r, RunSettings(context=4096))
    rates = {"cpu": DeviceRates("cpu", "cpu", 50.0, 1.0)}
    s = estimate_runtime(b, _cpu_layout(spec), rates, c, costs)
    chunk = sum(costs.prefill_layer_s) + sum(costs.prefill_expert_s) + costs.prefill_head_s
    assert s.prefill_tok_s == pytest.approx(512 / chunk, rel=1e-12)
    assert s.to_dict()["prefill_tok_s"] == round(512 / chunk, 1)
    assert estimate_runtime(b, _cpu_layout(spec), rates, c, decode).prefill_tok_s is None
    # a layer on a GPU: no GPU prefill was calibrated, so no runtime prefill figure
    rates["cuda:0"] = DeviceRates("cuda:0", "gpu", 1000.0, 80.0, 25.0)
    gpu = Layout(["cuda:0"] + ["cpu"] * (c.num_hidden_layers - 1), [{"cpu": c.num_experts}] * c.num_hidden_layers,
                 "cpu", "cpu")
    assert estimate_runtime(b, gpu, rates, c, costs).prefill_tok_s is None


def test_a_profile_missing_a_prefill_figure_still_plans_decode():
    spec = default_spec()
    r = get_recipe("int4")
    p = _with_prefill(_profile(spec, [r]), spec, [r])
    assert runtime_costs(p, spec, r).prefill_tokens == 512
    key = next(iter(p.prefill_matmul_s))
    short = replace(p, prefill_matmul_s={**p.prefill_matmul_s, key: {}})
    costs = runtime_costs(short, spec, r)
    assert costs.prefill_tokens == 0 and costs.layer_s == runtime_costs(p, spec, r).layer_s
    assert runtime_costs(replace(p, prefill_moe_s={}), spec, r).prefill_tokens == 0
    assert runtime_costs(replace(p, prefill_ops_s={"linear_attention": 1.0}), spec, r).prefill_tokens == 0


def test_prefill_figures_round_trip_merge_and_take_the_fastest(tmp_path):
    spec = default_spec()
    r = get_recipe("int4")
    p = _with_prefill(_profile(spec, [r]), spec, [r])
    f = tmp_path / "p.json"
    f.write_text(p.to_json())
    assert load_profile(f) == p
    old = json.loads(p.to_json())  # a profile written before prefill was measured
    for k in ("prefill_tokens", "prefill_matmul_s", "prefill_moe_s", "prefill_ops_s", "prefill_shell_s"):
        del old[k]
    f.write_text(json.dumps(old))
    assert load_profile(f).prefill_tokens == 0 and runtime_costs(load_profile(f), spec, r).prefill_tokens == 0
    q8 = get_recipe("int8")
    q = _with_prefill(_profile(spec, [q8]), spec, [q8])
    both = p.merged(q)
    assert set(both.prefill_matmul_s) == set(p.prefill_matmul_s) | set(q.prefill_matmul_s)
    assert runtime_costs(both, spec, r).prefill_tokens == runtime_costs(both, spec, q8).prefill_tokens == 512
    # a later calibration at another chunk size replaces the prefill figures rather than mixing two chunks
    other = p.merged(_with_prefill(_profile(spec, [q8]), spec, [q8], tokens=256))
    assert other.prefill_tokens == 256 and runtime_costs(other, spec, r).prefill_tokens == 0
    slow = replace(p, prefill_ops_s={k: 3 * v for k, v in p.prefill_ops_s.items()}, prefill_shell_s=0.5)
    got = fastest([slow, p])
    assert got.prefill_ops_s == p.prefill_ops_s and got.prefill_shell_s == p.prefill_shell_s
    assert fastest([slow, replace(p, prefill_tokens=0)]).prefill_tokens == 0  # the last has none: none
