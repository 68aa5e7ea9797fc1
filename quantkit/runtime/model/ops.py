"""The ops a row of a one-token step calls, chosen once per route: `TorchOps`, `KernelOps`, `GraphOps`; and the
routed-experts op of each MoE block (`experts_op`), chosen once per layer.

Every op object has the same methods: `rms`, `add_rms` (the residual add and the post-attention norm), `attention`
and `gdn` (one token's attention core and Gated DeltaNet core between the projections; `gdn_rows`: a decode batch's
rows, each on its own cache; `attention_rows` and `gdn_run`: a run of consecutive rows on one cache, a prompt
chunk's or a verify's, each row as `attention` / `gdn` computes it after the rows before it), `topk` (the router's
softmax, top-k and renormalisation, each row of its logits), `silu_mul` and `combine` (x + routed + sigmoid(gate) *
shared). The model (model/qwen3_5_moe.py) calls them row by row or run by run (`runs_of`; the kernel's `gdn_rows`,
`attention_rows`, `gdn_run` and `topk` take every row in one call, each row's bits its own call's) and never asks
which it holds:
- `TorchOps`: torch ops, transformers' eager arithmetic dtype for dtype (a GPU, a CPU without quantkit's kernel);
- `KernelOps`: quantkit's CPU kernel's fused row ops (csrc/qk_step.cpp; a step is their one-row case) on the
  `stack` and `fused` routes;
- `GraphOps`: the torch ops with the position on the device (`Model.static_step`, what a CUDA graph captures).
An experts op takes one row, `one(h [1, H], wts [1, k], ids [1, k])`, and, where one kernel call takes every row
of a B-row step bit for bit as B one-row calls, `rows(h, wts, ids)` (else None: the model runs them one by one).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from quantkit.kernels import cpu as cpu_kernel
from quantkit.runtime.kernels import Kernel, Projections
from quantkit.runtime.qexperts import QuantExperts

# One-query attention in torch runs over the filled length rounded up to this many positions, the rest masked:
# oneDNN builds a bf16 matmul primitive per new shape, which costs several times the product itself.
KV_BUCKET = 64


# ---- torch's arithmetic, transformers' eager forward ----
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


def top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' router: softmax, top-k, renormalised; fp32 weights and int64 ids, [T, k] each."""
    probs = torch.softmax(logits, dtype=torch.float, dim=-1)
    top, ids = torch.topk(probs, k, dim=-1)
    return (top / top.sum(dim=-1, keepdim=True)).to(logits.dtype).float(), ids


# ---- rows through a dense matrix ----
def row_slices(x: torch.Tensor) -> list[slice]:
    return [slice(j, j + 1) for j in range(x.shape[0])]


def cat_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """Rows made one at a time, as one tensor (a single row as it is: a step makes one)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def runs_of(slots: list[tuple[Any, Any]]) -> list[tuple[Any, int, int]]:
    """The runs of consecutive rows on one cache in a step's slots [(cache, position), ..]: (cache, first row, rows)
    in row order (a cache's rows are consecutive and at consecutive positions: `Steps`)."""
    runs: list[tuple[Any, int, int]] = []
    for j, (c, _pos) in enumerate(slots):
        if runs and runs[-1][0] is c:
            runs[-1] = (c, runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((c, j, 1))
    return runs


def project_rows(p: Projections, h: torch.Tensor) -> list[torch.Tensor]:
    """Every matrix of `p` on all rows of h, each row's sums those of the row alone: on the CPU kernel one call
    for any count of rows, every matrix read once for all of them (`Projections.rows`)."""
    return p.rows(h)


def linear_rows(k: Kernel, h: torch.Tensor) -> torch.Tensor:
    """One matrix on all rows of h (`Kernel.rows`, as `project_rows`)."""
    return k.rows(h)


# ---- a row's ops ----
class TorchOps:
    """A step's row ops in torch. rms, add_rms, silu_mul and combine take rows [R, ..] and compute each as it would
    alone: torch's exp, sigmoid and reductions take a vector or a scalar route by the tensor's size, so those run row
    by row here (the kernel's ops below take all rows in one call, each row its own loop)."""

    joint_router = False  # a step's router logits in the shared expert's kernel call (the kernel's bf16 product)

    def rms(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        return cat_rows([rms(x[r], w, eps) for r in row_slices(x)])

    def add_rms(self, x: torch.Tensor, a: torch.Tensor, w: torch.Tensor, eps: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + a
        return x, self.rms(x, w, eps)

    def attention(self, m: Any, qo: torch.Tensor, ko: torch.Tensor, vo: torch.Tensor, keys: torch.Tensor,
                  values: torch.Tensor, n: Any, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """One token at position n: q/k norms, rotary, K/V written at n, the query over the filled length
        (rounded up to KV_BUCKET, the rest masked), the sigmoid gate. [1, heads * hd]."""
        q, gate = m.qk_written(qo, ko, vo, keys, values, n, cos, sin)
        span = min(-(-(n + 1) // KV_BUCKET) * KV_BUCKET, keys.shape[1])
        masked = torch.arange(span, device=q.device) > n if span > n + 1 else None
        return attend(q[0], keys[:, :span], values[:, :span], m.scaling, masked) * torch.sigmoid(gate)

    def attention_rows(self, m: Any, qo: torch.Tensor, ko: torch.Tensor, vo: torch.Tensor, keys: torch.Tensor,
                       values: torch.Tensor, n: Any, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """R rows of one cache at positions n, n + 1, ..: row j `attention` after rows 0..j-1. [R, heads * hd]."""
        if qo.shape[0] == 1:
            return self.attention(m, qo, ko, vo, keys, values, n, cos, sin)
        return cat_rows([self.attention(m, qo[r], ko[r], vo[r], keys, values, n + j, cos[r], sin[r])
                         for j, r in enumerate(row_slices(qo))])

    def gdn(self, m: Any, qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
            window: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        return m.core(qkv, z, b, a, window, state)[0]

    def gdn_run(self, m: Any, qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                window: torch.Tensor, state: torch.Tensor, keep: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """T rows of one cache through `gdn` in order, its window and state carried on: (the outputs [T, Hv * Dv],
        with `keep` the state after each row but the last [T - 1, Hv, Dk, Dv], else None)."""
        out, states = [], []
        for j, r in enumerate(row_slices(qkv)):
            out.append(self.gdn(m, qkv[r], z[r], b[r], a[r], window, state))
            if keep and j + 1 < qkv.shape[0]:
                states.append(state.clone())
        return cat_rows(out), (torch.stack(states) if states else None)

    def gdn_rows(self, m: Any, qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                 windows: list[torch.Tensor], states: list[torch.Tensor]) -> torch.Tensor:
        """`gdn` of every row j on its own window and state (the rows of a decode batch, each its own cache)."""
        return cat_rows([self.gdn(m, qkv[r], z[r], b[r], a[r], w, s)
                         for r, w, s in zip(row_slices(qkv), windows, states, strict=True)])

    def topk(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return top_k(logits, k)

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return cat_rows([F.silu(gate[r]) * up[r] for r in row_slices(gate)])

    def combine(self, x: torch.Tensor, routed: torch.Tensor, shared: torch.Tensor, sg: torch.Tensor) -> torch.Tensor:
        return cat_rows([x[r] + (routed[r].to(x.dtype) + torch.sigmoid(sg[r]) * shared[r]) for r in row_slices(x)])


class KernelOps(TorchOps):
    """quantkit's CPU kernel's fused row ops (bf16 rows on the CPU: what the `stack` and `fused` routes guarantee);
    an attention layer the kernel cannot take (`kernel_attends` False) keeps torch's."""

    joint_router = True

    def __init__(self, mod: Any):
        self.mod = mod

    def rms(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        return self.mod.rms(x.contiguous(), w, eps)

    def add_rms(self, x: torch.Tensor, a: torch.Tensor, w: torch.Tensor, eps: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.mod.add_rms(x, a, w, eps)

    def attention_rows(self, m: Any, qo: torch.Tensor, ko: torch.Tensor, vo: torch.Tensor, keys: torch.Tensor,
                       values: torch.Tensor, n: Any, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if not m.kernel_attends:
            return super().attention_rows(m, qo, ko, vo, keys, values, n, cos, sin)
        # one kernel call: each block of K/V read once for a tile of rows, each row's bits its own call's
        return self.mod.attn_rows(qo.contiguous(), ko.contiguous(), vo.contiguous(), m.qk_scale,
                                  cos.reshape(qo.shape[0], -1).contiguous(), sin.reshape(qo.shape[0], -1).contiguous(),
                                  keys, values, n, m.scaling, m.eps)

    def gdn_run(self, m: Any, qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                window: torch.Tensor, state: torch.Tensor, keep: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        # one kernel call: each head's state through the rows while it is in cache, each row's bits its own call's
        t = qkv.shape[0]
        kept = torch.empty((t - 1, *state.shape), dtype=state.dtype) if keep and t > 1 else torch.empty(0)
        out = self.mod.gdn_rows(qkv.contiguous(), z.contiguous(), b.contiguous(), a.contiguous(), window, m.conv_taps,
                                m.neg_a, m.dt_bias, m.norm_wf, m.norm_w.dtype == torch.bfloat16, state, kept, m.hk,
                                m.eps)
        return out, (kept if kept.numel() else None)

    def gdn_rows(self, m: Any, qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                 windows: list[torch.Tensor], states: list[torch.Tensor]) -> torch.Tensor:
        # one kernel call: every row's heads in one parallel region, each row's bits its own gdn_run's
        return self.mod.gdn_batch(qkv.contiguous(), z.contiguous(), b.contiguous(), a.contiguous(), windows,
                                  m.conv_taps, m.neg_a, m.dt_bias, m.norm_wf, m.norm_w.dtype == torch.bfloat16, states,
                                  m.hk, m.eps)

    def topk(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        # every row in one call, each as it is picked alone
        w, ids = self.mod.route(logits.reshape(-1, logits.shape[-1]).contiguous(), k)
        return w, ids

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.mod.silu_mul(gate, up)

    def combine(self, x: torch.Tensor, routed: torch.Tensor, shared: torch.Tensor, sg: torch.Tensor) -> torch.Tensor:
        # the routed sums as their op left them (the fused experts' fp32): moe_out rounds each once
        return self.mod.moe_out(x, routed.float().contiguous().view(-1), shared.contiguous(), sg.contiguous())


class GraphOps(TorchOps):
    """torch's ops with the position a device tensor [1]: K/V written by index, the query over the whole
    buffer with the positions after it masked, so every step has the same shapes and reads nothing on the host."""

    def attention(self, m: Any, qo: torch.Tensor, ko: torch.Tensor, vo: torch.Tensor, keys: torch.Tensor,
                  values: torch.Tensor, n: Any, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        qk, gate = m.qk(qo, ko, cos, sin)
        keys.index_copy_(1, n, qk[:, m.heads:].transpose(0, 1))
        values.index_copy_(1, n, vo.view(1, m.kv_heads, m.head_dim).transpose(0, 1))
        masked = torch.arange(keys.shape[1], device=n.device) > n
        return attend(qk[0, :m.heads], keys, values, m.scaling, masked) * torch.sigmoid(gate)


TORCH = TorchOps()


def on_device(ops: TorchOps, device: torch.device) -> TorchOps:
    """`ops` for rows on `device`: the kernel's on the CPU, torch's elsewhere (a head on a GPU)."""
    return ops if device.type == "cpu" else TORCH


class Fp32Router:
    """A step's router logits as an fp32 GEMV cast back to the rows' dtype (where the kernel's bf16 product of
    the router does not apply)."""

    def __init__(self, w: torch.Tensor):
        self.w32 = w.float()

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h.float(), self.w32).to(h.dtype)


def router_op(moe: Any, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """A step's router product for rows in `dtype`: the CPU kernel's bf16 one where the loader made it."""
    return moe.router_kernel if moe.router_kernel is not None and dtype == torch.bfloat16 else Fp32Router(moe.router_w)


def for_route(kind: str) -> TorchOps:
    """The ops of a route kind (model/route.py): the kernel's on `stack` and `fused`, else torch's."""
    mod = cpu_kernel.module() if kind in ("stack", "fused") else None
    return KernelOps(mod) if mod is not None else TORCH


# ---- a MoE block's routed experts, one token (or one row) at a time ----
class FusedExperts:
    """Every expert of the layer an int4 / int8 / bf16 matrix of the CPU kernel: a row in one `qk.moe` call (the
    fp32 sum as the kernel leaves it), several rows in one call where its experts are int4/int8 (each chosen
    expert read once for the rows that chose it, each row's sum bit for bit its own call's)."""

    def __init__(self, experts: QuantExperts):
        self.experts = experts

    def one(self, h: torch.Tensor, wts: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        mod, table, _ok = self.experts._fused_table()  # type: ignore[misc]
        return mod.moe(h, table, ids.view(-1), wts.view(-1)).view(1, -1)

    def rows(self, h: torch.Tensor, wts: torch.Tensor, ids: torch.Tensor) -> torch.Tensor | None:
        many = self.experts._rows_call()
        return many(h.contiguous(), ids, wts.float()) if many is not None else None


class HostExperts:
    """QuantExperts' one-token decode, the ids read on the host (experts on the CPU, or off it in a format the
    device cannot gather)."""

    def __init__(self, experts: QuantExperts):
        self.experts = experts

    def one(self, h: torch.Tensor, wts: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.experts._forward_one(h, ids.view(-1).tolist(), wts.view(1, -1))

    def rows(self, h: torch.Tensor, wts: torch.Tensor, ids: torch.Tensor) -> None:
        return None


class GatheredSplit(HostExperts):
    """Expert groups on a device gathered by routed id (model/experts.py), no host read; the groups left on the
    CPU (`cpu_groups`) run there after the one sync of the hand-off."""

    def __init__(self, experts: QuantExperts, gathered: list[Any], cpu_groups: frozenset[int]):
        super().__init__(experts)
        self.gathered, self.cpu_groups = gathered, cpu_groups

    def one(self, h: torch.Tensor, wts: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        ex, ids, wts = self.experts, ids.view(-1), wts.view(-1)
        out = torch.zeros(1, ex.hidden_dim, dtype=torch.float32, device=h.device)
        for g in self.gathered:
            out.add_(g(h, ids, wts).to(h.device))
        if self.cpu_groups:
            ids_c, wts_c = ids.cpu(), wts.cpu()
            keep = [s for s, e in enumerate(ids_c.tolist()) if ex._owner[e] in self.cpu_groups]
            if keep:
                part = ex._forward_one(h.cpu(), ids_c[keep].tolist(), wts_c[keep].view(1, -1))
                out.add_(part.float().to(h.device))
        return out.to(h.dtype)


def fuses_all(moe: Any) -> bool:
    """Whether every routed expert of a MoE block runs in the kernel's one fused call (none gathered on a device,
    none read by id on the host)."""
    fused = moe.experts._fused_table() if not moe.gathered and not moe.host_ids else None
    return fused is not None and all(fused[2])


def experts_op(moe: Any, device: torch.device) -> FusedExperts | HostExperts:
    """The one-token experts op of a MoE block whose layer sits on `device`."""
    if moe.fused_all:
        return FusedExperts(moe.experts)
    if moe.host_ids or (not moe.gathered and device.type == "cpu"):
        return HostExperts(moe.experts)
    return GatheredSplit(moe.experts, moe.gathered, moe.cpu_groups)
