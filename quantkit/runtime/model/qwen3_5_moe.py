"""quantkit's Qwen3.5-MoE language model, top to bottom: embedding, Gated DeltaNet and gated attention layers,
the MoE block (router, routed experts, shared expert), final norm and head, and the MTP layer that drafts.

Contract:
- `Model.forward_batch(segments)`: the one path of every call. A segment is one cache's tokens at positions
  cache.n .. (cache.n advanced): a one-token step, a speculative verify (the Gated DeltaNet states after every
  position kept for `cache.rewind`), a prompt chunk in the row arithmetic ("prefill"), or a prompt in the T-token
  arithmetic ("prompt", `Layer.tokens`: transformers' eager arithmetic dtype for dtype, so the tests hold it to
  transformers layer by layer). Steps, verifies and row chunks run together as one-token steps (`Layer.steps`):
  each dense matrix read once for all rows (any count), the routed experts of all rows grouped in one call, the
  Gated DeltaNet cores and each cache's attention run in one call, so row j is bit for bit its step alone.
- `Model.forward(ids, cache)` (one segment: a step, a verify with keep_positions, else a prompt) and
  `Model.step_batch(ids, caches)` (decode and verify segments) are its callers.
- `MTP.forward` / `MTP.draft`: the MTP layer after the main model's hidden states, as speculative decoding's
  drafter (drafts only decide how many tokens a verify accepts, never which: runtime/speculative.py).
How a row's ops compute is chosen once, when the route is set (model/route.py, `Model.set_route`): the op
objects of model/ops.py (torch, the CPU kernel's fused ops, or the CUDA graph's) and each MoE block's experts
op. Where the route is `stack`, the route's executor (model/executors.py) runs steps and short verifies in one
kernel call over the same tensors (tests hold the two bit for bit); `cuda-graph` replays `static_step`.
Projections go through the loader's `Kernel`s (runtime/loader.py builds the model from a checkpoint).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from quantkit.checkpoint.draft import DRAFT_ROWS
from quantkit.runtime import cpu_kernel
from quantkit.runtime.devices import HeapGuard
from quantkit.runtime.kernels import Kernel, Projections, QKernel
from quantkit.runtime.model import executors
from quantkit.runtime.model import ops as O
from quantkit.runtime.model import route as routes
from quantkit.runtime.model.cache import HybridCache, Trail
from quantkit.runtime.model.config import ModelConfig
from quantkit.runtime.model.delta_rule import conv_tokens, delta_rule
from quantkit.runtime.model.draft_head import DraftHead
from quantkit.runtime.model.executors import STACK_PAIRS, STACK_VERIFY_ROWS, DraftStack, executor_for, take
from quantkit.runtime.model.experts import GatheredExperts
from quantkit.runtime.model.ops import cat_rows, linear_rows, project_rows, rms, row_slices
from quantkit.runtime.qexperts import QuantExperts

ROPE_BLOCK = 256  # positions per table of rotary cos / sin for the stack's steps
EMBED_ROWS = 4096  # dequantized embedding rows kept (16 MiB at hidden 2048 in bf16)


@dataclass
class Segment:
    """One cache's tokens in a batch (docs/engine.md): a decode step ("decode", one token), a speculative verify
    ("verify", 1 + k drafted tokens, its Gated DeltaNet states kept for `cache.rewind`), a prompt chunk in the row
    arithmetic ("prefill": its tokens computed as one-token steps compute them, so the state after any of them is
    what a prefill cut there gives: a snapshot may sit at any token) or in the T-token arithmetic ("prompt":
    transformers' eager arithmetic, the path the tests hold to transformers; a snapshot only at its end).
    Logits: every row of a step or verify, the last row of a chunk (every row with `all_logits`)."""

    cache: HybridCache
    ids: list[int]
    kind: str = "decode"
    all_logits: bool = False

    def __post_init__(self) -> None:
        if self.kind not in SEGMENT_KINDS:
            raise ValueError(f"segment kind {self.kind!r}: give one of {', '.join(SEGMENT_KINDS)}")
        if not self.ids or (self.kind == "decode" and len(self.ids) != 1):
            raise ValueError(f"a {self.kind} segment of {len(self.ids)} tokens")

    @property
    def keep(self) -> bool:
        return self.kind == "verify" and len(self.ids) > 1

    @property
    def out_rows(self) -> int:
        """Rows of logits this segment gives."""
        return 1 if self.kind in ("prefill", "prompt") and not self.all_logits else len(self.ids)


SEGMENT_KINDS = ("decode", "verify", "prefill", "prompt")


@dataclass
class Out:
    """A segment's result: logits [out_rows, V]; with `hidden`, the final norm's output of every token [T, H]
    (a prompt chunk's every row: what the MTP layer pairs with its tokens), else None."""

    logits: torch.Tensor
    hidden: torch.Tensor | None = None


@dataclass
class Prompt:
    """A forward of T tokens on one cache at cache.n .., the layers' T-token path."""

    cache: HybridCache
    cos: torch.Tensor
    sin: torch.Tensor


@dataclass
class Steps:
    """Rows run as one-token steps: row j is at position slots[j][1] of cache slots[j][0] (an int, or a device
    tensor [1] for a static step; a cache's rows consecutive, in position order). `keep`: verifies, their Gated
    DeltaNet states after every row kept (`kept`); `last_only`: only the last row's output is read (the MTP
    layer), the MoE block runs on it alone."""

    slots: list[tuple[HybridCache, Any]]
    cos: torch.Tensor
    sin: torch.Tensor
    ops: O.TorchOps
    keep: bool = False
    last_only: bool = False
    kept_caches: frozenset[int] | None = None  # with keep: only the runs on these caches (by id) are kept
    kept: list[tuple[HybridCache, int, int]] = field(init=False)  # with keep: (cache, first row, rows) of each run

    def __post_init__(self) -> None:
        """With `keep`, the runs of consecutive rows on one cache whose states are kept: every run of several rows
        (a verify inside a batch; with `kept_caches`, only those caches' runs: not a prompt chunk's), or the one
        run where the rows are all on one cache."""
        runs: list[tuple[HybridCache, int, int]] = []
        for j, (c, _pos) in enumerate(self.slots if self.keep else []):
            if runs and runs[-1][0] is c:
                runs[-1] = (c, runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((c, j, 1))
        self.kept = [r for r in runs if (r[2] > 1 or len(runs) == 1)
                     and (self.kept_caches is None or id(r[0]) in self.kept_caches)]


# ---- the gated attention layer ----
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
    kind: ClassVar[str] = "attention"

    def __post_init__(self) -> None:
        self.scaling = self.head_dim ** -0.5
        self.qkv_in = Projections([self.q, self.k, self.v])
        self.o_one = Projections([self.o])

    def tokens(self, h: torch.Tensor, cache: HybridCache, i: int, cos: torch.Tensor, sin: torch.Tensor
               ) -> torch.Tensor:
        qo, ko, vo = self.qkv_in(h)
        return self.o(self.core(qo, ko, vo, cache.keys[i], cache.values[i], cache.n, cos, sin))

    def steps(self, h: torch.Tensor, p: Steps, i: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        qo, ko, vo = project_rows(self.qkv_in, h)
        # each run of rows on one cache (a step, a prompt chunk, a verify) in one call
        core = [p.ops.attention_rows(self, qo[j:j + t], ko[j:j + t], vo[j:j + t], c.keys[i], c.values[i],
                                     p.slots[j][1], cos[j:j + t], sin[j:j + t]) for c, j, t in O.runs_of(p.slots)]
        return linear_rows(self.o, cat_rows(core))

    def core(self, qo: torch.Tensor, ko: torch.Tensor, vo: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
             n: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Between the projections, T tokens: q/k norms, rotary, K/V written at n.., causal attention (SDPA,
        fp32 scores) over keys and values [kv_heads, capacity, hd], the sigmoid gate. [T, heads * hd]."""
        t = qo.shape[0]
        q, gate = self.qk_written(qo, ko, vo, keys, values, n, cos, sin)
        pos = torch.arange(n + t, device=qo.device)
        mask = None if n == 0 else pos <= (n + torch.arange(t, device=qo.device)).unsqueeze(1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), keys[None, :, :n + t],
                                             values[None, :, :n + t], attn_mask=mask, is_causal=mask is None,
                                             scale=self.scaling, enable_gqa=True)
        return out[0].transpose(0, 1).reshape(t, -1) * torch.sigmoid(gate)

    def qk_written(self, qo: torch.Tensor, ko: torch.Tensor, vo: torch.Tensor, keys: torch.Tensor,
                   values: torch.Tensor, n: int, cos: torch.Tensor, sin: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of the T tokens written at n..; q [T, heads, hd] and the output gate [T, heads * hd]."""
        t = qo.shape[0]
        qk, gate = self.qk(qo, ko, cos, sin)
        keys[:, n:n + t].copy_(qk[:, self.heads:].transpose(0, 1))
        values[:, n:n + t].copy_(vo.view(t, self.kv_heads, self.head_dim).transpose(0, 1))
        return qk[:, :self.heads], gate

    def qk(self, qo: torch.Tensor, ko: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k [T, heads + kv_heads, hd] normed and rotated, and the output gate [T, heads * hd]."""
        t = qo.shape[0]
        qg = qo.view(t, self.heads, 2 * self.head_dim)
        q, gate = qg[..., :self.head_dim], qg[..., self.head_dim:].reshape(t, -1)
        qk = rms(torch.cat([q, ko.view(t, self.kv_heads, self.head_dim)], dim=1), self.qk_scale, self.eps)
        return O.rotate(qk, cos.view(t, 1, -1), sin.view(t, 1, -1), self.rot), gate


# ---- the Gated DeltaNet layer ----
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
    kind: ClassVar[str] = "gdn"

    def __post_init__(self) -> None:
        self.proj_in = Projections([self.qkv, self.z, self.b, self.a])
        self.out_one = Projections([self.out])
        self.norm_wf = self.norm_w.float().contiguous()

    def tokens(self, h: torch.Tensor, cache: HybridCache, i: int, cos: torch.Tensor, sin: torch.Tensor
               ) -> torch.Tensor:
        qkv, z, b, a = self.proj_in(h)
        return self.out(self.core(qkv, z, b, a, cache.conv[i], cache.state[i])[0])

    def steps(self, h: torch.Tensor, p: Steps, i: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Each row through its own cache's conv window and state; for each run `p.kept` the window before and
        the state after every row but its last (the cache's own) left in the cache's trail for `rewind`."""
        qkv, z, b, a = project_rows(self.proj_in, h)
        runs, kept = O.runs_of(p.slots), {j0 for _c, j0, _t in p.kept}
        # rows alone on their cache (a decode batch's) in one call; each run of several rows (a prompt chunk, a
        # verify) in one call of its own; the outputs back in row order
        alone = [j for _c, j, t in runs if t == 1 and j not in kept]
        parts: dict[int, torch.Tensor] = {}
        if alone:
            xs = [qkv, z, b, a] if len(alone) == len(runs) else [x[alone] for x in (qkv, z, b, a)]
            core = p.ops.gdn_rows(self, *xs, [p.slots[j][0].conv[i] for j in alone],
                                  [p.slots[j][0].state[i] for j in alone])
            parts.update((j, core[k:k + 1]) for k, j in enumerate(alone))
        for c, j, t in runs:
            if j in parts:
                continue
            r, before = slice(j, j + t), c.conv[i].clone() if j in kept else None
            parts[j], states = p.ops.gdn_run(self, qkv[r], z[r], b[r], a[r], c.conv[i], c.state[i], j in kept)
            if before is not None:
                c.trail[i] = Trail(c.n, torch.cat([before, qkv[r].to(before.dtype)]), states)
        return linear_rows(self.out, cat_rows([parts[j] for _c, j, _t in runs]))

    def core(self, qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor, window: torch.Tensor,
             state: torch.Tensor, keep: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Between the projections, T tokens: causal conv (window [K, C] shifted in place), SiLU, gates, the delta
        rule on the fp32 state [Hv, Dk, Dv] (in place), gated norm. (The input of out_proj [T, Hv * Dv], with keep
        the state after every position [T, Hv, Dk, Dv].)"""
        t = qkv.shape[0]
        x = conv_tokens(qkv, window, self.conv_taps)
        kd = self.hk * self.dk
        g = self.neg_a * F.softplus(a.float() + self.dt_bias)
        out, states = delta_rule(x[:, :kd].view(t, self.hk, self.dk), x[:, kd:2 * kd].view(t, self.hk, self.dk),
                                 x[:, 2 * kd:].view(t, self.hv, self.dv), g, b.sigmoid(), state, keep_states=keep)
        core = O.gated_norm(out.reshape(t * self.hv, self.dv), z.reshape(t * self.hv, self.dv), self.norm_w, self.eps)
        return core.view(t, -1), states


# ---- the MoE block ----
@dataclass
class MoE:
    """The sparse MoE block: router, routed experts (`QuantExperts`, split over devices as planned), shared
    expert with its sigmoid gate."""

    router_w: torch.Tensor  # as stored (bf16): transformers' router product for a prompt
    router_kernel: Kernel | None  # the CPU kernel's bf16 product for a step's row (else an fp32 GEMV)
    top_k: int
    experts: QuantExperts
    shared_gate: Kernel
    shared_up: Kernel
    shared_down: Kernel
    shared_sigmoid: Kernel  # shared_expert_gate: [H] -> 1
    gathered: list[GatheredExperts] = field(default_factory=list)  # expert groups on a device, by routed id
    cpu_groups: frozenset[int] = frozenset()  # groups computed on the CPU beside gathered ones
    host_ids: bool = False  # experts off the CPU that only QuantExperts' decode runs: ids read on the host

    def __post_init__(self) -> None:
        self.shared_in = Projections([self.shared_gate, self.shared_up, self.shared_sigmoid])
        self.fused_all = O.fuses_all(self)
        # for the one-call stack (model/executors.py) and the kernel's rows: the shared expert's inputs with the
        # router in one call, the shared down
        self.shared_and_router = (Projections([*self.shared_in.kernels, self.router_kernel])
                                  if self.router_kernel is not None else None)
        self.down_one = Projections([self.shared_down])
        self.bind(torch.device("cpu"), torch.bfloat16, O.TORCH)

    def bind(self, device: torch.device, dtype: torch.dtype, ops: O.TorchOps) -> None:
        """Choose, for a step's rows on `device` in `dtype` under `ops`, the router's product and the experts op."""
        self.router_row = O.router_op(self, dtype)
        joint = ops.joint_router and self.shared_and_router is not None
        self.inputs = self._inputs_joint if joint else self._inputs
        self.experts_op = O.experts_op(self, device)

    def tokens(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """x + the block on h (the post-attention norm of x), T tokens."""
        gate, up, sg = self.shared_in(h)
        wts, ids = self.route(F.linear(h, self.router_w), O.TORCH)
        shared = self.shared_down(F.silu(gate) * up)
        return x + (self.routed(h, wts, ids) + torch.sigmoid(sg) * shared)

    def steps(self, x: torch.Tensor, h: torch.Tensor, ops: O.TorchOps) -> torch.Tensor:
        """x + the block on h, each row as a one-token step computes it (its top-k from its own router logits)."""
        gate, up, sg, logits = self.inputs(h)
        wts, ids = self.route(logits, ops)
        shared = linear_rows(self.shared_down, ops.silu_mul(gate, up))
        return ops.combine(x, self.routed_rows(h, wts, ids), shared, sg)

    def route(self, logits: torch.Tensor, ops: O.TorchOps) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's top-k of its own router logits: fp32 weights and int64 ids, [R, k] each."""
        return ops.topk(logits, self.top_k)

    def _inputs(self, h: torch.Tensor) -> list[torch.Tensor]:
        """The shared expert's gate, up, sigmoid gate on all rows; the router's logits row by row (the fp32 GEMV
        has no multi-row form that keeps the one-row sums)."""
        return [*project_rows(self.shared_in, h), cat_rows([self.router_row(h[r]) for r in row_slices(h)])]

    def _inputs_joint(self, h: torch.Tensor) -> list[torch.Tensor]:
        """`_inputs` with the router's bf16 product in the same kernel call (as the stack runs it)."""
        assert self.shared_and_router is not None
        return project_rows(self.shared_and_router, h)

    def routed(self, h: torch.Tensor, wts: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum: a prompt's T tokens through QuantExperts' grouped path, one token
        through the experts op (fp32 where the kernel's fused call leaves it so, else h's dtype)."""
        return self.experts(h, ids, wts) if h.shape[0] > 1 else self.experts_op.one(h, wts, ids)

    def routed_rows(self, h: torch.Tensor, wts: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Every row's `routed` as its step computes it: in one call where the experts op has a multi-row form
        that keeps each row's sum, else row by row."""
        many = self.experts_op.rows(h, wts, ids) if h.shape[0] > 1 else None
        return many if many is not None else cat_rows([self.routed(h[r], wts[r], ids[r]) for r in row_slices(h)])


# ---- a decoder layer ----
@dataclass
class Layer:
    index: int
    device: torch.device
    pre: torch.Tensor  # input_layernorm's (1 + w), fp32
    post: torch.Tensor  # post_attention_layernorm's
    eps: float
    mixer: Attention | DeltaNet
    moe: MoE

    def __call__(self, x: torch.Tensor, p: Prompt | Steps) -> torch.Tensor:
        x, cos, sin = x.to(self.device), p.cos.to(self.device), p.sin.to(self.device)
        return self.tokens(x, p.cache, cos, sin) if isinstance(p, Prompt) else self.steps(x, p, cos, sin)

    def tokens(self, x: torch.Tensor, cache: HybridCache, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.mixer.tokens(rms(x, self.pre, self.eps), cache, self.index, cos, sin)
        return self.moe.tokens(x, rms(x, self.post, self.eps))

    def steps(self, x: torch.Tensor, p: Steps, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        a = self.mixer.steps(p.ops.rms(x, self.pre, self.eps), p, self.index, cos, sin)
        if p.last_only:
            x, a = x[-1:], a[-1:]
        return self.moe.steps(*p.ops.add_rms(x, a, self.post, self.eps), p.ops)


# ---- the model ----
@dataclass
class Model:
    cfg: ModelConfig
    embed: Any  # a bf16 [V, H] tensor, or a QuantEmbedding (rows dequantized on demand)
    layers: list[Layer]
    final: torch.Tensor  # the final norm's (1 + w), fp32
    head: Kernel
    dtype: torch.dtype = torch.bfloat16
    keep_rows: bool = False  # a quantized table's step rows are kept once made (`embed_tokens`; the loader's choice)
    route: routes.Route = field(init=False)
    _rows: dict[int, torch.Tensor] = field(default_factory=dict, init=False)  # kept embedding rows, oldest first
    _rope: dict[Any, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, init=False)
    executor: Any = field(default=None, init=False)  # the route's (model/executors.py; None: the layers)
    mtp: MTP | None = field(default=None, init=False)  # the checkpoint's MTP layer, where it has one
    ops: O.TorchOps = field(default=O.TORCH, init=False)  # a step's row ops, bound with the route

    def __post_init__(self) -> None:
        rot = self.cfg.rotary_dims
        self.inv_freq = 1.0 / (self.cfg.rope_theta ** (torch.arange(0, rot, 2, dtype=torch.float) / rot))
        self.head_device = self.head.device
        self.eps = self.cfg.rms_eps
        self.heap = HeapGuard()  # a prefill's temporaries given back between its layers
        self.vocab = self.cfg.text.vocab_size
        self.static_ops = O.GraphOps()
        self.set_route("torch")

    @property
    def dtype_is_bf16(self) -> bool:
        return self.dtype == torch.bfloat16

    @property
    def layer_devices(self) -> list[torch.device]:
        return [L.device for L in self.layers]

    def set_route(self, forced: str | None = None, notes: list[str] | None = None,
                  source: str = "route") -> routes.Route:
        """Choose the one-token route (see model/route.py): `forced` (RuntimeOptions.route, named by
        `source` in a refusal's note) or the best; bind its ops, executor and every MoE block's experts op."""
        self.route = routes.choose(self, forced, notes, source)
        self.ops = O.for_route(self.route.kind)
        self.final_ops = O.on_device(self.ops, self.head_device)  # the final norm's, beside the head
        self.executor = executor_for(self)
        for L in self.layers + ([self.mtp.layer] if self.mtp is not None else []):
            L.moe.bind(L.device, self.dtype, self.ops)
        return self.route

    def new_cache(self, capacity: int = 0) -> HybridCache:
        return HybridCache(self.cfg, self.layer_devices, self.dtype, capacity)

    def forward(self, ids: list[int] | torch.Tensor, cache: HybridCache, *, all_logits: bool = False,
                keep_positions: bool = False, hidden: bool = False) -> Any:
        """Logits [V] of the last of the T tokens `ids` (all_logits: [T, V]), cache advanced by T: `forward_batch`
        of one segment, a step (T = 1), a verify (keep_positions: T one-token steps' logits bit for bit, the Gated
        DeltaNet states after every position kept for `cache.rewind`) or a prompt (the T-token path). hidden:
        (logits, the final norm's output [T, H] of every token), what the MTP layer drafts from."""
        ids = ids.view(-1).tolist() if isinstance(ids, torch.Tensor) else ids
        if not ids:
            raise ValueError("forward of no tokens")
        kind = "verify" if keep_positions else "decode" if len(ids) == 1 else "prompt"
        out = self.forward_batch([Segment(cache, ids, kind, all_logits)], hidden=hidden)[0]
        logits = out.logits if all_logits else out.logits[-1]
        return (logits, out.hidden) if hidden else logits

    def forward_batch(self, batch: list[Segment], hidden: bool = False) -> list[Out]:
        """Every segment of `batch` in one forward (docs/engine.md "One forward"), the one path of every call: all
        rows of the steps, verifies and row-arithmetic chunks through each layer once, each row at its cache's
        position, the dense matrices and the chosen experts read once for all of them; row j bit for bit its result
        alone. A step or verify alone runs in the route's executor where it takes it (the stack's one call); a
        "prompt" segment runs the layers' T-token path. Each cache appears once and is advanced by its segment's
        tokens. CPU work runs with denormals flushed. `hidden`: each segment's final-norm rows too."""
        if not batch:
            raise ValueError("forward_batch of no segments")
        if len({id(s.cache) for s in batch}) != len(batch):
            raise ValueError("forward_batch: a cache appears twice in the batch (each segment needs its own)")
        with cpu_kernel.denormals_flushed():
            for s in batch:
                s.cache.reserve(s.cache.n + len(s.ids))
                s.cache.drop_trail()
            # a one-token prompt is a step: the T-token path is for T > 1 (a forward of one token always stepped)
            rows = [s for s in batch if s.kind != "prompt" or len(s.ids) == 1]
            done = {id(s): self._prompt(s, hidden) for s in batch if s.kind == "prompt" and len(s.ids) > 1}
            if len(rows) == 1 and rows[0].kind != "prefill":  # the route's own step or verify, where it takes it
                s = rows[0]
                got = take(self.executor, s.ids, s.cache, s.keep, hidden)
                if got is not None:
                    done[id(s)], rows = Out(*got), []
            if rows:
                done.update(zip(map(id, rows), self._run_rows(rows, hidden), strict=True))
            return [done[id(s)] for s in batch]

    def _prompt(self, s: Segment, hidden: bool) -> Out:
        """The T-token path of a "prompt" segment (module docstring)."""
        cache, ids, t = s.cache, s.ids, len(s.ids)
        cache.pos = None
        x = self.embed_tokens(ids)
        cos, sin = self.rope_rows(torch.arange(cache.n, cache.n + t), x.dtype)
        for L in self.layers:
            x = L(x, Prompt(cache, cos, sin))
            if t > STACK_VERIFY_ROWS:
                self.heap.check()
        cache.n += t
        x = x.to(self.head_device)
        x = x if s.all_logits or hidden else x[-1:]
        x = self._final_rows(x) if x.shape[0] == 1 else rms(x, self.final, self.eps)
        return Out(self.head(x if s.all_logits else x[-1:]), x if hidden else None)

    def _run_rows(self, batch: list[Segment], hidden: bool) -> list[Out]:
        """Segments of one-token-step rows through the layers together (`forward_batch`)."""
        for s in batch:
            s.cache.pos = None
        slots = [(s.cache, s.cache.n + k) for s in batch for k in range(len(s.ids))]
        keep = any(s.keep for s in batch)
        kept = frozenset(id(s.cache) for s in batch if s.keep) if keep else None
        x = self._step_rows(torch.cat([self.embed_tokens(s.ids) for s in batch]), slots, keep, kept)
        spans = self._spans(batch)
        need: list[int] = []  # rows whose final norm is taken: every row with `hidden`, else the logits' rows
        for s, a, t in spans:
            s.cache.n += t
            need.extend(range(a, a + t) if hidden or s.out_rows == t else [a + t - 1])
        normed = self._final_rows(x if len(need) == x.shape[0] else x[need])
        at = {r: i for i, r in enumerate(need)}
        pick = [at[r] for s, a, t in spans for r in range(a + t - s.out_rows, a + t)]
        logits = linear_rows(self.head, normed if len(pick) == normed.shape[0] else normed[pick])
        out, b = [], 0
        for s, a, t in spans:
            out.append(Out(logits[b:b + s.out_rows], normed[at[a]:at[a] + t] if hidden else None))
            b += s.out_rows
        return out

    @staticmethod
    def _spans(batch: list[Segment]) -> list[tuple[Segment, int, int]]:
        """(segment, its first row, its rows) in batch order."""
        out, a = [], 0
        for s in batch:
            out.append((s, a, len(s.ids)))
            a += len(s.ids)
        return out

    def step_batch(self, ids: list[int] | list[list[int]], caches: list[HybridCache], hidden: bool = False) -> Any:
        """Logits [R, V] of every row: ids[j] (a token, or the tokens of a speculative verify, its Gated DeltaNet
        states kept for `cache.rewind`) on caches[j]: `forward_batch` of those decode and verify segments, their
        rows in order. hidden: (logits, the final norm's output [R, H]), what the MTP layer drafts from."""
        segs = [[int(t)] if isinstance(t, int) else [int(x) for x in t] for t in ids]
        if len(segs) != len(caches) or not segs or not all(segs):
            raise ValueError(f"step_batch takes one cache per token (or verify's tokens); got {len(segs)} rows "
                             f"of tokens, {len(caches)} caches")
        outs = self.forward_batch([Segment(c, s, "decode" if len(s) == 1 else "verify")
                                   for c, s in zip(caches, segs, strict=True)], hidden=hidden)
        logits = torch.cat([o.logits for o in outs]) if len(outs) > 1 else outs[0].logits
        if not hidden:
            return logits
        return logits, torch.cat([o.hidden for o in outs]) if len(outs) > 1 else outs[0].hidden

    def static_step(self, token: torch.Tensor, cache: HybridCache) -> torch.Tensor:
        """Logits [V] of one token given as a device tensor [1] at the device-side position cache.pos: the same
        shapes at every position and no host read (what `CudaGraphStep` captures). cache.n is the caller's."""
        assert cache.pos is not None
        x = self.embed_tokens(token)
        cos, sin = self.rope_rows(cache.pos, x.dtype)
        for L in self.layers:
            x = L(x, Steps([(cache, cache.pos)], cos, sin, self.static_ops))
        return self.head(rms(x.to(self.head_device), self.final, self.eps)).view(-1)

    def _step_rows(self, x: torch.Tensor, slots: list[tuple[HybridCache, int]], keep: bool = False,
                   kept: frozenset[int] | None = None) -> torch.Tensor:
        """Every layer on rows x [R, H] as one-token steps at their slots (with `keep`, the states of the runs on
        caches `kept` kept; None: every run's); the last layer's output on the head's device."""
        cos, sin = self.rope_rows(torch.tensor([pos for _c, pos in slots]), x.dtype)
        p = Steps(slots, cos, sin, self.ops, keep, kept_caches=kept)
        for L in self.layers:
            x = L(x, p)
            if x.shape[0] > STACK_VERIFY_ROWS:
                self.heap.check()
        return x.to(self.head_device)

    def _final_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm of rows x, each as its step norms it."""
        return self.final_ops.rms(x, self.final, self.eps)

    def embed_tokens(self, ids: list[int] | torch.Tensor) -> torch.Tensor:
        """[T, H] rows. A quantized table on the CPU dequantizes a row in a dozen small ops, so the rows of steps
        and verifies are kept once made (up to EMBED_ROWS, least recently used out)."""
        if isinstance(self.embed, torch.Tensor):
            idx = torch.as_tensor(ids, dtype=torch.long, device=self.embed.device).view(-1)
            return F.embedding(idx, self.embed)
        if isinstance(ids, list) and len(ids) <= STACK_VERIFY_ROWS and self.keep_rows:  # a step, a verify
            return torch.cat([self._embed_row(tok) for tok in ids]) if len(ids) > 1 else self._embed_row(ids[0])
        return self.embed(torch.as_tensor(ids, dtype=torch.long).view(-1))

    def _embed_row(self, tok: int) -> torch.Tensor:
        row = self._rows.pop(tok, None)
        if row is None:
            row = self.embed(torch.tensor([tok], dtype=torch.long))
            if len(self._rows) >= EMBED_ROWS:
                self._rows.pop(next(iter(self._rows)))
        self._rows[tok] = row
        return row

    def rope_rows(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [len(pos), rot]: the text rotary (its three position axes are equal for text, so the
        interleaved recomposition is the identity)."""
        freqs = pos.to(self.inv_freq.device).float().view(-1, 1) * self.inv_freq
        cos, sin = freqs.cos(), freqs.sin()
        return torch.cat([cos, cos], dim=-1).to(dtype), torch.cat([sin, sin], dim=-1).to(dtype)

    def rope_table(self, n: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """cos, sin [ROPE_BLOCK, rot] for the block of positions holding n, and n's row in them."""
        block, row = divmod(n, ROPE_BLOCK)
        if block not in self._rope:
            pos = torch.arange(block * ROPE_BLOCK, (block + 1) * ROPE_BLOCK)
            self._rope = {block: self.rope_rows(pos, self.dtype)}  # one block at a time: positions only grow
        cos, sin = self._rope[block]
        return cos, sin, row

    def rope_span(self, n: int, t: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(cos, sin, row): tables whose rows row .. row + t - 1 are the rotary of positions n .. n + t - 1, as
        the stack's steps read them (`rope_table`'s block where the span fits in it, else row by row)."""
        cos, sin, row = self.rope_table(n)
        if row + t <= cos.shape[0]:
            return cos, sin, row
        rows = [self.rope_table(p) for p in range(n, n + t)]
        return torch.stack([c[r] for c, _s, r in rows]), torch.stack([s[r] for _c, s, r in rows]), 0

    def stackable(self) -> bool:
        """Whether every layer, the final norm and the head can run in the kernel's one-call stack."""
        return executors.stackable(self)


# ---- the MTP layer ----
@dataclass
class MTP:
    """The multi-token-prediction layer: given the main model's final-normed hidden h_p at position p and the
    token x_(p+1), it predicts x_(p+2). The embedding of x_(p+1) and h_p, each through its own RMSNorm, are
    concatenated and projected back to the hidden size (`fc`), pass one gated full-attention decoder layer with
    its own experts and KV cache (pair i at position i: RoPE is relative), then the MTP's final norm and the
    shared lm_head over part of the vocabulary (model/draft_head.py). Drafting k tokens chains it on its own
    output. On the stack route a draft of up to STACK_PAIRS pairs is one kernel call (`DraftStack`), the same
    ops as the rows below on the kernel's ops, so the same logits bit for bit."""

    cfg: ModelConfig  # a one-layer (full attention) config: the MTP cache's shape
    fc: Kernel  # [H, 2H]
    emb_scale: torch.Tensor  # pre_fc_norm_embedding's (1 + w), fp32
    hid_scale: torch.Tensor  # pre_fc_norm_hidden's
    final: torch.Tensor  # mtp.norm's
    layer: Layer  # index 0 of its own cache
    draft_rows: int = DRAFT_ROWS  # ids the draft head scores from the bottom of the vocabulary (0: all)
    compact: QKernel | None = None  # an int4 copy of the head's DRAFT_ROWS rows (draft_head.compact_copy)
    use_stack: bool = True  # the kernel's one-call draft where it applies (False: the rows, for tests)
    _head: DraftHead | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.stack = DraftStack(self)

    def new_cache(self, capacity: int) -> HybridCache:
        return HybridCache(self.cfg, [self.layer.device], torch.bfloat16, capacity)

    def forward(self, model: Model, tokens: list[int], hidden: torch.Tensor, cache: HybridCache
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [V] of the token after the last pair, the MTP's normed hidden [1, H] to chain on) for the
        pairs (tokens[i], hidden[i]) appended to its cache (hidden [>= T, H]: its first T rows pair with the T
        tokens); `model` lends the embedding, rotary and head."""
        outs, h, head = self._run(model, tokens, hidden, cache)
        return (head.logits(outs) if isinstance(outs, list) else outs), h

    def draft(self, model: Model, tokens: list[int], hidden: torch.Tensor, cache: HybridCache
              ) -> tuple[int, torch.Tensor]:
        """`forward`'s greedy draft: (the argmax of its logits, the hidden to chain on), without spreading the
        draft head's outputs over the whole vocabulary first (on the stack route, with no torch op at all)."""
        head = self.head(model)
        got = self.stack.draft_argmax(model, head, tokens, hidden, cache)
        if got is not None:
            return got
        outs, h, head = self._run(model, tokens, hidden, cache)
        return (head.argmax(outs) if isinstance(outs, list) else cpu_kernel.argmax(outs)), h

    def _run(self, model: Model, tokens: list[int], hidden: torch.Tensor, cache: HybridCache
             ) -> tuple[list[torch.Tensor] | torch.Tensor, torch.Tensor, DraftHead]:
        """`forward` up to the head: (the kernel's head outputs on `head.table` as a list, or the logits [V]), the
        hidden, the head."""
        t, head, eps = len(tokens), self.head(model), self.cfg.rms_eps
        hidden = hidden[:t] if hidden.shape[0] > t else hidden
        cache.reserve(cache.n + t)
        e = model.embed_tokens(tokens).to(self.layer.device)
        out = self.stack.draft(model, head, e, hidden, cache)
        if out is not None:
            return list(out[1:]), out[0], head
        h = hidden.to(self.layer.device, torch.bfloat16)
        x = self.fc(torch.cat([model.ops.rms(e, self.emb_scale, eps), model.ops.rms(h, self.hid_scale, eps)], dim=-1))
        cos, sin = model.rope_rows(torch.arange(cache.n, cache.n + t), x.dtype)
        # a few pairs (the accepted drafts of a verify) as one-token steps: the T-token path's grouped experts cost
        # more than the rows' own calls; only the last row's output is drafted from, so the rows before it just
        # write their K/V
        p = (Steps([(cache, cache.n + j) for j in range(t)], cos, sin, model.ops, last_only=True)
             if t <= STACK_PAIRS else Prompt(cache, cos, sin))
        x = self.layer(x, p)
        cache.n += t
        out = model.ops.rms(x[-1:].to(model.head_device), self.final, eps)
        return head(out), out, head

    def head(self, model: Model) -> DraftHead:
        """The draft's head on the model's lm_head, `draft_rows` of it (made again when that changes)."""
        if self._head is None or self._head.head is not model.head or self._head.asked != self.draft_rows:
            self._head = DraftHead(model.head, self.draft_rows, self.compact if self.draft_rows == DRAFT_ROWS else None)
        return self._head

    def nbytes(self) -> int:
        m, mix = self.layer.moe, self.layer.mixer
        assert isinstance(mix, Attention)
        kernels = [self.fc, mix.q, mix.k, mix.v, mix.o, m.shared_gate, m.shared_up, m.shared_down, m.shared_sigmoid]
        copy = self.compact.nbytes if self.compact is not None else 0
        return (sum(k.nbytes for k in kernels) + m.experts.nbytes + m.router_w.numel() * m.router_w.element_size()
                + copy)
