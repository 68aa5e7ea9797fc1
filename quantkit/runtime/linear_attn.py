"""A CPU replacement for the causal depthwise conv of transformers' Gated DeltaNet torch fallback.

Without the `causal-conv1d` package, transformers runs the linear-attention conv as
`F.conv1d(..., groups=channels)`. oneDNN takes that depthwise conv through a slow path on CPUs without
AVX512-BF16: measured on the 2-core AMD EPYC build machine with 8192 channels (the real model's
conv_dim), one decode step costs 7.8 s in bf16 and 28 ms in fp32, against about 1 ms for the same sum
written as 4 multiply-adds over the kernel taps. `install()` swaps transformers' two module-level
functions for the versions below (same signatures, same math in fp32, same dtype out); CUDA tensors
and every other caller keep the original. It is a process-wide patch of `modeling_qwen3_5_moe`, made
by the loader; `uninstall()` restores the originals (the benchmark uses it to time plain transformers).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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


def causal_conv1d_update(hidden_states, conv_state, weight, bias=None, activation=None):
    if hidden_states.device.type != "cpu":
        return _ORIG["causal_conv1d_update"](hidden_states, conv_state, weight, bias, activation)
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
        return _ORIG["causal_conv1d_fn"](hidden_states, weight, bias, activation, **kwargs)
    seq_len = hidden_states.shape[-1]
    x = F.pad(hidden_states.to(weight.dtype), (weight.shape[-1] - 1, 0))
    out = _taps(x, weight, seq_len)
    if bias is not None:
        out = out + bias.float()[:, None]
    return _act(out, activation).to(hidden_states.dtype)


def install() -> None:
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m

    for name, fn in (("causal_conv1d_update", causal_conv1d_update), ("causal_conv1d_fn", causal_conv1d_fn)):
        cur = getattr(m, name)
        if cur is fn:
            continue
        _ORIG.setdefault(name, cur)
        setattr(m, name, fn)


def uninstall() -> None:
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m

    for name, fn in _ORIG.items():
        setattr(m, name, fn)
