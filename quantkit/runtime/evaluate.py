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


def _cast(x: Any, dtype: torch.dtype) -> Any:
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.to(dtype)
    if isinstance(x, tuple):
        return tuple(_cast(v, dtype) for v in x)
    if isinstance(x, dict):
        return {k: _cast(v, dtype) for k, v in x.items()}
    return x


def layer_errors(runtime_model: Any, ref: Any, ids: torch.Tensor) -> list[float]:
    """Relative error of each layer's update with the reference's expert choice held fixed."""
    rec = _capture_layers(ref, ids)
    errs = []
    for i, layer in enumerate(runtime_model.model.layers):
        r = rec[i]
        logits, scores, idx = r["router"]

        def force(_m, _a, _out, logits=logits, scores=scores, idx=idx):
            return logits.to(torch.bfloat16), scores.to(torch.bfloat16), idx

        h = layer.mlp.gate.register_forward_hook(force)
        try:
            with torch.inference_mode():
                args = _cast(r["args"], torch.bfloat16)
                kwargs = _cast({k: v for k, v in r["kwargs"].items() if k != "cache"}, torch.bfloat16)
                out = layer(*args, **kwargs)
        finally:
            h.remove()
        out = out[0] if isinstance(out, tuple) else out
        x_in = r["args"][0] if r["args"] else r["kwargs"]["hidden_states"]
        d_ref = (r["out"] - x_in).float()
        d_q = out.float() - x_in.float()
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
