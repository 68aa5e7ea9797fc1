"""The Gated DeltaNet core for T tokens at batch 1: the causal depthwise conv and the gated delta rule.

Contract (no batch dimension anywhere):
- `conv_tokens(x [T, C], window [K, C], taps [K, C] fp32)`: SiLU of the depthwise causal conv over
  cat(window, x), in x's dtype; `window` (the last K inputs, oldest first) is updated in place. Bit-equal to
  the CPU conv the runtime ran inside transformers (the former runtime/linear_attn.py, channel-major) for
  decode and prompts, with or without a previous conv state, where F.silu takes its vector route on every
  element of both layouts (C a multiple of 32, a power-of-two thread count): its scalar tail rounds exp
  otherwise.
- `delta_state_step(q, k, v, g, beta, state)`: one token on a [H, K, V] fp32 state in place, through
  quantkit's C++ `delta_step` when built; the former runtime's one-token step, op for op.
- `delta_rule(q, k, v, g, beta, state)`: T tokens; q and k are l2-normalised, q scaled and heads repeated
  here; `state` [Hv, Dk, Dv] fp32 is updated in place. T == 1, or `keep_states` (speculative verify: every
  position's state returned), runs `delta_state_step` token by token, bit-equal to T one-token calls;
  T > 1 otherwise runs the chunked (UT transform) algorithm with the arithmetic of transformers'
  `torch_chunk_gated_delta_rule`, bit-equal to it: same ops on the same shapes and strides (matmul,
  solve and exp results depend on them), minus the batch dimension and the copies it does not need.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from quantkit.kernels import cpu as cpu_kernel

L2_EPS = 1e-6


def conv_tokens(x: torch.Tensor, window: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
    """SiLU(depthwise causal conv) of x [T, C] after the K inputs in `window` [K, C] (oldest first, x's dtype);
    `taps` [K, C] fp32, taps[j] weighting the input j steps after the oldest of the K it reads (the conv1d
    weight squeezed and transposed). Sums tap by tap in fp32, product then add (no fused multiply-add).
    `window` becomes the last K rows of cat(window, x). Returns [T, C] in x's dtype."""
    t, kk = x.shape[0], taps.shape[0]
    buf = torch.cat([window, x]).float()  # [K + T, C]; output i reads rows i + 1 .. i + K
    window.copy_(buf[-kk:])
    acc = buf[1:1 + t] * taps[0]
    prod = torch.empty_like(acc)
    for j in range(1, kk):
        torch.mul(buf[1 + j:1 + j + t], taps[j], out=prod)
        acc.add_(prod)
    return F.silu(acc).to(x.dtype)


def delta_state_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor) -> torch.Tensor:
    """The state update and readout of one token, fp32 throughout: q, k [H, K] (normalised, q scaled, heads
    repeated), v [H, V], g (log decay) and beta [H]; `state` [H, K, V] contiguous, updated in place; returns
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
    state.addcmul_(k.view(h, kd, 1), delta)  # the outer product added in one pass
    return torch.bmm(q.view(h, 1, kd), state).view(h, vd)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim, as FLA writes it (rsqrt, then multiply), on a contiguous fp32
    copy of x that is normalised in place."""
    x = x.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    return x.mul_(torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS))


def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state: torch.Tensor, *, chunk: int = 64, keep_states: bool = False,
               exact: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule over T tokens: q, k [T, Hk, Dk] (raw: normalised, scaled and repeated here),
    v [T, Hv, Dv], g (log decay, fp32) and beta [T, Hv]; `state` [Hv, Dk, Dv] fp32 contiguous, updated in
    place to the state after the T tokens. Returns (out [T, Hv, Dv] in v's dtype, with `keep_states` the
    fp32 state after every position [T, Hv, Dk, Dv], else None). `exact=False` lets the chunked path invert
    each chunk's triangular system once and multiply (faster; fp32 roundings differ from transformers')."""
    t, hk = k.shape[:2]
    hv = v.shape[1]
    if hv % hk:
        raise ValueError(f"delta_rule: {hv} value heads do not group over {hk} key heads")
    if t == 1 or keep_states:
        return _sequential(q, k, v, g, beta, state, keep_states)
    return _chunked(q, k, v, g, beta, state, chunk, exact), None


def _sequential(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor, keep_states: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token by token through `delta_state_step`, with the former one-token path's arithmetic around it
    (normalised before the heads are repeated, q divided by sqrt(Dk))."""
    t, hk, dk = k.shape
    hv, dv = v.shape[1:]
    qf, kf = _l2norm(q), _l2norm(k)
    qf = qf / (dk ** 0.5)
    if hv != hk:
        qf, kf = qf.repeat_interleave(hv // hk, dim=1), kf.repeat_interleave(hv // hk, dim=1)
    vf, gf, bf = (x.float().contiguous() for x in (v, g, beta))
    out = torch.empty(t, hv, dv, dtype=v.dtype, device=v.device)
    states = torch.empty(t, *state.shape, dtype=state.dtype, device=state.device) if keep_states else None
    for i in range(t):
        out[i] = delta_state_step(qf[i], kf[i], vf[i], gf[i], bf[i], state)
        if states is not None:
            states[i].copy_(state)
    return out, states


def _chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             state: torch.Tensor, chunk: int, exact: bool) -> torch.Tensor:
    """transformers' torch_chunk_gated_delta_rule at batch 1 (use_qk_l2norm_in_kernel=True, its state in
    place). Same per-element arithmetic; the normalisation runs before the heads are repeated (per row, so
    the same values), and the transposes, padding and repeats are one copy into zero-padded heads-major
    buffers. Chunks of the padded length keep the matmul shapes, and so their sums, the reference's."""
    t, hk, dk = k.shape
    hv, dv = v.shape[1:]
    rep = hv // hk
    n = -(-t // chunk)
    tp = n * chunk
    f32 = {"dtype": torch.float32, "device": v.device}

    def heads_major(x: torch.Tensor, h: int, d: int, r: int) -> torch.Tensor:
        buf = torch.empty(h * r, tp, d, **f32)
        buf.view(h, r, tp, d)[:, :, :t].copy_(x.permute(1, 0, 2).unsqueeze(1).expand(h, r, t, d))
        buf[:, t:].zero_()
        return buf.view(h * r, n, chunk, d)

    def column_major(d: int) -> torch.Tensor:
        """[Hv, n, chunk, d] stored chunk-position fastest: the layout LAPACK solves in."""
        return torch.empty(hv, n, d, chunk, **f32).transpose(-1, -2)

    query = heads_major(_l2norm(q).mul_(dk ** -0.5), hk, dk, rep)
    key = heads_major(_l2norm(k), hk, dk, rep)
    beta_d = torch.zeros(hv, tp, **f32)
    beta_d[:, :t].copy_(beta.t())
    beta_d = beta_d.view(hv, n, chunk, 1)
    decay = torch.zeros(hv, tp, **f32)
    decay[:, :t].copy_(g.t())
    cum = decay.view(hv, n, chunk).cumsum(dim=-1)

    # transformers' solve copies B into a fresh column-major result and solves there. B built in that layout
    # and passed as its own `out` is the same LAPACK call without the copy (a row-major `out` would solve
    # the transposed system instead: other roundings).
    v_beta = column_major(dv)
    full, rest = divmod(t, chunk)
    v_beta[:, :full].copy_(v[:full * chunk].view(full, chunk, hv, dv).permute(2, 0, 1, 3))
    if rest:
        v_beta[:, full, :rest].copy_(v[full * chunk:].transpose(0, 1))
        v_beta[:, full, rest:].zero_()
    v_beta.mul_(beta_d)
    k_beta = key * beta_d

    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=v.device).triu(1)
    pair = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill_(upper, float("-inf")).exp_()
    ut = (k_beta @ key.transpose(-1, -2)).mul_(pair)
    intra = (query @ key.transpose(-1, -2)).mul_(pair)
    del pair
    cum_exp = cum.exp().unsqueeze(-1)
    k_cumdecay = torch.mul(k_beta, cum_exp, out=column_major(dk))
    if exact:
        new_values = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True, out=v_beta)
        k_cumdecay = torch.linalg.solve_triangular(ut, k_cumdecay, upper=False, unitriangular=True, out=k_cumdecay)
    else:  # one solve against I (64 columns instead of Dk + Dv), then two products
        eye = torch.eye(chunk, **f32).expand_as(ut)
        inv = torch.linalg.solve_triangular(ut, eye, upper=False, unitriangular=True)
        new_values, k_cumdecay = inv @ v_beta, inv @ k_cumdecay
    del ut

    query.mul_(cum_exp)
    key.mul_((cum[..., -1:] - cum).exp().unsqueeze(-1))
    chunk_decay = cum[..., -1].exp()[..., None, None]  # exp of a strided view, as the reference takes it

    # chunk-major, so that each add writes one whole block; k_beta's pages when it fits
    out = k_beta.view(n, hv, chunk, dv) if dk == dv else torch.empty(n, hv, chunk, dv, **f32)
    for i in range(n):
        v_new = new_values[:, i] - k_cumdecay[:, i] @ state
        torch.add(query[:, i] @ state, intra[:, i] @ v_new, out=out[i])
        state.mul_(chunk_decay[:, i]).add_(key[:, i].transpose(-1, -2) @ v_new)
    out = out.permute(0, 2, 1, 3).reshape(tp, hv, dv)[:t]
    return out.to(v.dtype, memory_format=torch.contiguous_format)
