"""A lean batch-1 decode step for the whole Qwen3.5-MoE decoder stack: `LeanDecoder`.

Why: one decode step through transformers' `Qwen3_5MoeForCausalLM.forward` spends, besides reading the
weights, a fixed cost per layer in Python and small ops: decorated forwards (kwarg deprecation, output
capture, kernel-hub wrappers) and module calls with hooks, the causal and recurrent masks, the multimodal
rotary recomposition, zero-centred norms that add 1 to their weight on every call, q and k normalised and
rotated apart, `DynamicCache.update` growing K and V by `torch.cat` (a copy of the whole KV per layer per
token), the recurrent state copied onto itself by `update_recurrent_state`, the router's casts, and
`QuantExperts.forward` reading the expert ids back with `.tolist()` (a host sync on a GPU). On a CPU,
three torch paths cost more than the arithmetic they do: SDPA with one bf16 query (its flash path), a
bf16 matmul whose shape changes every token (oneDNN builds a new primitive per shape), and ops over the
conv state's [1, C, K] layout (each a stride-K walk); and a bf16 router GEMV is several times an fp32 one.

Contract: the step reads the SAME objects the loaded model holds (its `Kernel`s, norm weights,
`QuantExperts`, conv and gate parameters; derived constants are computed once: (1 + w) of each norm,
-exp(A_log), the conv taps and the router weight in fp32) and the SAME transformers `DynamicCache` the
prefill filled, so prefill stays transformers' forward and the prompt cache (`runtime.state_cache`) keeps
working. The math is transformers' with eager attention, op for op in its dtypes (bf16 activations, fp32
norms, gates, conv and recurrent state): the tests find logits and cache states bit-equal to
transformers' eager forward, and within stated bounds of the loader's SDPA attention (fp32 scores).

State while decoding: the Gated DeltaNet recurrent state is updated in place in the cache; the conv state
is held tap-major by the decoder (`ConvWindow`) and written back by `sync()`; full-attention K and V go
into a buffer the decoder owns (allocated by `begin` for the positions the generation may reach, the
prefill's K and V copied in), and the cache's `keys`/`values` are set to views of its filled part after
each step, so `get_seq_length` stays right and no prompt-cache snapshot ever points into the buffer
(snapshots are views of the prefill's own `torch.cat` results). Attention runs over the filled length
rounded up to `KV_BUCKET` positions, the rest masked.

On a CPU, quantkit's kernel (runtime/cpu_kernel.py) takes the step's pieces that torch runs as many small
ops: a layer's projections of one hidden state in one call (`Projections`), the Gated DeltaNet state
update (`linear_attn.delta_state_step`: one read and one write of the state), the router on the bf16
kernel, and, with dynamic KV, the attention over the filled positions (`qk.attend`). With dynamic KV
(`fused_ops`, the default; on every instruction set the kernel has) the rest of a layer follows (csrc/qk_step.cpp):
its norms with the residual add, the Gated DeltaNet core between its projections (`gdn_step`: conv
window, SiLU, gates, q/k l2-norm, state update, gated RMSNorm), the attention core (`attn_step`: q/k
norm, rotary, K/V write, attention, sigmoid gate), the routing and the MoE block's sum, so a layer is about
a dozen calls instead of forty-odd torch ops (per-layer overhead before and after in
reports/bench-decode.md). Where every layer takes that route on quantkit's matrices, `begin` fills the
kernel's `Layers` (csrc/qk_layers.cpp) and a step runs the whole stack in one call: the same calls in
C++, bit-equal (`one_call=False` keeps the loop in Python). They keep torch's dtypes and bf16 roundings with fp32 sums in another order: on
the test model every logit is still bit-equal to transformers' eager forward and the cache states agree
to 1e-7 (tests/test_decode_step.py, tests/test_step_ops.py state the bounds); `fused_ops=False` keeps
the torch route, bit-equal. The rotary's cos / sin come from a table made once per `ROPE_BLOCK`
positions, and a quantized embedding table's rows are kept once dequantized (`EMBED_ROWS`).

No host syncs inside the step: routing (softmax, top-k, renormalisation) stays on the layer's device;
CPU experts fused in quantkit's kernel take the expert ids as a CPU tensor; experts on another device run
through `GatheredExperts` (weights gathered by the routed ids on the device; dense, int8 and tinygemm
int4 kernels, other formats off the CPU keep QuantExperts' decode, which reads the ids on the host). On a GPU+CPU split
the copy of the routed ids to the CPU is the one sync. `static_kv=True` keeps every shape fixed
(attention over the whole buffer, masked from a device-side position), which `cuda_graphs=True` needs:
the step is then captured once in a `torch.cuda.CUDAGraph` and replayed (`CudaGraphStep`, CUDA only).

Switches: `QUANTKIT_LEAN_DECODE=0` (or `Runtime.lean_decode = False`) sends every step through
transformers' forward again; `QUANTKIT_CUDA_GRAPHS=1` has generation build its decoder with
`cuda_graphs=True` when the model sits on a CUDA device (off by default).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from quantkit.errors import QuantkitError
from quantkit.runtime import cpu_kernel
from quantkit.runtime.kernels import DenseKernel, Int4Kernel, Int8Kernel, Kernel, Projections, QBf16Kernel
from quantkit.runtime.linear_attn import delta_state_step
from quantkit.runtime.qexperts import QuantExperts
from quantkit.runtime.state_cache import set_token_count

ENV = "QUANTKIT_LEAN_DECODE"
GRAPHS_ENV = "QUANTKIT_CUDA_GRAPHS"
# Dynamic-KV attention runs over the filled length rounded up to this many positions, the rest masked:
# oneDNN builds a bf16 matmul primitive per new shape, which costs several times the product itself, so
# a shape that changes every token would pay it on every step.
KV_BUCKET = 64
ROPE_BLOCK = 256  # positions per table of rotary cos / sin (dynamic KV)
EMBED_ROWS = 4096  # dequantized embedding rows kept (16 MiB at hidden 2048 in bf16)


def enabled_by_env() -> bool:
    """Lean decode is on unless QUANTKIT_LEAN_DECODE=0."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def graphs_by_env(model: Any) -> bool:
    """QUANTKIT_CUDA_GRAPHS=1 asks for CUDA-graph decode (off by default), honoured for a model whose
    first layer is on a CUDA device (`CudaGraphStep` then checks that all of it is)."""
    if os.environ.get(GRAPHS_ENV, "0").strip() != "1":
        return False
    return on_cuda(model)


def on_cuda(model: Any) -> bool:
    """The model's first decoder layer is on a CUDA device."""
    return model.model.layers[0].input_layernorm.weight.device.type == "cuda"


def supports(model: Any) -> bool:
    """True for a Qwen3.5-MoE causal LM built by quantkit's loader (QuantExperts in every layer)."""
    if type(model).__name__ != "Qwen3_5MoeForCausalLM":
        return False
    cfg = model.config
    rope = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope in ("dynamic", "longrope") or cfg.hidden_act not in ("silu", "swish"):
        return False  # frequencies that change with the length; another activation: transformers' path
    return all(isinstance(layer.mlp.experts, QuantExperts) for layer in model.model.layers)


def _kernel(mod: Any) -> Any:
    """The callable behind a projection: a QuantLinear's Kernel, else the module itself."""
    return getattr(mod, "kernel", mod)


def _scale(norm: Any) -> torch.Tensor:
    """A zero-centred RMSNorm's multiplier (1 + w) in fp32, as transformers computes it on every call."""
    return 1.0 + norm.weight.float()


def rms(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen3_5MoeRMSNorm with the (1 + w) multiplier precomputed."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * scale).to(x.dtype)


# ---- experts on a device: gathered by the routed ids ------------------------------------------------------

class GatheredExperts:
    """The experts of one QuantExperts group computed without reading the ids on the host: each part of
    every expert stacked into one [E_g, ...] tensor (the kernels are re-pointed at views of it, so no
    weight is held twice), the k routed experts' weights gathered by index on the device, and slots whose
    expert lives in another group weighted 0. Dense (bf16), int8 and tinygemm int4 kernels (`possible`):
    int4 runs one tinygemm call per slot on the gathered packed tiles (tinygemm has no batched form)."""

    def __init__(self, experts: QuantExperts, group_index: int):
        g = experts.groups[group_index]
        self.device = g.device
        self.kind = "dense" if isinstance(g.gate_up[0], DenseKernel) else \
            "int4" if isinstance(g.gate_up[0], Int4Kernel) else "int8"
        self.gu = self._stack(g.gate_up)
        self.dn = self._stack(g.down)
        n = experts.num_experts
        local = torch.zeros(n, dtype=torch.long)
        own = torch.zeros(n, dtype=torch.float32)
        for li, e in enumerate(g.ids):
            local[e], own[e] = li, 1.0
        self.local, self.own = local.to(g.device), own.to(g.device)
        experts._fused = None  # kernel tensors moved: the fused CPU table is rebuilt from them

    @staticmethod
    def possible(group_kernels: list[Kernel]) -> bool:
        kinds = {type(k) for k in group_kernels}
        if len(kinds) != 1:
            return False
        kind = kinds.pop()
        if issubclass(kind, Int4Kernel):
            groups = {(k.out_features, k.in_features): k.group for k in group_kernels}  # one group per part
            return all(k.dup == 1 and groups[(k.out_features, k.in_features)] == k.group for k in group_kernels)
        return issubclass(kind, DenseKernel) or issubclass(kind, Int8Kernel)

    def _stack(self, kernels: list[Kernel]) -> tuple[torch.Tensor, torch.Tensor | None, Kernel]:
        if self.kind == "dense":
            w = torch.stack([k.w for k in kernels])
            for i, k in enumerate(kernels):
                k.w = w[i]
            return w, None, kernels[0]
        names = ("packed", "sz") if self.kind == "int4" else ("q", "s")
        q = torch.stack([getattr(k, names[0]) for k in kernels])
        s = torch.stack([getattr(k, names[1]) for k in kernels])
        for i, k in enumerate(kernels):
            setattr(k, names[0], q[i])
            setattr(k, names[1], s[i])
        return q, s, kernels[0]

    def _mm(self, part: tuple[torch.Tensor, torch.Tensor | None, Kernel], rows: torch.Tensor,
            x: torch.Tensor) -> torch.Tensor:
        """[k, out] = per slot W[rows[slot]] @ x[slot], x [k, in] in bf16."""
        w, s, k0 = part
        if self.kind == "int4":
            wk, sk = w.index_select(0, rows), s.index_select(0, rows)
            ys = [k0._mm(x[i:i + 1].contiguous(), wk[i], k0.group, sk[i])  # type: ignore[attr-defined]
                  for i in range(x.shape[0])]
            return torch.cat(ys)[:, :k0.out_features]
        if s is None:
            return torch.bmm(w[rows], x.unsqueeze(-1)).squeeze(-1)
        y = torch.bmm(w[rows].to(x.dtype), x.unsqueeze(-1)).squeeze(-1)
        return y * s[rows]

    def __call__(self, h: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor) -> torch.Tensor:
        """fp32 [1, H]: sum over slots of wts * expert(h), experts of other groups contributing 0."""
        rows = self.local[ids]
        k = ids.numel()
        x = h.to(self.device, torch.bfloat16).expand(k, -1)
        gate, up = self._mm(self.gu, rows, x).chunk(2, dim=-1)
        y = self._mm(self.dn, rows, F.silu(gate) * up)
        w = (wts.to(self.device) * self.own[ids]).unsqueeze(-1)
        return (y.float() * w).sum(0, keepdim=True)


# ---- the layers ------------------------------------------------------------------------------------------

@dataclass
class _Moe:
    """A layer's sparse MoE block: router, routed experts, shared expert with its sigmoid gate."""

    # the router's weight in fp32 (torch's bf16 GEMV is several times slower on CPU), or as stored where
    # router_kernel runs: quantkit's bf16 kernel on the CPU (the bf16 products summed in fp32, rounded to
    # bf16; faster than the fp32 GEMV for 256 experts: reports/bench-kernel.md)
    router_w: torch.Tensor
    router_kernel: Kernel | None
    top_k: int
    experts: QuantExperts
    shared_gate_proj: Any  # the shared expert's MLP: gate_proj, up_proj, down_proj
    shared_up: Any
    shared_down: Any
    shared_sigmoid_gate: Any  # shared_expert_gate: [H] -> 1, through a sigmoid
    device: torch.device
    gathered: list[GatheredExperts] = field(default_factory=list)
    cpu_fused_all: bool = False
    cpu_groups: frozenset[int] = frozenset()  # groups computed on the CPU when others are gathered
    host_ids: bool = False  # experts off the CPU that cannot be gathered: the ids are read on the host
    step: Any = None  # quantkit's kernel module when the step's fused ops run this CPU layer (`fused_ops`)
    shared_in: Projections = field(init=False)  # gate_proj, up_proj and the sigmoid gate, all on h
    # for the one-call layer loop (`Layers`): the same three with the router's matrix, and the shared down
    shared_and_router: Projections | None = field(init=False)
    down_one: Projections = field(init=False)

    def __post_init__(self) -> None:
        self.shared_in = Projections([self.shared_gate_proj, self.shared_up, self.shared_sigmoid_gate])
        self.shared_and_router = (Projections([*self.shared_in.kernels, self.router_kernel])
                                  if self.router_kernel is not None else None)
        self.down_one = Projections([self.shared_down])

    @property
    def has_cpu(self) -> bool:
        return bool(self.cpu_groups)

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' Qwen3_5MoeTopKRouter on the device: (fp32 weights [k], int64 ids [k])."""
        if self.router_kernel is not None and h.dtype == torch.bfloat16:
            logits = self.router_kernel(h)
        else:
            logits = F.linear(h.float(), self.router_w.float()).to(h.dtype)
        if self.step is not None and logits.dtype == torch.bfloat16:
            wts, ids = self.step.route(logits, self.top_k)
            return wts, ids
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        top, ids = torch.topk(probs, self.top_k, dim=-1)
        top = (top / top.sum(dim=-1, keepdim=True)).to(logits.dtype)
        return top.reshape(-1).float(), ids.reshape(-1)

    def routed(self, h: torch.Tensor, wts: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum [1, H] in h's dtype."""
        ex = self.experts
        if self.cpu_fused_all:
            return self._fused_sum(h, wts, ids).view(h.shape).to(h.dtype)
        if self.host_ids or (not self.gathered and h.device.type == "cpu"):
            # a CPU layer (its ids are host memory), or experts only QuantExperts' own decode can run
            return ex._forward_one(h, ids.tolist(), wts.view(1, -1))
        out = torch.zeros(1, ex.hidden_dim, dtype=torch.float32, device=h.device)
        for g in self.gathered:
            out.add_(g(h, ids, wts).to(h.device))
        if self.has_cpu:  # the hand-off: the one sync of a GPU+CPU split
            out.add_(self._cpu_part(h, wts, ids).to(h.device))
        return out.to(h.dtype)

    def _fused_sum(self, h: torch.Tensor, wts: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """fp32 [H]: a CPU layer whose experts all run in quantkit's fused kernel, one `qk.moe` call."""
        mod, table, _ok = self.experts._fused_table()  # type: ignore[misc]
        return mod.moe(h, table, ids, wts)

    def _cpu_part(self, h: torch.Tensor, wts: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """fp32 [1, H] on the CPU: the slots whose experts live in the CPU groups, through QuantExperts'
        decode (quantkit's fused kernel where it applies), the others weighted out."""
        ex = self.experts
        ids_c, wts_c = ids.to("cpu"), wts.to("cpu")
        keep = [s for s, e in enumerate(ids_c.tolist()) if ex._owner[e] in self.cpu_groups]
        if not keep:
            return torch.zeros(1, ex.hidden_dim, dtype=torch.float32)
        return ex._forward_one(h.to("cpu"), ids_c[keep].tolist(), wts_c[keep].view(1, -1)).float()

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        gate, up, sg = self.shared_in(h)
        shared = self.shared_down(F.silu(gate) * up)
        wts, ids = self.route(h)
        out = self.routed(h, wts, ids)
        return out + torch.sigmoid(sg) * shared

    def add_to(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """x + this block's output on h (h = the post-attention norm of x)."""
        f = self.step
        if f is None or h.dtype != torch.bfloat16:
            return x + self(h)
        gate, up, sg = self.shared_in(h)
        shared = self.shared_down(f.silu_mul(gate, up))
        wts, ids = self.route(h)
        routed = (self._fused_sum(h, wts, ids) if self.cpu_fused_all
                  else self.routed(h, wts, ids).float().view(-1))
        return f.moe_out(x, routed, shared, sg)


@dataclass
class _Norms:
    pre: torch.Tensor
    post: torch.Tensor
    eps: float


@dataclass
class _Attn:
    """A gated full-attention layer's projections and the constants of its q/k norm and rotary."""

    q: Any
    k: Any
    v: Any
    o: Any
    qk_scale: torch.Tensor  # [heads + kv_heads, head_dim]: q_norm's (1 + w) then k_norm's
    heads: int
    kv_heads: int
    head_dim: int
    rot: int
    scaling: float
    eps: float
    qkv_in: Projections = field(init=False)
    o_one: Projections = field(init=False)  # o_proj as a one-matrix table (the one-call layer loop)

    def __post_init__(self) -> None:
        self.qkv_in = Projections([self.q, self.k, self.v])
        self.o_one = Projections([self.o])


@dataclass
class _Linear:
    """A Gated DeltaNet layer's projections and fp32 constants."""

    qkv: Any
    z: Any
    b: Any
    a: Any
    out: Any
    conv_w: list[torch.Tensor]  # per tap: fp32 [C]
    neg_a: torch.Tensor  # -exp(A_log) in fp32
    dt_bias: torch.Tensor
    norm_w: torch.Tensor
    key_dim: int
    value_dim: int
    hk: int
    hv: int
    dk: int
    dv: int
    proj_in: Projections = field(init=False)  # in_proj_qkv, _z, _b, _a, all on h
    out_one: Projections = field(init=False)  # out_proj as a one-matrix table (the one-call layer loop)
    # for the kernel's gdn_step: the taps as one fp32 [K, C], dt_bias and the norm weight in fp32
    conv_taps: torch.Tensor = field(init=False)
    dt_bias_f: torch.Tensor = field(init=False)
    norm_wf: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.proj_in = Projections([self.qkv, self.z, self.b, self.a])
        self.out_one = Projections([self.out])
        self.conv_taps = torch.stack(self.conv_w).contiguous()
        self.dt_bias_f = self.dt_bias.float().contiguous()
        self.norm_wf = self.norm_w.float().contiguous()


@dataclass
class _Layer:
    index: int
    device: torch.device
    norms: _Norms
    mixer: _Attn | _Linear
    moe: _Moe


def _moe(layer: Any, dev: torch.device, gather: frozenset[int] | None) -> _Moe:
    mlp = layer.mlp
    ex: QuantExperts = mlp.experts
    if not isinstance(ex, QuantExperts):
        raise TypeError("lean decode needs QuantExperts (a model built by quantkit's loader)")
    se = mlp.shared_expert
    rw = mlp.gate.weight
    router_kernel = (QBf16Kernel(rw, shared=True) if rw.dtype == torch.bfloat16 and rw.is_contiguous()
                     and cpu_kernel.supports("bf16", tuple(rw.shape), rw.device) else None)
    m = _Moe(router_w=rw.float() if router_kernel is None else rw, router_kernel=router_kernel,
             top_k=mlp.gate.top_k, experts=ex, shared_gate_proj=_kernel(se.gate_proj), shared_up=_kernel(se.up_proj), shared_down=_kernel(se.down_proj),
             shared_sigmoid_gate=_kernel(mlp.shared_expert_gate), device=dev)
    off_cpu = [i for i, g in enumerate(ex.groups) if (g.device.type != "cpu" if gather is None else i in gather)]
    m.cpu_groups = frozenset(i for i in range(len(ex.groups)) if i not in off_cpu)
    if off_cpu:
        if all(GatheredExperts.possible(ex.groups[i].gate_up + ex.groups[i].down) for i in off_cpu):
            m.gathered = [GatheredExperts(ex, i) for i in off_cpu]
        else:  # e.g. int4 experts on a GPU: QuantExperts' own decode, which reads the ids on the host
            m.cpu_groups, m.host_ids = frozenset(), True
        return m
    fused = ex._fused_table() if dev.type == "cpu" else None
    m.cpu_fused_all = fused is not None and all(fused[2])
    return m


def _attn(layer: Any) -> _Attn:
    sa = layer.self_attn
    cfg = sa.config
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = sa.head_dim
    qs, ks = _scale(sa.q_norm), _scale(sa.k_norm)
    scale = torch.cat([qs.expand(heads, hd), ks.expand(kv, hd)])
    rot = int(hd * cfg.rope_parameters.get("partial_rotary_factor", 1.0)) // 2 * 2
    return _Attn(_kernel(sa.q_proj), _kernel(sa.k_proj), _kernel(sa.v_proj), _kernel(sa.o_proj), scale,
                 heads, kv, hd, rot, sa.scaling, sa.q_norm.eps)


def _linear(layer: Any) -> _Linear:
    la = layer.linear_attn
    w = la.conv1d.weight.squeeze(1).float()  # [C, K]
    if la.conv1d.bias is not None:
        raise TypeError("lean decode assumes the Gated DeltaNet conv has no bias (as Qwen3.5-MoE's)")
    return _Linear(_kernel(la.in_proj_qkv), _kernel(la.in_proj_z), _kernel(la.in_proj_b), _kernel(la.in_proj_a),
                   _kernel(la.out_proj), [w[:, j].contiguous() for j in range(w.shape[1])],
                   -la.A_log.float().exp(), la.dt_bias, la.norm.weight, la.key_dim, la.value_dim,
                   la.num_k_heads, la.num_v_heads, la.head_k_dim, la.head_v_dim)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def linear_mixer(m: _Linear, eps: float, h: torch.Tensor, conv: ConvWindow,
                 state: torch.Tensor) -> torch.Tensor:
    """One token through a Gated DeltaNet layer, conv window and recurrent state updated in place:
    transformers' Qwen3_5MoeGatedDeltaNet with quantkit's CPU conv and delta rule
    (runtime/linear_attn.py), op for op."""
    qkv, z, b, a = m.proj_in(h)  # qkv [1, C]
    return m.out(linear_core(m, eps, qkv, z, b, a, conv, state))


def linear_core(m: _Linear, eps: float, qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                conv: ConvWindow, state: torch.Tensor) -> torch.Tensor:
    """`linear_mixer` between the projections: the input of out_proj [1, Hv*Dv] (what the kernel's
    `gdn_step` computes in one call)."""
    nf = conv.push(qkv).float()  # [K, C]: the last K inputs, oldest first
    acc = nf[0] * m.conv_w[0]
    for j in range(1, len(m.conv_w)):
        acc.add_(nf[j] * m.conv_w[j])
    x = F.silu(acc).to(qkv.dtype).view(1, -1)
    qk, v = x[:, :2 * m.key_dim], x[:, 2 * m.key_dim:]  # q then k, then v
    beta = b.sigmoid()
    g = m.neg_a * F.softplus(a.float() + m.dt_bias)
    core = _delta_rule(m, qk, v, g, beta, state)  # [Hv, V] in the activations' dtype
    return _gated_norm(core, z.view(m.hv, m.dv), m.norm_w, eps).view(1, -1)


def _delta_rule(m: _Linear, qk: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor) -> torch.Tensor:
    """runtime.linear_attn.recurrent_gated_delta_rule for one token and batch 1 (its fp32 state [1, Hv, K, V]);
    q and k, adjacent in the conv output, normalised as one [2 Hk, K] tensor (the same rows)."""
    qkf = _l2norm(qk.view(2 * m.hk, m.dk).float()).view(2, m.hk, m.dk)
    if m.hv != m.hk:
        qkf = qkf.repeat_interleave(m.hv // m.hk, dim=1)
    qf, kf = qkf[0] / (m.dk ** 0.5), qkf[1]
    out = delta_state_step(qf, kf, v.float().view(m.hv, m.dv), g.view(m.hv), beta.float().view(m.hv),
                           state.view(m.hv, m.dk, m.dv))
    return out.to(qk.dtype)


def _gated_norm(x: torch.Tensor, gate: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen3_5MoeRMSNormGated: norm, weight in x's dtype, SiLU gate in fp32."""
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return ((w * y) * F.silu(gate.float())).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot: int) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb on [rows, head_dim] (partial rotary: the first `rot` dims)."""
    xr, xp = x[:, :rot], x[:, rot:]
    half = rot // 2
    rotated = torch.cat([-xr[:, half:], xr[:, :half]], dim=-1)
    return torch.cat([xr * cos + rotated * sin, xp], dim=-1)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float,
           masked: torch.Tensor | None = None) -> torch.Tensor:
    """One query token over [kv_heads, n, head_dim] keys and values: transformers' eager attention
    (bf16 scores scaled, softmax in fp32 cast back, bf16 weighted sum), each group of query heads against
    its key/value head without repeating K and V. `masked` [n] bool marks positions to ignore. torch's
    CPU SDPA (the loader's attention) takes a flash-attention path for one bf16 query that costs many
    times this at every length, so the lean step does not use it."""
    kv, _n, hd = keys.shape
    qg = q.reshape(kv, -1, hd)
    scores = torch.bmm(qg, keys.transpose(1, 2)) * scaling
    if masked is not None:
        scores = scores.masked_fill(masked, float("-inf"))
    w = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.bmm(w, values)  # [kv, heads / kv, hd]: query heads in order


class ConvWindow:
    """A Gated DeltaNet layer's conv state held tap-major, [K, C], while this decoder runs: the cache's
    own layout, [1, C, K], makes every op of the 4-tap conv a stride-K walk over C channels, which costs
    tens of times the same op on rows. `sync` writes it back into the cache's tensor."""

    def __init__(self, conv_state: torch.Tensor):
        self.cache_state = conv_state
        self.rows = conv_state[0].t().contiguous()

    def push(self, x: torch.Tensor) -> torch.Tensor:
        """Shift in x [1, C]; the new window [K, C] (also the state kept)."""
        new = torch.cat([self.rows[1:], x.to(self.rows.dtype)])
        self.rows.copy_(new)
        return new

    def sync(self) -> None:
        self.cache_state.copy_(self.rows.t().unsqueeze(0))


# ---- the decoder -------------------------------------------------------------------------------------------

class KVBuffer:
    """One attention layer's K and V for this generation: [1, kv_heads, capacity, head_dim] each."""

    def __init__(self, layer_cache: Any, capacity: int):
        k, v = layer_cache.keys, layer_cache.values
        n = k.shape[-2]
        self.k = k.new_zeros(*k.shape[:2], capacity, k.shape[-1])
        self.v = v.new_zeros(*v.shape[:2], capacity, v.shape[-1])
        self.k[:, :, :n].copy_(k)
        self.v[:, :, :n].copy_(v)
        self.cache = layer_cache
        self.positions = torch.arange(capacity, device=k.device)  # static mode's mask: positions > pos

    def publish(self, n: int) -> None:
        """Point the transformers cache layer at the first n positions."""
        self.cache.keys, self.cache.values = self.k[:, :, :n], self.v[:, :, :n]


class LeanDecoder:
    """Batch-1 decode over a loaded Qwen3.5-MoE: `begin(cache, capacity)` after the prefill, then
    `step(token)` -> logits [V] per token. See the module docstring. `gather_groups`: the expert groups
    (by index in each layer's QuantExperts) computed by `GatheredExperts`; None: those off the CPU (the
    tests name CPU groups to run that path, and a split, on a CPU-only machine)."""

    def __init__(self, model: Any, *, static_kv: bool = False, cuda_graphs: bool = False,
                 gather_groups: frozenset[int] | None = None, fused_ops: bool = True, one_call: bool = True):
        tm = model.model
        cfg = model.config
        self.model = model
        self.static_kv = static_kv or cuda_graphs
        self.cuda_graphs = cuda_graphs
        self.embed = tm.embed_tokens
        self._rows: dict[int, torch.Tensor] = {}  # insertion-ordered: the oldest first
        self.final = (_scale(tm.norm), tm.norm.eps)
        self.head = _kernel(model.lm_head)
        self.head_device = tm.norm.weight.device
        self.inv_freq = tm.rotary_emb.inv_freq.float()
        self.rope_scaling = float(tm.rotary_emb.attention_scaling)
        self.layers: list[_Layer] = []
        for i, layer in enumerate(tm.layers):
            dev = layer.input_layernorm.weight.device
            norms = _Norms(_scale(layer.input_layernorm), _scale(layer.post_attention_layernorm),
                           layer.input_layernorm.eps)
            mixer = _linear(layer) if cfg.layer_types[i] == "linear_attention" else _attn(layer)
            self.layers.append(_Layer(i, dev, norms, mixer, _moe(layer, dev, gather_groups)))
        self.cache: Any = None
        self.kv: dict[int, KVBuffer] = {}
        self.conv: dict[int, ConvWindow] = {}
        self.n = 0
        self.capacity = 0
        self.pos: torch.Tensor | None = None
        self._rope: dict[tuple[torch.dtype, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.graph: CudaGraphStep | None = None
        # a CPU layer's attention on quantkit's kernel (`qk.attend`, every instruction set)
        self.attend_kernel = cpu_kernel.module() if not static_kv else None
        # a quantized embedding's rows kept (`_embed`) on an all-CPU decoder: elsewhere reading the token id
        # would be the host read the device path avoids
        parts = getattr(self.embed, "parts", None)  # a QuantEmbedding (runtime/loader.py)
        self._cache_rows = (bool(parts) and all(t.device.type == "cpu" for t in parts.values())
                            and not self.static_kv and all(not L.moe.gathered and not L.moe.host_ids
                                                           and L.device.type == "cpu" for L in self.layers))
        # a CPU layer's norms, mixer core, routing and MoE sum as the kernel's fused ops (every instruction set)
        mod = cpu_kernel.module()
        self.step_ops = mod if fused_ops and mod is not None and not self.static_kv else None
        for L in self.layers:
            if L.device.type == "cpu":
                L.moe.step = self.step_ops
        self.one_call = one_call
        self.stack: Any = None  # the kernel's `Layers` for this generation, where `_stack` can make one
        self.stack_head = False  # whether `stack` also runs the final norm and the head (`_stack_head`)

    # -- state --
    def begin(self, cache: Any, capacity: int) -> None:
        """Take over `cache` (a DynamicCache the prefill filled) for up to `capacity` positions in all."""
        self.cache = cache
        self.n = int(cache.get_seq_length())  # a tensor from transformers >= 5.25
        self.capacity = capacity
        if capacity <= self.n:
            raise ValueError(f"capacity {capacity} leaves no room after {self.n} cached tokens")
        self.kv = {L.index: KVBuffer(cache.layers[L.index], capacity)
                   for L in self.layers if isinstance(L.mixer, _Attn)}
        self.conv = {L.index: ConvWindow(cache.layers[L.index].conv_states[0])
                     for L in self.layers if isinstance(L.mixer, _Linear)}
        # the device-side position the static-KV step reads (a host int would be baked into a CUDA graph)
        self.pos = torch.full((1,), self.n, dtype=torch.long, device=self.inv_freq.device) if self.static_kv else None
        self.graph = None
        self.stack = self._stack() if self.one_call else None
        self.stack_head = self.stack is not None and self._stack_head(self.stack)
        if self.cuda_graphs and self.inv_freq.device.type == "cuda":
            try:
                self.graph = CudaGraphStep(self)
            except ValueError as e:
                raise QuantkitError(f"CUDA-graph decode: {e}; load without cuda_graphs") from None

    def sync(self) -> None:
        """Write the conv windows back into the cache and point its K/V at the filled positions (its
        recurrent states are current after every step): call before anything else reads the cache."""
        for w in self.conv.values():
            w.sync()
        for buf in self.kv.values():
            buf.publish(self.n)
        if self.cache is not None:
            set_token_count(self.cache, self.n)

    def end(self) -> None:
        """`sync`, then let go of the cache and this generation's buffers."""
        self.sync()
        self.cache, self.kv, self.conv, self.graph, self.stack = None, {}, {}, None, None
        self.stack_head = False

    def step(self, token: torch.Tensor | int) -> torch.Tensor:
        """Logits [V] of the next token after `token`: [1, 1] int64 on the embedding's device, or the id
        (then no tensor is made for it where the embedding's rows are kept)."""
        if self.n >= self.capacity:
            raise ValueError(f"the decoder was begun for {self.capacity} positions; all are filled")
        logits = self.graph.replay(self._ids(token)) if self.graph is not None else self.forward(token)
        self.n += 1
        return logits

    # -- the step itself (no host reads of device values) --
    def forward(self, token: torch.Tensor | int) -> torch.Tensor:
        x = self._embed(token).view(1, -1)
        stacked = self.stack is not None and x.dtype == torch.bfloat16 and x.device.type == "cpu"
        if stacked and self.stack_head:
            cos, sin, row = self._rope_table(x.dtype)
            return self.stack.step(x, cos, sin, row, self.n)
        cos, sin = self._rotary(x.dtype)
        if stacked:
            x = self.stack.run(x, cos.reshape(-1), sin.reshape(-1), self.n)
        else:
            for L in self.layers:
                x = self._layer(L, x, cos, sin)
        x = x.to(self.head_device)
        f = self._ops(x)
        x = f.rms(x, *self.final) if f is not None else rms(x, *self.final)
        if self.pos is not None:
            self.pos.add_(1)
        return self.head(x).view(-1)

    def _stack(self) -> Any:
        """The whole stack of layers as one call of the kernel (`qk.Layers`, csrc/qk_layers.cpp): the fused
        route's calls in C++, bit-equal to `_layer_fused` layer by layer. None unless every layer takes that
        route on quantkit's kernels: CPU, the kernel's attention, bf16 conv windows, every projection a
        `QKernel` / `QBf16Kernel` table, the routed experts in one `qk.moe` call, the router on the bf16 kernel."""
        if not self.one_call_possible():
            return None
        stack = self.step_ops.Layers()
        for L in self.layers:
            m, moe = L.mixer, L.moe
            pre, post, eps = L.norms.pre, L.norms.post, L.norms.eps
            if isinstance(m, _Linear):
                conv = self.conv[L.index].rows
                if conv.dtype != torch.bfloat16:
                    return None
                state = self.cache.layers[L.index].recurrent_states[0].view(m.hv, m.dk, m.dv)
                stack.add_gdn(pre, post, eps, m.proj_in.table, m.out_one.table, conv, m.conv_taps, m.neg_a,
                              m.dt_bias_f, m.norm_wf, m.norm_w.dtype == torch.bfloat16, state, m.hk)
            else:
                buf = self.kv[L.index]
                stack.add_attention(pre, post, eps, m.qkv_in.table, m.o_one.table, m.qk_scale, buf.k[0], buf.v[0],
                                    m.scaling, m.eps)
            stack.set_moe(moe.shared_and_router.table, moe.down_one.table, moe.experts._fused_table()[1], moe.top_k)
        return stack

    def one_call_possible(self) -> bool:
        """Whether every layer can take the one-call stack (what `_stack` checks before the cache exists):
        CPU, fused ops, every projection on quantkit's kernel, the experts in one `qk.moe` call."""
        f = self.step_ops
        if not self.one_call or f is None or not hasattr(f, "Layers"):
            return False
        for L in self.layers:
            m, moe = L.mixer, L.moe
            if L.device.type != "cpu" or not moe.cpu_fused_all or moe.shared_and_router is None:
                return False
            tables = [moe.shared_and_router, moe.down_one] + (
                [m.proj_in, m.out_one] if isinstance(m, _Linear) else [m.qkv_in, m.o_one])
            if not all(p.fused for p in tables) or (isinstance(m, _Attn) and not self._attends(m)):
                return False
        return True

    def route(self) -> dict[str, Any]:
        """How this decoder computes a step on the CPU: the kernel's instruction set and op table, whether
        the CPU layers run the fused ops, and whether the whole stack is one call."""
        cpu = any(L.device.type == "cpu" for L in self.layers)
        return {"isa": cpu_kernel.isa(), "table": cpu_kernel.isa_name(),
                "fused_ops": cpu and self.step_ops is not None, "one_call": self.one_call_possible()}

    def _stack_head(self, stack: Any) -> bool:
        """Give `stack` the final norm and the head where the head is on quantkit's CPU kernel, so that a
        step after the embedding is one call: the rotary's row, the norm and the head were torch ops from
        Python, each slow right after a step has streamed the weights through the caches. Same calls,
        same logits."""
        head = Projections([self.head])  # a table where the head is a QKernel / QBf16Kernel
        if self.head_device.type != "cpu" or not head.fused:
            return False
        self._head_table = head.table  # kept alive beside the stack that reads it
        stack.set_head(self.final[0], self.final[1], self._head_table)
        return True

    def _ids(self, token: torch.Tensor | int) -> torch.Tensor:
        """`token` as the [1, 1] int64 tensor the embedding module takes."""
        if isinstance(token, torch.Tensor):
            return token
        w = getattr(self.embed, "weight", None)
        return torch.tensor([[token]], dtype=torch.long, device=w.device if isinstance(w, torch.Tensor) else "cpu")

    def _embed(self, token: torch.Tensor | int) -> torch.Tensor:
        """The token's embedding row. A quantized table on the CPU dequantizes a row in a dozen small ops,
        so its rows are kept once made (up to EMBED_ROWS, least recently used first out); elsewhere the
        module itself (reading the id back would be a host sync on a GPU)."""
        if not self._cache_rows:
            return self.embed(self._ids(token))
        t = int(token)
        row = self._rows.pop(t, None)
        if row is None:
            row = self.embed(self._ids(token))
            if len(self._rows) >= EMBED_ROWS:
                self._rows.pop(next(iter(self._rows)))
        self._rows[t] = row
        return row

    def _rotary(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [1, rot] at the current position: the text rotary of Qwen3_5MoeTextRotaryEmbedding
        (text positions are equal on its three axes, so the interleaved recomposition is the identity).
        With dynamic KV, rows of a table made once per ROPE_BLOCK positions (the same ops on more rows:
        ten small ops a step saved); with static KV from the device-side position."""
        if not self.static_kv:
            cos, sin, row = self._rope_table(dtype)
            return cos[row:row + 1], sin[row:row + 1]
        assert self.pos is not None
        return self._rope_rows(self.pos, dtype)

    def _rope_table(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, int]:
        """cos, sin [ROPE_BLOCK, rot] for the block of positions holding n, and n's row in them."""
        block, row = divmod(self.n, ROPE_BLOCK)
        key = (dtype, block)
        if key not in self._rope:
            pos = torch.arange(block * ROPE_BLOCK, (block + 1) * ROPE_BLOCK, device=self.inv_freq.device)
            self._rope = {key: self._rope_rows(pos, dtype)}  # one block at a time: positions only grow
        cos, sin = self._rope[key]
        return cos, sin, row

    def _rope_rows(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = pos.float().view(-1, 1) * self.inv_freq
        cos, sin = freqs.cos() * self.rope_scaling, freqs.sin() * self.rope_scaling
        return torch.cat([cos, cos], dim=-1).to(dtype), torch.cat([sin, sin], dim=-1).to(dtype)

    def _ops(self, x: torch.Tensor) -> Any:
        """The kernel module when its fused ops take this activation (bf16 on the CPU), else None."""
        if self.step_ops is not None and x.device.type == "cpu" and x.dtype == torch.bfloat16:
            return self.step_ops
        return None

    def _layer(self, L: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if x.device != L.device:
            x = x.to(L.device)
            cos, sin = cos.to(L.device), sin.to(L.device)
        f = self._ops(x)
        if f is not None:
            return self._layer_fused(f, L, x, cos, sin)
        h = rms(x, L.norms.pre, L.norms.eps)
        if isinstance(L.mixer, _Attn):
            a = self._attention(L, h, cos, sin)
        else:
            a = linear_mixer(L.mixer, L.norms.eps, h, self.conv[L.index],
                             self.cache.layers[L.index].recurrent_states[0])
        x = x + a
        return x + L.moe(rms(x, L.norms.post, L.norms.eps))

    def _layer_fused(self, f: Any, L: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """`_layer` with the kernel's fused ops: about a dozen calls instead of forty-odd torch ops."""
        eps = L.norms.eps
        h = f.rms(x, L.norms.pre, eps)
        m = L.mixer
        if isinstance(m, _Linear) and self.conv[L.index].rows.dtype != torch.bfloat16:
            out = linear_mixer(m, eps, h, self.conv[L.index], self.cache.layers[L.index].recurrent_states[0])
        elif isinstance(m, _Linear):
            qkv, z, b, a = m.proj_in(h)
            state = self.cache.layers[L.index].recurrent_states[0]
            core = f.gdn_step(qkv, z, b, a, self.conv[L.index].rows, m.conv_taps, m.neg_a, m.dt_bias_f, m.norm_wf,
                              m.norm_w.dtype == torch.bfloat16, state.view(m.hv, m.dk, m.dv), m.hk, eps)
            out = m.out(core)
        elif self._kernel_attends(m, h):
            qo, ko, vo = m.qkv_in(h)
            buf = self.kv[L.index]
            gated = f.attn_step(qo, ko, vo, m.qk_scale, cos.reshape(-1), sin.reshape(-1), buf.k[0], buf.v[0], self.n,
                                m.scaling, m.eps)
            out = m.o(gated)
        else:
            out = self._attention(L, h, cos, sin)
        x, h2 = f.add_rms(x, out, L.norms.post, eps)
        return L.moe.add_to(x, h2)

    def _kernel_attends(self, m: _Attn, h: torch.Tensor) -> bool:
        """Whether this layer's attention runs on the kernel (`qk.attend` / `qk.attn_step`): dynamic KV,
        bf16 activations on the CPU, head_dim a multiple of 16."""
        return h.device.type == "cpu" and h.dtype == torch.bfloat16 and self._attends(m)

    def _attends(self, m: _Attn) -> bool:
        """The activation-independent half of `_kernel_attends`: the kernel is there and takes this head_dim."""
        return self.attend_kernel is not None and m.head_dim % 16 == 0

    def _attention(self, L: _Layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        m = L.mixer
        assert isinstance(m, _Attn)
        qo, ko, vo = m.qkv_in(h)
        qg = qo.view(m.heads, 2 * m.head_dim)
        q, gate = qg[:, :m.head_dim], qg[:, m.head_dim:]
        k = ko.view(m.kv_heads, m.head_dim)
        v = vo.view(1, m.kv_heads, 1, m.head_dim)
        qk = rms(torch.cat([q, k]), m.qk_scale, m.eps)
        qk = _rotate(qk, cos, sin, m.rot)
        q, k = qk[:m.heads].view(1, m.heads, 1, m.head_dim), qk[m.heads:].view(1, m.kv_heads, 1, m.head_dim)
        buf = self.kv[L.index]
        if self.static_kv:
            assert self.pos is not None
            pos = self.pos.to(h.device)
            buf.k.index_copy_(2, pos, k)
            buf.v.index_copy_(2, pos, v)
            out = attend(q, buf.k[0], buf.v[0], m.scaling, buf.positions > pos)
        elif self._kernel_attends(m, h):
            buf.k[:, :, self.n].copy_(k[:, :, 0])
            buf.v[:, :, self.n].copy_(v[:, :, 0])
            out = self.attend_kernel.attend(q.view(m.heads, m.head_dim), buf.k[0], buf.v[0], self.n + 1, m.scaling)
        else:
            buf.k[:, :, self.n].copy_(k[:, :, 0])
            buf.v[:, :, self.n].copy_(v[:, :, 0])
            span = min(-(-(self.n + 1) // KV_BUCKET) * KV_BUCKET, buf.k.shape[2])
            masked = buf.positions[:span] > self.n if span > self.n + 1 else None
            out = attend(q, buf.k[0, :, :span], buf.v[0, :, :span], m.scaling, masked)
        out = out.reshape(1, -1) * torch.sigmoid(gate.reshape(1, -1))
        return m.o(out)


# ---- CUDA graphs (CUDA only) ---------------------------------------------------------------------------------

class CudaGraphStep:
    """The static-shape step captured once in a torch.cuda.CUDAGraph and replayed per token: the token
    is copied into a fixed input tensor, the logits come out in a fixed output tensor. Needs every layer,
    expert and the head on one CUDA device (no CPU hand-off inside a graph) and `static_kv`."""

    def __init__(self, dec: LeanDecoder):
        devs = {L.device for L in dec.layers} | {dec.head_device, dec.inv_freq.device}
        if len(devs) != 1 or next(iter(devs)).type != "cuda" or any(L.moe.has_cpu for L in dec.layers):
            raise ValueError("CUDA graphs need the whole model on one CUDA device")
        if any(L.moe.host_ids for L in dec.layers):
            raise ValueError("CUDA graphs need experts the lean step can gather (dense or int8)")
        self.dec = dec
        self.token = torch.zeros(1, 1, dtype=torch.long, device=next(iter(devs)))
        self.graph: Any = None
        self.logits: torch.Tensor | None = None

    def capture(self) -> None:
        """Warm up on a side stream (state restored), then capture one step."""
        dec = self.dec
        saved = self._state()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            dec.forward(self.token)
        torch.cuda.current_stream().wait_stream(s)
        self._restore(saved)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = dec.forward(self.token)
        self._restore(saved)  # capture does not run the kernels, but keep the state exact

    def _state(self) -> list[torch.Tensor]:
        dec = self.dec
        out = [dec.pos.clone()] if dec.pos is not None else []
        for L in dec.layers:
            if isinstance(L.mixer, _Linear):
                lc = dec.cache.layers[L.index]
                out += [dec.conv[L.index].rows.clone(), lc.recurrent_states[0].clone()]
        return out

    def _restore(self, saved: list[torch.Tensor]) -> None:
        dec = self.dec
        it = iter(saved)
        if dec.pos is not None:
            dec.pos.copy_(next(it))
        for L in dec.layers:
            if isinstance(L.mixer, _Linear):
                lc = dec.cache.layers[L.index]
                dec.conv[L.index].rows.copy_(next(it))
                lc.recurrent_states[0].copy_(next(it))

    def replay(self, token: torch.Tensor) -> torch.Tensor:
        if self.graph is None:
            self.token.copy_(token)
            self.capture()
        self.token.copy_(token)
        self.graph.replay()
        assert self.logits is not None
        return self.logits
