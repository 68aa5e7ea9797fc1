"""How a run of consecutive layers executes on the CPU kernel's one-call stack (`qk.Layers`, csrc/qk_layers.cpp).

A route's executor (`executor_for`, bound once when the route is chosen) takes the one-token steps and the
short verifies it can run; what it leaves (None) runs in the layers. The CPU stack is an executor, not a second
definition of the model: it is handed the layers' own tensors (the
`Projections` tables, norms' constants, conv taps, the caches' K/V and states) and runs, in one call, the
one-token step the layers (model/layers.py) compute with the kernel's fused ops; tests/runtime/test_model_forward.py
holds the two bit for bit on every op table. The model (model/model.py) asks `StackExecutor` for a step or a
verify where the route (model/route.py) is `stack`; the MTP layer (model/mtp.py) binds a one-layer stack the
same way (`stack_of`). The cuda-graph route's executor replays a captured step (model/graph.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from quantkit.runtime import cpu_kernel
from quantkit.runtime.kernels import Projections
from quantkit.runtime.model.cache import HybridCache, Trail
from quantkit.runtime.model.graph import GraphExecutor
from quantkit.runtime.model.layers import Attention, DeltaNet, Layer

if TYPE_CHECKING:
    from quantkit.runtime.model.model import Model


def layer_stackable(L: Layer) -> bool:
    """Whether a layer can run in the kernel's one-call stack: on the CPU, every projection a kernel table, the
    routed experts in one `qk.moe` call, the router on the bf16 kernel and the kernel's attention."""
    m, moe = L.mixer, L.moe
    if L.device.type != "cpu" or not moe.fused_all or moe.shared_and_router is None:
        return False
    tables = [moe.shared_and_router, moe.down_one] + (
        [m.proj_in, m.out_one] if isinstance(m, DeltaNet) else [m.qkv_in, m.o_one])
    return all(p.fused for p in tables) and (not isinstance(m, Attention) or m.kernel_attends)


def stack_of(layers: list[Layer], cache: HybridCache) -> Any:
    """The kernel's `Layers` for these (stackable) layers, pointed at this cache's tensors."""
    stack = cpu_kernel.module().Layers()
    for L in layers:
        m, moe = L.mixer, L.moe
        if isinstance(m, DeltaNet):
            stack.add_gdn(L.pre, L.post, L.eps, m.proj_in.table, m.out_one.table, cache.conv[L.index], m.conv_taps,
                          m.neg_a, m.dt_bias, m.norm_wf, m.norm_w.dtype == torch.bfloat16, cache.state[L.index], m.hk)
        else:
            stack.add_attention(L.pre, L.post, L.eps, m.qkv_in.table, m.o_one.table, m.qk_scale,
                                cache.keys[L.index], cache.values[L.index], m.scaling, m.eps)
        assert moe.shared_and_router is not None
        stack.set_moe(moe.shared_and_router.table, moe.down_one.table, moe.experts._fused_table()[1], moe.top_k)
    return stack


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
        self._gdn_layers = [L.index for L in model.layers if isinstance(L.mixer, DeltaNet)]

    def bind(self, cache: HybridCache) -> Any:
        """The kernel's `Layers` pointed at this cache's tensors."""
        key = (cache.serial, cache.version)
        if self._key == key:
            return self._stack
        m = self.model
        stack = stack_of(m.layers, cache)
        self._head_table = Projections([m.head]).table  # kept alive beside the stack that reads it
        stack.set_head(m.final, m.eps, self._head_table)
        if m.stack_embedding() is not None:
            stack.set_embed(m.embed)
        self._stack, self._key = stack, key
        return stack

    def _input(self, ids: list[int] | torch.Tensor) -> torch.Tensor | list[int] | None:
        """The ids where the stack reads the embedding itself, else their rows [T, H]; None where the rows are
        off the CPU (the layers run them)."""
        m = self.model
        if isinstance(ids, list) and m.stack_embedding() is not None:
            return ids
        x = m._embed(ids)
        return x if x.device.type == "cpu" else None

    def step(self, ids: list[int] | torch.Tensor, cache: HybridCache) -> torch.Tensor | None:
        """Logits [V] of one token at cache.n, cache.n advanced (None: the layers take it)."""
        cache.pos = None
        x = self._input(ids)
        if x is None:
            return None
        cos, sin, row = self.model._rope_table(cache.n)
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
        cos, sin, row = self.model._rope_span(n, t)
        st = self.bind(cache)
        out = st.verify_ids(x, cos, sin, row, n) if isinstance(x, list) else st.verify(x.contiguous(), cos, sin, row, n)
        for j, i in enumerate(self._gdn_layers):
            cache.trail[i] = Trail(n, out[2 + 2 * j], None)
            cache.state[i] = out[3 + 2 * j]
        if self._gdn_layers:
            cache.replay = st.rewind
        cache.n += t
        return out[0], out[1]


def executor_for(model: Model) -> StackExecutor | GraphExecutor | None:
    """The executor of the route chosen for `model` (None: every token runs in the layers)."""
    kind = model.route.kind
    return StackExecutor(model) if kind == "stack" else GraphExecutor(model) if kind == "cuda-graph" else None
