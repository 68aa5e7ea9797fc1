"""How the model computes a one-token step, chosen once at load: a named `Route`.

- `cpu-<table>-stack`: the whole stack of layers (and the head) in one call of quantkit's CPU kernel
  (`qk.Layers`, csrc/qk_layers.cpp), where every layer is on the CPU with every matrix on the kernel;
- `cpu-<table>-fused`: per layer the kernel's fused ops (norms, the mixers' cores, routing, the MoE sum);
- `torch`: torch ops (a GPU, a CPU without the kernel, or forced);
- `cuda-graph`: the torch step captured once in a CUDA graph and replayed (model/graph.py), where the whole model
  sits on one CUDA device; only when asked for.
Prompts run the layers' T-token path; a speculative verify of 2-4 tokens runs in the stack where the route is
`stack` (`Layers.verify`), else in the layers' rows as one-token steps on the route's ops (model/ops.py).
`RuntimeOptions.route` (runtime/options.py: `load_model(options=)`, `forced_route=`, or
QUANTKIT_ROUTE=stack|fused|torch|cuda-graph read by `RuntimeOptions.from_env`) forces one; a route this machine or placement cannot run is refused in one line, naming the route used instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from quantkit.kernels import cpu as cpu_kernel
from quantkit.runtime.options import ROUTE_ENV

if TYPE_CHECKING:
    from quantkit.runtime.model.qwen3_5_moe import Model

ENV = ROUTE_ENV
KINDS = ("stack", "fused", "torch", "cuda-graph")


@dataclass(frozen=True)
class Route:
    kind: str  # stack | fused | torch
    table: str  # the CPU kernel's op table ("" without it)
    isa: str

    @property
    def name(self) -> str:
        return self.kind if self.kind in ("torch", "cuda-graph") else f"cpu-{self.table}-{self.kind}"

    def describe(self) -> dict[str, Any]:
        """For `generate --json`, /stats and the load line."""
        return {"name": self.name, "isa": self.isa, "table": self.table, "fused_ops": self.kind in ("stack", "fused"),
                "one_call": self.kind == "stack"}


def possible(model: Model) -> list[str]:
    """The route kinds this model can take here, best first (cuda-graph last: only when asked for)."""
    mod = cpu_kernel.module()
    cpu = all(L.device.type == "cpu" for L in model.layers)
    out = []
    if mod is not None and cpu and model.dtype_is_bf16:
        if hasattr(mod, "Layers") and model.stackable():
            out.append("stack")
        out.append("fused")
    out.append("torch")
    if graphable(model):
        out.append("cuda-graph")
    return out


def graphable(model: Model) -> bool:
    """Every layer, expert, the embedding and the head on one CUDA device, the experts gathered by routed id
    (a graph cannot hold a CPU hand-off or a host read)."""
    emb = model.embed if isinstance(model.embed, torch.Tensor) else next(iter(model.embed.parts.values()))
    devs = {L.device for L in model.layers} | {model.head_device, emb.device}
    if len(devs) != 1 or next(iter(devs)).type != "cuda":
        return False
    return all(L.moe.gathered and not L.moe.cpu_groups and not L.moe.host_ids for L in model.layers)


def choose(model: Model, forced: str | None = None, notes: list[str] | None = None, source: str = "route") -> Route:
    """The best route, or `forced` (None: the best) where this model can take it; `source` names where a
    refused `forced` came from in the note (RuntimeOptions.route_source: "route" or the variable)."""
    want = (forced or "").strip().lower()
    can = possible(model)
    kind = can[0]
    if want and want in can:
        kind = want
    elif want:
        why = f"{source}={want}" if source != "route" else f"route {want!r}"
        cannot = ("needs every layer, expert, the embedding and the head on one CUDA device, experts in a format "
                  "it can gather (bf16, int8, int4)" if want == "cuda-graph" else "this model and machine cannot run it")
        line = (f"{why}: not one of {', '.join(KINDS)}" if want not in KINDS else f"{why}: {cannot}") + f"; using {kind}"
        if notes is not None:
            notes.append(line)
    has_kernel = cpu_kernel.module() is not None
    return Route(kind, cpu_kernel.isa_name() if has_kernel else "", cpu_kernel.isa() if has_kernel else "none")
