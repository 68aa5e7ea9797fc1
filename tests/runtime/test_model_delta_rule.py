"""quantkit.runtime.model.delta_rule against transformers' Gated DeltaNet functions and the CPU arithmetic the
runtime ran before it (runtime/linear_attn.py, restated here as `_channel_major_*` and `_one_token_before`).

Bit-equal (torch.equal): the conv to the former CPU conv; the chunked rule to transformers'
torch_chunk_gated_delta_rule; one token to the former one-token path; keep_states to one-token calls.
Within a bound: the conv against transformers' F.conv1d (oneDNN sums the taps in its own order) and one token
against transformers' torch_recurrent_gated_delta_rule (broadcast multiply + sum, another fp32 order).
Channel counts are multiples of 32 so F.silu takes its vector route on every element of either layout.
Run also with QUANTKIT_CPU_ISA=none (torch ops for the step) and QUANTKIT_CPU_ISA=avx2-plain.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, LinearAttentionLayer
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf

from quantkit.kernels import cpu as cpu_kernel
from quantkit.runtime.model.delta_rule import conv_tokens, delta_rule, delta_state_step


def _channel_major_conv(x: torch.Tensor, weight: torch.Tensor, out_len: int) -> torch.Tensor:
    """The former CPU conv: x [B, C, L] against weight [C, K], fp32 product then add per tap, SiLU, last
    `out_len` outputs; x's dtype out."""
    kk = weight.shape[-1]
    start = x.shape[-1] - kk + 1 - out_len
    w = weight.float()
    acc = x[..., start:start + out_len].float() * w[:, 0:1]
    for j in range(1, kk):
        acc.add_(x[..., start + j:start + j + out_len].float() * w[:, j:j + 1])
    return F.silu(acc).to(x.dtype)


def _channel_major_update(hidden_states, conv_state, weight, bias=None, activation=None):
    assert bias is None and activation == "silu"
    new = torch.cat([conv_state, hidden_states], dim=-1).to(weight.dtype)
    conv_state.copy_(new[:, :, -conv_state.shape[-1]:])
    return _channel_major_conv(new, weight, hidden_states.shape[-1]).to(hidden_states.dtype)


def _channel_major_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
    assert bias is None and activation == "silu"
    x = F.pad(hidden_states.to(weight.dtype), (weight.shape[-1] - 1, 0))
    return _channel_major_conv(x, weight, hidden_states.shape[-1]).to(hidden_states.dtype)


def _one_token_before(q, k, v, g, beta, state):
    """The former one-token path (linear_attn.recurrent_gated_delta_rule at batch 1): l2norm before the heads
    are repeated, q divided by sqrt(Dk)."""
    hk, dk = k.shape[1:]
    hv = v.shape[1]
    qf, kf = hf.l2norm(q[0].float(), dim=-1, eps=1e-6), hf.l2norm(k[0].float(), dim=-1, eps=1e-6)
    qf = qf / (dk ** 0.5)
    qf, kf = qf.repeat_interleave(hv // hk, dim=0), kf.repeat_interleave(hv // hk, dim=0)
    out = delta_state_step(qf, kf, v[0].float(), g[0].float(), beta[0].float(), state)
    return out.to(v.dtype)


def _conv_inputs(t: int, c: int, kk: int = 4, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, c, generator=gen).bfloat16()
    window = torch.randn(kk, c, generator=gen).bfloat16()
    weight = (torch.randn(c, kk, generator=gen) * 0.5).bfloat16()  # conv1d.weight.squeeze(1), as stored
    return x, window, weight


def _rule_inputs(t: int, hk: int, hv: int, dk: int, dv: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(t, hk, dk, generator=gen).bfloat16()
    k = torch.randn(t, hk, dk, generator=gen).bfloat16()
    v = torch.randn(t, hv, dv, generator=gen).bfloat16()
    g = -torch.rand(t, hv, generator=gen) * 2
    beta = torch.rand(t, hv, generator=gen).bfloat16()
    state = torch.randn(hv, dk, dv, generator=gen) * 0.3
    return q, k, v, g, beta, state


# ---------------------------------------------------------------- conv_tokens


def test_conv_one_token_matches_the_decode_update():
    x, window, weight = _conv_inputs(1, 96)
    conv_state = window.t().contiguous()[None]  # transformers' [1, C, K]
    ref = _channel_major_update(x.t()[None], conv_state, weight, None, "silu")
    got = conv_tokens(x, window, weight.t().float())
    assert got.dtype == x.dtype and got.shape == x.shape
    assert torch.equal(got, ref[0].t())
    assert torch.equal(window, conv_state[0].t())
    # transformers' own update (F.conv1d; fp32 here so that only the order of the four products differs)
    x, window, weight = (a.float() for a in _conv_inputs(1, 96, seed=1))
    conv_state = window.t().contiguous()[None]
    tf = hf.causal_conv1d_update(x.t()[None], conv_state, weight, None, "silu")
    torch.testing.assert_close(conv_tokens(x, window, weight.t().float()), tf[0].t(), rtol=1e-6, atol=1e-6)
    assert torch.equal(window, conv_state[0].t())


def _forward_through_cache(chunks: list[torch.Tensor], weight: torch.Tensor, monkeypatch) -> tuple[list, Cache]:
    """transformers' causal_conv1d_forward on a real linear-attention cache, one call per chunk, with the
    former CPU conv in place of F.conv1d (what the runtime ran)."""
    monkeypatch.setattr(hf, "causal_conv1d_update", _channel_major_update)
    monkeypatch.setattr(hf, "causal_conv1d_fn", _channel_major_fn)
    c, kk = weight.shape
    conv1d = torch.nn.Conv1d(c, c, kk, groups=c, bias=False, padding=kk - 1)
    conv1d.weight.data = weight.unsqueeze(1)
    cache = Cache(layers=[LinearAttentionLayer()])
    return [hf.causal_conv1d_forward(conv1d, x.t()[None], cache, 0, activation="silu")[0].t() for x in chunks], cache


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("lengths", [[2], [3], [5], [64], [7, 1, 1, 3], [2, 5], [1, 65]])
def test_conv_prompts_match_the_cache_path(lengths, dtype, monkeypatch):
    """Prefill from an empty cache (zero window; shorter than K too), then decode steps and multi-token
    calls on the kept state (transformers prepends the previous conv state). bf16 products are exact in
    fp32 and their sums nearly always too: the fp32 case is the one that sees the order of the sum."""
    c, kk = 64, 4
    x, _, weight = (a.to(dtype) for a in _conv_inputs(sum(lengths), c, kk, seed=len(lengths)))
    if dtype == torch.float32:
        gen = torch.Generator().manual_seed(1)  # full mantissas
        x, weight = (a + torch.rand(a.shape, generator=gen) * 1e-2 for a in (x, weight))
    chunks = list(torch.split(x, lengths))
    refs, cache = _forward_through_cache(chunks, weight, monkeypatch)
    window = torch.zeros(kk, c, dtype=x.dtype)
    taps = weight.t().float()
    for chunk, ref in zip(chunks, refs, strict=True):
        assert torch.equal(conv_tokens(chunk, window, taps), ref)
    assert torch.equal(window, cache.layers[0].conv_states[0][0].t())
    assert torch.equal(window, torch.cat([torch.zeros(kk, c, dtype=x.dtype), x])[-kk:])


def test_conv_prompt_matches_transformers_conv1d():
    """transformers' causal_conv1d_fn over the previous window and the prompt, fp32 (oneDNN's tap order)."""
    x, window, weight = _conv_inputs(9, 64)
    ref = hf.causal_conv1d_fn(torch.cat([window, x]).float().t()[None], weight.float(), None, "silu")[0, :, -9:].t()
    got = conv_tokens(x.float(), window.float(), weight.t().float())
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- delta_state_step


def _step_inputs(h: int, kd: int, vd: int):
    g = torch.Generator().manual_seed(h + kd + vd)
    q, k = (F.normalize(torch.randn(h, kd, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(h, vd, generator=g)
    logd, beta = -torch.rand(h, generator=g) * 2, torch.rand(h, generator=g)
    return q, k, v, logd, beta, torch.randn(h, kd, vd, generator=g) * 0.3


def _step_torch_ops(q, k, v, g, beta, state):
    """delta_state_step's torch route as it was: decay, kv = k S, S += k^T (beta (v - kv)), out = q S."""
    h, kd, vd = state.shape
    state.mul_(g.exp().view(h, 1, 1))
    delta = (v.view(h, 1, vd) - torch.bmm(k.view(h, 1, kd), state)) * beta.view(h, 1, 1)
    state.addcmul_(k.view(h, kd, 1), delta)
    return torch.bmm(q.view(h, 1, kd), state).view(h, vd)


@pytest.mark.parametrize("h,kd,vd", [(32, 128, 128), (4, 16, 24), (3, 8, 8)])
@pytest.mark.usefixtures("each_table")
def test_state_step_is_the_kernel_or_the_torch_ops(h, kd, vd):
    q, k, v, logd, beta, state = _step_inputs(h, kd, vd)
    mine, ref = state.clone(), state.clone()
    out = delta_state_step(q, k, v, logd, beta, mine)
    mod = cpu_kernel.module()
    if mod is None:
        ref_out = _step_torch_ops(q, k, v, logd, beta, ref)
    else:
        ref_out = mod.delta_step(q, k, v, logd.exp(), beta, ref)
    assert torch.equal(out, ref_out) and torch.equal(mine, ref)
    assert not torch.equal(mine, state)  # updated in place


@pytest.mark.parametrize("h,kd,vd", [(32, 128, 128), (4, 16, 24), (3, 8, 8)])
def test_state_step_kernel_matches_torch_ops(h, kd, vd, kernel_table, monkeypatch):
    """quantkit's `delta_step` on each op table against the torch ops: the fp32 sums in another order."""
    q, k, v, logd, beta, state = _step_inputs(h, kd, vd)
    fast_state = state.clone()
    fast = delta_state_step(q, k, v, logd, beta, fast_state)
    monkeypatch.setattr(cpu_kernel, "module", lambda: None)
    ref_state = state.clone()
    ref = delta_state_step(q, k, v, logd, beta, ref_state)
    assert torch.equal(ref, _step_torch_ops(q, k, v, logd, beta, state.clone()))
    torch.testing.assert_close(fast_state, ref_state, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- delta_rule

SHAPES = [(2, 2, 32, 32), (2, 4, 32, 32), (2, 4, 8, 16)]  # (Hk, Hv, Dk, Dv): Hv == Hk, Hv == 2 Hk, Dk != Dv


@pytest.mark.parametrize("hk,hv,dk,dv", SHAPES)
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.usefixtures("each_table")
def test_one_token_matches_the_former_path_and_transformers(hk, hv, dk, dv, with_state):
    q, k, v, g, beta, state = _rule_inputs(1, hk, hv, dk, dv)
    if not with_state:
        state.zero_()
    ref_state = state.clone()
    ref = _one_token_before(q, k, v, g, beta, ref_state)
    mine = state.clone()
    out, states = delta_rule(q, k, v, g, beta, mine)
    assert states is None and out.dtype == v.dtype and out.shape == (1, hv, dv)
    assert torch.equal(out[0], ref) and torch.equal(mine, ref_state)
    tf_out, tf_state = hf.torch_recurrent_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None],
                                                           state[None].clone(), True, True)
    torch.testing.assert_close(mine, tf_state[0], rtol=1e-5, atol=1e-5)  # fp32 sums in another order
    torch.testing.assert_close(out.float(), tf_out[0].float(), rtol=1e-2, atol=1e-2)  # a bf16 rounding at most


def _chunked_against_transformers(t, hk, hv, dk, dv, with_state, seed=0):
    q, k, v, g, beta, state = _rule_inputs(t, hk, hv, dk, dv, seed)
    init = state[None].clone() if with_state else None
    ref_out, ref_state = hf.torch_chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None],
                                                         initial_state=init, output_final_state=True,
                                                         use_qk_l2norm_in_kernel=True)
    mine = state.clone() if with_state else torch.zeros_like(state)
    out, states = delta_rule(q, k, v, g, beta, mine)
    assert states is None and out.dtype == v.dtype and out.shape == (t, hv, dv) and out.is_contiguous()
    assert torch.equal(out, ref_out[0])
    assert torch.equal(mine, ref_state[0])


@pytest.mark.parametrize("t", [2, 5, 64, 65, 130])
@pytest.mark.parametrize("hk,hv,dk,dv", SHAPES)
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_is_bit_equal_to_transformers(t, hk, hv, dk, dv, with_state):
    _chunked_against_transformers(t, hk, hv, dk, dv, with_state)


@pytest.mark.parametrize("t", [1, 130])
@pytest.mark.usefixtures("each_table")
def test_realistic_layer_is_bit_equal(t):
    """Qwen3.5-MoE's layer dims: 16 key heads, 32 value heads, 128 wide."""
    if t == 1:
        q, k, v, g, beta, state = _rule_inputs(1, 16, 32, 128, 128)
        ref_state, mine = state.clone(), state.clone()
        assert torch.equal(delta_rule(q, k, v, g, beta, mine)[0][0], _one_token_before(q, k, v, g, beta, ref_state))
        assert torch.equal(mine, ref_state)
    else:
        _chunked_against_transformers(t, 16, 32, 128, 128, True)


@pytest.mark.usefixtures("each_table")
def test_chunked_matches_the_token_loop():
    """The chunked rule against transformers' token loop on the same inputs: the UT transform reorders the
    fp32 arithmetic (triangular solve, chunk products), so agreement to fp32 noise, not bits."""
    q, k, v, g, beta, state = _rule_inputs(130, 2, 4, 16, 16)
    ref_out, ref_state = hf.torch_recurrent_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None],
                                                             state[None].clone(), True, True)
    mine = state.clone()
    out, _ = delta_rule(q, k, v, g, beta, mine)
    torch.testing.assert_close(mine, ref_state[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.float(), ref_out[0].float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("t", [5, 130])
def test_inverse_route_is_close_to_the_exact_one(t):
    """exact=False multiplies by each chunk's inverted system instead of solving it twice: other fp32
    roundings, so the exact result within fp32 noise (state) and a bf16 rounding (output)."""
    q, k, v, g, beta, state = _rule_inputs(t, 2, 4, 32, 32)
    exact, fast = state.clone(), state.clone()
    ref, _ = delta_rule(q, k, v, g, beta, exact)
    out, _ = delta_rule(q, k, v, g, beta, fast, exact=False)
    torch.testing.assert_close(fast, exact, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)
    assert (out != ref).float().mean() < 0.02


@pytest.mark.parametrize("t", [2, 3, 4, 7])
@pytest.mark.parametrize("hk,hv,dk,dv", SHAPES[1:])
@pytest.mark.usefixtures("each_table")
def test_keep_states_is_one_token_calls(t, hk, hv, dk, dv):
    q, k, v, g, beta, state = _rule_inputs(t, hk, hv, dk, dv, seed=t)
    mine = state.clone()
    out, states = delta_rule(q, k, v, g, beta, mine, keep_states=True)
    assert states is not None and states.shape == (t, hv, dk, dv) and states.dtype == torch.float32
    ref = state.clone()
    for i in range(t):
        one, none = delta_rule(q[i:i + 1], k[i:i + 1], v[i:i + 1], g[i:i + 1], beta[i:i + 1], ref)
        assert none is None
        assert torch.equal(out[i], one[0])
        assert torch.equal(states[i], ref)
    assert torch.equal(states[-1], mine) and torch.equal(mine, ref)
    one_state = state.clone()  # keep_states with one token is the plain step plus its state
    out1, states1 = delta_rule(q[:1], k[:1], v[:1], g[:1], beta[:1], one_state, keep_states=True)
    assert states1 is not None and torch.equal(states1[0], one_state) and torch.equal(out1[0], out[0])


@pytest.mark.usefixtures("each_table")
def test_inputs_are_left_alone_and_views_are_taken():
    """Strided views (the layer slices q, k and v out of the conv output) and fp32 inputs: nothing but the
    state is written."""
    t, hk, hv, d = 5, 2, 4, 16
    q, k, v, g, beta, state = _rule_inputs(t, hk, hv, d, d)
    x = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=1).float()
    qs, ks, vs = x[:, :hk * d].view(t, hk, d), x[:, hk * d:2 * hk * d].view(t, hk, d), x[:, 2 * hk * d:].view(t, hv, d)
    before = x.clone()
    for keep in (False, True):
        mine = state.clone()
        out, _ = delta_rule(qs, ks, vs, g, beta, mine, keep_states=keep)
        assert torch.equal(x, before) and out.dtype == torch.float32
        ref = state.clone()
        ref_out, _ = delta_rule(q.float(), k.float(), v.float(), g, beta, ref, keep_states=keep)
        assert torch.equal(out, ref_out) and torch.equal(mine, ref)


def test_value_heads_must_group_over_key_heads():
    q, k, v, g, beta, state = _rule_inputs(3, 2, 3, 8, 8)
    with pytest.raises(ValueError, match="do not group"):
        delta_rule(q, k, v, g, beta, state)
