"""The math of a Qwen3.5-MoE decoder layer for T tokens: gated attention, Gated DeltaNet and the MoE block.

Each layer computes x [T, H] (bf16) at positions cache.n .. cache.n + T - 1 and updates its part of the
`HybridCache`. The arithmetic is transformers' eager forward, dtypes included (bf16 activations, fp32 norms,
gates, conv and recurrent state), so the tests hold it to transformers layer by layer. Projections go through
the loader's `Kernel`s (quantized or bf16, on whichever device the plan put them).

One seam chooses how: `ops`, quantkit's CPU kernel module when the route (model/route.py) gives this layer
its fused one-token ops, else None. With `ops` a one-token step is about a dozen calls per layer (norms with
the residual add, the Gated DeltaNet core, the attention core, routing and the MoE sum: csrc/qk_step.cpp);
without it, or for T > 1 (prefill, multi-token verify), torch ops.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from quantkit.runtime.kernels import Kernel, Projections
from quantkit.runtime.model.cache import HybridCache, Trail
from quantkit.runtime.model.delta_rule import conv_tokens, delta_rule
from quantkit.runtime.model.experts import GatheredExperts
from quantkit.runtime.qexperts import QuantExperts

# One-query attention in torch runs over the filled length rounded up to this many positions, the rest masked:
# oneDNN builds a bf16 matmul primitive per new shape, which costs several times the product itself.
KV_BUCKET = 64


def rms(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' zero-centred RMSNorm with its multiplier (1 + w) precomputed in fp32."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * scale).to(x.dtype)


def gated_norm(x: torch.Tensor, gate: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen3_5MoeRMSNormGated: norm, weight in x's dtype, SiLU gate in fp32."""
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return ((w * y) * F.silu(gate.float())).to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot: int) -> torch.Tensor:
    """Rotary embedding of the first `rot` dims of x [..., head_dim] (cos, sin broadcast to [..., rot])."""
    xr, xp = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
    return torch.cat([xr * cos + rotated * sin, xp], dim=-1)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float,
           masked: torch.Tensor | None = None) -> torch.Tensor:
    """One query token [heads, hd] over keys and values [kv_heads, n, hd]: eager attention (bf16 scores,
    softmax in fp32 cast back), each group of query heads against its KV head. `masked` [n]: ignored."""
    kv, _n, hd = keys.shape
    scores = torch.bmm(q.reshape(kv, -1, hd), keys.transpose(1, 2)) * scaling
    if masked is not None:
        scores = scores.masked_fill(masked, float("-inf"))
    w = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.bmm(w, values).reshape(1, -1)


@dataclass
class Attention:
    """A gated full-attention layer: q (with its output gate), k, v, o and the q/k norms' constants."""

    q: Kernel
    k: Kernel
    v: Kernel
    o: Kernel
    qk_scale: torch.Tensor  # [heads + kv_heads, head_dim]: q_norm's (1 + w), then k_norm's
    heads: int
    kv_heads: int
    head_dim: int
    rot: int
    eps: float
    kernel_attends: bool = False  # the CPU kernel's attention takes this layer (head_dim a multiple of 16)
    qkv_in: Projections = field(init=False)
    o_one: Projections = field(init=False)

    def __post_init__(self) -> None:
        self.scaling = self.head_dim ** -0.5
        self.qkv_in = Projections([self.q, self.k, self.v])
        self.o_one = Projections([self.o])

    def __call__(self, h: torch.Tensor, cache: HybridCache, i: int, cos: torch.Tensor, sin: torch.Tensor,
                 ops: Any) -> torch.Tensor:
        qo, ko, vo = self.qkv_in(h)
        if cache.pos is not None:  # a static step (CUDA graphs): the position lives on the device
            return self.o(self.static_core(qo, ko, vo, cache.keys[i], cache.values[i], cache.pos, cos, sin))
        return self.o(self.core(qo, ko, vo, cache.keys[i], cache.values[i], cache.n, cos, sin, ops))

    def verify(self, h: torch.Tensor, cache: HybridCache, i: int, cos: torch.Tensor, sin: torch.Tensor,
               ops: Any) -> torch.Tensor:
        """T tokens as T one-token steps would compute them, bit for bit, the projections batched."""
        qo, ko, vo = self.qkv_in(h)
        keys, values, n = cache.keys[i], cache.values[i], cache.n
        rows = [self.core(qo[j:j + 1], ko[j:j + 1], vo[j:j + 1], keys, values, n + j, cos[j:j + 1], sin[j:j + 1], ops)
                for j in range(h.shape[0])]
        return self.o(torch.cat(rows))

    def core(self, qo: torch.Tensor, ko: torch.Tensor, vo: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
             n: int, cos: torch.Tensor, sin: torch.Tensor, ops: Any = None) -> torch.Tensor:
        """Between the projections: q/k norms, rotary, K/V written at n.., causal attention over keys and values
        [kv_heads, capacity, hd], the sigmoid gate. The input of o_proj, [T, heads * hd]."""
        t = qo.shape[0]
        if t == 1 and ops is not None and self.kernel_attends:
            return ops.attn_step(qo, ko, vo, self.qk_scale, cos.reshape(-1), sin.reshape(-1), keys, values, n,
                                 self.scaling, self.eps)
        qk, gate = self._qk(qo, ko, cos, sin)
        keys[:, n:n + t].copy_(qk[:, self.heads:].transpose(0, 1))
        values[:, n:n + t].copy_(vo.view(t, self.kv_heads, self.head_dim).transpose(0, 1))
        q = qk[:, :self.heads]
        if t == 1:
            out = self._one(q[0], keys, values, n, ops)
        else:  # causal over the cached positions and this chunk: SDPA, fp32 scores
            pos = torch.arange(n + t, device=qo.device)
            mask = None if n == 0 else pos <= (n + torch.arange(t, device=qo.device)).unsqueeze(1)
            out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), keys[None, :, :n + t],
                                                 values[None, :, :n + t], attn_mask=mask, is_causal=mask is None,
                                                 scale=self.scaling, enable_gqa=True)
            out = out[0].transpose(0, 1).reshape(t, -1)
        return out * torch.sigmoid(gate)

    def static_core(self, qo: torch.Tensor, ko: torch.Tensor, vo: torch.Tensor, keys: torch.Tensor,
                    values: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """`core` for one token at the device-side position `pos` [1]: K/V written by index, attention over the
        whole buffer with the positions after `pos` masked, so every step has the same shapes (what a captured
        CUDA graph replays) and nothing is read on the host."""
        qk, gate = self._qk(qo, ko, cos, sin)
        keys.index_copy_(1, pos, qk[:, self.heads:].transpose(0, 1))
        values.index_copy_(1, pos, vo.view(1, self.kv_heads, self.head_dim).transpose(0, 1))
        masked = torch.arange(keys.shape[1], device=pos.device) > pos
        return attend(qk[0, :self.heads], keys, values, self.scaling, masked) * torch.sigmoid(gate)

    def _qk(self, qo: torch.Tensor, ko: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k [T, heads + kv_heads, hd] normed and rotated, and the output gate [T, heads * hd]."""
        t = qo.shape[0]
        qg = qo.view(t, self.heads, 2 * self.head_dim)
        q, gate = qg[..., :self.head_dim], qg[..., self.head_dim:].reshape(t, -1)
        qk = rms(torch.cat([q, ko.view(t, self.kv_heads, self.head_dim)], dim=1), self.qk_scale, self.eps)
        return rotate(qk, cos.view(t, 1, -1), sin.view(t, 1, -1), self.rot), gate

    def _one(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, n: int, ops: Any) -> torch.Tensor:
        if ops is not None and self.kernel_attends and q.dtype == torch.bfloat16:
            return ops.attend(q, keys, values, n + 1, self.scaling).reshape(1, -1)
        span = min(-(-(n + 1) // KV_BUCKET) * KV_BUCKET, keys.shape[1])
        masked = torch.arange(span, device=q.device) > n if span > n + 1 else None
        return attend(q, keys[:, :span], values[:, :span], self.scaling, masked)


@dataclass
class DeltaNet:
    """A Gated DeltaNet layer: its projections, conv taps and fp32 constants."""

    qkv: Kernel
    z: Kernel
    b: Kernel
    a: Kernel
    out: Kernel
    conv_taps: torch.Tensor  # fp32 [K, C]
    neg_a: torch.Tensor  # -exp(A_log), fp32
    dt_bias: torch.Tensor  # fp32
    norm_w: torch.Tensor  # the gated norm's weight as stored
    hk: int
    hv: int
    dk: int
    dv: int
    eps: float
    proj_in: Projections = field(init=False)
    out_one: Projections = field(init=False)

    def __post_init__(self) -> None:
        self.proj_in = Projections([self.qkv, self.z, self.b, self.a])
        self.out_one = Projections([self.out])
        self.norm_wf = self.norm_w.float().contiguous()

    def __call__(self, h: torch.Tensor, cache: HybridCache, i: int, ops: Any, keep: bool) -> torch.Tensor:
        qkv, z, b, a = self.proj_in(h)
        window = cache.conv[i]
        before = window.clone() if keep else None
        core, states = self.core(qkv, z, b, a, window, cache.state[i], ops, keep)
        if keep:
            assert before is not None and states is not None
            cache.trail[i] = Trail(cache.n, torch.cat([before, qkv.to(before.dtype)]), states)
        return self.out(core)

    def verify(self, h: torch.Tensor, cache: HybridCache, i: int, ops: Any) -> torch.Tensor:
        """T tokens as T one-token steps would compute them, bit for bit, the projections batched; the state after
        every position kept for `cache.rewind`."""
        qkv, z, b, a = self.proj_in(h)
        window, state = cache.conv[i], cache.state[i]
        before, rows, states = window.clone(), [], []
        for j in range(h.shape[0]):
            r = slice(j, j + 1)
            rows.append(self.core(qkv[r], z[r], b[r], a[r], window, state, ops)[0])
            states.append(state.clone())
        cache.trail[i] = Trail(cache.n, torch.cat([before, qkv.to(before.dtype)]), torch.stack(states))
        return self.out(torch.cat(rows))

    def core(self, qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, window: torch.Tensor,
             state: torch.Tensor, ops: Any = None, keep: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Between the projections: causal conv (window [K, C] shifted in place), SiLU, gates, the delta rule on
        the fp32 state [Hv, Dk, Dv] (in place), gated norm. (The input of out_proj [T, Hv * Dv], with keep the
        state after every position [T, Hv, Dk, Dv].)"""
        t = qkv.shape[0]
        if t == 1 and ops is not None and window.dtype == torch.bfloat16:
            core = ops.gdn_step(qkv, z, b, a, window, self.conv_taps, self.neg_a, self.dt_bias, self.norm_wf,
                                self.norm_w.dtype == torch.bfloat16, state, self.hk, self.eps)
            return core, state.unsqueeze(0).clone() if keep else None
        x = conv_tokens(qkv, window, self.conv_taps)
        kd = self.hk * self.dk
        g = self.neg_a * F.softplus(a.float() + self.dt_bias)
        out, states = delta_rule(x[:, :kd].view(t, self.hk, self.dk), x[:, kd:2 * kd].view(t, self.hk, self.dk),
                                 x[:, 2 * kd:].view(t, self.hv, self.dv), g, b.sigmoid(), state, keep_states=keep)
        core = gated_norm(out.reshape(t * self.hv, self.dv), z.reshape(t * self.hv, self.dv), self.norm_w, self.eps)
        return core.view(t, -1), states


@dataclass
class MoE:
    """The sparse MoE block: router, routed experts (`QuantExperts`, split over devices as planned), shared
    expert with its sigmoid gate."""

    router_w: torch.Tensor  # as stored (bf16): transformers' router product for T > 1
    router_kernel: Kernel | None  # the CPU kernel's bf16 product at T = 1 (else an fp32 GEMV)
    top_k: int
    experts: QuantExperts
    shared_gate: Kernel
    shared_up: Kernel
    shared_down: Kernel
    shared_sigmoid: Kernel  # shared_expert_gate: [H] -> 1
    gathered: list[GatheredExperts] = field(default_factory=list)  # expert groups on a device, by routed id
    cpu_groups: frozenset[int] = frozenset()  # groups computed on the CPU beside gathered ones
    host_ids: bool = False  # experts off the CPU that only QuantExperts' decode runs: ids read on the host
    shared_in: Projections = field(init=False)

    def __post_init__(self) -> None:
        self.shared_in = Projections([self.shared_gate, self.shared_up, self.shared_sigmoid])
        self.router_w32 = self.router_w.float() if self.router_kernel is None else None  # the fp32 GEMV's
        fused = self.experts._fused_table() if not self.gathered and not self.host_ids else None
        self.fused_all = fused is not None and all(fused[2])
        # for the one-call stack (model/route.py): the shared expert's inputs with the router, the shared down
        self.shared_and_router = (Projections([*self.shared_in.kernels, self.router_kernel])
                                  if self.router_kernel is not None else None)
        self.down_one = Projections([self.shared_down])

    def route(self, h: torch.Tensor, ops: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Softmax, top-k, renormalised (transformers' router): fp32 weights and int64 ids, [T, k] each."""
        if h.shape[0] > 1:
            logits = F.linear(h, self.router_w)
        elif self.router_kernel is not None and h.dtype == torch.bfloat16:
            logits = self.router_kernel(h)
        else:
            w = self.router_w32 if self.router_w32 is not None else self.router_w.float()
            logits = F.linear(h.float(), w).to(h.dtype)
        if ops is not None and logits.dtype == torch.bfloat16 and h.shape[0] == 1:
            wts, ids = ops.route(logits, self.top_k)
            return wts.view(1, -1), ids.view(1, -1)
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        top, ids = torch.topk(probs, self.top_k, dim=-1)
        return (top / top.sum(dim=-1, keepdim=True)).to(logits.dtype).float(), ids

    def routed(self, h: torch.Tensor, wts: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum [T, H] in h's dtype."""
        ex = self.experts
        if h.shape[0] > 1:
            return ex(h, ids, wts)
        ids, wts = ids.view(-1), wts.view(-1)
        if self.fused_all:
            return self._fused_sum(h, wts, ids).view(h.shape).to(h.dtype)
        if self.host_ids or (not self.gathered and h.device.type == "cpu"):
            return ex._forward_one(h, ids.tolist(), wts.view(1, -1))
        out = torch.zeros(1, ex.hidden_dim, dtype=torch.float32, device=h.device)
        for g in self.gathered:
            out.add_(g(h, ids, wts).to(h.device))
        if self.cpu_groups:  # the hand-off: the one sync of a GPU+CPU split
            ids_c, wts_c = ids.cpu(), wts.cpu()
            keep = [s for s, e in enumerate(ids_c.tolist()) if ex._owner[e] in self.cpu_groups]
            if keep:
                part = ex._forward_one(h.cpu(), ids_c[keep].tolist(), wts_c[keep].view(1, -1))
                out.add_(part.float().to(h.device))
        return out.to(h.dtype)

    def _fused_sum(self, h: torch.Tensor, wts: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """fp32 [H]: one token's routed experts in one `qk.moe` call (every expert of this CPU layer fuses)."""
        mod, table, _ok = self.experts._fused_table()  # type: ignore[misc]
        return mod.moe(h, table, ids, wts)

    def add_to(self, x: torch.Tensor, h: torch.Tensor, ops: Any) -> torch.Tensor:
        """x + this block's output on h (the post-attention norm of x)."""
        gate, up, sg = self.shared_in(h)
        wts, ids = self.route(h, ops)
        if ops is not None and h.shape[0] == 1 and h.dtype == torch.bfloat16:
            shared = self.shared_down(ops.silu_mul(gate, up))
            if self.fused_all:  # the fp32 sum as the kernel leaves it: moe_out rounds it once
                routed = self._fused_sum(h, wts.view(-1), ids.view(-1))
            else:
                routed = self.routed(h, wts, ids).float().view(-1)
            return ops.moe_out(x, routed, shared, sg)
        shared = self.shared_down(F.silu(gate) * up)
        return x + (self.routed(h, wts, ids) + torch.sigmoid(sg) * shared)


@dataclass
class Layer:
    index: int
    device: torch.device
    pre: torch.Tensor  # input_layernorm's (1 + w), fp32
    post: torch.Tensor  # post_attention_layernorm's
    eps: float
    mixer: Attention | DeltaNet
    moe: MoE

    def __call__(self, x: torch.Tensor, cache: HybridCache, cos: torch.Tensor, sin: torch.Tensor, ops: Any,
                 keep: bool = False, last_only: bool = False) -> torch.Tensor:
        """The layer on x [T, H]; `keep`: as a speculative verify (`verify`), with `last_only` the last row alone
        returned [1, H] and the MoE block skipped for the rows before it."""
        if x.device != self.device:
            x, cos, sin = x.to(self.device), cos.to(self.device), sin.to(self.device)
        if keep and x.shape[0] > 1:
            return self.verify(x, cache, cos, sin, ops, last_only)
        ops = ops if ops is not None and x.shape[0] == 1 and x.dtype == torch.bfloat16 else None
        m = self.mixer
        h = self._pre(x, ops)
        a = m(h, cache, self.index, ops, keep) if isinstance(m, DeltaNet) else m(h, cache, self.index, cos, sin, ops)
        x, h2 = self._post(x, a, ops)
        return self.moe.add_to(x, h2, ops)

    def _pre(self, x: torch.Tensor, ops: Any) -> torch.Tensor:
        """The input norm (the kernel's where `ops`)."""
        return ops.rms(x, self.pre, self.eps) if ops is not None else rms(x, self.pre, self.eps)

    def _post(self, x: torch.Tensor, a: torch.Tensor, ops: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add of the mixer's output and the post-attention norm: (x + a, its norm)."""
        if ops is not None:
            return ops.add_rms(x, a, self.post, self.eps)
        x = x + a
        return x, rms(x, self.post, self.eps)

    def verify(self, x: torch.Tensor, cache: HybridCache, cos: torch.Tensor, sin: torch.Tensor,
               ops: Any, last_only: bool = False) -> torch.Tensor:
        """T tokens (a speculative verify) with the logits T one-token steps would give, bit for bit: the
        projections of the mixer run on all T rows at once (the kernels' rows are independent), everything else
        row by row as a step runs it. The states after every position are kept (`cache.rewind`). `last_only`:
        the last row's output alone (what the MTP layer drafts from); the earlier rows only write their caches,
        and no other row's output depends on their MoE block, which is skipped."""
        ops = ops if ops is not None and x.dtype == torch.bfloat16 else None
        t = x.shape[0]
        h = torch.cat([self._pre(x[j:j + 1], ops) for j in range(t)])
        m = self.mixer
        a = m.verify(h, cache, self.index, ops) if isinstance(m, DeltaNet) else m.verify(h, cache, self.index, cos, sin,
                                                                                          ops)
        out = []
        for j in range(t - 1 if last_only else 0, t):
            xj, hj = self._post(x[j:j + 1], a[j:j + 1], ops)
            out.append(self.moe.add_to(xj, hj, ops))
        return torch.cat(out)
