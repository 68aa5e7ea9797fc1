"""Importance matrices: the importance-weighted scale search, and llama.cpp's imatrix GGUF file.

Importance of input column j of a linear = mean of x_j^2 over the tokens that reach it (stats.py's
`in_sum2 / count`; per expert for routed experts, over its routed tokens). The output error of a
rounding error d_j on column j grows with E[x_j^2] d_j^2 (the diagonal of the Hessian), so:

- `imatrix_quantize(w, importance, spec)`: round-to-nearest with the SCALE of each group (int8: of each
  row) chosen to minimise sum_j importance_j (w_j - deq_j)^2 over a grid of shrink factors SEARCH_GRID
  of the format's own full-range scale (int4 asymmetric: of its [min, max] range), instead of the plain
  squared error. Codes are then round-to-nearest on the chosen grid; the stored parts are the format's
  (quantize/grid.py). Formats without a grid (nf4, fp4, mxfp4) get their own RTN.
- `write_imatrix_gguf(stats_path, out_path)`: the statistics as the GGUF imatrix llama.cpp's
  `llama-imatrix` writes and `llama-quantize --imatrix` reads: `general.type=imatrix`,
  `imatrix.datasets`, `imatrix.chunk_count`, `imatrix.chunk_size`, and per weight tensor under its GGUF
  name `<name>.in_sum2` F32 (numpy [n_mat, n_per_row]) and `<name>.counts` F32 ([n_mat, 1]). The fused
  gate_up stack gives both `ffn_gate_exps` and `ffn_up_exps` (same input); the columns of
  `ssm_out` follow the value-head reorder of the GGUF export (checkpoint/gguf_layout.py).
- `read_imatrix_gguf(path)`: {gguf name: importance [n_mat * n_per_row]} as llama.cpp's quantizer
  derives it (in_sum2 / count per matrix, 1 where a matrix saw no token): what a caller hands to
  `llama_model_quantize` through `llama_model_quantize_params.imatrix`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from quantkit.checkpoint.gguf_file import check_header_bounds
from quantkit.checkpoint.gguf_layout import pieces_for
from quantkit.checkpoint.spec import parse_text_config, spec_from_config
from quantkit.errors import QuantkitError
from quantkit.fileio import fsync_dir, temp_name
from quantkit.formats import QuantSpec, get_format
from quantkit.formats.int4 import DEFAULT_GROUP
from quantkit.outputs import guard_output, has_magic
from quantkit.quantize.grid import Grid
from quantkit.quantize.stats import Stats

# Shrink factors of the full-range scale tried per group (1.0 first: ties keep the full range).
SEARCH_GRID = (1.0, 0.97, 0.94, 0.91, 0.88, 0.85, 0.82, 0.79, 0.76, 0.73, 0.70)
ROW_CHUNK = 256
MAX_IMATRIX_BYTES = 16 << 30


def importance(in_sum2: torch.Tensor, count: int) -> torch.Tensor | None:
    """Mean x^2 per input column of one matrix ([in]); None when no token reached it."""
    if count <= 0:
        return None
    return (in_sum2.double() / count).float()


def _candidates(x: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Candidate scales (and zeros) [K, R, G] for x [R, G, g], in the stored dtype (bf16)."""
    f = torch.tensor(SEARCH_GRID)[:, None, None]
    if spec.format == "int8":
        base = x.abs().amax(dim=-1) / 127.0
        return (base * f).to(torch.bfloat16), None
    mn, mx = x.amin(dim=-1), x.amax(dim=-1)
    if spec.symmetric:
        base = torch.where(mx >= -mn, mx, mn) * (-1.0 / 8)
        return (base * f).to(torch.bfloat16), None
    lo = torch.where(mn < 0, mn * f, mn)
    hi = torch.where(mx > 0, mx * f, mx)
    s = ((hi - lo) / 15).to(torch.bfloat16)
    return s, (lo + 8 * s.float()).to(torch.bfloat16)


def _search(x: torch.Tensor, imp: torch.Tensor, spec: QuantSpec, lo: int, hi: int
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Best (scale, zero) per group of x [R, G, g] under importance imp [G, g]."""
    cs, cz = _candidates(x, spec)
    best_s, best_z = cs[0].clone(), (cz[0].clone() if cz is not None else None)
    best_e = torch.full(cs.shape[1:], float("inf"))
    for k in range(cs.shape[0]):
        s = cs[k].float()[..., None]
        z = cz[k].float()[..., None] if cz is not None else 0.0
        inv = torch.where(s != 0, 1.0 / s, torch.zeros_like(s))
        q = torch.round((x - z) * inv).clamp_(lo, hi)
        e = ((q * s + z - x).square_() * imp).sum(-1)
        better = e < best_e
        best_e = torch.where(better, e, best_e)
        best_s = torch.where(better, cs[k], best_s)
        if cz is not None:
            best_z = torch.where(better, cz[k], best_z)
    return best_s, best_z


def imatrix_quantize(w: torch.Tensor, imp: torch.Tensor, spec: QuantSpec) -> dict[str, torch.Tensor]:
    """Stored parts of w [R, C] with importance-weighted scales (module docstring); imp [C]."""
    if spec.format not in ("int4", "int8"):
        return get_format(spec.format).quantize(w, spec)
    rows, cols = w.shape
    g = cols if spec.format == "int8" else (spec.group_size or DEFAULT_GROUP)
    lo, hi, off = (-127, 127, 0) if spec.format == "int8" else (-8, 7, 8)
    imp_g = imp.float().clamp_min(0).reshape(cols // g, g)
    if float(imp_g.sum()) == 0:
        imp_g = torch.ones_like(imp_g)
    scales = torch.empty(rows, cols // g, dtype=torch.bfloat16)
    zeros = None if spec.format == "int8" or spec.symmetric else torch.empty_like(scales)
    for r0 in range(0, rows, ROW_CHUNK):
        x = w[r0:r0 + ROW_CHUNK].float().reshape(-1, cols // g, g)
        s, z = _search(x, imp_g, spec, lo, hi)
        scales[r0:r0 + ROW_CHUNK] = s
        if zeros is not None:
            zeros[r0:r0 + ROW_CHUNK] = z
    grid = Grid(spec, scales[:, 0] if spec.format == "int8" else scales, zeros, g, lo, hi, off)
    codes, _ = grid.round(w, slice(None))
    return grid.parts(codes)


# --- llama.cpp's imatrix GGUF ------------------------------------------------------------------------------

def _entries(stats: Stats, config: dict[str, Any]) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """(gguf name, in_sum2 [n_mat, n_per_row], counts [n_mat, 1]) for every weight with statistics."""

    tc = parse_text_config(config)
    shapes = {t.name: tuple(t.shape) for t in spec_from_config(config, include_mtp=False).tensors}
    out = []
    for key in sorted(stats.names):
        if not key.endswith(".in_sum2"):
            continue
        name = key[: -len(".in_sum2")]
        if name not in shapes:
            continue
        s2 = stats.get(key).float()
        cnt = stats.get(f"{name}.count").float()
        s2 = s2.reshape(-1, s2.shape[-1])
        cnt = cnt.reshape(-1, 1).expand(s2.shape[0], 1) if cnt.numel() == 1 else cnt.reshape(-1, 1)
        for piece in pieces_for(name, shapes[name], tc):
            v = s2.index_select(1, piece.col_perm) if piece.col_perm is not None else s2
            out.append((piece.gguf_name, v.contiguous().numpy(), cnt.contiguous().numpy()))
    return out


def write_imatrix_gguf(stats_path: str | Path, out_path: str | Path, *, ckpt: Any = None,
                       overwrite: bool = False, datasets: list[str] | None = None) -> Path:
    """Write the llama.cpp imatrix GGUF of a statistics file (module docstring); returns the path.
    `ckpt` (optional) is checked against the statistics' model fingerprint."""
    import gguf


    stats = Stats.open(stats_path)
    if ckpt is not None:
        stats.check_model(ckpt)
    out = Path(out_path)
    sources = [Path(stats_path)] + ([Path(ckpt.path)] if ckpt is not None else [])
    guard_output(out, sources=sources, overwrite=overwrite, owned=has_magic(b"GGUF"))
    if "config" not in stats.meta:
        raise QuantkitError(f"{stats_path} does not carry its model's config; rerun `quantkit stats`")
    entries = _entries(stats, json.loads(stats.meta["config"]))  # the config was validated by Stats.open
    if not entries:
        raise QuantkitError(f"{stats_path} holds no per-column statistics to export")
    tmp = temp_name(out)
    try:
        w = gguf.GGUFWriter(str(tmp), arch="imatrix")
        w.add_type("imatrix")
        w.add_array("imatrix.datasets", datasets or [stats.meta.get("data_source", "quantkit")])
        w.add_uint32("imatrix.chunk_count", int(stats.meta.get("chunk_count", 0)))
        w.add_uint32("imatrix.chunk_size", int(stats.meta.get("chunk_size", 0)))
        for name, s2, cnt in entries:
            w.add_tensor(f"{name}.in_sum2", s2.astype(np.float32))
            w.add_tensor(f"{name}.counts", cnt.astype(np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        tmp.replace(out)
    except OSError as e:
        raise QuantkitError(f"{out}: cannot write ({e.strerror}); free space or pick another location") from None
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(out.parent)
    return out


def read_imatrix_gguf(path: str | Path) -> dict[str, np.ndarray]:
    """{gguf weight name: importance float32 [n_mat * n_per_row]} as llama.cpp's quantizer reads the file."""
    import gguf

    p = Path(path)
    if not p.is_file():
        raise QuantkitError(f"imatrix file {p} does not exist")
    if p.stat().st_size > MAX_IMATRIX_BYTES:
        raise QuantkitError(f"imatrix file {p} is larger than {MAX_IMATRIX_BYTES >> 30} GiB; refusing to read it")
    check_header_bounds(p, p.stat().st_size)  # before the reader trusts what the header declares
    try:
        r = gguf.GGUFReader(str(p))
    except (ValueError, OSError) as e:
        raise QuantkitError(f"{p} is not a GGUF file ({e})") from None
    kind = r.get_field("general.type")
    if kind is None or bytes(kind.parts[kind.data[0]]).decode() != "imatrix":
        raise QuantkitError(f"{p} is not a llama.cpp imatrix GGUF (general.type is not 'imatrix')")
    tensors = {t.name: np.asarray(t.data, dtype=np.float32) for t in r.tensors}
    out = {}
    for k, s2 in tensors.items():
        if not k.endswith(".in_sum2"):
            continue
        name = k[: -len(".in_sum2")]
        cnt = tensors.get(f"{name}.counts")
        if cnt is None:
            raise QuantkitError(f"{p}: {name} has in_sum2 but no counts")
        s2 = s2.reshape(cnt.size, -1)
        c = cnt.reshape(-1, 1)
        out[name] = np.where(c > 0, s2 / np.maximum(c, 1e-30), 1.0).astype(np.float32).reshape(-1)
    return out


def llama_imatrix_array(imatrix: dict[str, np.ndarray]) -> Any:
    """A null-terminated ctypes array of `llama_cpp.llama_model_imatrix_data` for
    `llama_model_quantize_params.imatrix` (keep the returned object alive while quantizing: it holds the
    name and value buffers)."""
    import ctypes

    import llama_cpp

    n = len(imatrix)
    arr = (llama_cpp.llama_model_imatrix_data * (n + 1))()
    keep: list[Any] = []
    for i, (name, v) in enumerate(sorted(imatrix.items())):
        buf = np.ascontiguousarray(v, dtype=np.float32)
        keep += [name.encode(), buf]
        arr[i].name = keep[-2]
        arr[i].data = buf.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        arr[i].size = buf.size
    arr[n].name = None
    arr._keep = keep  # the buffers live as long as the array
    return arr
