"""Loading a checkpoint onto a placement: quantkit's model (runtime/model/) built tensor by tensor, each read
from safetensors straight onto the device the plan names and prepared there.

Flow of `load_model(path, plan=None)`:
1. config.json: a quantkit output (quantization_config.quant_method == "quantkit") must have a version
   this code knows and pass `quantkit.quantize.verify.verify_folder`; any other folder is read as an
   unquantized source through `quantkit.checkpoint.reader.Checkpoint` (both layouts, FP8 dequantized) and
   quantized on the fly with `recipe` (default "bf16": kept as is).
2. Placement: from a plan file (`quantkit plan --out`; its fingerprint must match this model and it
   must fit the detected hardware, checked before anything is read) or planned on the spot for the
   detected hardware with `quantkit.planner.placement.solve`.
3. `build_model`: every projection of attention, linear attention, the shared expert and lm_head becomes a
   `Kernel` of its format; every layer's routed experts a `QuantExperts` with one group per device. Each
   tensor is read alone (experts: one slab of the ids a device holds, via safetensors' `get_slice`) and
   prepared once by `runtime.kernels.prepare` on its device; the whole model never sits in RAM twice: shards
   are read with plain reads (no memory map left behind; a folder above a quarter of RAM has its page cache
   dropped first and leaves none behind) and the heap's freed temporaries go back to the system as the load
   goes. The MTP layer, which only drafts, holds its int8 / bf16 attention and shared expert as int4 copies
   (checkpoint/draft.py `layer_copy_spec`). Then the one-token route is chosen (runtime/model/route.py).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from quantkit.checkpoint.contract import read_quant_config
from quantkit.checkpoint.draft import layer_copy_spec
from quantkit.checkpoint.quantized import QuantizedFolder
from quantkit.checkpoint.reader import Checkpoint, resolve_model
from quantkit.checkpoint.spec import TextConfig, load_config, spec_from_config
from quantkit.errors import QuantkitError
from quantkit.fileio import read_text_bounded
from quantkit.formats import QuantSpec, get_format
from quantkit.kernels import cpu as kernel_cpu
from quantkit.planner.fit import check_plan, default_context, hardware_here, plan_here
from quantkit.planner.hardware import Hardware
from quantkit.planner.placement import Plan, contiguous_runs
from quantkit.quantize.verify import verify_folder
from quantkit.recipe import Recipe, decide, get_recipe
from quantkit.runtime import args, cpu_kernel
from quantkit.runtime.devices import available_bytes, check_device_exists, release_free_heap
from quantkit.runtime.engine import Runtime
from quantkit.runtime.kernels import Kernel, QBf16Kernel, QKernel, prepare, slice_parts
from quantkit.runtime.model.config import ModelConfig, model_config
from quantkit.runtime.model.draft_head import compact_copy, requantized
from quantkit.runtime.model.experts import GatheredExperts
from quantkit.runtime.model.qwen3_5_moe import MTP, Attention, DeltaNet, Layer, Model, MoE
from quantkit.runtime.options import RuntimeOptions
from quantkit.runtime.qexperts import ExpertGroup, QuantExperts

LM = "model.language_model."
# Experts read and prepared per step: the slab and the repacking temporaries of this many experts are what the
# load holds beyond the weights (glibc keeps freed temporaries in its heap until `release_free_heap`; measured:
# about 3 MB per int4 expert of the 35B shape, so a 256-expert layer in one step peaked about 1.2 GB above it).
SLAB_EXPERTS = 32


# ---- placement ----------------------------------------------------------------------------------------

@dataclass
class Placement:
    """Where each part of the model lives: what the runtime takes from a Plan."""

    layer_device: list[str]
    experts: list[list[tuple[str, list[int]]]]  # per layer: (device, expert ids) groups
    embedding: str = "cpu"
    lm_head: str = "cpu"
    context: int = 4096
    source: str = "detected hardware"
    context_source: str = ""  # why this context, for a start-up line ("-c", "the plan's", the default's reason)

    @classmethod
    def single(cls, n_layers: int, n_experts: int, device: str = "cpu", context: int = 4096) -> Placement:
        return cls([device] * n_layers, [[(device, list(range(n_experts)))] for _ in range(n_layers)],
                   device, device, context, f"everything on {device}")

    @classmethod
    def from_plan(cls, plan: Plan, source: str) -> Placement:
        groups = []
        for L in range(len(plan.layer_device)):
            devs = list(dict.fromkeys(d for d, _a, _b in plan.expert_ranges[L]))
            groups.append([(d, plan.experts_on(L, d)) for d in devs])
        return cls(list(plan.layer_device), groups, plan.embedding_device, plan.lm_head_device,
                   plan.settings.context, source)

    def devices(self) -> list[str]:
        seen = dict.fromkeys([self.embedding, *self.layer_device, self.lm_head])
        for g in self.experts:
            seen.update(dict.fromkeys(d for d, _ in g))
        return list(seen)


def _free_bytes(plan: Plan) -> dict[str, int]:
    """What is free now on each device the plan puts weights on (devices checked to exist first)."""
    for dev in dict.fromkeys([plan.embedding_device, plan.lm_head_device, *plan.layer_device,
                              *(d for rs in plan.expert_ranges for d, _a, _b in rs)]):
        check_device_exists(dev)
    return {d.id: available_bytes(d.id) for d in plan.devices if d.used_bytes}


def _hardware_here() -> Hardware:
    return hardware_here(available_bytes("cpu"))


# ---- tensor sources -----------------------------------------------------------------------------------

class TensorSource:
    """Reads canonical tensors (published names) as (parts or dense tensor, QuantSpec or None)."""

    def spec(self, name: str) -> tuple[QuantSpec | None, tuple[int, ...]]:
        raise NotImplementedError

    def read(self, name: str, device: str, experts: slice | None = None) -> dict[str, torch.Tensor] | torch.Tensor:
        raise NotImplementedError

    def has(self, name: str) -> bool:
        raise NotImplementedError

    def close(self) -> None:
        pass


class QuantizedSource(TensorSource):
    """A quantkit output folder (`QuantizedFolder`): quantized tensors are read as their parts."""

    def __init__(self, folder: QuantizedFolder):
        self.folder = folder

    def has(self, name: str) -> bool:
        return self.folder.has(name)

    def spec(self, name: str) -> tuple[QuantSpec | None, tuple[int, ...]]:
        t = self.folder.get(name)
        return t.spec, t.shape

    def read(self, name: str, device: str, experts: slice | None = None) -> dict[str, torch.Tensor] | torch.Tensor:
        if self.folder.get(name).spec is not None:
            return {s: v.to(device) for s, v in self.folder.parts(name, experts).items()}
        return self.folder.stored(name, experts).to(device)

    def close(self) -> None:
        self.folder.close()


class OnTheFlySource(TensorSource):
    """An unquantized checkpoint, quantized tensor by tensor with a recipe as it is read."""

    def __init__(self, ckpt: Checkpoint, recipe: Recipe):

        self.ckpt, self.recipe = ckpt, recipe
        self.tensors = {t.name: t for t in ckpt.canonical()}
        self.decisions = {n: decide(recipe, t).spec for n, t in self.tensors.items()}

    def has(self, name: str) -> bool:
        return name in self.tensors

    def spec(self, name: str) -> tuple[QuantSpec | None, tuple[int, ...]]:
        return self.decisions[name], tuple(self.tensors[name].shape)

    def read(self, name: str, device: str, experts: slice | None = None) -> dict[str, torch.Tensor] | torch.Tensor:
        w = self.ckpt.load(name, experts)
        q = self.decisions[name]
        if q is None:
            return (w.to(torch.bfloat16) if w.is_floating_point() else w).to(device)
        parts = get_format(q.format).quantize(w.to(torch.bfloat16), q)
        return {k: v.to(device) for k, v in parts.items()}

    def close(self) -> None:
        self.ckpt.close()


# ---- building -----------------------------------------------------------------------------------------

@dataclass
class LoadReport:
    """What the loader did: bytes per device, kernel routes, the placement used, notes, and the switches it
    ran with (`options`: each matrix is prepared by them)."""

    bytes_by_device: dict[str, int] = field(default_factory=dict)
    routes: dict[str, int] = field(default_factory=dict)
    formats: dict[str, int] = field(default_factory=dict)
    placement: Placement | None = None
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    options: RuntimeOptions = field(default_factory=RuntimeOptions)

    def add(self, dev: str | torch.device, nbytes: int) -> None:
        d = str(dev)
        self.bytes_by_device[d] = self.bytes_by_device.get(d, 0) + int(nbytes)

    def add_kernel(self, k: Kernel, fmt: str) -> None:
        self.routes[f"{fmt}: {k.route}"] = self.routes.get(f"{fmt}: {k.route}", 0) + 1
        self.add(k.device, k.nbytes)


def dense_dtype(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16) if t.is_floating_point() and t.dtype != torch.bfloat16 else t


class QuantEmbedding:
    """Token embedding whose table is quantized: gathers the rows asked for and dequantizes only them."""

    def __init__(self, parts: dict[str, torch.Tensor], spec: QuantSpec, shape: tuple[int, int]):
        self.num_embeddings, self.embedding_dim = shape
        # int8/int4/mxfp4 parts are stored by rows; nf4/fp4 over the flattened matrix, whose blocks never
        # straddle two rows when the row length is a multiple of the block (the quantizer checks it)
        flat = spec.format in ("nf4", "fp4")
        self.parts = {k: v.reshape(shape[0], -1) if flat else v for k, v in parts.items()}
        self.spec, self.fmt = spec, get_format(spec.format)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).to(next(iter(self.parts.values())).device)
        sub = {k: v[flat] for k, v in self.parts.items()}
        rows = self.fmt.dequantize(sub, self.spec, (flat.numel(), self.embedding_dim), torch.bfloat16)
        return rows.reshape(*ids.shape, self.embedding_dim)

    @property
    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self.parts.values())


def _kernel(src: TensorSource, name: str, dev: str, report: LoadReport) -> Kernel:
    spec, shape = src.spec(name)
    return _kernel_of(src.read(name, dev), spec, shape, report)


def _kernel_of(parts: Any, spec: QuantSpec | None, shape: tuple[int, ...], report: LoadReport) -> Kernel:
    k = prepare(parts if spec else dense_dtype(parts), spec, shape, mxfp4=report.options.mxfp4_route)
    k.format = spec.format if spec else "bf16"
    report.add_kernel(k, k.format)
    return k


def build_experts(src: TensorSource, prefix: str, groups: list[tuple[str, list[int]]], cfg: TextConfig,
                  report: LoadReport, route: str | None = None) -> QuantExperts:
    """A layer's QuantExperts: each device group's expert slab read and prepared on that device."""
    gu_name, dn_name = f"{prefix}.gate_up_proj", f"{prefix}.down_proj"
    gu_spec, gu_shape = src.spec(gu_name)
    dn_spec, dn_shape = src.spec(dn_name)
    out: list[ExpertGroup] = []
    for dev, ids in groups:
        g = ExpertGroup(torch.device(dev), [])
        for a, b in contiguous_runs(ids):
            for c0 in range(a, b, SLAB_EXPERTS):
                c1 = min(c0 + SLAB_EXPERTS, b)
                for name, spec, shape, dest in ((gu_name, gu_spec, gu_shape, g.gate_up),
                                                (dn_name, dn_spec, dn_shape, g.down)):
                    slab = src.read(name, dev, slice(c0, c1))
                    for i in range(c1 - c0):
                        p = slice_parts(slab, i) if spec else dense_dtype(slab[i])
                        k = prepare(p, spec, shape[1:], route=route, mxfp4=report.options.mxfp4_route)
                        dest.append(k)
                        report.add_kernel(k, spec.format if spec else "bf16")
                    del slab
                release_free_heap()
            g.ids.extend(range(a, b))
        out.append(g)
    fmt = gu_spec.format if gu_spec else "bf16"
    report.formats[fmt] = report.formats.get(fmt, 0) + 1
    return QuantExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, out, fmt=fmt)


def _vector(src: TensorSource, name: str, dev: str, report: LoadReport) -> torch.Tensor:
    t = dense_dtype(src.read(name, dev))
    report.add(dev, t.numel() * t.element_size())
    return t


def _scale(src: TensorSource, name: str, dev: str, report: LoadReport) -> torch.Tensor:
    """A zero-centred RMSNorm's multiplier (1 + w) in fp32 (transformers computes it on every call)."""
    return 1.0 + _vector(src, name, dev, report).float()


def _draft_kernel(src: TensorSource, name: str, dev: str, report: LoadReport) -> Kernel:
    """An MTP-layer matrix as the draft holds it: an int4 copy where `layer_copy_spec` names one (the stored
    parts let go), else as stored."""
    spec, shape = src.spec(name)
    copy = layer_copy_spec(name, spec.format if spec else "bf16", shape)
    if copy is None:
        return _kernel(src, name, dev, report)
    # made on the CPU, where the quantizer is proven, then moved to `dev`
    held = {k: v.to(dev) for k, v in requantized(src.read(name, "cpu"), spec, shape, copy).items()}
    return _kernel_of(held, copy, shape, report)


def _attention(src: TensorSource, p: str, dev: str, mc: ModelConfig, report: LoadReport,
               kernel: Callable[..., Kernel] = _kernel) -> Attention:
    t = mc.text
    hd = t.head_dim
    qs, ks = _scale(src, f"{p}q_norm.weight", dev, report), _scale(src, f"{p}k_norm.weight", dev, report)
    proj = [kernel(src, f"{p}{n}_proj.weight", dev, report) for n in "qkvo"]
    return Attention(*proj, torch.cat([qs.expand(t.num_attention_heads, hd), ks.expand(t.num_key_value_heads, hd)]),
                     t.num_attention_heads, t.num_key_value_heads, hd, mc.rotary_dims, mc.rms_eps,
                     kernel_attends=dev == "cpu" and kernel_cpu.module() is not None and hd % 16 == 0)


def _delta_net(src: TensorSource, p: str, dev: str, mc: ModelConfig, report: LoadReport) -> DeltaNet:
    t = mc.text
    if src.has(f"{p}conv1d.bias"):
        raise QuantkitError(f"{p}conv1d.bias: this model's Gated DeltaNet conv has no bias")
    proj = [_kernel(src, f"{p}{n}.weight", dev, report)
            for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")]
    conv = _vector(src, f"{p}conv1d.weight", dev, report)  # [C, 1, K]
    want = (mc.conv_dim, 1, t.linear_conv_kernel_dim)
    if tuple(conv.shape) != want:
        raise QuantkitError(f"{p}conv1d.weight has shape {list(conv.shape)}; the config says {list(want)}")
    return DeltaNet(*proj, conv.squeeze(1).float().t().contiguous(),
                    -_vector(src, f"{p}A_log", dev, report).float().exp(),
                    _vector(src, f"{p}dt_bias", dev, report).float(), _vector(src, f"{p}norm.weight", dev, report),
                    t.linear_num_key_heads, t.linear_num_value_heads, t.linear_key_head_dim, t.linear_value_head_dim,
                    mc.rms_eps)


def _router(src: TensorSource, name: str, dev: str, report: LoadReport) -> tuple[torch.Tensor, QBf16Kernel | None]:
    """A router's weight as stored, and the CPU kernel's bf16 product of it where the kernel takes it."""
    rw = _vector(src, name, dev, report)
    kernel = (QBf16Kernel(rw, shared=True) if rw.dtype == torch.bfloat16 and rw.is_contiguous()
              and cpu_kernel.supports("bf16", tuple(rw.shape), rw.device) else None)
    return rw, kernel


def _moe(src: TensorSource, p: str, dev: str, groups: list[tuple[str, list[int]]], mc: ModelConfig,
         report: LoadReport, route: str | None, gather: frozenset[int] | None) -> MoE:
    rw, router_kernel = _router(src, f"{p}gate.weight", dev, report)
    ex = build_experts(src, f"{p}experts", groups, mc.text, report, route)
    shared = [_kernel(src, f"{p}shared_expert.{n}_proj.weight", dev, report) for n in ("gate", "up", "down")]
    m = MoE(rw, router_kernel, mc.text.num_experts_per_tok, ex, *shared,
            _kernel(src, f"{p}shared_expert_gate.weight", dev, report), **_expert_split(ex, gather))
    return m


def _expert_split(ex: QuantExperts, gather: frozenset[int] | None) -> dict[str, Any]:
    """How a layer's experts off the CPU run at T = 1: gathered by routed id on their device where their
    kernels allow it, else through QuantExperts' decode reading the ids on the host. `gather` names the groups
    to gather (tests run that path on the CPU); None: those off the CPU."""
    off = [i for i, g in enumerate(ex.groups) if (g.device.type != "cpu" if gather is None else i in gather)]
    if not off:
        return {}
    if all(GatheredExperts.possible(ex.groups[i].gate_up + ex.groups[i].down) for i in off):
        return {"gathered": [GatheredExperts(ex, i) for i in off],
                "cpu_groups": frozenset(i for i in range(len(ex.groups)) if i not in off)}
    return {"host_ids": True}


def _cat_rows(a: dict[str, torch.Tensor] | torch.Tensor, b: dict[str, torch.Tensor] | torch.Tensor
              ) -> dict[str, torch.Tensor] | torch.Tensor:
    """Two matrices stacked by output rows, stored parts part by part (every format's parts run over the
    output rows first; nf4/fp4 blocks never straddle two rows)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        return torch.cat([a, b])
    assert isinstance(b, dict) and a.keys() == b.keys()
    return {k: torch.cat([a[k], b[k]]) for k in a}


def _mtp_experts(src: TensorSource, p: str, dev: str, mc: ModelConfig, report: LoadReport,
                 route: str | None) -> QuantExperts:
    """The MTP layer's routed experts, stored one by one (gate_proj, up_proj, down_proj each), as a
    QuantExperts on `dev` (gate and up stacked into the gate_up matrix the runtime computes)."""
    t = mc.text
    g = ExpertGroup(torch.device(dev), list(range(t.num_experts)))
    for e in range(t.num_experts):
        q = f"{p}experts.{e}."
        (gs, gshape), (us, ushape) = src.spec(f"{q}gate_proj.weight"), src.spec(f"{q}up_proj.weight")
        if gs != us or gshape[1:] != ushape[1:]:
            raise QuantkitError(f"{q}gate_proj and up_proj are stored differently; re-run `quantkit quantize`")
        parts = _cat_rows(src.read(f"{q}gate_proj.weight", dev), src.read(f"{q}up_proj.weight", dev))
        gu = prepare(parts if gs else dense_dtype(parts), gs, (gshape[0] + ushape[0], gshape[1]), route=route,
                     mxfp4=report.options.mxfp4_route)
        g.gate_up.append(gu)
        g.down.append(_kernel(src, f"{q}down_proj.weight", dev, report))
        report.add_kernel(gu, gs.format if gs else "bf16")
    return QuantExperts(t.num_experts, t.hidden_size, t.moe_intermediate_size, [g],
                        fmt=gs.format if gs else "bf16")


def build_mtp(src: TensorSource, mc: ModelConfig, dev: str, report: LoadReport, route: str | None = None,
              copies: bool = True) -> MTP:
    """The checkpoint's MTP layer (`mtp.*`) on `dev`; `copies`: its dense matrices as the draft holds them
    (`_draft_kernel`), else as stored."""
    t = mc.text
    kernel = _draft_kernel if copies else _kernel
    one = ModelConfig(replace(t, num_hidden_layers=1, layer_types=("full_attention",)), mc.rms_eps, mc.rope_theta,
                      mc.partial_rotary)
    p = "mtp.layers.0."
    rw, router_kernel = _router(src, f"{p}mlp.gate.weight", dev, report)
    shared = [kernel(src, f"{p}mlp.shared_expert.{n}_proj.weight", dev, report) for n in ("gate", "up", "down")]
    moe = MoE(rw, router_kernel, t.num_experts_per_tok, _mtp_experts(src, f"{p}mlp.", dev, mc, report, route),
              *shared, _kernel(src, f"{p}mlp.shared_expert_gate.weight", dev, report))
    pre, post = (_scale(src, f"{p}{nm}.weight", dev, report) for nm in ("input_layernorm", "post_attention_layernorm"))
    layer = Layer(0, torch.device(dev), pre, post, mc.rms_eps,
                  _attention(src, f"{p}self_attn.", dev, mc, report, kernel), moe)
    fc = kernel(src, "mtp.fc.weight", dev, report)
    if (fc.out_features, fc.in_features) != (t.hidden_size, 2 * t.hidden_size):
        raise QuantkitError(f"mtp.fc.weight is {fc.out_features} x {fc.in_features}; this model's MTP layer "
                            f"takes {t.hidden_size} x {2 * t.hidden_size}")
    return MTP(one, fc, *(_scale(src, f"mtp.{n}.weight", dev, report)
                          for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")), layer)


def build_model(src: TensorSource, config: dict[str, Any], placement: Placement, report: LoadReport,
                progress: Callable[[str], None] | None = None, route: str | None = None,
                gather: frozenset[int] | None = None, mtp_copies: bool = True) -> Model:
    """quantkit's model from `src`, each tensor on the device `placement` names (`mtp_copies`: `build_mtp`'s)."""
    mc = model_config(config)
    t = mc.text
    n = t.num_hidden_layers
    if len(placement.layer_device) != n or len(placement.experts) != n:
        raise QuantkitError(f"the placement covers {len(placement.layer_device)} layers, the model has {n}")
    emb_name = f"{LM}embed_tokens.weight"
    spec, shape = src.spec(emb_name)
    if spec is None:
        embed: Any = _vector(src, emb_name, placement.embedding, report)
    else:
        embed = QuantEmbedding(src.read(emb_name, placement.embedding), spec, shape)
        report.add(placement.embedding, embed.nbytes)
    layers = []
    for i in range(n):
        dev = placement.layer_device[i]
        if progress:
            progress(f"layer {i + 1}/{n}")
        p = f"{LM}layers.{i}."
        mixer: Attention | DeltaNet = (_delta_net(src, f"{p}linear_attn.", dev, mc, report)
                                       if t.layer_types[i] == "linear_attention"
                                       else _attention(src, f"{p}self_attn.", dev, mc, report))
        pre, post = (_scale(src, f"{p}{nm}.weight", dev, report)
                     for nm in ("input_layernorm", "post_attention_layernorm"))
        moe = _moe(src, f"{p}mlp.", dev, placement.experts[i], mc, report, route, gather)
        layers.append(Layer(i, torch.device(dev), pre, post, mc.rms_eps, mixer, moe))
    head_dev = placement.lm_head
    final = _scale(src, f"{LM}norm.weight", head_dev, report)
    if src.has("lm_head.weight"):
        h_spec, h_shape = src.spec("lm_head.weight")
        h_parts = src.read("lm_head.weight", head_dev)
        head = _kernel_of(h_parts, h_spec, h_shape, report)
    elif t.tie_word_embeddings and isinstance(embed, torch.Tensor):
        h_parts, h_spec = embed.to(head_dev), None
        head = prepare(h_parts, None, tuple(h_parts.shape), shared=h_parts is embed)
    else:
        raise QuantkitError("the checkpoint has no lm_head.weight and the embedding is not tied")
    has_mtp = bool(t.mtp_num_hidden_layers) and src.has("mtp.fc.weight")
    # the draft's rows in int4 (model/draft_head.py), made before the head's stored parts are let go
    compact = (compact_copy(h_parts, h_spec, (head.out_features, head.in_features))
               if has_mtp and isinstance(head, (QKernel, QBf16Kernel)) else None)
    del h_parts
    # a quantized table on the CPU dequantizes a row in a dozen small ops: the model keeps its steps' rows
    keep_rows = isinstance(embed, QuantEmbedding) and all(p.device.type == "cpu" for p in embed.parts.values())
    model = Model(mc, embed, layers, final, head, keep_rows=keep_rows)
    if has_mtp:
        model.mtp = build_mtp(src, mc, head_dev, report, route, mtp_copies)
        model.mtp.compact = compact
        if compact is not None:
            report.add(head_dev, compact.nbytes)
    return model


# ---- entry point ----------------------------------------------------------------------------------------

def total_ram() -> int:
    import psutil

    return psutil.virtual_memory().total


def drop_page_cache(files: list[Path]) -> None:
    """Tell the kernel the files' cached pages are not needed (POSIX_FADV_DONTNEED), before a load that copies
    them into memory. With a just-written folder filling the page cache, every 2 MiB page the weights fault in
    stalls in direct reclaim and compaction (free memory near zero and in 4 KiB scraps), which at full size
    slowed the load many times over (reports/bench-full-size.md); the folder is then read from disk instead."""
    if not hasattr(os, "posix_fadvise"):
        return
    for f in files:
        try:
            fd = os.open(f, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _check_load_args(path: Any, plan: Any, recipe: Any, context: Any, verify: Any, placement: Any, progress: Any,
                     route: Any, forced_route: Any, gather: Any, mtp_copies: Any, options: Any, slots: Any) -> None:
    """`load_model`'s arguments, each of its type and range (quantkit/runtime/args.py)."""
    args.instance(path, "path", (str, os.PathLike), "a folder (str or Path)", optional=False)
    args.instance(plan, "plan", (str, os.PathLike, Plan), "a plan file (str or Path) or a Plan")
    args.instance(recipe, "recipe", str, "a recipe name (str)")
    if context is not None:
        args.whole(context, "context", 1)
    args.choice(verify, "verify", args.VERIFY_MODES)
    args.instance(placement, "placement", Placement, "a Placement")
    args.callback(progress, "progress")
    args.instance(route, "route", str, "a kernel route (str)")
    args.instance(forced_route, "forced_route", str, "a one-token route kind (str)")
    args.instance(gather, "gather", (set, frozenset), "a set of expert groups")
    args.flag(mtp_copies, "mtp_copies")
    args.whole(slots, "slots", 1)
    args.instance(options, "options", RuntimeOptions,
                  "a RuntimeOptions (quantkit.runtime.options; e.g. RuntimeOptions(route=\"torch\"))")


def verify_or_refuse(folder: Path, mode: str = "auto") -> None:
    """`quantkit.quantize.verify.verify_folder`; "auto" hashes every shard only when the folder's shards total
    under 4 GB (else it checks their sizes and headers)."""
    args.choice(mode, "verify", args.VERIFY_MODES)
    if mode == "off":
        return

    if mode == "auto":
        size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
        hash_files = size < 4_000_000_000
    else:
        hash_files = mode == "full"
    res = verify_folder(folder, hash_files=hash_files)
    if not res.ok:
        more = f" (and {len(res.problems) - 1} more problems)" if len(res.problems) > 1 else ""
        raise QuantkitError(f"{folder}: fails verification: {res.problems[0]}{more}; re-run `quantkit quantize`")


def load_plan_file(path: str | Path) -> Plan:
    p = Path(path)
    text = read_text_bounded(p, "plan")
    try:
        return Plan.from_json(text)
    except json.JSONDecodeError as e:
        raise QuantkitError(f"{p}: plan is not valid JSON (line {e.lineno}: {e.msg})") from None
    except QuantkitError as e:
        raise QuantkitError(f"{p}: {e}") from None


def load_model(path: str | Path, plan: str | Path | Plan | None = None, *, recipe: str | None = None,
               context: int | None = None, verify: str = "auto", placement: Placement | None = None,
               progress: Callable[[str], None] | None = None, route: str | None = None,
               forced_route: str | None = None, gather: frozenset[int] | None = None,
               mtp_copies: bool = True, options: RuntimeOptions | None = None, slots: int = 1) -> Runtime:
    """Load a quantized (or bf16) checkpoint folder into a `Runtime`. See the module docstring.
    `options`: every switch of the load (runtime/options.py; None: `RuntimeOptions.from_env()`, read here and
    nowhere else); `route` and `forced_route` override its kernel_route and route.
    `forced_route`: a one-token route kind (runtime/model/route.py; None: the options' or the best);
    `gather`: expert groups to compute as on a device (tests); `mtp_copies`: False holds the MTP layer's
    matrices as stored (to compare the layer with another engine's), not as int4 copies (checkpoint/draft.py).
    `context` None: the longest at which `slots` conversations fit here, capped (planner/fit.py default_context).
    Every argument is checked first, nothing read before: ArgumentTypeError / ArgumentError naming it."""
    t0 = time.perf_counter()
    _check_load_args(path, plan, recipe, context, verify, placement, progress, route, forced_route, gather,
                     mtp_copies, options, slots)
    if options is None:
        options = RuntimeOptions.from_env()
    else:
        cpu_kernel.configure(options)  # before any matrix is prepared: the kernel's table follows the options
    if forced_route is not None:
        options = options.with_(route=forced_route, route_source="route")
    if route is not None:
        options = options.with_(kernel_route=route)
    folder = resolve_model(path)
    if not folder.is_dir():
        raise QuantkitError(f"{folder}: not a model folder")
    config = load_config(folder / "config.json")
    qc = read_quant_config(folder, config)
    spec = spec_from_config(config, name=folder.name, source=str(folder / "config.json"))
    model_config(config, str(folder / "config.json"))  # a config this model cannot compute: one line, nothing read
    if qc is not None:
        if recipe:
            raise QuantkitError(f"{folder} is already quantized ({qc.get('recipe', {}).get('name', '?')}); "
                                "--scheme (recipe=) quantizes an unquantized checkpoint while loading: drop it to "
                                "run this folder as stored")
        verify_or_refuse(folder, verify)
        rec = Recipe.from_dict(qc["recipe"])
    else:
        rec = get_recipe(recipe or "bf16")
    report = LoadReport(options=options)
    plan_obj = None
    if placement is None:
        if plan is not None:
            plan_obj = plan if not isinstance(plan, (str, Path)) else load_plan_file(plan)
            check_plan(plan_obj, spec, folder, str(plan), _free_bytes(plan_obj), _hardware_here)
            placement = Placement.from_plan(plan_obj, f"plan {plan}")
            placement.context_source = "the plan's"
            if context:
                placement.context, placement.context_source = context, "as given (-c)"
        else:
            here = _hardware_here()
            chosen = default_context(spec, rec, here, slots) if not context else None
            plan_obj = plan_here(spec, rec, chosen.tokens if chosen else context, here)
            placement = Placement.from_plan(plan_obj, f"planned for {here.describe()}")
            placement.context_source = f"default: {chosen.why}" if chosen else "as given (-c)"
    placement.context = min(placement.context, spec.config.max_position_embeddings)
    report.placement = placement
    # nothing was read before this point but headers and config
    src: TensorSource
    if qc is not None:
        qf = QuantizedFolder.open(folder)
        shards = sorted(folder.glob("*.safetensors"))
        # a folder of a sizeable share of RAM: its page-cache copy would only compete with the loaded weights
        qf.drop_cache = sum(p.stat().st_size for p in shards) > total_ram() // 4
        if qf.drop_cache:
            drop_page_cache(shards)
        src = QuantizedSource(qf)
    else:
        src = OnTheFlySource(Checkpoint.open(folder), rec)

    try:
        model = build_model(src, config, placement, report, progress, options.kernel_route, gather, mtp_copies)
    finally:
        src.close()
    release_free_heap()
    model.set_route(options.route, report.notes, options.route_source)
    report.seconds = time.perf_counter() - t0
    rt = Runtime(model, folder, config, placement, report, recipe=rec, plan=plan_obj)
    if options.mtp is not None:
        note = rt.set_mtp(options.mtp)
        if note:
            report.notes.append(note)
    return rt

