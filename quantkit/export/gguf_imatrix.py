"""Reading a llama.cpp importance-matrix GGUF (`--imatrix FILE`) for llama.cpp's quantizer.

The file (llama.cpp's `llama-imatrix` output, or quantkit.quantize.imatrix.write_imatrix_gguf) has
`general.type = imatrix` and, per weight tensor NAME of the model's GGUF, `NAME.in_sum2` (F32, ggml ne
[n_per_row, n_mat]: the sum of squared inputs per input column, per expert for `ffn_*_exps`) and
`NAME.counts` (F32, [1, n_mat]: the tokens summed). llama.cpp's quantizer takes, per tensor, the mean
square input in_sum2 / count laid out expert after expert (n_per_row * n_mat floats); an expert no token
reached (count 0) gets uniform weights (ones), as llama-quantize does.

Validation, against the model's GGUF tensor table: every imatrix entry must name a tensor of the model
with the same row length and expert count, else the file is refused in one line naming the first
mismatch (an imatrix from another model fails here, not deep inside llama.cpp). Model tensors the
imatrix does not cover are quantized without one (returned as `missing`). The file is read with a size
bound (MAX_IMATRIX_BYTES) and its values must be finite and non-negative.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from quantkit.checkpoint.gguf_file import read_gguf
from quantkit.errors import QuantkitError

# the real model's imatrix is about 0.2 GB (experts: 40 layers x (2 x 2048 + 512) x 256 floats)
MAX_IMATRIX_BYTES = 4 << 30


@dataclass
class Imatrix:
    path: Path
    data: dict[str, np.ndarray]  # model tensor name -> float32 [n_mat * n_per_row]
    missing: list[str]  # quantizable model tensors without an entry
    chunks: int


def load_imatrix(path: str | Path, model: dict[str, tuple[int, ...]], quantized: list[str]) -> Imatrix:
    """The importance data of imatrix GGUF `path` for a model whose GGUF tensors are `model` (name ->
    numpy shape); `quantized` names the tensors the quantizer will quantize (for `missing`)."""
    p = Path(path)
    if p.is_file() and p.stat().st_size > MAX_IMATRIX_BYTES:
        raise QuantkitError(f"{p}: {p.stat().st_size:,} bytes is larger than any imatrix of this model "
                            f"({MAX_IMATRIX_BYTES:,} at most); name the imatrix GGUF file")
    info = read_gguf(p, "imatrix file")
    if info.metadata.get("general.type") != "imatrix":
        raise QuantkitError(f"{p}: not an importance-matrix GGUF (general.type is "
                            f"{info.metadata.get('general.type')!r}, not 'imatrix'); pass llama.cpp's imatrix file")
    import gguf

    reader = gguf.GGUFReader(str(p))
    raw = {t.name: np.asarray(t.data, dtype=np.float32).reshape(-1) for t in reader.tensors}
    names = sorted(n[: -len(".in_sum2")] for n in raw if n.endswith(".in_sum2"))
    if not names:
        raise QuantkitError(f"{p}: holds no <tensor>.in_sum2 entries; pass llama.cpp's imatrix file")
    out: dict[str, np.ndarray] = {}
    for name in names:
        if name not in model:
            raise QuantkitError(f"{p}: has data for {name}, which this model does not have; the imatrix was "
                                "computed on another model")
        shape = model[name]
        n_per_row = shape[-1]
        n_mat = shape[0] if len(shape) == 3 else 1
        s2 = raw[name + ".in_sum2"]
        counts = raw.get(name + ".counts")
        if counts is None:
            raise QuantkitError(f"{p}: {name}.in_sum2 has no {name}.counts; the file is incomplete")
        if s2.size != n_per_row * n_mat or counts.size != n_mat:
            raise QuantkitError(f"{p}: {name} has {s2.size // max(counts.size, 1)} columns x {counts.size} "
                                f"matrices, the model's tensor {n_per_row} x {n_mat}; the imatrix was computed "
                                "on another model")
        if not (np.isfinite(s2).all() and np.isfinite(counts).all()) or (s2 < 0).any() or (counts < 0).any():
            raise QuantkitError(f"{p}: {name} has negative or non-finite values; recompute the imatrix")
        s2 = s2.reshape(n_mat, n_per_row)
        c = counts.reshape(n_mat, 1)
        mean = np.where(c > 0, s2 / np.maximum(c, 1e-30), 1.0).astype(np.float32)
        out[name] = np.ascontiguousarray(mean.reshape(-1))
    chunks = info.metadata.get("imatrix.chunk_count", 0)
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 0:
        raise QuantkitError(f"{p}: imatrix.chunk_count is {chunks!r}, not a count; pass llama.cpp's imatrix file")
    return Imatrix(p, out, [n for n in quantized if n not in out], chunks)
