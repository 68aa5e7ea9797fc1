"""`QuantExperts`: routed experts resident where the plan put them, with transformers' forward signature.

Per layer the experts are split into device groups (e.g. ids 0..99 on cuda:0, 100..255 on cpu). A batch
of tokens is routed (by transformers' router, unchanged); each group computes ITS experts on ITS device:
only the hidden rows routed to it cross over, never a weight. Each (token, slot) result lands in a
[T, k, H] buffer on the layer's device, which is summed in slot order, so the output does not depend on
how the experts are split (bit for bit, as the tests check).

Decode (one token) touches only the k routed experts and sums their weighted outputs in slot order as it
goes (no buffer: the same fp32 operations in the same order); prefill sorts the (token, slot) pairs by
expert and runs one matmul per hit expert over all its tokens, or, where every expert is an int4/int8 CPU
kernel, one `qk.moe` call for all T tokens (each expert read once for its tokens; each row bit for bit
what decode gives it).

Fused CPU decode: where the routed experts' kernels are quantkit's C++ kernel (`QKernel`: int4/int8 on
a CPU with AVX2/AVX512-VNNI; `QBf16Kernel`: bf16 with AVX512-BF16), one call (`qk.moe`) runs all of them (gate_up, SiLU x up, down, weighted
sum in slot order) on torch's thread pool, instead of 2k kernel calls and ~6k small ops from Python.
Its table of weight pointers covers every CPU expert of the layer whatever its group, so the result
still does not depend on the split. It is built at the first decode from the kernels then in place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from quantkit.runtime.kernels import Kernel, QBf16Kernel, QKernel

_FUSABLE = (QKernel, QBf16Kernel)


@dataclass
class ExpertGroup:
    """The experts of one layer that live on one device."""

    device: torch.device
    ids: list[int]
    gate_up: list[Kernel] = field(default_factory=list)  # per expert: [2I, H]
    down: list[Kernel] = field(default_factory=list)  # per expert: [H, I]

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes for k in self.gate_up) + sum(k.nbytes for k in self.down)


class QuantExperts(nn.Module):
    """Drop-in for `Qwen3_5MoeExperts`: forward(hidden_states [T, H], top_k_index [T, k],
    top_k_weights [T, k]) -> [T, H] on hidden_states' device."""

    def __init__(self, num_experts: int, hidden_dim: int, intermediate_dim: int, groups: list[ExpertGroup],
                 act_fn: nn.Module | None = None, fmt: str = "bf16"):
        super().__init__()
        self.num_experts = num_experts
        self.hidden_dim = hidden_dim
        self.intermediate_dim = intermediate_dim
        self.groups = groups
        self.format = fmt
        self.act_fn = act_fn or nn.SiLU()
        self._silu = type(self.act_fn) is nn.SiLU
        owner, local = [-1] * num_experts, [-1] * num_experts
        for gi, g in enumerate(groups):
            if len(g.gate_up) != len(g.ids) or len(g.down) != len(g.ids):
                raise ValueError("each expert of a group needs a gate_up and a down kernel")
            for li, e in enumerate(g.ids):
                if owner[e] != -1:
                    raise ValueError(f"expert {e} is placed twice")
                owner[e], local[e] = gi, li
        missing = [e for e in range(num_experts) if owner[e] == -1]
        if missing:
            raise ValueError(f"experts {missing[:5]} are placed nowhere")
        self._owner, self._local = owner, local
        # GPU groups first: their kernels run asynchronously while the CPU computes its own experts.
        self._order = sorted(range(len(groups)), key=lambda i: groups[i].device.type == "cpu")
        self._fused: tuple[Any, torch.Tensor, list[bool]] | None | bool = None  # built at the first decode
        self._rows: Any = None  # the multi-token call on that table (`_rows_call`)

    def _fused_table(self) -> tuple[Any, torch.Tensor, list[bool]] | None:
        """(kernel module, int64 [E, 2, 8] table, which experts it covers) or None when none can fuse."""
        if self._fused is None:
            self._fused = False
            rows, ok = [], []
            for e in range(self.num_experts):
                g = self.groups[self._owner[e]]
                gu, dn = g.gate_up[self._local[e]], g.down[self._local[e]]
                fits = (self._silu and g.device.type == "cpu" and type(gu) in _FUSABLE and type(dn) in _FUSABLE
                        and (gu.out_features, gu.in_features) == (2 * self.intermediate_dim, self.hidden_dim)
                        and (dn.out_features, dn.in_features) == (self.hidden_dim, self.intermediate_dim))
                ok.append(fits)
                rows.append([gu.descriptor(), dn.descriptor()] if fits else [[0] * 8, [0] * 8])
            if any(ok):
                mod = next(gu._mod for g in self.groups for gu in g.gate_up if type(gu) in _FUSABLE)
                self._fused = (mod, torch.tensor(rows, dtype=torch.int64), ok)
        return self._fused or None

    def _rows_call(self) -> Any:
        """`qk.moe` bound to this layer's table where every expert is an int4/int8 CPU kernel (bf16 experts
        keep torch's GEMM per expert, faster on many rows than the kernel's row-by-row bf16 tile), else None."""
        if self._rows is None:
            fused = self._fused_table()
            ok = fused is not None and all(fused[2]) and bool((fused[1][:, :, 3] != 16).all())
            self._rows = (lambda x, ids, wts, f=fused[0].moe, table=fused[1]: f(x, table, ids, wts)) if ok else False
        return self._rows or None

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.groups)

    def placement(self) -> dict[str, list[int]]:
        return {str(g.device): list(g.ids) for g in self.groups}

    def _expert(self, g: ExpertGroup, li: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = g.gate_up[li](x).chunk(2, dim=-1)
        act = F.silu(gate) if self._silu else self.act_fn(gate)  # F.silu: the SiLU module's own op, no hooks
        return g.down[li](act * up)

    def _forward_one(self, hidden_states: torch.Tensor, experts: list[int],
                     top_k_weights: torch.Tensor) -> torch.Tensor:
        """Decode: one token, its k experts. Fused CPU experts: one `qk.moe` call (module docstring).
        Others: the same fp32 products and slot-order sum as the batched path below (bit for bit),
        without its [T*k, H] buffer and scatter: each expert's output is weighted in place and added to
        the running sum."""
        dev = hidden_states.device
        wts = top_k_weights.reshape(-1).float()
        out = None
        fused = self._fused_table() if dev.type == "cpu" else None
        if fused is not None:
            mod, table, ok = fused
            slots = [s for s, e in enumerate(experts) if ok[e]]
            if len(slots) == len(experts):
                y = mod.moe(hidden_states, table, torch.tensor(experts), wts)
                return y.view(hidden_states.shape).to(hidden_states.dtype)
            if slots:
                out = mod.moe(hidden_states, table, torch.tensor([experts[s] for s in slots]), wts[slots])
                out = out.view(hidden_states.shape)
                experts = [e if not ok[e] else -1 for e in experts]
        for slot, e in enumerate(experts):
            if e < 0:
                continue
            g = self.groups[self._owner[e]]
            x = hidden_states if g.device == dev else hidden_states.to(g.device, non_blocking=True)
            r = self._expert(g, self._local[e], x).to(dev, torch.float32).mul_(wts[slot])
            out = r if out is None else out.add_(r)
        return out.to(hidden_states.dtype)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        t, k = top_k_index.shape
        flat = top_k_index.reshape(-1)
        if t == 1:
            return self._forward_one(hidden_states, flat.tolist(), top_k_weights)
        dev = hidden_states.device
        rows = self._rows_call() if dev.type == "cpu" else None
        if rows is not None:
            return rows(hidden_states.contiguous(), top_k_index, top_k_weights.float()).to(hidden_states.dtype)
        buf = torch.zeros(t * k, self.hidden_dim, dtype=torch.float32, device=dev)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        starts = [0] * (self.num_experts + 1)
        for e in range(self.num_experts):
            starts[e + 1] = starts[e] + counts[e]
        token_of = order // k  # (token, slot) pair -> token row
        for gi in self._order:
            g = self.groups[gi]
            hit = [e for e in g.ids if counts[e]]
            if not hit:
                continue
            sel = torch.cat([order[starts[e]:starts[e + 1]] for e in hit])
            rows = hidden_states[token_of[torch.cat([torch.arange(starts[e], starts[e + 1], device=dev)
                                                     for e in hit])]]
            xg = rows.to(g.device, non_blocking=True)
            outs, off = [], 0
            for e in hit:
                n = counts[e]
                outs.append(self._expert(g, self._local[e], xg[off:off + n]))
                off += n
            buf[sel] = torch.cat(outs).to(dev, torch.float32)
        w = top_k_weights.reshape(t, k, 1).float()
        y = buf.view(t, k, self.hidden_dim).mul_(w)
        out = y[:, 0]
        for slot in range(1, k):
            out = out + y[:, slot]
        return out.to(hidden_states.dtype)

    def extra_repr(self) -> str:
        where = ", ".join(f"{d}: {len(ids)}" for d, ids in self.placement().items())
        return f"experts={self.num_experts}, format={self.format}, placement=({where})"
