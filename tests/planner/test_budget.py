"""Budgets to the byte: card estimate, bits per weight, weights per role, caches checked against the cache
transformers itself allocates for a tiny Qwen3.5-MoE."""

from __future__ import annotations

import importlib

import pytest
import torch

from quantkit.checkpoint.spec import Role, TensorSpec, default_spec, spec_from_config
from quantkit.errors import QuantkitError
from quantkit.formats import QuantSpec
from quantkit.planner.budget import (
    RunSettings,
    bits_per_weight,
    card_estimate_gb,
    compute_budget,
    kv_bytes_per_token,
    linear_state_bytes,
    tensor_bytes,
    with_settings,
)
from quantkit.recipe import RECIPES, Recipe

SPEC = default_spec()
EXPERT = TensorSpec("model.language_model.layers.0.mlp.experts.gate_up_proj", (256, 1024, 2048), "bfloat16",
                    Role.ROUTED_EXPERT, 0)
DOWN = TensorSpec("model.language_model.layers.0.mlp.experts.down_proj", (256, 2048, 512), "bfloat16",
                  Role.ROUTED_EXPERT, 0)


def tiny_config() -> dict:
    from transformers import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, mtp_num_hidden_layers=0, max_position_embeddings=1024,
    ).to_dict()


def test_card_estimate_reproduced_exactly() -> None:
    assert [card_estimate_gb(b) for b in (16, 8, 4, 4)] == [74.0, 37.0, 18.5, 18.5]
    assert [card_estimate_gb(RECIPES[s].nominal_bits) for s in ("fp16", "int8", "int4", "fp4")] == [
        74.0, 37.0, 18.5, 18.5]


@pytest.mark.parametrize(
    "q,bpw",
    [
        (QuantSpec("int4", 128, True), 4.125),
        (QuantSpec("int4", 32, True), 4.5),
        (QuantSpec("int4", 128, False), 4.25),
        (QuantSpec("mxfp4", 32, True), 4.25),
        (QuantSpec("nf4", 64, True), 4.5),
        (QuantSpec("fp4", 64, True), 4.5),
        (QuantSpec("int8", None, True), 8 + 16 / 2048),
    ],
)
def test_bits_per_weight_match_reference(q: QuantSpec, bpw: float) -> None:
    assert bits_per_weight(EXPERT, q) == pytest.approx(bpw, abs=1e-12)


def test_int4_parts_byte_exact() -> None:
    tb = tensor_bytes(DOWN, QuantSpec("int4", 128, False))
    assert tb.weight == 256 * 2048 * 256  # two codes per byte
    assert tb.scales == tb.zeros == 256 * 2048 * 4 * 2  # bf16 per group of 128 along in=512


def test_quality_weights_role_by_role() -> None:
    b = compute_budget(SPEC, RECIPES["quality"], RunSettings())
    w = b.weights_by_role
    per_layer_experts = (256 * 1024 * 1024 + 256 * 1024 * 16 * 2) + (256 * 2048 * 256 + 256 * 2048 * 4 * 2)
    assert w[Role.ROUTED_EXPERT].total == 40 * per_layer_experts
    assert w[Role.ROUTED_EXPERT].scales == 40 * (256 * 1024 * 16 * 2 + 256 * 2048 * 4 * 2)
    assert w[Role.EMBEDDING].total == 248320 * 2048 * 2  # kept bf16
    assert w[Role.LM_HEAD].total == 248320 * 2048 + 248320 * 2  # int8 + one bf16 scale per row
    assert w[Role.ROUTER].total == 40 * 256 * 2048 * 2
    assert Role.MTP not in w  # not loaded unless asked
    assert b.expert_bytes == [per_layer_experts // 256] * 40
    assert b.weights == sum(tb.total for tb in w.values())


def test_bf16_weights_are_two_bytes_per_text_param() -> None:
    b = compute_budget(SPEC, RECIPES["bf16"], RunSettings())
    assert b.weights == SPEC.text_params * 2
    with_mtp = compute_budget(SPEC, RECIPES["bf16"], RunSettings(include_mtp=True))
    mtp_params = SPEC.params_by_role()[Role.MTP]
    assert with_mtp.weights - b.weights == mtp_params * 2


def test_kv_and_linear_state_match_reference_figures() -> None:
    c = SPEC.config
    assert kv_bytes_per_token(c, "fp16", 10) == 20 * 1024
    b = compute_budget(SPEC, RECIPES["quality"], RunSettings(context=262144))
    assert b.kv_cache == 5 * (1 << 30)
    assert compute_budget(SPEC, RECIPES["quality"], RunSettings(context=4096)).kv_cache == 83_886_080
    rec, conv = linear_state_bytes(c)
    assert rec == 2 * (1 << 20)
    assert 60e6 < 30 * (rec + conv) < 66e6  # "about 64 MB for one sequence"
    fp8 = compute_budget(SPEC, RECIPES["quality"], RunSettings(context=4096, cache_dtype="fp8")).kv_cache
    q8 = compute_budget(SPEC, RECIPES["quality"], RunSettings(context=4096, cache_dtype="q8")).kv_cache
    q4 = compute_budget(SPEC, RECIPES["quality"], RunSettings(context=4096, cache_dtype="q4")).kv_cache
    assert (fp8, q8, q4) == (83_886_080 // 2, 83_886_080 // 2 * 34 // 32, 83_886_080 // 2 * 18 // 32)


def test_cache_bytes_match_what_transformers_allocates() -> None:
    """Run a tiny real Qwen3_5MoeForCausalLM and weigh the cache it built."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    cfg = tiny_config()
    spec = spec_from_config(cfg, name="tiny")
    torch.manual_seed(0)
    model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**cfg)).to(torch.bfloat16).eval()
    batch, tokens = 2, 37
    with torch.no_grad():
        cache = model(torch.randint(0, 256, (batch, tokens)), use_cache=True).past_key_values

    def nbytes(v) -> int:
        vals = v.values() if isinstance(v, dict) else (v if isinstance(v, list) else [v])
        return sum(x.numel() * x.element_size() for x in vals if torch.is_tensor(x))

    measured = []
    for layer in cache.layers:
        d = vars(layer)
        measured.append(sum(nbytes(d[k]) for k in ("keys", "values", "conv_states", "recurrent_states")
                            if d.get(k) is not None))
    b = compute_budget(spec, RECIPES["bf16"], RunSettings(context=tokens, batch=batch, prompt_cache_snapshots=0))
    assert b.layer_cache == measured and b.prompt_cache == 0
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert b.weights == params


def test_budget_grows_with_context_and_batch() -> None:
    r = RECIPES["quality"]
    b1 = compute_budget(SPEC, r, RunSettings(context=4096))
    b2 = compute_budget(SPEC, r, RunSettings(context=8192))
    b3 = compute_budget(SPEC, r, RunSettings(context=4096, batch=2))
    assert b2.kv_cache == 2 * b1.kv_cache and b2.weights == b1.weights
    assert b3.recurrent_state == 2 * b1.recurrent_state and b3.kv_cache == 2 * b1.kv_cache
    assert with_settings(b1, SPEC.config, RunSettings(context=8192)).components() == b2.components()


@pytest.mark.parametrize("ctx", [0, -5, 262145])
def test_bad_context_rejected(ctx: int) -> None:
    with pytest.raises(QuantkitError, match="context"):
        compute_budget(SPEC, RECIPES["int4"], RunSettings(context=ctx))


def test_recipe_round_trips_and_keeps_small_tensors() -> None:
    r = RECIPES["quality"]
    assert Recipe.from_dict(r.to_dict()) == r
    norm = next(t for t in SPEC.tensors if t.name.endswith("linear_attn.conv1d.weight"))
    assert r.spec_for(norm) is None
    mtp_expert = next(t for t in SPEC.tensors if t.name.startswith("mtp.") and ".experts." in t.name)
    assert r.spec_for(mtp_expert) == r.rules[Role.ROUTED_EXPERT]


@pytest.mark.parametrize("fmt,mod", [("int8", "int8"), ("int4", "int4"), ("nf4", "bnb4"), ("fp4", "bnb4"),
                                     ("mxfp4", "mxfp4")])
def test_bytes_match_the_format_implementation(fmt: str, mod: str) -> None:
    """The budget's byte arithmetic equals what the format's quantize() actually stores."""
    try:
        importlib.import_module(f"quantkit.formats.{mod}")
    except ModuleNotFoundError:
        pytest.skip(f"quantkit.formats.{mod} not written yet")
    from quantkit.formats import get_format

    f = get_format(fmt)
    q = QuantSpec(fmt, None if fmt == "int8" else {"int4": 128, "nf4": 64, "fp4": 64, "mxfp4": 32}[fmt], True)
    w = torch.randn(3, 64, 256, dtype=torch.bfloat16)
    parts = f.quantize(w, q)
    stored = sum(p.numel() * p.element_size() for p in parts.values())
    assert stored == tensor_bytes(TensorSpec("x.mlp.experts.down_proj", (3, 64, 256), "bfloat16",
                                             Role.ROUTED_EXPERT, 0), q).total


def test_card_formula_uses_the_models_own_size_for_other_models() -> None:
    from quantkit.checkpoint.spec import default_spec, spec_from_config
    from quantkit.planner.budget import CARD_PARAMS, card_params

    assert card_params(default_spec()) == CARD_PARAMS
    no_mtp = spec_from_config(default_spec().raw_config, include_mtp=False)
    assert card_params(no_mtp) == CARD_PARAMS  # the published checkpoint without its MTP layer
    small = dict(default_spec().raw_config)
    small["text_config"] = {**small["text_config"], "num_hidden_layers": 4, "layer_types": ["linear_attention"] * 3 + ["full_attention"]}
    spec = spec_from_config(small)
    assert card_params(spec) == spec.total_params
    assert card_estimate_gb(16, 4096, card_params(spec)) < 74.0 / 5


def test_mtp_budget_holds_the_runtimes_int4_copy_of_the_draft_rows() -> None:
    """With the MTP layer used, the lm_head adds the runtime's int4 g128 copy of the draft's rows (32,768 ranked
    ids and 248,032 up: 33,056 rows of 2048, 0.5 byte each plus a bf16 scale per 128), whatever its format: the
    ranked rows lie scattered over a 4-bit head's tiles too."""
    rows = 32768 + 248320 - 248032
    copy = rows * 2048 // 2 + rows * 2048 // 128 * 2
    for recipe, want in (("quality", copy), ("bf16", copy), ("int4", copy)):
        b = compute_budget(SPEC, RECIPES[recipe], RunSettings(include_mtp=True))
        assert b.mtp_draft_copy == want, recipe
        assert b.mtp == (b.mtp_weights - b.mtp_copy_saving + want + b.kv_cache
                         - compute_budget(SPEC, RECIPES[recipe], RunSettings()).kv_cache)
    assert compute_budget(SPEC, RECIPES["quality"], RunSettings()).mtp_draft_copy == 0


def test_mtp_budget_holds_the_layers_attention_and_shared_expert_as_int4() -> None:
    """The runtime holds the MTP layer's int8 or bf16 fc, attention and shared expert as int4 g128 (0.5 byte a
    weight and a bf16 scale per 128) and lets the stored ones go: the MTP figure counts that; 4-bit ones, its
    router, norms, shared_expert_gate and routed experts are held as stored."""
    dense = [(2048, 4096), (8192, 2048), (512, 2048), (512, 2048), (2048, 4096), (512, 2048), (512, 2048),
             (2048, 512)]  # fc; q, k, v, o; the shared expert's gate, up, down
    int4 = sum(n * k // 2 + n * k // 128 * 2 for n, k in dense)
    for recipe, stored in (("quality", sum(n * k + n * 2 for n, k in dense)),  # int8: a bf16 scale per row
                           ("bf16", sum(n * k * 2 for n, k in dense)), ("int4", int4)):
        b = compute_budget(SPEC, RECIPES[recipe], RunSettings(include_mtp=True))
        assert b.mtp_copy_saving == stored - int4, recipe
        kv = b.kv_cache - compute_budget(SPEC, RECIPES[recipe], RunSettings()).kv_cache
        assert b.mtp == b.mtp_weights - (stored - int4) + b.mtp_draft_copy + kv, recipe
