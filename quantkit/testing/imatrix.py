"""A reference importance matrix of a tiny checkpoint, in llama.cpp's imatrix GGUF format, for tests and
benchmarks of `quantkit export gguf --imatrix` (quantkit's own calibration statistics are the job of
`quantkit stats`; this is the small independent reference that checks the export side).

`collect_expert_imatrix` runs transformers' fp32 model on calibration token ids and records, for every
layer's routed experts, what llama.cpp's `llama-imatrix` records for `ffn_{gate,up,down}_exps`: per expert,
the sum of squared inputs per input column over the tokens routed to it, and that token count (gate and
up share their input, the post-norm hidden state; down's input is act(gate) * up). `write_imatrix_gguf`
writes such sums as `general.type = imatrix` with `<name>.in_sum2` [n_mat, n_per_row] and `<name>.counts`
[n_mat, 1] (numpy order) F32 tensors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

Sums = dict[str, tuple[np.ndarray, np.ndarray]]  # GGUF tensor name -> (in_sum2 [n_mat, n], counts [n_mat])


def collect_expert_imatrix(model: Any, ids: torch.Tensor) -> Sums:
    """Per-expert input statistics of every layer's routed experts on `ids` [batch, seq]."""
    sums: Sums = {}

    def hook(layer: int, mod: Any, args: tuple[Any, ...]) -> None:
        x, top_k_index = args[0].detach().float(), args[1]
        e_n, i_n = mod.num_experts, mod.intermediate_dim
        s_in = np.zeros((e_n, x.shape[-1]), np.float32)
        s_down = np.zeros((e_n, i_n), np.float32)
        counts = np.zeros(e_n, np.float32)
        for e in range(e_n):
            tok = (top_k_index == e).any(-1).nonzero().flatten()
            if tok.numel() == 0:
                continue
            xe = x[tok]
            gate, up = torch.nn.functional.linear(xe, mod.gate_up_proj[e].float()).chunk(2, dim=-1)
            h = mod.act_fn(gate) * up
            s_in[e] = (xe * xe).sum(0).numpy()
            s_down[e] = (h * h).sum(0).numpy()
            counts[e] = tok.numel()
        for name, s in ((f"blk.{layer}.ffn_gate_exps.weight", s_in), (f"blk.{layer}.ffn_up_exps.weight", s_in),
                        (f"blk.{layer}.ffn_down_exps.weight", s_down)):
            old = sums.get(name)
            sums[name] = (s, counts) if old is None else (old[0] + s, old[1] + counts)

    hooks = [layer.mlp.experts.register_forward_pre_hook(lambda m, a, i=i: hook(i, m, a))
             for i, layer in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            for row in ids:
                model(input_ids=row[None])
    finally:
        for h in hooks:
            h.remove()
    return sums


def write_imatrix_gguf(sums: Sums, out: Path, chunks: int = 1, chunk_size: int = 512) -> Path:
    """`sums` as a llama.cpp imatrix GGUF at `out`."""
    import gguf

    w = gguf.GGUFWriter(str(out), arch="imatrix")
    w.add_type("imatrix")
    w.add_array("imatrix.datasets", ["quantkit-tiny"])
    w.add_uint32("imatrix.chunk_count", chunks)
    w.add_uint32("imatrix.chunk_size", chunk_size)
    for name, (s2, counts) in sorted(sums.items()):
        w.add_tensor(f"{name}.in_sum2", np.ascontiguousarray(s2, dtype=np.float32))
        w.add_tensor(f"{name}.counts", np.ascontiguousarray(counts.reshape(-1, 1), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
