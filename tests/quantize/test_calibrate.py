"""`quantkit calibrate` (quantkit/runtime/calibrate.py): what it measures and that it measures the
runtime's real parts. Nothing here asserts a speed; these check that the timed kernels are the loader's
kernels, that the stubbed model is the runtime's model, that stubs never leak, and the CLI round trip."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from quantkit.checkpoint.spec import default_spec, load_config, spec_from_config
from quantkit.kernels import cpu as cpu_kernel
from quantkit.planner.host_costs import (
    expert_pairs,
    kernel_matrices,
    load_profile,
    moe_key,
    moe_shape_key,
    runtime_costs,
    shape_key,
    spec_key,
)
from quantkit.recipe import get_recipe
from quantkit.runtime import kernels as K
from quantkit.runtime.calibrate import (
    CAL_VOCAB,
    _StubbedKernels,
    calibration_config,
    moe_module,
    runtime_fuses,
    time_kernel,
    time_layer_ops,
    time_moe,
    time_moe_prefill,
    time_prefill_ops,
)

from helpers.cli import run_cli
from helpers.runtime import quantized

pytestmark = pytest.mark.usefixtures("one_thread")


def test_calibration_config_keeps_one_layer_of_each_type():
    spec = default_spec()
    cal = calibration_config(spec.raw_config)
    tc, orig = cal["text_config"], spec.raw_config["text_config"]
    assert tc["layer_types"] == orig["layer_types"][:4] == ["linear_attention"] * 3 + ["full_attention"]
    assert tc["num_hidden_layers"] == 4 and tc["vocab_size"] == CAL_VOCAB and tc["mtp_num_hidden_layers"] == 0
    for k in ("hidden_size", "num_experts", "num_experts_per_tok", "linear_num_value_heads", "head_dim"):
        assert tc[k] == orig[k]
    assert orig["num_hidden_layers"] == 40  # the input is untouched


@pytest.mark.parametrize("recipe", ["int4", "int8", "nf4", "mxfp4", "quality"])
def test_the_kernels_enumerated_are_the_kernels_the_loader_builds(tiny_model, recipe):
    """The composition counts, per layer, exactly the (format, shape) kernels the runtime runs."""
    from quantkit.runtime import load_model
    from quantkit.runtime.model.qwen3_5_moe import Attention

    rt = load_model(quantized(tiny_model, recipe))
    spec = spec_from_config(load_config(tiny_model / "config.json"))
    planned: Counter = Counter()
    for t, q, shape in kernel_matrices(spec, get_recipe(recipe)):
        planned[(t.layer, (q.format if q else "bf16"), shape)] += 1
    built: Counter = Counter()
    for L, layer in enumerate(rt.model.layers):
        m, moe = layer.mixer, layer.moe
        ks = [m.q, m.k, m.v, m.o] if isinstance(m, Attention) else [m.qkv, m.z, m.b, m.a, m.out]
        for k in [*ks, moe.shared_gate, moe.shared_up, moe.shared_down, moe.shared_sigmoid]:
            built[(L, k.format, (k.out_features, k.in_features))] += 1
        g = moe.experts.groups[0]  # one expert's pair
        for k in (g.gate_up[0], g.down[0]):
            built[(L, moe.experts.format, (k.out_features, k.in_features))] += 1
    head = rt.model.head
    built[(None, head.format, (head.out_features, head.in_features))] += 1
    assert built == planned


@pytest.mark.parametrize("q", [None, "int4", "int8", "nf4"])
def test_time_kernel_times_copies_of_the_runtime_kernel(q):
    from quantkit.formats import QuantSpec

    spec = QuantSpec(q, 64) if q in ("int4", "nf4") else (QuantSpec(q) if q else None)
    sec, d = time_kernel(spec, (256, 512), working_set=4 << 20, passes=1)
    w = torch.zeros(256, 512, dtype=torch.bfloat16)
    from quantkit.formats import get_format

    ref = K.prepare(w if spec is None else get_format(spec.format).quantize(w, spec), spec, (256, 512))
    assert d["route"] == ref.route  # the same route the loader would take
    assert d["copies"] * d["bytes_each"] >= 4 << 20 and d["copies"] >= 2
    assert 0 < sec < 1


def test_tall_matrices_are_timed_on_a_slab_and_scaled(monkeypatch):
    from quantkit.runtime import calibrate as cal

    monkeypatch.setattr(cal, "ROW_CAP", 64)
    sec, d = time_kernel(None, (640, 128), working_set=1 << 20, passes=1)
    assert d["rows_timed"] == 64 and d["bytes_each"] == 64 * 128 * 2 and sec > 0


def test_stubs_return_zeros_and_always_come_off():
    from quantkit.runtime.qexperts import QuantExperts

    w = torch.randn(32, 64).to(torch.bfloat16)
    k = K.prepare(w, None, (32, 64))
    x = torch.randn(1, 64).to(torch.bfloat16)
    real = k(x)
    classes = (K.DenseKernel, K.QBf16Kernel, K.QKernel, K.Int4Kernel, K.Int8Kernel, K.Bnb4Kernel)
    before = {cls: cls.__dict__.get("__call__") for cls in classes}
    table = QuantExperts.__dict__["_fused_table"]
    with pytest.raises(RuntimeError, match="inside"):
        with _StubbedKernels():
            y = k(x)
            assert y.shape == (1, 32) and not y.any()
            assert all(cls.__dict__.get("__call__") is not before[cls] for cls in classes if before[cls])
            assert QuantExperts.__dict__["_fused_table"] is not table  # no real fused call on empty weights
            raise RuntimeError("inside")
    assert {cls: cls.__dict__.get("__call__") for cls in before} == before
    assert QuantExperts.__dict__["_fused_table"] is table
    assert torch.equal(k(x), real)


def test_layer_ops_run_the_runtime_model_with_every_layer_type(tiny_model):
    cfg = json.loads((tiny_model / "config.json").read_text())
    lo = time_layer_ops(cfg, steps=2, prompt=4)
    assert set(lo.ops_s) == {"linear_attention", "full_attention"}
    assert all(v > 0 for v in lo.ops_s.values()) and lo.shell_s > 0 and lo.expert_loop_s > 0
    d = lo.detail
    assert d["linear_attention"]["samples"] == 3 * 2 and d["full_attention"]["samples"] == 2
    assert d["expert_loop"]["samples"] == 4 * 2  # the experts module of every layer, timed apart
    fused = cpu_kernel.available()
    assert d["path"] == {"step": f"cpu-{cpu_kernel.isa_name()}-fused" if fused else "torch"}


def test_layer_ops_can_time_the_torch_route(tiny_model):
    cfg = json.loads((tiny_model / "config.json").read_text())
    lo = time_layer_ops(cfg, steps=2, prompt=4, fused=False)
    assert set(lo.ops_s) == {"linear_attention", "full_attention"} and lo.shell_s > 0 and lo.expert_loop_s > 0
    assert lo.detail["path"] == {"step": "torch"} and lo.detail["full_attention"]["samples"] == 2


@pytest.mark.parametrize("fused", [True, False])
def test_layer_ops_exclude_the_routed_experts_module(tiny_model, monkeypatch, fused):
    """Slow routed experts (here: 20 ms of sleep per decode call) land in `expert_loop_s`, not in the layers'
    ops, on the fused and the torch routes alike."""
    import time as _time

    from quantkit.runtime.qexperts import QuantExperts

    cfg = json.loads((tiny_model / "config.json").read_text())
    one = QuantExperts._forward_one

    def slow(self, *a, **k):
        _time.sleep(0.02)
        return one(self, *a, **k)

    monkeypatch.setattr(QuantExperts, "_forward_one", slow)
    lo = time_layer_ops(cfg, steps=2, prompt=4, fused=fused)
    assert lo.expert_loop_s >= 0.02
    assert all(v < 0.02 for v in lo.ops_s.values())


def _pair(q, h: int = 64, i: int = 32):
    return (q, (2 * i, h), q, (h, i))


@pytest.mark.parametrize("fmt", ["int4", "int8", None])
def test_time_moe_times_the_runtimes_fused_call_where_it_fuses(fmt):
    from quantkit.formats import QuantSpec
    from quantkit.kernels import cpu as cpu_kernel

    q = QuantSpec(fmt, 32) if fmt == "int4" else (QuantSpec(fmt) if fmt else None)
    fuses = cpu_kernel.available()
    one = moe_module(_pair(q), 1)
    assert runtime_fuses(one) is fuses  # the runtime's own decision, for the kernels it would build
    got = time_moe(_pair(q), 2, working_set=1 << 20, passes=1)
    if not fuses:
        assert got is None  # the planner then composes the kernel calls
        return
    sec, d = got
    assert 0 < sec < 1
    assert d["copies"] * d["bytes_each"] >= 1 << 20 and d["copies"] >= 4 and d["top_k"] == 2
    assert d["route"] == one.groups[0].gate_up[0].route


def test_time_moe_gives_no_entry_for_formats_the_runtime_runs_unfused():
    from quantkit.formats import QuantSpec

    assert time_moe(_pair(QuantSpec("nf4", 32)), 2, working_set=1 << 20, passes=1) is None


def test_calibrate_cli_then_plan_reads_the_profile(tiny_model, tmp_path, capsys, monkeypatch):
    prof = tmp_path / "p.json"
    code, out, err = run_cli(["profile-host", "--model", tiny_model, "--scheme", "int4", "--out", prof,
                              "--working-set", "1MB", "--passes", "1", "--steps", "2"], capsys, monkeypatch)
    assert code == 0, err
    assert "profile saved to" in out and "int4" in out
    p = load_profile(prof)
    spec = spec_from_config(load_config(tiny_model / "config.json"))
    want = {(spec_key(q), shape_key(s)) for _, q, s in kernel_matrices(spec, get_recipe("int4"))}
    assert {(k, s) for k, v in p.matmul_s.items() for s in v} == want
    from quantkit.kernels import cpu as cpu_kernel

    if cpu_kernel.available():  # int4 experts fuse: the profile holds their fused call, which the plan uses
        pair = expert_pairs(spec, get_recipe("int4"))[0]
        assert p.moe_s[moe_key(pair[0], pair[2])][moe_shape_key(pair[1], pair[3])] > 0
        assert runtime_costs(p, spec, get_recipe("int4")).fused[0]
    code, out, err = run_cli(["plan", "--model", tiny_model, "--profile", prof, "--scheme", "int4", "--scheme", "int8",
                              "--json"], capsys, monkeypatch)
    assert code == 0, err
    d = json.loads(out)
    rows = {r["scheme"]: r for r in d["schemes"]}
    assert rows["int4"]["runtime_decode_tok_s"] > 0
    assert rows["int8"]["runtime_decode_tok_s"] is None  # not calibrated for int8's kernels
    assert d["runtime_profile"].startswith(str(prof))
    # a second calibration of another scheme adds to the profile
    code, _, err = run_cli(["profile-host", "--model", tiny_model, "--scheme", "int8", "--out", prof,
                            "--working-set", "1MB", "--passes", "1", "--steps", "2"], capsys, monkeypatch)
    assert code == 0, err
    want8 = {spec_key(q) for _, q, _ in kernel_matrices(spec, get_recipe("int8"))}
    assert "int8" in want8 and set(load_profile(prof).matmul_s) == set(p.matmul_s) | want8


def test_plan_refuses_a_profile_of_another_model(tiny_model, tmp_path, capsys, monkeypatch):
    prof = tmp_path / "p.json"
    code, _, err = run_cli(["profile-host", "--model", tiny_model, "--scheme", "int4", "--out", prof,
                            "--working-set", "1MB", "--passes", "1", "--steps", "2"], capsys, monkeypatch)
    assert code == 0, err
    code, out, err = run_cli(["plan", "--profile", prof], capsys, monkeypatch)  # the default 35B model
    assert code == 2
    assert err.count("\n") == 1 and "another model shape" in err and str(prof) in err.replace("\n", "")


def test_a_quantized_folder_is_planned_from_its_config_and_calibrated_for_its_recipe(tiny_model, tmp_path, capsys,
                                                                                    monkeypatch):
    q = quantized(tiny_model, "quality")
    code, out, err = run_cli(["plan", "--model", q, "--scheme", "int4", "--json"], capsys, monkeypatch)
    assert code == 0, err
    assert json.loads(out)["schemes"][0]["fits"] is True
    prof = tmp_path / "p.json"
    code, out, err = run_cli(["profile-host", "--model", q, "--out", prof, "--working-set", "1MB", "--passes", "1",
                              "--steps", "2"], capsys, monkeypatch)
    assert code == 0, err
    spec = spec_from_config(load_config(tiny_model / "config.json"))
    want = {spec_key(q_) for _, q_, _ in kernel_matrices(spec, get_recipe("quality"))}
    assert set(load_profile(prof).matmul_s) == want  # the folder's own recipe, not every scheme
    assert "tok/s: quality " in out


@pytest.mark.parametrize("args,want", [
    (["--passes", "0"], "'--passes': '0' is out of range"),
    (["--working-set", "1KB"], "at least 1,000,000 bytes"),
    (["--working-set", "lots"], "lots"),
    (["--scheme", "int3"], "int3"),
    (["--out", "/proc/no/such/p.json", "--working-set", "1MB", "--passes", "1", "--steps", "1", "--scheme", "int4"],
     "/proc/no/such/p.json: cannot write"),
])
def test_calibrate_bad_input_gets_one_line(tiny_model, capsys, monkeypatch, args, want):
    code, out, err = run_cli(["profile-host", "--model", tiny_model, *args], capsys, monkeypatch)
    assert code == 2 and err.count("\n") == 1 and want in err and "Traceback" not in err


def test_prefill_ops_time_one_chunk_per_layer_type_without_the_routed_experts(tiny_model, monkeypatch):
    """Slow multi-token routed experts (20 ms of sleep per chunk) land outside the layers' prefill ops."""
    import time as _time

    from quantkit.runtime.qexperts import QuantExperts

    cfg = json.loads((tiny_model / "config.json").read_text())
    forward, seen = QuantExperts.forward, []

    def slow(self, h, ids, wts):
        seen.append(tuple(h.shape))
        _time.sleep(0.02)
        return forward(self, h, ids, wts)

    monkeypatch.setattr(QuantExperts, "forward", slow)
    lo = time_prefill_ops(cfg, tokens=16, passes=2)
    assert set(lo.ops_s) == {"linear_attention", "full_attention"} and lo.shell_s > 0
    assert all(v < 0.02 for v in lo.ops_s.values()) and lo.expert_loop_s >= 0.02
    assert lo.detail["linear_attention"]["samples"] == 3 * 2 and lo.detail["full_attention"]["samples"] == 2
    assert lo.detail["tokens"] == 16 and set(seen) == {(16, cfg["text_config"]["hidden_size"])}


def test_time_moe_prefill_runs_the_experts_module_on_the_chunk(monkeypatch):
    """Every token goes to top_k distinct experts of all num_experts, in one multi-token module forward."""
    from quantkit.formats import QuantSpec
    from quantkit.runtime.qexperts import QuantExperts

    forward, calls = QuantExperts.forward, []

    def spy(self, h, ids, wts):
        calls.append((self.num_experts, tuple(h.shape), ids.clone()))
        return forward(self, h, ids, wts)

    monkeypatch.setattr(QuantExperts, "forward", spy)
    sec, d = time_moe_prefill(_pair(QuantSpec("int4", 32)), num_experts=16, top_k=4, tokens=24, passes=2)
    assert 0 < sec < 10 and d["experts"] == 16 and d["tokens"] == 24 and d["bytes_each"] > 0
    assert len(calls) == 3  # a warm-up and the timed passes
    for n, shape, ids in calls:
        assert n == 16 and shape == (24, 64) and ids.shape == (24, 4)
        assert all(len(set(row)) == 4 for row in ids.tolist()) and len(set(ids.flatten().tolist())) > 4


def test_calibrate_times_a_prefill_chunk_for_the_plan(tiny_model, tmp_path, capsys, monkeypatch):
    prof = tmp_path / "p.json"
    code, out, err = run_cli(["profile-host", "--model", tiny_model, "--scheme", "int4", "--out", prof,
                              "--working-set", "1MB", "--passes", "1", "--steps", "2", "--prefill-tokens", "32"],
                             capsys, monkeypatch)
    assert code == 0, err
    assert "one prefill chunk of 32 tokens" in out and "(prefill " in out
    p = load_profile(prof)
    spec = spec_from_config(load_config(tiny_model / "config.json"))
    dense = {(spec_key(q), shape_key(s)) for t, q, s in kernel_matrices(spec, get_recipe("int4"))
             if t.layer is not None and t.role.value != "routed_expert"}
    assert p.prefill_tokens == 32 and {(k, s) for k, v in p.prefill_matmul_s.items() for s in v} >= dense
    assert set(p.prefill_ops_s) == {"linear_attention", "full_attention"}
    pair = expert_pairs(spec, get_recipe("int4"))[0]
    assert p.prefill_moe_s[moe_key(pair[0], pair[2])][moe_shape_key(pair[1], pair[3])] > 0
    code, out, err = run_cli(["plan", "--model", tiny_model, "--profile", prof, "--scheme", "int4", "--json"],
                             capsys, monkeypatch)
    assert code == 0, err
    row = json.loads(out)["schemes"][0]
    assert row["runtime_prefill_tok_s"] > 0 and row["runtime_decode_tok_s"] > 0
