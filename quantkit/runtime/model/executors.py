"""How a run of consecutive layers executes on the CPU kernel's one-call stack (`qk.Layers`, csrc/qk_layers.cpp).

A route's executor (`executor_for`, bound once when the route is chosen) takes the one-token steps and the
short verifies it can run; what it leaves (None) runs in the layers. The CPU stack is an executor, not a second
definition of the model: it is handed the layers' own tensors (the
`Projections` tables, norms' constants, conv taps, the caches' K/V and states) and runs, in one call, the
one-token step the layers (model/qwen3_5_moe.py) compute with the kernel's fused ops (model/ops.py `KernelOps`);
tests/runtime/test_model_forward.py holds the two bit for bit on every op table. The model asks its executor
(`take`) for a step or a verify where the route (model/route.py) is `stack`; the MTP layer drafts through a
one-layer stack the same way (`DraftStack`). The cuda-graph route's executor replays a captured step
(model/graph.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from quantkit.kernels import cpu as cpu_kernel
from quantkit.runtime.kernels import Projections
from quantkit.runtime.model.cache import HybridCache, Trail
from quantkit.runtime.model.graph import GraphExecutor

if TYPE_CHECKING:
    from quantkit.runtime.model.draft_head import DraftHead
    from quantkit.runtime.model.qwen3_5_moe import MTP, Layer, Model

STACK_VERIFY_ROWS = 4  # a verify of up to this many tokens runs in the kernel's stack (its tiles take 4 rows)
STACK_PAIRS = 4  # an MTP draft of up to this many pairs runs in the kernel's one call


def layer_stackable(L: Layer) -> bool:
    """Whether a layer can run in the kernel's one-call stack: on the CPU, every projection a kernel table, the
    routed experts in one `qk.moe` call, the router on the bf16 kernel and the kernel's attention."""
    m, moe = L.mixer, L.moe
    if L.device.type != "cpu" or not moe.fused_all or moe.shared_and_router is None:
        return False
    tables = [moe.shared_and_router, moe.down_one] + (
        [m.proj_in, m.out_one] if m.kind == "gdn" else [m.qkv_in, m.o_one])
    return all(p.fused for p in tables) and (m.kind == "gdn" or m.kernel_attends)


def stack_of(layers: list[Layer], cache: HybridCache) -> Any:
    """The kernel's `Layers` for these (stackable) layers, pointed at this cache's tensors."""
    stack = cpu_kernel.module().Layers()
    for L in layers:
        m, moe = L.mixer, L.moe
        if m.kind == "gdn":
            stack.add_gdn(L.pre, L.post, L.eps, m.proj_in.table, m.out_one.table, cache.conv[L.index], m.conv_taps,
                          m.neg_a, m.dt_bias, m.norm_wf, m.norm_w.dtype == torch.bfloat16, cache.state[L.index], m.hk)
        else:
            stack.add_attention(L.pre, L.post, L.eps, m.qkv_in.table, m.o_one.table, m.qk_scale,
                                cache.keys[L.index], cache.values[L.index], m.scaling, m.eps)
        assert moe.shared_and_router is not None
        stack.set_moe(moe.shared_and_router.table, moe.down_one.table, moe.experts._fused_table()[1], moe.top_k)
    return stack


def stack_embedding(model: Model) -> torch.Tensor | None:
    """The embedding table the kernel's stack reads token rows from itself (a contiguous bf16 table on the
    CPU), or None (the model makes the rows)."""
    e = model.embed
    ok = isinstance(e, torch.Tensor) and e.dtype == torch.bfloat16 and e.device.type == "cpu" and e.is_contiguous()
    return e if ok else None


def stackable(model: Model) -> bool:
    """Whether every layer of `model` can run in the one-call stack (`layer_stackable`), and the final norm and
    head on the CPU kernel."""
    if model.head_device.type != "cpu" or not Projections([model.head]).fused:
        return False
    return all(layer_stackable(L) for L in model.layers)


class StackExecutor:
    """Every layer of a model, its final norm and head in one kernel call per step (and per verify of a few
    tokens), pointed at one cache at a time (bound again when the cache or its buffers change)."""

    def __init__(self, model: Model):
        self.model = model
        self._stack: Any = None
        self._key: tuple[int, int] | None = None
        self._head_table: Any = None
        self._gdn_layers = [L.index for L in model.layers if L.mixer.kind == "gdn"]

    def bind(self, cache: HybridCache) -> Any:
        """The kernel's `Layers` pointed at this cache's tensors."""
        key = (cache.serial, cache.version)
        if self._key == key:
            return self._stack
        m = self.model
        stack = stack_of(m.layers, cache)
        self._head_table = Projections([m.head]).table  # kept alive beside the stack that reads it
        stack.set_head(m.final, m.eps, self._head_table)
        if stack_embedding(m) is not None:
            stack.set_embed(m.embed)
        self._stack, self._key = stack, key
        return stack

    def _input(self, ids: list[int] | torch.Tensor) -> torch.Tensor | list[int] | None:
        """The ids where the stack reads the embedding itself, else their rows [T, H]; None where the rows are
        off the CPU (the layers run them)."""
        m = self.model
        if isinstance(ids, list) and stack_embedding(m) is not None:
            return ids
        x = m.embed_tokens(ids)
        return x if x.device.type == "cpu" else None

    def step(self, ids: list[int] | torch.Tensor, cache: HybridCache) -> torch.Tensor | None:
        """Logits [V] of one token at cache.n, cache.n advanced (None: the layers take it)."""
        cache.pos = None
        x = self._input(ids)
        if x is None:
            return None
        cos, sin, row = self.model.rope_table(cache.n)
        st = self.bind(cache)
        logits = st.step_ids(x, cos, sin, row, cache.n) if isinstance(x, list) else st.step(x, cos, sin, row, cache.n)
        cache.n += 1
        return logits

    def verify(self, ids: list[int] | torch.Tensor, cache: HybridCache) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A keep-positions forward of T tokens (`Layers.verify`): logits [T, V] and the final norm's output
        [T, H], bit for bit what T one-token steps give; the Gated DeltaNet trail recorded (the stack's `rewind`
        replays a rejected draft's tokens from the state before, kept in the buffer the cache's state traded
        places with) and cache.n advanced (None: the layers take it)."""
        cache.pos = None
        x = self._input(ids)
        if x is None:
            return None
        n = cache.n
        t = len(x) if isinstance(x, list) else x.shape[0]
        cos, sin, row = self.model.rope_span(n, t)
        st = self.bind(cache)
        out = st.verify_ids(x, cos, sin, row, n) if isinstance(x, list) else st.verify(x.contiguous(), cos, sin, row, n)
        for j, i in enumerate(self._gdn_layers):
            cache.trail[i] = Trail(n, out[2 + 2 * j], None)
            cache.state[i] = out[3 + 2 * j]
        if self._gdn_layers:
            cache.replay = st.rewind
        cache.n += t
        return out[0], out[1]


def take(ex: StackExecutor | GraphExecutor | None, ids: list[int] | torch.Tensor, cache: HybridCache, keep: bool,
         hidden: bool) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(logits [T, V], the final norm's output [T, H] or None) of T tokens as one-token steps where the route's
    executor takes them: one token with nothing kept, or a verify of up to STACK_VERIFY_ROWS tokens (also one
    token whose hidden is asked for: a batch row that the MTP layer drafts from later); else None (the layers run
    them)."""
    t = len(ids) if isinstance(ids, list) else int(ids.numel())
    if ex is None:
        return None
    if t == 1 and not keep and not hidden:
        logits = ex.step(ids, cache)
        return None if logits is None else (logits.view(1, -1), None)
    if not (keep or hidden) or t > STACK_VERIFY_ROWS or (t == 1 and keep):
        return None
    out = ex.verify(ids, cache)
    if not keep:
        cache.drop_trail()
    return out


class DraftStack:
    """The MTP layer's draft of up to STACK_PAIRS pairs in one call of the kernel's one-layer `Layers`
    (`Layers.draft`, csrc/qk_layers.cpp) where the model's route is `stack`: the ops the layer's rows run with the
    kernel's fused ops, so the same logits bit for bit."""

    def __init__(self, mtp: MTP):
        self.mtp = mtp
        self._stack: Any = None
        self._key: tuple[int, int, int] | None = None
        self._layer_stacks: bool | None = None

    def applies(self, model: Model, head: DraftHead, t: int) -> bool:
        """The stack route, this layer and fc on the kernel, the draft's head a kernel table, few enough pairs."""
        mtp = self.mtp
        if self._layer_stacks is None:
            self._layer_stacks = Projections([mtp.fc]).fused and layer_stackable(mtp.layer)
        return (mtp.use_stack and t <= STACK_PAIRS and model.route.kind == "stack" and head.table is not None
                and self._layer_stacks)

    def draft(self, model: Model, head: DraftHead, e: torch.Tensor, hidden: torch.Tensor, cache: HybridCache
              ) -> list[torch.Tensor] | None:
        """The layer on the pairs (embedding rows e, hidden), cache.n advanced: [its hidden, the head's outputs on
        `head.table`...], or None where the stack does not apply."""
        t = e.shape[0]
        if not self.applies(model, head, t):
            return None
        cos, sin, row = model.rope_span(cache.n, t)
        out = self.bind(cache, model).draft(e.contiguous(), hidden.to(torch.bfloat16).contiguous(), cos, sin, row,
                                            cache.n, head.table)
        cache.n += t
        return list(out)

    def draft_argmax(self, model: Model, head: DraftHead, tokens: list[int], hidden: torch.Tensor,
                     cache: HybridCache) -> tuple[int, torch.Tensor] | None:
        """The greedy draft's (vocabulary id, hidden) in one call, the embedding rows read by the kernel, or None."""
        t = len(tokens)
        if not (self.applies(model, head, t) and stack_embedding(model) is not None
                and hidden.dtype == torch.bfloat16 and hidden.is_contiguous()):
            return None
        cache.reserve(cache.n + t)
        cos, sin, row = model.rope_span(cache.n, t)
        i, h = self.bind(cache, model).draft_argmax(tokens, hidden, cos, sin, row, cache.n, head.table)
        cache.n += t
        return head.vocab_id(i), h

    def bind(self, cache: HybridCache, model: Model) -> Any:
        """The kernel's one-layer `Layers` on this cache's K/V and `model`'s embedding (made again when the cache
        or its buffers change)."""
        key = (cache.serial, cache.version, id(model.embed))
        if self._key != key:
            mtp = self.mtp
            self._fc_table = Projections([mtp.fc]).table  # kept alive beside the stack that reads it
            self._stack = stack_of([mtp.layer], cache)
            self._stack.set_draft(mtp.emb_scale, mtp.hid_scale, mtp.final, mtp.cfg.rms_eps, self._fc_table)
            if stack_embedding(model) is not None:
                self._stack.set_embed(model.embed)
            self._key = key
        return self._stack


def executor_for(model: Model) -> StackExecutor | GraphExecutor | None:
    """The executor of the route chosen for `model` (None: every token runs in the layers)."""
    kind = model.route.kind
    if kind == "cuda-graph":
        model.inv_freq = model.inv_freq.to(model.layers[0].device)  # the rotary rows are made inside the graph
        return GraphExecutor(model)
    return StackExecutor(model) if kind == "stack" else None
