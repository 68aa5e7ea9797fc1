"""Routed experts on a device computed without reading their ids on the host: `GatheredExperts`.

Where a layer's experts live on a GPU, reading the routed ids back to pick kernels would sync the device every
layer. Instead each part of every expert of a group is stacked into one [E_g, ...] tensor, the k routed
experts' weights are gathered by index on the device, and slots whose expert lives in another group are
weighted 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from quantkit.runtime.kernels import DenseKernel, Int4Kernel, Int8Kernel, Kernel
from quantkit.runtime.qexperts import QuantExperts


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
        experts._fused = experts._rows = None  # kernel tensors moved: the fused CPU table is rebuilt from them

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
