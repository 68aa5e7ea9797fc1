"""One decode step over B sequences at once, each at its own position with its own `HybridCache`.

`step_batch(model, ids, caches)` feeds token ids[j] to caches[j] for every row j and returns the logits [B, V],
row j bit for bit what `model.forward([ids[j]], caches[j])` gives (tests/runtime/test_batch_decode.py), on every route.

Which ops take all B rows and which run row by row, and why:
- all rows at once: every dense matrix (the mixers' input and output projections, the shared expert's gate / up
  / gate and down, the head), in groups of up to ROWS rows: the kernels' multi-row tiles read a matrix once for
  the group and a row's sums do not depend on the other rows (what a speculative verify already relies on;
  above ROWS the bf16 kernel hands over to a GEMM whose roundings differ). The routed experts, where every
  expert of the layer is an int4 / int8 CPU kernel: one `qk.moe_rows` call for all B rows, each chosen expert
  read once for the rows that chose it, each row's sum bit for bit `qk.moe`'s.
- row by row: the attention core and the Gated DeltaNet conv + recurrent update (each row reads and writes its
  own cache: its K/V at its own position, its own states), the norms, the routing (a row's top-k of its own
  router logits; the router runs on one row as a step runs it: the fp32 GEMV has no multi-row form that keeps
  the one-row sums; on the kernel's routes its bf16 product runs on all rows with the shared expert's inputs)
  and the elementwise ops around the MoE sum (one row as a step runs them: torch's
  vectorised SiLU rounds its scalar tail otherwise). Routed experts on other kernels (bf16 experts, GPU
  gathered experts, a CPU+GPU split) also run row by row through the one-token path, which keeps each row's
  result; their batched form is left to the prefill path, whose sums are ordered otherwise.
The route (model/route.py) decides the ops as a one-token step does: the CPU kernel's fused ops on the `stack` and
`fused` routes (the stack's one-call step computes the same logits as the fused ops, tests/runtime/test_model_forward.py),
torch ops otherwise; nothing here looks at the device or the instruction set.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from quantkit.runtime import cpu_kernel
from quantkit.runtime.kernels import Projections
from quantkit.runtime.model.cache import HybridCache
from quantkit.runtime.model.layers import DeltaNet, Layer, MoE, rms

if TYPE_CHECKING:
    from quantkit.runtime.model.model import Model

ROWS = 4  # rows per call of a dense matrix: the kernels' multi-row tiles (QBf16Kernel.MAX_ROWS)


def _groups(n: int) -> list[slice]:
    return [slice(a, min(a + ROWS, n)) for a in range(0, n, ROWS)]


def _project(p: Projections, h: torch.Tensor) -> list[torch.Tensor]:
    """Every matrix of `p` on all rows of h, in groups of ROWS rows."""
    parts = [p(h[g]) for g in _groups(h.shape[0])]
    return parts[0] if len(parts) == 1 else [torch.cat(outs) for outs in zip(*parts, strict=True)]


def _linear(k: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    parts = [k(h[g]) for g in _groups(h.shape[0])]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _rows(n: int) -> list[slice]:
    return [slice(j, j + 1) for j in range(n)]


def step_batch(model: Model, ids: Sequence[int], caches: Sequence[HybridCache]) -> torch.Tensor:
    """Logits [B, V] of token ids[j] at position caches[j].n for each row j; every cache advanced by one."""
    if len(ids) != len(caches) or not ids:
        raise ValueError(f"step_batch takes one cache per token; got {len(ids)} tokens, {len(caches)} caches")
    if len({id(c) for c in caches}) != len(caches):
        raise ValueError("step_batch: a cache appears twice in the batch (each row needs its own)")
    if len(ids) == 1:  # one row: the route's own step (the stack's one call), the same logits with no per-row ops
        return model.forward([int(ids[0])], caches[0]).view(1, -1)
    with cpu_kernel.denormals_flushed():
        return _step(model, [int(t) for t in ids], list(caches))


def _step(model: Model, ids: list[int], caches: list[HybridCache]) -> torch.Tensor:
    for c in caches:
        c.reserve(c.n + 1)
        c.drop_trail()
        c.pos = None
    x = torch.cat([model._embed([t]) for t in ids])
    ops = model.ops
    rope = [model._rope_rows(torch.tensor([c.n]), x.dtype) for c in caches]
    cos, sin = torch.cat([r[0] for r in rope]), torch.cat([r[1] for r in rope])
    for L in model.layers:
        x = _layer(L, x, caches, cos, sin, ops)
    for c in caches:
        c.n += 1
    x = x.to(model.head_device)
    f = ops if ops is not None and x.device.type == "cpu" and x.dtype == torch.bfloat16 else None
    x = torch.cat([f.rms(x[r], model.final, model.eps) if f is not None else rms(x[r], model.final, model.eps)
                   for r in _rows(x.shape[0])])
    return _linear(model.head, x)


def _layer(L: Layer, x: torch.Tensor, caches: list[HybridCache], cos: torch.Tensor, sin: torch.Tensor,
           ops: Any) -> torch.Tensor:
    """Layer L on x [B, H], row j against caches[j] (`Layer.__call__` of one token, per row)."""
    if x.device != L.device:
        x, cos, sin = x.to(L.device), cos.to(L.device), sin.to(L.device)
    ops = ops if ops is not None and x.dtype == torch.bfloat16 else None
    rows = _rows(x.shape[0])
    h = torch.cat([L._pre(x[r], ops) for r in rows])
    m, i = L.mixer, L.index
    if isinstance(m, DeltaNet):
        qkv, z, b, a = _project(m.proj_in, h)
        core = [m.core(qkv[r], z[r], b[r], a[r], c.conv[i], c.state[i], ops)[0] for r, c in zip(rows, caches, strict=True)]
        out = _linear(m.out, torch.cat(core))
    else:
        qo, ko, vo = _project(m.qkv_in, h)
        core = [m.core(qo[r], ko[r], vo[r], c.keys[i], c.values[i], c.n, cos[r], sin[r], ops)
                for r, c in zip(rows, caches, strict=True)]
        out = _linear(m.o, torch.cat(core))
    post = [L._post(x[r], out[r], ops) for r in rows]
    return _moe(L.moe, torch.cat([p[0] for p in post]), torch.cat([p[1] for p in post]), ops)


def _moe(moe: MoE, x: torch.Tensor, h: torch.Tensor, ops: Any) -> torch.Tensor:
    """x + the MoE block on h, [B, H] (`MoE.add_to` of one token, per row, its matrices on all rows)."""
    rows = _rows(h.shape[0])
    fused = ops is not None and h.dtype == torch.bfloat16
    if fused and moe.shared_and_router is not None:  # the router's logits beside the shared expert's inputs,
        # on all rows (as the kernel's stack runs them), each row's top-k then taken alone
        gate, up, sg, logits = _project(moe.shared_and_router, h)
        picks = [ops.route(logits[r], moe.top_k) for r in rows]
        wts, ids = torch.stack([p[0].view(-1) for p in picks]), torch.stack([p[1].view(-1) for p in picks])
    else:
        gate, up, sg = _project(moe.shared_in, h)
        picks = [moe.route(h[r], ops) for r in rows]
        wts, ids = torch.cat([p[0] for p in picks]), torch.cat([p[1] for p in picks])
    act = torch.cat([ops.silu_mul(gate[r], up[r]) if fused else F.silu(gate[r]) * up[r] for r in rows])
    shared = _linear(moe.shared_down, act)
    many = moe.experts._rows_call() if moe.fused_all else None
    routed = many(h.contiguous(), ids, wts.float()) if many is not None else None  # fp32 [B, H]
    out = []
    for j, r in enumerate(rows):
        if routed is not None:
            rj = routed[j] if fused else routed[r].to(h.dtype)
        else:
            rj = moe.routed(h[r], wts[r], ids[r])
            rj = rj.float().view(-1) if fused else rj
        out.append(ops.moe_out(x[r], rj, shared[r], sg[r]) if fused else x[r] + (rj + torch.sigmoid(sg[r]) * shared[r]))
    return torch.cat(out)
