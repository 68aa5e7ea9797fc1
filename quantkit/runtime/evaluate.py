"""Accuracy of a Runtime against the unquantized transformers model, used by tests and benchmarks.

- `layer_errors`: each decoder layer run on the reference's own input with the reference's expert
  choice held fixed (the router's output replaced by the reference's), so what is measured is the
  quantization error of that layer and not a flipped expert choice (random MoE routers are nearly tied).
  The error is relative on the layer's update: ||d_q - d_ref|| / ||d_ref|| with d = output - input.
- `logit_agreement`: top-1 agreement and mean KL(ref || runtime) of next-token distributions over
  full sequences.
"""

from __future__ import annotations

from typing import Any

import torch

from quantkit.runtime.model.qwen3_5_moe import Prompt


def _capture_layers(ref: Any, ids: torch.Tensor) -> list[dict[str, Any]]:
    """Per reference decoder layer: its call's args/kwargs, its output and its router output."""
    rec: list[dict[str, Any]] = [{} for _ in ref.model.layers]
    hooks = []
    for i, layer in enumerate(ref.model.layers):
        def pre(_m, args, kwargs, i=i):
            rec[i]["args"], rec[i]["kwargs"] = args, dict(kwargs)

        def post(_m, _args, _kwargs, out, i=i):
            rec[i]["out"] = out[0] if isinstance(out, tuple) else out

        def gate(_m, _args, out, i=i):
            rec[i]["router"] = out

        hooks += [layer.register_forward_pre_hook(pre, with_kwargs=True),
                  layer.register_forward_hook(post, with_kwargs=True),
                  layer.mlp.gate.register_forward_hook(gate)]
    try:
        with torch.no_grad():
            ref(input_ids=ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return rec


def layer_errors(model: Any, ref: Any, ids: torch.Tensor) -> list[float]:
    """Relative error of each layer of quantkit's `model` (runtime/model/) on the reference's input, with the
    reference's expert choice held fixed; each sequence of `ids` [B, T] from a fresh cache."""
    rec = _capture_layers(ref, ids)
    b, t = ids.shape
    cos, sin = model.rope_rows(torch.arange(t), torch.bfloat16)
    errs = []
    for i, layer in enumerate(model.layers):
        r = rec[i]
        _logits, scores, idx = r["router"]
        x_in = r["args"][0] if r["args"] else r["kwargs"]["hidden_states"]
        outs = []
        with torch.inference_mode():
            for row in range(b):
                rows = slice(row * t, (row + 1) * t)
                layer.moe.route = lambda _h, _ops, s=scores[rows], d=idx[rows]: (s.to(torch.bfloat16).float(), d)
                try:
                    outs.append(layer(x_in[row].to(torch.bfloat16), Prompt(model.new_cache(t), cos, sin)))
                finally:
                    del layer.moe.route
        d_ref = (r["out"] - x_in).float()
        d_q = torch.stack(outs).float() - x_in.float()
        errs.append(float((d_q - d_ref).norm() / d_ref.norm()))
    return errs


def logit_agreement(logits_q: torch.Tensor, logits_ref: torch.Tensor) -> dict[str, float]:
    """Top-1 agreement and mean/max KL(ref || q) over every position of [B, T, V] logits."""
    lq = logits_q.float().flatten(0, -2)
    lr = logits_ref.float().flatten(0, -2)
    pr = torch.log_softmax(lr, -1)
    pq = torch.log_softmax(lq, -1)
    kl = (pr.exp() * (pr - pq)).sum(-1)
    return {"positions": int(lr.shape[0]), "top1_agreement": float((lq.argmax(-1) == lr.argmax(-1)).float().mean()),
            "kl_mean": float(kl.mean()), "kl_max": float(kl.max())}
