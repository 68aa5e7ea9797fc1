"""Loading a checkpoint onto a placement: transformers' skeleton on the meta device, quantized modules
swapped in, each tensor read from safetensors straight onto the device the plan names.

Flow of `load_model(path, plan=None)`:
1. config.json: a quantkit output (quantization_config.quant_method == "quantkit") must have a version
   this code knows and pass `quantkit.quantize.verify.verify_folder`; any other folder is read as an
   unquantized source through `quantkit.model.checkpoint.Checkpoint` (both layouts, FP8 dequantized) and
   quantized on the fly with `recipe` (default "bf16": kept as is).
2. Placement: from a plan file (`quantkit plan --out`; its fingerprint must match this model and it
   must fit the detected hardware, checked before anything is read) or planned on the spot for the
   detected hardware with `quantkit.planner.placement.solve`.
3. `Qwen3_5MoeForCausalLM(text_config)` is built on the meta device (no memory). Every projection of
   attention, linear attention, the shared expert and lm_head becomes a `QuantLinear`; every
   `mlp.experts` a `QuantExperts` with one group per device. Each tensor is read alone (experts: one
   slab of the ids a device holds, via safetensors' `get_slice`), prepared once by
   `runtime.kernels.prepare` on its device and assigned; the whole model never sits in RAM twice: shards are
   read with plain reads (no memory map left behind; a folder above a quarter of RAM has its page cache dropped
   first and leaves none behind) and the heap's freed temporaries go back to the system as the load goes.
   Published names `model.language_model.X` map onto the CausalLM's `model.X`.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from quantkit.errors import QuantkitError
from quantkit.fileio import read_text_bounded
from quantkit.formats import QuantSpec, get_format
from quantkit.model.checkpoint import Checkpoint, resolve_model
from quantkit.model.contract import read_quant_config
from quantkit.model.quantized import QuantizedFolder
from quantkit.model.spec import load_config, spec_from_config, text_config_dict
from quantkit.planner.fit import check_plan, hardware_here, plan_here
from quantkit.planner.hardware import Hardware
from quantkit.planner.placement import Plan, contiguous_runs
from quantkit.quantize.verify import verify_folder
from quantkit.recipe import Recipe, decide, get_recipe
from quantkit.runtime import linear_attn
from quantkit.runtime.devices import available_bytes, check_device_exists, release_free_heap
from quantkit.runtime.engine import Runtime
from quantkit.runtime.kernels import Kernel, prepare, slice_parts
from quantkit.runtime.qexperts import ExpertGroup, QuantExperts
from quantkit.runtime.qlinear import QuantLinear

if TYPE_CHECKING:
    from transformers import PretrainedConfig

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
    """What the loader did: bytes per device, kernel routes, the placement used, notes."""

    bytes_by_device: dict[str, int] = field(default_factory=dict)
    routes: dict[str, int] = field(default_factory=dict)
    formats: dict[str, int] = field(default_factory=dict)
    placement: Placement | None = None
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def add(self, dev: str | torch.device, nbytes: int) -> None:
        d = str(dev)
        self.bytes_by_device[d] = self.bytes_by_device.get(d, 0) + int(nbytes)

    def add_kernel(self, k: Kernel, fmt: str) -> None:
        self.routes[f"{fmt}: {k.route}"] = self.routes.get(f"{fmt}: {k.route}", 0) + 1
        self.add(k.device, k.nbytes)


def build_skeleton(config: dict[str, Any]) -> Any:
    """transformers' Qwen3_5MoeForCausalLM on the meta device (no weight memory)."""
    import transformers
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    transformers.logging.set_verbosity_error()
    cfg = Qwen3_5MoeTextConfig(**text_config_dict(config))
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = Qwen3_5MoeForCausalLM(cfg)
    return model.eval()


def _set_param(module: nn.Module, name: str, t: torch.Tensor) -> None:
    mod_path, _, leaf = name.rpartition(".")
    m = module.get_submodule(mod_path) if mod_path else module
    m._parameters[leaf] = nn.Parameter(t, requires_grad=False)


def _replace(module: nn.Module, path: str, new: nn.Module) -> None:
    parent_path, _, leaf = path.rpartition(".")
    parent = module.get_submodule(parent_path) if parent_path else module
    setattr(parent, leaf, new)


def _dense_dtype(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16) if t.is_floating_point() and t.dtype != torch.bfloat16 else t


class QuantEmbedding(nn.Module):
    """Token embedding whose table is quantized: gathers the rows asked for and dequantizes only them."""

    def __init__(self, parts: dict[str, torch.Tensor], spec: QuantSpec, shape: tuple[int, int]):
        super().__init__()
        self.num_embeddings, self.embedding_dim = shape
        # int8/int4/mxfp4 parts are stored by rows; nf4/fp4 over the flattened matrix, whose blocks never
        # straddle two rows when the row length is a multiple of the block (the quantizer checks it)
        flat = spec.format in ("nf4", "fp4")
        self.parts = {k: v.reshape(shape[0], -1) if flat else v for k, v in parts.items()}
        self.spec, self.fmt = spec, get_format(spec.format)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).to(next(iter(self.parts.values())).device)
        sub = {k: v[flat] for k, v in self.parts.items()}
        rows = self.fmt.dequantize(sub, self.spec, (flat.numel(), self.embedding_dim), torch.bfloat16)
        return rows.reshape(*ids.shape, self.embedding_dim)

    @property
    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self.parts.values())


def _move_hook(dev: torch.device) -> Callable:
    def hook(_mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        def mv(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and x.device != dev:
                return x.to(dev)
            if isinstance(x, tuple):
                return tuple(mv(v) for v in x)
            return x

        return tuple(mv(a) for a in args), {k: mv(v) for k, v in kwargs.items()}

    return hook


def _linear_kernel(src: TensorSource, name: str, dev: str, report: LoadReport) -> QuantLinear:
    spec, shape = src.spec(name)
    parts = src.read(name, dev)
    k = prepare(parts if spec else _dense_dtype(parts), spec, shape)
    fmt = spec.format if spec else "bf16"
    report.add_kernel(k, fmt)
    return QuantLinear(k, fmt)


def build_experts(src: TensorSource, prefix: str, groups: list[tuple[str, list[int]]], cfg: PretrainedConfig,
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
                        p = slice_parts(slab, i) if spec else _dense_dtype(slab[i])
                        k = prepare(p, spec, shape[1:], route=route)
                        dest.append(k)
                        report.add_kernel(k, spec.format if spec else "bf16")
                    del slab
                release_free_heap()
            g.ids.extend(range(a, b))
        out.append(g)
    fmt = gu_spec.format if gu_spec else "bf16"
    report.formats[fmt] = report.formats.get(fmt, 0) + 1
    return QuantExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, out, fmt=fmt)


def populate(model: Any, src: TensorSource, placement: Placement, report: LoadReport,
             progress: Callable[[str], None] | None = None, route: str | None = None) -> None:
    """Fill the meta skeleton from `src` according to `placement`."""
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTextRotaryEmbedding

    cfg = model.config
    tm = model.model
    n = cfg.num_hidden_layers
    if len(placement.layer_device) != n or len(placement.experts) != n:
        raise QuantkitError(f"the placement covers {len(placement.layer_device)} layers, the model has {n}")
    # embedding
    emb_name = f"{LM}embed_tokens.weight"
    spec, shape = src.spec(emb_name)
    if spec is None:
        w = _dense_dtype(src.read(emb_name, placement.embedding))
        _set_param(tm, "embed_tokens.weight", w)
        report.add(placement.embedding, w.numel() * w.element_size())
    else:
        qe = QuantEmbedding(src.read(emb_name, placement.embedding), spec, shape)
        tm.embed_tokens = qe
        report.add(placement.embedding, qe.nbytes)
    for L, layer in enumerate(tm.layers):
        dev = placement.layer_device[L]
        if progress:
            progress(f"layer {L + 1}/{n}")
        pre = f"{LM}layers.{L}."
        linears = [nm for nm, m in layer.named_modules() if isinstance(m, nn.Linear)]
        for nm in linears:
            _replace(layer, nm, _linear_kernel(src, f"{pre}{nm}.weight", dev, report))
        layer.mlp.experts = build_experts(src, f"{pre}mlp.experts", placement.experts[L], cfg, report, route)
        for pn, p in list(layer.named_parameters()):
            if p.device.type == "meta":
                t = _dense_dtype(src.read(f"{pre}{pn}", dev))
                _set_param(layer, pn, t)
                report.add(dev, t.numel() * t.element_size())
        layer.register_forward_pre_hook(_move_hook(torch.device(dev)), with_kwargs=True)
    head = placement.lm_head
    w = _dense_dtype(src.read(f"{LM}norm.weight", head))
    _set_param(tm, "norm.weight", w)
    report.add(head, w.numel() * w.element_size())
    tm.norm.register_forward_pre_hook(_move_hook(torch.device(head)), with_kwargs=True)
    if src.has("lm_head.weight"):
        model.lm_head = _linear_kernel(src, "lm_head.weight", head, report)
    elif cfg.tie_word_embeddings and isinstance(tm.embed_tokens, nn.Embedding):
        w = tm.embed_tokens.weight.to(head)
        model.lm_head = QuantLinear(prepare(w, None, tuple(w.shape), shared=w is tm.embed_tokens.weight))
    else:
        raise QuantkitError("the checkpoint has no lm_head.weight and the embedding is not tied")
    rot = Qwen3_5MoeTextRotaryEmbedding(cfg)
    tm.rotary_emb = rot.to(placement.embedding)
    left = [nm for nm, p in model.named_parameters() if p.device.type == "meta"]
    left += [nm for nm, b in model.named_buffers() if b.device.type == "meta"]
    if left:
        raise QuantkitError(f"the checkpoint lacks {left[0]}" + (f" and {len(left) - 1} more" if len(left) > 1 else ""))


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


def verify_or_refuse(folder: Path, mode: str = "auto") -> None:
    """`quantkit.quantize.verify.verify_folder`; "auto" hashes shards only when the folder is under 4 GB."""
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
               cuda_graphs: bool | None = None) -> Runtime:
    """Load a quantized (or bf16) checkpoint folder into a `Runtime`. See the module docstring.
    `cuda_graphs`: decode through a captured CUDA graph (the model must be on one CUDA device; None: the
    QUANTKIT_CUDA_GRAPHS environment switch)."""


    t0 = time.perf_counter()
    folder = resolve_model(path)
    if not folder.is_dir():
        raise QuantkitError(f"{folder}: not a model folder")
    config = load_config(folder / "config.json")
    qc = read_quant_config(folder, config)
    spec = spec_from_config(config, name=folder.name, source=str(folder / "config.json"))
    if qc is not None:
        if recipe:
            raise QuantkitError(f"{folder} is already quantized ({qc.get('recipe', {}).get('name', '?')}); "
                                "--recipe applies to an unquantized checkpoint")
        verify_or_refuse(folder, verify)
        rec = Recipe.from_dict(qc["recipe"])
    else:
        rec = get_recipe(recipe or "bf16")
    report = LoadReport()
    plan_obj = None
    if placement is None:
        if plan is not None:
            plan_obj = plan if not isinstance(plan, (str, Path)) else load_plan_file(plan)
            check_plan(plan_obj, spec, folder, str(plan), _free_bytes(plan_obj), _hardware_here)
            placement = Placement.from_plan(plan_obj, f"plan {plan}")
            if context:
                placement.context = context
        else:
            ctx = context or min(4096, spec.config.max_position_embeddings)
            here = _hardware_here()
            plan_obj = plan_here(spec, rec, ctx, here)
            placement = Placement.from_plan(plan_obj, f"planned for {here.describe()}")
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

    linear_attn.install()
    model = build_skeleton(config)
    try:
        populate(model, src, placement, report, progress, route)
    finally:
        src.close()
    release_free_heap()
    report.seconds = time.perf_counter() - t0
    rt = Runtime(model, folder, config, placement, report, recipe=rec, plan=plan_obj)
    rt.cuda_graphs = cuda_graphs
    return rt

