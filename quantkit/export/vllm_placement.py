"""What a `vllm serve` line asks of each GPU, by the bytes of the folder it serves.

vLLM keeps every weight on the GPUs and takes `--gpu-memory-utilization` (0.92 in our line) of each card;
inside that it needs, per GPU: its share of the weights (tensor parallel splits every matrix, the
vocabulary-parallel embedding and lm_head included; pipeline parallel splits the layers), the activation
peak of its profiling run, the CUDA-graph pool, and room for at least one sequence of `--max-model-len`:
the KV cache of the full-attention layers (KV heads split over TP, replicated when TP exceeds them) and
one Gated DeltaNet state. The weights are the export's (quantkit.export.compressed_tensors: routed experts
int4 symmetric g128 with bf16 scales; with `--rest int8` attention, linear attention and the shared expert
int8 per channel; lm_head, embedding, routers, norms bf16), or the bf16 source for the 16-bit schemes
(fp8 on load for int8: one byte per weight). Drafting with the MTP layer (`--speculative-config` method mtp)
adds its weights, as exported, and its KV cache (one more full-attention layer).

Assumed, not measured here (stated in the plan's assumptions): the CUDA-graph
pool `CUDA_GRAPH_BYTES` and vLLM's profiling batch `MAX_BATCHED_TOKENS` times the per-token activation
peak of the budget module.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from quantkit.checkpoint.spec import ModelSpec, Role
from quantkit.planner.budget import (
    RunSettings,
    activation_bytes_per_token,
    compute_budget,
    kv_bytes_per_token,
    linear_state_bytes,
)
from quantkit.recipe import INT4_G128, INT8, RECIPES, Recipe

UTILIZATION = 0.92
CUDA_GRAPH_BYTES = 1 << 30
MAX_BATCHED_TOKENS = 8192


def export_recipe(scheme: str) -> Recipe:
    """The weights vLLM loads for `scheme`: the compressed-tensors export for the 4-bit schemes (quality:
    --rest int8), the source for the others (int8: fp8 on load, one byte per weight like int8)."""
    if scheme == "quality":
        return Recipe("vllm-ct-int8", {Role.ROUTED_EXPERT: INT4_G128, Role.ATTENTION: INT8,
                                       Role.LINEAR_ATTENTION: INT8, Role.SHARED_EXPERT: INT8})
    if scheme in ("int4", "nf4", "fp4", "mxfp4"):
        return Recipe("vllm-ct-bf16", {Role.ROUTED_EXPERT: INT4_G128})
    return RECIPES[scheme]


@dataclass
class VllmFit:
    per_gpu: dict[str, int]  # what each GPU needs at least
    budget: int  # UTILIZATION x card
    kv_pool: int  # bytes left for the KV cache and states on each GPU
    max_tokens: int  # tokens of KV that pool holds (one sequence's state set aside)
    fits: bool
    assumptions: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, object]:
        return {"per_gpu": self.per_gpu, "gpu_total": sum(self.per_gpu.values()), "budget": self.budget,
                "kv_pool": self.kv_pool, "max_tokens": self.max_tokens, "fits": self.fits,
                "assumptions": self.assumptions}


def vllm_fit(spec: ModelSpec, scheme: str, settings: RunSettings, card_bytes: int, tp: int, pp: int,
             mtp: bool = False) -> VllmFit:
    """What the vLLM line asks of each GPU; `mtp`: it drafts with the MTP layer (its weights and KV count)."""
    c = spec.config
    mtp = mtp and c.mtp_num_hidden_layers > 0 and any(t.role == Role.MTP for t in spec.tensors)
    st = RunSettings(context=settings.context, batch=1, cache_dtype=settings.cache_dtype, include_mtp=mtp)
    weights = compute_budget(spec, export_recipe(scheme), st).weights
    n_full, n_lin = len(c.full_attention_layers) + (c.mtp_num_hidden_layers if mtp else 0), len(c.linear_attention_layers)
    kv_split = min(tp, c.num_key_value_heads)
    kv_tok = kv_bytes_per_token(c, settings.cache_dtype, n_full) // kv_split // pp
    rec, conv = linear_state_bytes(c)
    state = (rec + conv) * n_lin // tp // pp
    per = {"weights": weights // (tp * pp), "activations": activation_bytes_per_token(c) * MAX_BATCHED_TOKENS,
           "cuda_graphs": CUDA_GRAPH_BYTES, "kv_one_sequence": kv_tok * settings.context, "state": state}
    budget = int(UTILIZATION * card_bytes)
    pool = budget - per["weights"] - per["activations"] - per["cuda_graphs"]
    max_tokens = max(0, (pool - state) // kv_tok) if kv_tok else 0
    return VllmFit(per, budget, pool, max_tokens, sum(per.values()) <= budget, [
        f"vLLM takes {UTILIZATION} of each card; its CUDA graphs assumed {CUDA_GRAPH_BYTES / 2**30:.2f} GiB and "
        f"its profiling peak {MAX_BATCHED_TOKENS} batched tokens of activations (not measured here: no GPU)",
        f"weights as loaded: {export_recipe(scheme).name}, {weights / 1e9:.2f} GB over TP {tp} x PP {pp}"
        + (", the MTP layer's included (drafting with it), and its KV cache" if mtp else ""),
    ])
