"""CPU replacements for two pieces of transformers' Gated DeltaNet torch fallback: the causal depthwise
conv and the one-token recurrent (decode) step.

Without the `causal-conv1d` package, transformers runs the linear-attention conv as
`F.conv1d(..., groups=channels)`. oneDNN takes that depthwise conv through a slow path on CPUs without
AVX512-BF16: measured on the 2-core AMD EPYC build machine with 8192 channels (the real model's
conv_dim), one decode step costs 7.8 s in bf16 and 28 ms in fp32, against about 1 ms for the same sum
written as 4 multiply-adds over the kernel taps. `install()` swaps transformers' two module-level
functions for the versions below (same signatures, same math in fp32, same dtype out); CUDA tensors
and every other caller keep the original. It is a process-wide patch of `modeling_qwen3_5_moe`, made
by the loader; `uninstall()` restores the originals (the benchmark uses it to time plain transformers).

The decode step (`torch_recurrent_gated_delta_rule` with one token) updates a [B, Hv, 128, 128] fp32 state
per layer. transformers writes it as broadcast multiplies and sums, each allocating a new 2 MB state:
0.54-0.73 ms per layer per token inside the loaded model on the 2-core build machine (3.5-7.8 ms when
timed alone under load). `recurrent_gated_delta_rule` below does the same math on the state in place:
decay, kv = k @ S, S += k^T (beta (v - kv)), out = q @ S (`delta_state_step`). With quantkit's CPU kernel
built that is one call (`delta_step` in csrc/qk_step.cpp) that reads and writes the state once, head by
head; without it, torch's batched matrix products and `addcmul_` (0.29-0.43 ms per layer in the model),
which pass over the 2 MB state four times. Only the fp32 rounding of the k/q contractions and of the
multiply-adds differs from transformers (state differences ~1e-7). quantkit.runtime.decode_step calls the
same `delta_state_step`, so its decode step and this one agree bit for bit. Prompts (more than
one token), CUDA tensors and a missing initial state go to transformers' own functions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from quantkit.runtime import cpu_kernel

_ORIG: dict[str, object] = {}


def _act(x: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return x
    if activation in ("silu", "swish"):
        return F.silu(x)
    from transformers.activations import ACT2FN

    return ACT2FN[activation](x)


def _taps(x: torch.Tensor, weight: torch.Tensor, out_len: int) -> torch.Tensor:
    """Cross-correlation of x [B, C, L] with weight [C, K] along L, valid part, last `out_len` outputs."""
    k = weight.shape[-1]
    start = x.shape[-1] - k + 1 - out_len
    w = weight.float()
    acc = x[..., start:start + out_len].float() * w[:, 0:1]
    for j in range(1, k):
        acc.add_(x[..., start + j:start + j + out_len].float() * w[:, j:j + 1])
    return acc


def _original(name: str):
    """transformers' own function `name` (the saved one once `install` has replaced it)."""
    if name in _ORIG:
        return _ORIG[name]
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m

    return getattr(m, name)


def causal_conv1d_update(hidden_states, conv_state, weight, bias=None, activation=None):
    if hidden_states.device.type != "cpu":
        return _original("causal_conv1d_update")(hidden_states, conv_state, weight, bias, activation)
    seq_len = hidden_states.shape[-1]
    state_len = conv_state.shape[-1]
    new = torch.cat([conv_state, hidden_states], dim=-1).to(weight.dtype)
    conv_state.copy_(new[:, :, -state_len:])
    out = _taps(new, weight, seq_len)
    if bias is not None:
        out = out + bias.float()[:, None]
    return _act(out, activation).to(hidden_states.dtype)


def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
    if hidden_states.device.type != "cpu" or kwargs.get("seq_idx") is not None:
        return _original("causal_conv1d_fn")(hidden_states, weight, bias, activation, **kwargs)
    seq_len = hidden_states.shape[-1]
    x = F.pad(hidden_states.to(weight.dtype), (weight.shape[-1] - 1, 0))
    out = _taps(x, weight, seq_len)
    if bias is not None:
        out = out + bias.float()[:, None]
    return _act(out, activation).to(hidden_states.dtype)


def recurrent_gated_delta_rule(query, key, value, g, beta, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, **kwargs):
    """One-token gated delta rule on CPU: transformers' `torch_recurrent_gated_delta_rule` (same arguments,
    same [B, 1, Hv, V] output in query's dtype, fp32 state) with the state updated in place by batched
    matrix products. The state tensor passed in is the one updated and returned, as the cache expects."""
    seq_len = key.shape[1]
    if (query.device.type != "cpu" or seq_len != 1 or initial_state is None
            or initial_state.dtype != torch.float32 or kwargs.get("cu_seqlens") is not None):
        return _original("torch_recurrent_gated_delta_rule")(query, key, value, g, beta, initial_state,
                                                             output_final_state, use_qk_l2norm_in_kernel, **kwargs)
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import l2norm

    out_dtype = query.dtype
    b, _, hk, kd = key.shape
    hv, vd = value.shape[-2:]
    q, k = query[:, 0].float(), key[:, 0].float()  # [B, Hk, K]
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q, dim=-1, eps=1e-6), l2norm(k, dim=-1, eps=1e-6)
    q = q / (kd ** 0.5)
    if hv != hk:
        q, k = q.repeat_interleave(hv // hk, dim=1), k.repeat_interleave(hv // hk, dim=1)
    state = initial_state if initial_state.is_contiguous() else initial_state.contiguous()
    out = delta_state_step(q.reshape(b * hv, kd), k.reshape(b * hv, kd), value[:, 0].float().reshape(b * hv, vd),
                           g[:, 0].float().reshape(-1), beta[:, 0].float().reshape(-1), state.view(b * hv, kd, vd))
    return out.view(b, 1, hv, vd).to(out_dtype), (state if output_final_state else None)


def delta_state_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor) -> torch.Tensor:
    """The state update and readout of one token, fp32 throughout: q, k [H, K] (normalised, q scaled,
    heads repeated), v [H, V], g and beta [H]; `state` [H, K, V] contiguous, updated in place; returns
    [H, V]. On the CPU with quantkit's kernel built, its `delta_step` (one read and one write of the state);
    elsewhere the same math in torch ops."""
    mod = cpu_kernel.module() if state.device.type == "cpu" else None
    if mod is not None:
        return mod.delta_step(q.contiguous(), k.contiguous(), v.contiguous(), g.exp().contiguous(),
                              beta.contiguous(), state)
    h, kd, vd = state.shape
    state.mul_(g.exp().view(h, 1, 1))
    kv = torch.bmm(k.view(h, 1, kd), state)  # [H, 1, V]
    delta = (v.view(h, 1, vd) - kv) * beta.view(h, 1, 1)
    state.addcmul_(k.view(h, kd, 1), delta)  # the outer product added in one pass (2x baddbmm_ with K=1)
    return torch.bmm(q.view(h, 1, kd), state).view(h, vd)


def install(recurrent: bool = True) -> None:
    """Patch transformers' Qwen3.5-MoE module: the conv functions always, the decode step if `recurrent`
    (the benchmark times transformers with the conv fix alone)."""
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m

    pairs = [("causal_conv1d_update", causal_conv1d_update), ("causal_conv1d_fn", causal_conv1d_fn)]
    if recurrent:
        pairs.append(("torch_recurrent_gated_delta_rule", recurrent_gated_delta_rule))
    for name, fn in pairs:
        cur = getattr(m, name)
        if cur is fn:
            continue
        _ORIG.setdefault(name, cur)
        setattr(m, name, fn)


def uninstall() -> None:
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m

    for name, fn in _ORIG.items():
        setattr(m, name, fn)
