"""Building recipes from the quantizer's options, per-tensor decisions and their serialization."""

from __future__ import annotations

import json

import pytest

from quantkit.checkpoint.spec import Role, TensorSpec, default_spec, role_of
from quantkit.errors import QuantkitError
from quantkit.formats import QuantSpec
from quantkit.recipe import (
    INT4_G128,
    INT8,
    Recipe,
    build_recipe,
    decide,
    get_recipe,
    parse_override,
    parse_spec_text,
)

SPEC = default_spec()
BY_NAME = {t.name: t for t in SPEC.tensors}
L0 = "model.language_model.layers.0."
L3 = "model.language_model.layers.3."


def _decide(recipe: Recipe, name: str) -> QuantSpec | None:
    return decide(recipe, BY_NAME[name]).spec


def test_default_four_bit_is_the_quality_recipe():
    r = build_recipe(4)
    assert r.name == "quality"
    assert _decide(r, L0 + "mlp.experts.gate_up_proj") == INT4_G128
    assert _decide(r, L0 + "mlp.experts.down_proj") == INT4_G128
    for n in ("linear_attn.in_proj_qkv.weight", "linear_attn.out_proj.weight", "mlp.shared_expert.down_proj.weight"):
        assert _decide(r, L0 + n) == INT8
    assert _decide(r, L3 + "self_attn.q_proj.weight") == INT8
    assert _decide(r, "lm_head.weight") == INT8
    # kept in bf16: router, shared_expert_gate, norms, A_log, dt_bias, conv1d, embedding
    for n in ("mlp.gate.weight", "mlp.shared_expert_gate.weight", "input_layernorm.weight",
              "linear_attn.A_log", "linear_attn.dt_bias", "linear_attn.conv1d.weight", "linear_attn.norm.weight"):
        assert _decide(r, L0 + n) is None, n
    assert _decide(r, "model.language_model.embed_tokens.weight") is None


@pytest.mark.parametrize("fmt,want", [("nf4", QuantSpec("nf4", 64)), ("fp4", QuantSpec("fp4", 64)),
                                      ("mxfp4", QuantSpec("mxfp4", 32)), ("int", INT4_G128)])
def test_format_sets_the_routed_experts_and_uniform_sets_all(fmt, want):
    r = build_recipe(4, fmt)
    assert _decide(r, L0 + "mlp.experts.down_proj") == want
    assert _decide(r, L0 + "linear_attn.out_proj.weight") == INT8
    u = build_recipe(4, fmt, uniform=True)
    for n in (L0 + "linear_attn.out_proj.weight", "lm_head.weight", "model.language_model.embed_tokens.weight",
              L0 + "mlp.shared_expert.up_proj.weight"):
        assert _decide(u, n) == want
    assert _decide(u, L0 + "mlp.gate.weight") is None  # the router stays bf16 even with --uniform


def test_bits_8_is_int8_everywhere_eligible_and_group_size_applies():
    r = build_recipe(8)
    assert all(_decide(r, t.name) in (INT8, None) for t in SPEC.tensors)
    assert _decide(r, "model.language_model.embed_tokens.weight") == INT8
    assert _decide(r, L0 + "mlp.gate.weight") is None
    assert _decide(build_recipe(4, group_size=32), L0 + "mlp.experts.down_proj") == QuantSpec("int4", 32)
    for bad in (dict(bits=8, fmt="nf4"), dict(bits=8, group_size=64), dict(bits=3), dict(fmt="q4_k"),
                dict(fmt="mxfp4", group_size=64), dict(group_size=48)):
        with pytest.raises(QuantkitError):
            build_recipe(**bad)


def test_overrides_and_spec_text():
    r = build_recipe(4, overrides=["linear_attention=4", "lm_head=bf16", "routed_expert=int4:g64:asym"])
    assert _decide(r, L0 + "linear_attn.in_proj_z.weight") == INT4_G128
    assert _decide(r, "lm_head.weight") is None
    assert _decide(r, L0 + "mlp.experts.gate_up_proj") == QuantSpec("int4", 64, False)
    assert parse_spec_text("8") == INT8 and parse_spec_text("keep") is None
    assert parse_override("embedding=nf4") == (Role.EMBEDDING, QuantSpec("nf4", 64))
    for bad in ("linear_attention", "bogus=8", "norm=8", "attention=int3", "attention=int4:g7", "attention=nf4:asym"):
        with pytest.raises(QuantkitError):
            parse_override(bad)


def test_recipe_file(tmp_path):
    p = tmp_path / "r.json"
    p.write_text(json.dumps({"name": "mine", "base": "quality",
                             "rules": {"routed_expert": {"format": "nf4", "group_size": 64}, "attention": "bf16"}}))
    r = build_recipe(recipe_file=str(p), overrides=["shared_expert=4"])
    assert _decide(r, L0 + "mlp.experts.down_proj") == QuantSpec("nf4", 64)
    assert _decide(r, L3 + "self_attn.o_proj.weight") is None
    assert _decide(r, L0 + "mlp.shared_expert.up_proj.weight") == INT4_G128
    assert _decide(r, L0 + "linear_attn.out_proj.weight") == INT8  # from the base
    p.write_text("{not json")
    with pytest.raises(QuantkitError, match="r.json: recipe file is not valid JSON"):
        build_recipe(recipe_file=str(p))
    p.write_text(json.dumps({"rules": {"experts": "4"}}))
    with pytest.raises(QuantkitError, match="unknown role 'experts'"):
        build_recipe(recipe_file=str(p))


@pytest.mark.parametrize("name", ["bf16", "int8", "int4", "quality", "mxfp4"])
def test_every_recipe_keeps_linear_attentions_in_proj_a_and_b(name):
    spec = default_spec()
    kept = [t for t in spec.tensors if t.name.endswith(("in_proj_a.weight", "in_proj_b.weight"))]
    assert len(kept) == 2 * spec.config.layer_types.count("linear_attention")
    assert all(decide(get_recipe(name), t).spec is None for t in kept)
    other = next(t for t in spec.tensors if t.name.endswith("in_proj_qkv.weight"))
    assert (decide(get_recipe(name), other).spec is None) == (name == "bf16")


def test_eligibility_falls_back_and_says_so():
    r = build_recipe(4, uniform=True)
    odd = TensorSpec(L0 + "linear_attn.in_proj_z.weight", (32, 100), "bfloat16", Role.LINEAR_ATTENTION, 0)
    d = decide(r, odd)
    assert d.spec == INT8 and "does not divide the row length 100" in d.note
    small = TensorSpec(L0 + "mlp.experts.down_proj", (8, 64, 32), "bfloat16", Role.ROUTED_EXPERT, 0)
    d = decide(r, small)
    assert d.spec == QuantSpec("int4", 32) and "group 32 instead" in d.note
    d = decide(build_recipe(4, "mxfp4"), TensorSpec(small.name, (8, 64, 48), "bfloat16", Role.ROUTED_EXPERT, 0))
    assert d.spec == INT8
    vis = TensorSpec("model.visual.blocks.0.attn.qkv.weight", (96, 32), "bfloat16", role_of("model.visual.x"), None)
    assert decide(build_recipe(8), vis).spec is None


def test_mtp_tensors_follow_their_decoder_role():
    r = build_recipe(4)
    e = TensorSpec("mtp.layers.0.mlp.experts.5.gate_proj.weight", (512, 2048), "bfloat16", Role.MTP, None)
    assert decide(r, e).spec == INT4_G128
    a = TensorSpec("mtp.layers.0.self_attn.k_proj.weight", (512, 2048), "bfloat16", Role.MTP, None)
    assert decide(r, a).spec == INT8
    n = TensorSpec("mtp.norm.weight", (2048,), "bfloat16", Role.MTP, None)
    assert decide(r, n).spec is None


def test_recipe_serializes_into_the_config_and_back():
    for r in (build_recipe(4), build_recipe(8), build_recipe(4, "nf4", uniform=True),
              build_recipe(4, overrides=["embedding=int4:g32:asym"])):
        d = json.loads(json.dumps(r.to_dict()))
        back = Recipe.from_dict(d)
        assert back.rules == r.rules and back.name == r.name
        assert all(decide(back, t) == decide(r, t) for t in SPEC.tensors)
