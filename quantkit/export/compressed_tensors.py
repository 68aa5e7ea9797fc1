"""`quantkit export vllm`: a checkpoint in compressed-tensors `pack-quantized` form, which vLLM and SGLang
(and transformers, through the compressed-tensors package) load.

Layout (the conventions of compressed-tensors 0.20, `PackedQuantizationCompressor`):
- routed experts UNFUSED, one module per expert, as vLLM and SGLang require for MoE:
  `...mlp.experts.E.{gate,up,down}_proj.weight_packed` int32 [out, in/8] (eight 4-bit codes per word,
  element i at bits 4*(i % 8), each code = signed value + 8), `.weight_scale` [out, in/g] (bf16),
  `.weight_shape` int64 [2]; int4 SYMMETRIC group-wise (vLLM refuses asymmetric int4 for MoE layers),
  one group size for every expert (vLLM takes one scheme per MoE layer). MTP experts, when the source
  keeps the MTP layer, are quantized the same way (vLLM's MTP drafter expects its experts quantized
  like the trunk's).
- `rest="bf16"` (default): every other tensor in bf16; the experts' config group targets "Linear" and
  every other projection is in `ignore`. That is the layout of the W4A16 MoE checkpoints vLLM and
  SGLang have taken longest (their older MoE code looks the scheme up under "Linear").
  `rest="int8"`: attention, linear attention (in_proj_qkv, in_proj_z, out_proj), the shared expert and
  the MTP projections as int8 symmetric per channel (pack-quantized 8-bit, `weight_scale` [out, 1]) in a
  second config group; both groups then target module-name regexes. lm_head, the routers, the
  shared-expert gate and linear attention's small in_proj_a/in_proj_b (32 output rows, below the
  packed kernels' tile) stay bf16 and ignored.
- names as published (`model.language_model.layers.N...`, `mtp.*`, `lm_head.weight`); config.json is
  the source's (architectures Qwen3_5MoeForConditionalGeneration for the published model; vLLM serves
  it with `--language-model-only`) plus `quantization_config`; tokenizer and other non-weight files
  copied; the folder is written under a temporary name and renamed when complete.

Codes are reused where the source already holds them: quantkit int4 symmetric at the export's group size (one
for every expert: the source's when it has one) becomes `weight_packed`/`weight_scale` without requantizing (an
expert stored at another group size is requantized, and a note says so), int8 per channel likewise; everything else is
quantized here with quantkit's own int4/int8 formats (from the dequantized weights for nf4/fp4/mxfp4 or
asymmetric int4 sources). Note: quantkit's symmetric int4 scales are signed (Q4_0's convention, so the
group's largest magnitude lands on code -8); compressed-tensors dequantizes `q * scale` either way.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from quantkit.checkpoint.contract import INDEX_NAME
from quantkit.checkpoint.quantized import StoredTensor
from quantkit.checkpoint.reader import check_finite
from quantkit.checkpoint.spec import Role
from quantkit.errors import QuantkitError
from quantkit.export.source import ExportSource
from quantkit.fileio import fsync_dir, pid_temp_name, replace_folder
from quantkit.formats import QuantSpec, get_format
from quantkit.formats.int4 import codes as int4_codes
from quantkit.outputs import check_free, guard_output, write_marker
from quantkit.progress import NoProgress, Progress
from quantkit.quantize.run import copyable_files
from quantkit.quantize.shards import ShardLayout, ShardWriter, TensorLayout

FORMAT = "pack-quantized"
CT_VERSION = "0.20.1"  # the compressed-tensors release whose layout this writes
GROUPS = (128, 64, 32)
DEFAULT_GROUP = 128
MAX_SHARD = 2_000_000_000
SLAB_BYTES = 256 << 20

_EXPERT_RE = re.compile(r"^(?P<pre>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_INT8_RE = re.compile(r"(self_attn\.[qkvo]_proj|linear_attn\.(in_proj_qkv|in_proj_z|out_proj)"
                      r"|shared_expert\.(gate|up|down)_proj|^mtp\.fc)\.weight$")
# module-name regexes, as compressed-tensors and vLLM match them ("re:" prefix, re.match)
EXPERT_TARGET = r"re:.*mlp\.experts\.\d+\.(gate|up|down)_proj$"
INT8_TARGET = r"re:.*(self_attn\.[qkvo]_proj|linear_attn\.(in_proj_qkv|in_proj_z|out_proj)|shared_expert\.(gate|up|down)_proj|mtp\.fc)$"
VISUAL = r"re:.*visual.*"  # the vision tower (the published checkpoint has no weights for it)
IGNORE_BF16 = ["lm_head", r"re:.*self_attn\.[qkvo]_proj$", r"re:.*linear_attn\.in_proj_(qkv|z|a|b)$",
               r"re:.*linear_attn\.out_proj$", r"re:.*shared_expert\.(gate|up|down)_proj$",
               r"re:.*mlp\.gate$", r"re:.*shared_expert_gate$", r"re:.*mtp\.fc$", VISUAL]
IGNORE_INT8 = ["lm_head", r"re:.*linear_attn\.in_proj_(a|b)$", r"re:.*mlp\.gate$", r"re:.*shared_expert_gate$", VISUAL]


@dataclass
class OutTensor:
    """One source tensor and what it becomes."""

    source: StoredTensor
    kind: str  # "int4-experts" (fused stack -> per-expert modules), "int4", "int8", "dense"
    how: str  # "reused", "quantized", "requantized", "copied", "dequantized"
    outputs: list[TensorLayout]
    modules: list[str]  # output module names (quantized kinds)

    @property
    def nbytes(self) -> int:
        return sum(o.nbytes for o in self.outputs)


@dataclass
class VllmResult:
    path: Path
    group_size: int
    rest: str
    tensors: list[OutTensor]
    shards: int
    nbytes: int
    seconds: float
    notes: list[str] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.tensors:
            key = f"{t.kind}:{t.how}"
            out[key] = out.get(key, 0) + 1
        return out


def _module_of(name: str) -> str:
    return name[: -len(".weight")] if name.endswith(".weight") else name


def _pick_group(src: ExportSource, wanted: int | None, prefer: int | None = None) -> int:
    """One group size for every expert matrix: the requested one, else `prefer` (the group the target engine
    loads) where it divides every expert row length, else the source's (int4 symmetric), else the largest of
    128/64/32 dividing every expert row length."""
    rows = set()
    src_groups = set()
    for t in src.tensors():
        if _is_expert(t):
            rows.add(t.shape[-1])
            if t.spec and t.spec.format == "int4" and t.spec.symmetric:
                src_groups.add(t.spec.group_size or 128)
    if not rows:
        raise QuantkitError(f"{src.path}: no routed experts found; not a Qwen3.5-MoE checkpoint")
    if wanted is not None:
        if wanted not in GROUPS:
            raise QuantkitError(f"--group-size {wanted}: use one of {', '.join(map(str, GROUPS))}")
        bad = sorted(r for r in rows if r % wanted)
        if bad:
            raise QuantkitError(f"--group-size {wanted} does not divide the expert row length {bad[0]}; "
                                f"pick a group size that does")
        return wanted
    if prefer is not None and all(r % prefer == 0 for r in rows):
        return prefer
    if len(src_groups) == 1 and all(r % next(iter(src_groups)) == 0 for r in rows):
        return next(iter(src_groups))
    for g in GROUPS:
        if all(r % g == 0 for r in rows):
            return g
    raise QuantkitError(f"expert row lengths {sorted(rows)} are not multiples of 32; vLLM's int4 MoE "
                        "kernels cannot take them")


def _is_expert(t: StoredTensor) -> bool:
    if t.role == Role.ROUTED_EXPERT and len(t.shape) == 3:
        return True
    return t.name.startswith("mtp.") and _EXPERT_RE.match(t.name) is not None


def _int4_outputs(module: str, out: int, inn: int, g: int) -> list[TensorLayout]:
    return [TensorLayout(f"{module}.weight_packed", (out, inn // 8), torch.int32),
            TensorLayout(f"{module}.weight_scale", (out, inn // g), torch.bfloat16),
            TensorLayout(f"{module}.weight_shape", (2,), torch.int64)]


def _int8_outputs(module: str, out: int, inn: int) -> list[TensorLayout]:
    return [TensorLayout(f"{module}.weight_packed", (out, inn // 4), torch.int32),
            TensorLayout(f"{module}.weight_scale", (out, 1), torch.bfloat16),
            TensorLayout(f"{module}.weight_shape", (2,), torch.int64)]


def _expert_modules(name: str, shape: tuple[int, ...]) -> list[tuple[str, int, str, int, int]]:
    """(module, expert, proj, out, in) for a fused stack's unfused per-expert modules."""
    pre = name.rsplit(".", 1)[0]  # ...mlp.experts
    e = shape[0]
    if name.endswith("gate_up_proj"):
        i, h = shape[1] // 2, shape[2]
        return [m for k in range(e) for m in ((f"{pre}.{k}.gate_proj", k, "gate", i, h),
                                               (f"{pre}.{k}.up_proj", k, "up", i, h))]
    h, i = shape[1], shape[2]
    return [(f"{pre}.{k}.down_proj", k, "down", h, i) for k in range(e)]


def plan(src: ExportSource, g: int, rest: str) -> list[OutTensor]:
    if rest not in ("bf16", "int8"):
        raise QuantkitError(f"--rest {rest!r}: use bf16 or int8")
    out: list[OutTensor] = []
    for t in src.tensors():
        if t.role == Role.VISION:
            continue
        s = t.spec
        if _is_expert(t):
            reuse = s is not None and s.format == "int4" and s.symmetric and (s.group_size or 128) == g
            how = "reused" if reuse else ("requantized" if s is not None else "quantized")
            if len(t.shape) == 3:
                mods = _expert_modules(t.name, t.shape)
                outs = [o for m, _k, _p, r, c in mods for o in _int4_outputs(m, r, c, g)]
                out.append(OutTensor(t, "int4-experts", how, outs, [m[0] for m in mods]))
            else:
                mod = _module_of(t.name)
                out.append(OutTensor(t, "int4", how, _int4_outputs(mod, t.shape[0], t.shape[1], g), [mod]))
            continue
        if rest == "int8" and _INT8_RE.search(t.name) and len(t.shape) == 2:
            reuse = s is not None and s.format == "int8"
            how = "reused" if reuse else ("requantized" if s is not None else "quantized")
            if t.shape[1] % 4:
                raise QuantkitError(f"{t.name}: row length {t.shape[1]} is not a multiple of 4 for int8 packing; "
                                    "export with --rest bf16")
            mod = _module_of(t.name)
            out.append(OutTensor(t, "int8", how, _int8_outputs(mod, t.shape[0], t.shape[1]), [mod]))
            continue
        dt = torch.bfloat16 if (s is not None or t.dtype in ("float32", "float16", "bfloat16")) else getattr(torch, t.dtype)
        how = "dequantized" if s is not None else "copied"
        out.append(OutTensor(t, "dense", how, [TensorLayout(t.name, t.shape, dt)], []))
    return out


def quantization_config(g: int, rest: str, has_mtp: bool) -> dict[str, Any]:
    int4 = {"num_bits": 4, "type": "int", "symmetric": True, "group_size": g, "strategy": "group",
            "dynamic": False}
    groups: dict[str, Any] = {}
    if rest == "bf16":
        groups["group_0"] = {"targets": ["Linear"], "weights": int4, "input_activations": None,
                             "output_activations": None, "format": FORMAT}
        ignore = list(IGNORE_BF16)
    else:
        groups["group_0"] = {"targets": [EXPERT_TARGET], "weights": int4, "input_activations": None,
                             "output_activations": None, "format": FORMAT}
        groups["group_1"] = {"targets": [INT8_TARGET],
                             "weights": {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None,
                                         "strategy": "channel", "dynamic": False},
                             "input_activations": None, "output_activations": None, "format": FORMAT}
        ignore = list(IGNORE_INT8)
    return {"quant_method": "compressed-tensors", "format": FORMAT, "quantization_status": "compressed",
            "config_groups": groups, "ignore": ignore, "kv_cache_scheme": None, "global_compression_ratio": None,
            "sparsity_config": {}, "transform_config": {}, "version": CT_VERSION}


def pack_int32(signed: torch.Tensor, bits: int) -> torch.Tensor:
    """compressed-tensors' pack: signed codes [..., out, in] -> int32 [..., out, in*bits/32], each code
    offset by 2**(bits-1), element i of every 32/bits at bits*(i % (32/bits)) of its word."""
    per = 32 // bits
    u = (signed.to(torch.int64) + (1 << (bits - 1))) & ((1 << bits) - 1)
    u = u.reshape(*u.shape[:-1], -1, per)
    shifts = torch.arange(per, dtype=torch.int64) * bits
    words = (u << shifts).sum(dim=-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def _int4_parts(src: ExportSource, ot: OutTensor, g: int, experts: slice | None) -> dict[str, torch.Tensor]:
    spec = QuantSpec("int4", g, True)
    if ot.how == "reused":
        return src.parts(ot.source.name, experts)
    w = src.dense(ot.source.name, experts)
    check_finite(ot.source.name, w)
    return get_format("int4").quantize(w, spec)


def _emit_int4(writer_for: Any, module: str, codes_u: torch.Tensor, scales: torch.Tensor) -> None:
    """codes_u: unsigned 0..15 [out, in]; scales [out, in/g]."""
    packed = pack_int32(codes_u.to(torch.int16) - 8, 4)
    writer_for(f"{module}.weight_packed").write(f"{module}.weight_packed", packed)
    writer_for(f"{module}.weight_scale").write(f"{module}.weight_scale", scales.to(torch.bfloat16).contiguous())
    writer_for(f"{module}.weight_shape").write(f"{module}.weight_shape",
                                               torch.tensor(list(codes_u.shape), dtype=torch.int64))


def _write(src: ExportSource, ot: OutTensor, g: int, writer_for: Any, progress: Progress) -> None:

    t = ot.source
    if ot.kind == "int4-experts":
        e, rows, cols = t.shape
        per = max(1, SLAB_BYTES // (rows * cols * 4))
        gate_up = t.name.endswith("gate_up_proj")
        pre = t.name.rsplit(".", 1)[0]
        for e0 in range(0, e, per):
            sl = slice(e0, min(e, e0 + per))
            parts = _int4_parts(src, ot, g, sl)
            q = int4_codes(parts)  # [n, rows, cols] unsigned
            s = parts["scales"]
            for j in range(q.shape[0]):
                k = e0 + j
                if gate_up:
                    i = rows // 2
                    _emit_int4(writer_for, f"{pre}.{k}.gate_proj", q[j, :i], s[j, :i])
                    _emit_int4(writer_for, f"{pre}.{k}.up_proj", q[j, i:], s[j, i:])
                else:
                    _emit_int4(writer_for, f"{pre}.{k}.down_proj", q[j], s[j])
            progress.advance(t.name, q.shape[0] * rows * cols * 2, False)
    elif ot.kind == "int4":
        parts = _int4_parts(src, ot, g, None)
        _emit_int4(writer_for, ot.modules[0], int4_codes(parts), parts["scales"])
        progress.advance(t.name, t.shape[0] * t.shape[1] * 2, False)
    elif ot.kind == "int8":
        if ot.how == "reused":
            parts = src.parts(t.name)
        else:
            w = src.dense(t.name)
            check_finite(t.name, w)
            parts = get_format("int8").quantize(w, QuantSpec("int8", None, True))
        mod = ot.modules[0]
        writer_for(f"{mod}.weight_packed").write(f"{mod}.weight_packed", pack_int32(parts["qweight"], 8))
        writer_for(f"{mod}.weight_scale").write(f"{mod}.weight_scale",
                                                parts["scales"].to(torch.bfloat16).reshape(-1, 1).contiguous())
        writer_for(f"{mod}.weight_shape").write(f"{mod}.weight_shape", torch.tensor(list(t.shape), dtype=torch.int64))
        progress.advance(t.name, t.shape[0] * t.shape[1] * 2, False)
    else:
        lay = ot.outputs[0]
        if t.spec is not None:
            w = src.dense(t.name).to(lay.dtype)
        else:
            w = src.native(t.name)
            w = w.to(lay.dtype) if w.is_floating_point() else w
        writer_for(lay.name).write(lay.name, w.contiguous())
        progress.advance(t.name, lay.nbytes, False)
    progress.advance(t.name, 0, True)


def _shards(tensors: list[OutTensor], max_shard: int) -> list[list[OutTensor]]:
    shards: list[list[OutTensor]] = []
    size = 0
    for ot in tensors:
        if not shards or (size + ot.nbytes > max_shard and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(ot)
        size += ot.nbytes
    return shards


def export_vllm(src_path: str | Path, out_dir: str | Path, group_size: int | None = None, rest: str = "bf16",
                overwrite: bool = False, max_shard_size: int = MAX_SHARD,
                progress: Progress | None = None, prefer_group: int | None = None) -> VllmResult:
    """Write `src_path` as a compressed-tensors pack-quantized folder at `out_dir` (atomically). `prefer_group`:
    the experts' group where no `group_size` is given and it divides their rows (vLLM CPU's: export/vllm_cpu.py)."""

    t0 = time.perf_counter()
    out = Path(out_dir)
    src = ExportSource.open(src_path)
    progress = progress or NoProgress()
    guard_output(out, sources=[src.path], kind="folder", overwrite=overwrite)
    tmp = pid_temp_name(out)
    try:
        g = _pick_group(src, group_size, prefer_group)
        tensors = plan(src, g, rest)
        shards = _shards(tensors, max_shard_size)
        check_free(out, sum(t.nbytes for t in tensors) + (1 << 20), "")
        n = len(shards)
        names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        weight_map: dict[str, str] = {}
        progress.start(len(tensors), sum(math.prod(t.source.shape) * 2 for t in tensors))
        for sname, group in zip(names, shards, strict=True):
            layout = ShardLayout([o for ot in group for o in ot.outputs])
            with ShardWriter(tmp / sname, layout) as wr:
                for ot in group:
                    _write(src, ot, g, lambda _n, _w=wr: _w, progress)
                    src.close()  # unmap the pages read, so RSS does not grow to the checkpoint's size
                wr.commit()
            weight_map.update(dict.fromkeys((o.name for ot in group for o in ot.outputs), sname))
        total = sum(t.nbytes for t in tensors)
        (tmp / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total},
                                                  "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
        cfg = json.loads(json.dumps(src.config))
        has_mtp = any(t.source.name.startswith("mtp.") for t in tensors)
        text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
        if not has_mtp and text.get("mtp_num_hidden_layers"):
            text["mtp_num_hidden_layers"] = 0  # no MTP weights here: loaders must not look for them
        cfg["quantization_config"] = quantization_config(g, rest, has_mtp)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        for f in copyable_files(src.path):
            shutil.copy2(f, tmp / f.name)
        write_marker(tmp, "export vllm")
        fsync_dir(tmp)
        replace_folder(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        src.close()
    notes = []
    redone = [t for t in tensors if t.kind.startswith("int4") and t.how == "requantized"]
    if redone:  # codes are reused only at the export's one group size: say why these were not
        groups = sorted({t.source.spec.group_size or 128 for t in redone if t.source.spec is not None})
        notes.append(f"{len(redone)} of the int4 expert tensors were requantized: stored at group "
                     f"{', '.join(map(str, groups))}, not the export's one group size {g} (--group-size); the "
                     "others' codes are reused as stored")
    if src.quant is not None and src.quant.get("mtp") == "dropped":
        notes.append("the source folder dropped the MTP layer; none exported")
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    return VllmResult(out, g, rest, tensors, n, size, time.perf_counter() - t0, notes)

