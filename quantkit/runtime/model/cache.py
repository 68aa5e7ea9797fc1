"""`HybridCache`: the state a generation carries between forwards, owned by quantkit's model.

Per full-attention layer, keys and values in buffers [kv_heads, capacity, head_dim] filled up to `n` (the
kernel's attention reads them in place; `reserve` grows them by copying). Per Gated DeltaNet layer, the conv
window [K, C] (the last K inputs of the causal conv, oldest first, in the activations' dtype) and the recurrent
state [Hv, Dk, Dv] in fp32, both updated in place. `n` counts the tokens the state has seen.

A forward with `keep_positions` also records, per Gated DeltaNet layer, what takes its state back to any position
it computed (`trail`: the states after each, or, from the kernel's stack, a `replay` of the first tokens from the
state before); `rewind(n)` then keeps the first n tokens exactly (speculative decoding rolls a rejected draft back
this way; the KV needs no trail, only its fill). `snapshot` / `from_snapshot` convert to and from
the prompt cache's `Snapshot` (quantkit.runtime.state_cache), whose layout session files keep: conv [1, C, K],
recurrent [1, Hv, Dk, Dv], keys and values [1, kv_heads, n, head_dim]. Snapshots are copies (the snapshots of one
prefill share one copy of the KV): nothing a snapshot holds is ever written by a forward.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from quantkit.runtime.model.config import ModelConfig
from quantkit.runtime.state_cache import Snapshot

_SERIAL = itertools.count()


@dataclass
class Trail:
    """What a keep-positions forward left for `rewind`: the first position it computed, the conv inputs it
    saw (the window before it, then its T inputs: [K + T, C]) and the recurrent state after each position (the
    last may be left out: it is the cache's own, and a rewind to it is none), or None where the cache's `replay`
    restores the states. The kernel's stack lends views of its own buffers here, which its next verify writes
    again: a trail lasts until the cache's next forward."""

    start: int
    conv_inputs: torch.Tensor
    states: torch.Tensor | None  # [T or T - 1, Hv, Dk, Dv] fp32


class HybridCache:
    def __init__(self, cfg: ModelConfig, devices: Sequence[str | torch.device], dtype: torch.dtype = torch.bfloat16,
                 capacity: int = 0):
        t = cfg.text
        if len(devices) != t.num_hidden_layers:
            raise ValueError(f"{len(devices)} devices for {t.num_hidden_layers} layers")
        self.cfg, self.dtype, self.n, self.capacity = cfg, dtype, 0, 0
        self.kinds = ["linear" if k == "linear_attention" else "kv" for k in t.layer_types]
        self.devices = [torch.device(d) for d in devices]
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.conv: dict[int, torch.Tensor] = {}
        self.state: dict[int, torch.Tensor] = {}
        self.trail: dict[int, Trail] = {}
        self.replay: Callable[[int], None] | None = None  # j -> every layer's state back to the trail's j-th token
        self.pos: torch.Tensor | None = None  # n on the device, for static steps (model/graph.py)
        self.serial = next(_SERIAL)  # never reused, unlike id(): what holds pointers into a cache keys on it
        self.version = 0  # bumped when the KV buffers move (whatever holds pointers into them rebinds)
        hv, dk, dv = t.linear_num_value_heads, t.linear_key_head_dim, t.linear_value_head_dim
        for i, kind in enumerate(self.kinds):
            if kind == "linear":
                dev = self.devices[i]
                self.conv[i] = torch.zeros(t.linear_conv_kernel_dim, cfg.conv_dim, dtype=dtype, device=dev)
                self.state[i] = torch.zeros(hv, dk, dv, dtype=torch.float32, device=dev)
        self.reserve(max(capacity, 1))

    def reserve(self, total: int) -> None:
        """Room for `total` positions in every attention layer (grown by half again, at least, when short)."""
        if total <= self.capacity:
            return
        cap = max(total, self.capacity + self.capacity // 2)
        t = self.cfg.text
        for i, kind in enumerate(self.kinds):
            if kind != "kv":
                continue
            k = torch.zeros(t.num_key_value_heads, cap, t.head_dim, dtype=self.dtype, device=self.devices[i])
            v = torch.zeros_like(k)
            if i in self.keys:
                k[:, :self.n].copy_(self.keys[i][:, :self.n])
                v[:, :self.n].copy_(self.values[i][:, :self.n])
            self.keys[i], self.values[i] = k, v
        self.capacity = cap
        self.version += 1

    def rewind(self, n: int) -> None:
        """Keep the first `n` tokens: with a trail of the last forward, back to any position it computed."""
        if n == self.n:
            self.drop_trail()
            return
        if not self.conv and 0 <= n < self.n:  # attention alone: its KV is cut back by its fill
            self.n = n
            return
        if not self.trail or n > self.n:
            raise ValueError(f"cannot rewind from {self.n} to {n} tokens without the positions kept")
        some = next(iter(self.trail.values()))
        j = n - some.start  # tokens of the last forward kept
        if j < 1:
            raise ValueError(f"the positions kept start after token {some.start}; cannot rewind to {n}")
        k = self.cfg.text.linear_conv_kernel_dim
        for i, tr in self.trail.items():
            self.conv[i].copy_(tr.conv_inputs[j:j + k])
            if tr.states is not None:
                self.state[i].copy_(tr.states[j - 1])
        if self.replay is not None:
            self.replay(j)
        self.drop_trail()
        self.n = n

    def drop_trail(self) -> None:
        """Forget the last forward's positions (its states stand)."""
        self.trail.clear()
        self.replay = None

    def nbytes(self) -> int:
        """Bytes this cache holds (KV buffers at their capacity, conv windows, recurrent states)."""
        ts = [*self.keys.values(), *self.values.values(), *self.conv.values(), *self.state.values()]
        return sum(x.numel() * x.element_size() for x in ts)

    # ---- the prompt cache's snapshots ----
    def linear_copies(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Copies of every Gated DeltaNet layer's (conv, recurrent) state in the snapshot layout: what a prefill
        keeps when it passes a position it will snapshot."""
        return {i: (self.conv[i].t().unsqueeze(0).clone(), self.state[i].unsqueeze(0).clone()) for i in self.conv}

    def snapshots(self, ids: Sequence[int], taken: list[tuple[int, dict[int, tuple[torch.Tensor, torch.Tensor]]]]
                  ) -> list[Snapshot]:
        """Snapshots after ids[:b] for each (b, `linear_copies` at b) in `taken`: their keys and values are
        views of one copy of this cache's KV up to the longest b, so they share it (the prompt cache and the
        planner count it once)."""
        if not taken:
            return []
        m = max(b for b, _lin in taken)
        if m > self.n:
            raise ValueError(f"a snapshot of {m} tokens from a cache of {self.n}")
        kv = {i: (self.keys[i][:, :m].unsqueeze(0).clone(), self.values[i][:, :m].unsqueeze(0).clone())
              for i in self.keys}
        out = []
        for b, lin in taken:
            layers: list[tuple[str, torch.Tensor | None, torch.Tensor | None]] = [
                ("linear", *lin[i]) if kind == "linear" else ("kv", kv[i][0][..., :b, :], kv[i][1][..., :b, :])
                for i, kind in enumerate(self.kinds)]
            out.append(Snapshot(tuple(ids[:b]), layers))
        return out

    def snapshot(self, ids: Sequence[int]) -> Snapshot:
        """A copy of this state, which is the state after `ids` (len(ids) == n)."""
        if len(ids) != self.n:
            raise ValueError(f"a snapshot of {len(ids)} tokens from a cache of {self.n}")
        return self.snapshots(ids, [(self.n, self.linear_copies())])[0]

    @classmethod
    def from_snapshot(cls, snap: Snapshot, cfg: ModelConfig, devices: Sequence[str | torch.device],
                      dtype: torch.dtype = torch.bfloat16, capacity: int = 0) -> HybridCache:
        """A cache in the state of `snap` (its tensors copied), with room for `capacity` positions."""
        cache = cls(cfg, devices, dtype, max(capacity, snap.length + 1))
        if [k for k, _a, _b in snap.layers] != cache.kinds:
            raise ValueError(f"a snapshot of {len(snap.layers)} layers does not fit this model's "
                             f"{len(cache.kinds)}")
        n = snap.length
        for i, (kind, a, b) in enumerate(snap.layers):
            assert a is not None and b is not None
            if kind == "linear":
                cache.conv[i].copy_(a[0].t())
                cache.state[i].copy_(b[0])
            else:
                cache.keys[i][:, :n].copy_(a[0])
                cache.values[i][:, :n].copy_(b[0])
        cache.n = n
        return cache
