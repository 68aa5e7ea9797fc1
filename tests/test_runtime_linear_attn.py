"""The Gated DeltaNet replacements of quantkit.runtime.linear_attn against transformers' own functions.

The one-token recurrent step is the decode hot spot the runtime replaces (batched matrix products on the
state, updated in place, instead of broadcast multiply + sum): it must give transformers' state and
output up to fp32 summation order, keep prompts and first steps on transformers' path, and leave the
whole model's greedy decode unchanged.
"""

from __future__ import annotations

import pytest
import torch

from quantkit.runtime import linear_attn

from test_runtime_common import one_thread  # noqa: F401


def _orig(name: str):
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m

    return linear_attn._ORIG.get(name, getattr(m, name))


def _inputs(b: int, hk: int, hv: int, d: int, seed: int = 0, seq: int = 1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, seq, hk, d, generator=g).bfloat16()
    k = torch.randn(b, seq, hk, d, generator=g).bfloat16()
    v = torch.randn(b, seq, hv, d, generator=g).bfloat16()
    decay = -torch.rand(b, seq, hv, generator=g) * 2
    beta = torch.rand(b, seq, hv, generator=g).bfloat16()
    state = torch.randn(b, hv, d, d, generator=g) * 0.3
    return q, k, v, decay, beta, state


@pytest.mark.parametrize("b,hk,hv,d", [(1, 16, 32, 128), (2, 2, 4, 16), (1, 4, 4, 8)])
def test_recurrent_step_matches_transformers(b, hk, hv, d):
    q, k, v, decay, beta, state = _inputs(b, hk, hv, d)
    ref_out, ref_state = _orig("torch_recurrent_gated_delta_rule")(q, k, v, decay, beta, state.clone(), True, True)
    mine = state.clone()
    out, new_state = linear_attn.recurrent_gated_delta_rule(q, k, v, decay, beta, mine, True, True)
    assert out.dtype == ref_out.dtype and out.shape == ref_out.shape
    assert new_state is mine  # updated in place: the cache's copy_ onto itself is then free
    torch.testing.assert_close(new_state, ref_state, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=1e-2, atol=1e-2)  # bf16 rounding at most
    assert (out != ref_out).float().mean() < 0.01


@pytest.mark.parametrize("h,kd,vd", [(32, 128, 128), (4, 16, 24), (3, 8, 8)])
def test_state_step_kernel_matches_torch_ops(h, kd, vd, kernel_table, monkeypatch):
    """quantkit's `delta_step` on each op table (vectors where V is a multiple of their width, the plain
    loop otherwise) against the torch ops it replaces, on the same inputs."""
    from quantkit.runtime import cpu_kernel

    g = torch.Generator().manual_seed(h + kd + vd)
    q, k = (torch.nn.functional.normalize(torch.randn(h, kd, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(h, vd, generator=g)
    logd, beta = -torch.rand(h, generator=g) * 2, torch.rand(h, generator=g)
    state = torch.randn(h, kd, vd, generator=g) * 0.3
    fast_state = state.clone()
    fast = linear_attn.delta_state_step(q, k, v, logd, beta, fast_state)
    monkeypatch.setattr(cpu_kernel, "module", lambda: None)
    ref_state = state.clone()
    ref = linear_attn.delta_state_step(q, k, v, logd, beta, ref_state)
    torch.testing.assert_close(fast_state, ref_state, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)
    assert not torch.equal(fast_state, state)  # updated in place


def test_recurrent_step_hands_other_cases_to_transformers():
    q, k, v, decay, beta, state = _inputs(1, 2, 4, 16, seq=3)  # a 3-token chunk: transformers' loop
    ref = _orig("torch_recurrent_gated_delta_rule")(q, k, v, decay, beta, state.clone(), True, True)
    got = linear_attn.recurrent_gated_delta_rule(q, k, v, decay, beta, state.clone(), True, True)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    q, k, v, decay, beta, _ = _inputs(1, 2, 4, 16)
    ref = _orig("torch_recurrent_gated_delta_rule")(q, k, v, decay, beta, None, True, True)  # no state yet
    got = linear_attn.recurrent_gated_delta_rule(q, k, v, decay, beta, None, True, True)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def test_install_can_leave_the_recurrent_step_alone():
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m

    try:
        linear_attn.uninstall()
        linear_attn.install(recurrent=False)
        assert m.causal_conv1d_update is linear_attn.causal_conv1d_update
        assert m.torch_recurrent_gated_delta_rule is not linear_attn.recurrent_gated_delta_rule
        linear_attn.install()
        assert m.torch_recurrent_gated_delta_rule is linear_attn.recurrent_gated_delta_rule
    finally:
        linear_attn.install()  # what the loader leaves behind


@pytest.mark.usefixtures("one_thread")
def test_greedy_decode_unchanged_by_the_recurrent_step(tiny_model):
    """transformers' bf16 model on the tiny checkpoint, 24 greedy tokens, with and without the step."""
    from transformers import DynamicCache

    from quantkit.testing.tiny import load_reference_model

    model = load_reference_model(tiny_model, torch.bfloat16)

    def decode() -> tuple[list[int], torch.Tensor]:
        toks, logits = [], []
        with torch.inference_mode():
            cache = DynamicCache(config=model.config)
            out = model(input_ids=torch.tensor([[5, 9, 12, 7, 30, 2, 11, 4]]), cache=cache, use_cache=True)
            for _ in range(24):
                toks.append(int(out.logits[0, -1].argmax()))
                logits.append(out.logits[0, -1].float())
                out = model(input_ids=torch.tensor([[toks[-1]]]), cache=cache, use_cache=True)
        return toks, torch.stack(logits)

    try:
        linear_attn.uninstall()
        linear_attn.install(recurrent=False)
        ref_toks, ref_logits = decode()
        linear_attn.install()
        toks, logits = decode()
    finally:
        linear_attn.install()
    assert toks == ref_toks
    torch.testing.assert_close(logits, ref_logits, rtol=0.02, atol=0.02)
