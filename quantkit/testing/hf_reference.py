"""transformers' own Qwen3.5-MoE forward over the very weights quantkit's runtime loaded: the reference the tests
hold quantkit's model (runtime/model/) to.

`reference_model(folder, recipe)` fills transformers' `Qwen3_5MoeForCausalLM` (eager attention, its own Gated
DeltaNet functions, no patches) from the same tensor source and with the same prepared kernels as the loader:
every projection a `QuantLinear` around a `Kernel`, every experts block a `QuantExperts`. Differences between
the two forwards are then the forwards' own, never the weights'. Tests and benches only: the runtime never
imports transformers' modeling code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from quantkit.checkpoint.contract import read_quant_config
from quantkit.checkpoint.quantized import QuantizedFolder
from quantkit.checkpoint.reader import Checkpoint, resolve_model
from quantkit.checkpoint.spec import load_config, text_config_dict
from quantkit.recipe import Recipe, get_recipe
from quantkit.runtime.kernels import Kernel, prepare
from quantkit.runtime.loader import (
    LM,
    LoadReport,
    OnTheFlySource,
    Placement,
    QuantEmbedding,
    QuantizedSource,
    TensorSource,
    build_experts,
    dense_dtype,
)


class QuantLinear(nn.Module):
    """A bias-free `nn.Linear` whose weight is a prepared `Kernel`."""

    def __init__(self, kernel: Kernel):
        super().__init__()
        self.kernel = kernel
        self.in_features, self.out_features = kernel.in_features, kernel.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x.reshape(-1, self.in_features)).reshape(*x.shape[:-1], self.out_features)


class _Embedding(nn.Module):
    def __init__(self, q: QuantEmbedding):
        super().__init__()
        self.q = q

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.q(ids)


def _set_param(module: nn.Module, name: str, t: torch.Tensor) -> None:
    mod_path, _, leaf = name.rpartition(".")
    m = module.get_submodule(mod_path) if mod_path else module
    m._parameters[leaf] = nn.Parameter(t, requires_grad=False)


def _linear(src: TensorSource, name: str) -> QuantLinear:
    spec, shape = src.spec(name)
    parts = src.read(name, "cpu")
    return QuantLinear(prepare(parts if spec else dense_dtype(parts), spec, shape))


def reference_model(folder: str | Path, recipe: str | None = None, fp32_conv: bool = False) -> Any:
    """transformers' Qwen3_5MoeForCausalLM (eager attention) on the CPU with the weights quantkit would load
    from `folder` (a quantkit output, or a checkpoint quantized on the fly with `recipe`). `fp32_conv`: the
    Gated DeltaNet conv weights held in fp32, so transformers computes the conv in fp32 as quantkit does
    (with bf16 weights it rounds to bf16 inside the conv)."""
    import transformers
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTextRotaryEmbedding

    transformers.logging.set_verbosity_error()
    folder = resolve_model(folder)
    config = load_config(folder / "config.json")
    qc = read_quant_config(folder, config)
    src: TensorSource = (QuantizedSource(QuantizedFolder.open(folder)) if qc is not None
                         else OnTheFlySource(Checkpoint.open(folder), get_recipe(recipe or "bf16")))
    cfg = Qwen3_5MoeTextConfig(**text_config_dict(config))
    cfg._attn_implementation = "eager"
    with torch.device("meta"):
        model = Qwen3_5MoeForCausalLM(cfg)
    tm = model.model
    n = cfg.num_hidden_layers
    place = Placement.single(n, cfg.num_experts)
    report = LoadReport()
    try:
        spec, shape = src.spec(f"{LM}embed_tokens.weight")
        if spec is None:
            _set_param(tm, "embed_tokens.weight", dense_dtype(src.read(f"{LM}embed_tokens.weight", "cpu")))
        else:
            tm.embed_tokens = _Embedding(QuantEmbedding(src.read(f"{LM}embed_tokens.weight", "cpu"), spec, shape))
        for i, layer in enumerate(tm.layers):
            pre = f"{LM}layers.{i}."
            for nm in [nm for nm, m in layer.named_modules() if isinstance(m, nn.Linear)]:
                parent, _, leaf = nm.rpartition(".")
                setattr(layer.get_submodule(parent) if parent else layer, leaf, _linear(src, f"{pre}{nm}.weight"))
            layer.mlp.experts = build_experts(src, f"{pre}mlp.experts", place.experts[i], cfg, report)
            for pn, p in list(layer.named_parameters()):
                if p.device.type == "meta":
                    t = dense_dtype(src.read(f"{pre}{pn}", "cpu"))
                    _set_param(layer, pn, t.float() if fp32_conv and pn.endswith("conv1d.weight") else t)
        _set_param(tm, "norm.weight", dense_dtype(src.read(f"{LM}norm.weight", "cpu")))
        if src.has("lm_head.weight"):
            model.lm_head = _linear(src, "lm_head.weight")
        else:
            w = tm.embed_tokens.weight
            model.lm_head = QuantLinear(prepare(w, None, tuple(w.shape), shared=True))
    finally:
        src.close()
    tm.rotary_emb = Qwen3_5MoeTextRotaryEmbedding(cfg)
    left = [nm for nm, p in model.named_parameters() if p.device.type == "meta"]
    if left:
        raise ValueError(f"the reference lacks {left[0]}")
    return model.eval()


def recipe_of(folder: Path) -> Recipe | None:
    qc = read_quant_config(folder, load_config(folder / "config.json"))
    return Recipe.from_dict(qc["recipe"]) if qc is not None else None
