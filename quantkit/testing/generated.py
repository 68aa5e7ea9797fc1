"""Quantized folders generated directly in the stored format: random, seeded, never through bf16. A TEST FIXTURE.

`write_quantized(out, cfg, recipe)` writes what `quantkit quantize --scheme RECIPE` writes for a checkpoint of
config `cfg` (the same `make_plan`: every tensor's decision, parts and shards; the same shard writer, journal,
index, config.json with its quantization_config, and manifest: quantize/run.py's functions), without a source
checkpoint. This is how `quantkit tiny-model --full-size --quantized RECIPE` makes the 35B shape on a machine
that cannot hold (or store) its 70 GB of bf16.

Weights: each quantized tensor's rows are drawn (seeded per tensor) from a pool of `POOL_ROWS` rows that the
format itself quantized from Gaussian weights (std 0.02), so every stored row is a row the format can produce;
this needs a format whose parts are stored row by row (each weight row's parts depend on that row alone, and
an expert stack is stored as its rows are), which `gatherable` checks on the format rather than assumes. Kept
tensors (embedding, norms, router, in_proj_a/b) are drawn as the tiny model draws them (`init_tensor` below:
zero-centred norms, A_log, dt_bias). Random weights: the model's outputs mean nothing; its shapes, bytes and
speed are the real model's.

Memory: one block (a slab of experts or rows, `DEFAULT_SLAB_BYTES` of bf16 input, as the quantizer streams)
of parts at a time, the pools, and the largest kept tensor (the embedding: 1 GB at full size); `peak_bytes`
bounds it and the caller checks it against free RAM before writing. Interruption: each shard is committed
through the quantizer's journal, so the same call with mode "resume" reuses the finished shards (checked by
sha256) and rewrites the rest; a folder without its manifest is refused by verify and the loader.
"""

from __future__ import annotations

import math
import zlib
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from quantkit.checkpoint.spec import spec_from_config
from quantkit.errors import QuantkitError
from quantkit.formats import QuantSpec, get_format
from quantkit.progress import NoProgress, Progress
from quantkit.quantize.manifest import fingerprint
from quantkit.quantize.run import (
    DEFAULT_SLAB_BYTES,
    Interrupted,
    QuantizeOptions,
    QuantPlan,
    TensorPlan,
    block_layout,
    commit_job,
    make_plan,
    open_journal,
    output_config,
    prepare_out,
    seal_folder,
    sigterm_as_interrupt,
    tensor_blocks,
    write_folder_files,
)
from quantkit.quantize.shards import ShardWriter
from quantkit.quantize.stream import StageTimes
from quantkit.recipe import Recipe

GENERATOR = "quantkit tiny-model --quantized"
POOL_ROWS = 256
# what the process holds besides blocks and the largest kept tensor: torch, pools, hashing buffers
BASE_BYTES = 512 << 20


def init_tensor(name: str, shape: tuple[int, ...], seed: int, dtype: torch.dtype) -> torch.Tensor:
    """transformers-like init for one tensor, from a per-name seed (for streamed and MTP tensors)."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) & 0x7FFFFFFF)
    if name.endswith("A_log"):
        return torch.empty(shape).uniform_(0.01, 16, generator=g).log_().to(dtype)
    if name.endswith("dt_bias"):
        return torch.ones(shape, dtype=dtype)
    if name.endswith("linear_attn.norm.weight"):
        return (1 + 0.05 * torch.randn(shape, generator=g)).to(dtype)
    if len(shape) == 1:
        return (0.05 * torch.randn(shape, generator=g)).to(dtype)
    if name.endswith("conv1d.weight"):
        b = 1 / math.sqrt(shape[-1])
        return torch.empty(shape).uniform_(-b, b, generator=g).to(dtype)
    out = torch.empty(shape, dtype=dtype)
    rows = out.view(-1, shape[-1])
    step = max(1, (1 << 24) // shape[-1])
    for r in range(0, rows.shape[0], step):
        rows[r:r + step] = (0.02 * torch.randn((min(step, rows.shape[0] - r), shape[-1]), generator=g)).to(dtype)
    return out


@lru_cache(maxsize=64)
def gatherable(spec: QuantSpec, in_features: int) -> bool:
    """True when the parts of a matrix under `spec` are its rows' parts stacked (each row quantized alone gives
    the same bytes) and a [2, R, in] stack is stored as its 2R rows are."""
    fmt = get_format(spec.format)
    w = (torch.randn(4, in_features, generator=torch.Generator().manual_seed(3)) * 0.02).to(torch.bfloat16)
    whole = fmt.quantize(w, spec)
    rows = [fmt.quantize(w[i:i + 1], spec) for i in range(4)]
    stack = fmt.quantize(w.view(2, 2, in_features), spec)
    for k, v in whole.items():
        if v.numel() % 4:
            return False
        flat = v.reshape(4, -1)
        if not torch.equal(flat, torch.cat([r[k].reshape(1, -1) for r in rows])):
            return False
        if k not in stack or not torch.equal(stack[k].reshape(4, -1), flat):
            return False
    return True


def _generator(name: str, seed: int, salt: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode()) + salt) & 0x7FFFFFFF)


def _pool(tp: TensorPlan, seed: int) -> dict[str, torch.Tensor]:
    """POOL_ROWS rows of Gaussian weights quantized by the tensor's format, each part as [POOL_ROWS, -1]."""
    assert tp.spec is not None
    in_f = tp.shape[-1]
    if not gatherable(tp.spec, in_f):
        raise QuantkitError(f"{tp.name}: format {tp.spec.format} (group {tp.spec.group_size}) is not stored row by "
                            "row, so it cannot be generated directly; generate the bf16 checkpoint and quantize it")
    w = (torch.randn(POOL_ROWS, in_f, generator=_generator(tp.name, seed, 1)) * 0.02).to(torch.bfloat16)
    return {k: v.reshape(POOL_ROWS, -1) for k, v in get_format(tp.spec.format).quantize(w, tp.spec).items()}


def _weight_rows(tp: TensorPlan, rows_dim0: int) -> int:
    return rows_dim0 * math.prod(tp.shape[1:-1])


def _write_tensor(shard: ShardWriter, tp: TensorPlan, seed: int, slab_bytes: int, progress: Progress) -> None:
    """Every block of one tensor, generated and written in place."""
    if tp.spec is None:
        t = init_tensor(tp.name, tp.shape, seed, getattr(torch, tp.dtype))
        shard.write(tp.name, t)
        progress.advance(tp.name, t.numel() * t.element_size(), True)
        return
    pool = _pool(tp, seed)
    g = _generator(tp.name, seed, 2)
    for blk in tensor_blocks(tp, slab_bytes):
        n0 = tp.shape[0] if blk.whole else blk.rows
        idx = torch.randint(0, POOL_ROWS, (_weight_rows(tp, n0),), generator=g)
        done = 0
        for suffix, sh, dt, _off in block_layout(tp, blk):
            part = pool[suffix].index_select(0, idx).view(sh)
            if part.dtype != dt:
                raise QuantkitError(f"internal: {tp.name}.{suffix} pool is {part.dtype}, the plan says {dt}")
            start = 0 if blk.whole else blk.start * (sh[0] // blk.rows)
            shard.write(f"{tp.name}.{suffix}", part, start)
            done += part.numel() * part.element_size()
            del part
        progress.advance(tp.name, done, False)
    progress.advance(tp.name, 0, True)


def plan_for(cfg: dict[str, Any], recipe: Recipe, max_shard_size: int = 2_000_000_000) -> QuantPlan:
    """The quantizer's plan for a checkpoint of `cfg` (its MTP layer kept, as `quantize` does by default)."""
    return make_plan(list(spec_from_config(cfg, include_mtp=True).tensors), recipe, True, max_shard_size)


def peak_bytes(plan: QuantPlan, slab_bytes: int = DEFAULT_SLAB_BYTES) -> int:
    """Bytes the generator may hold at once: the largest kept tensor (with its fp32 drawing chunk), the
    largest block of parts, the pools of one tensor, and BASE_BYTES."""
    kept = max((t.out_bytes for t in plan.tensors if t.spec is None), default=0)
    blk = 0
    for t in plan.tensors:
        if t.spec is not None:
            b = tensor_blocks(t, slab_bytes)[0]
            rows = t.shape[0] if b.whole else b.rows
            blk = max(blk, t.out_bytes * rows // t.shape[0] + POOL_ROWS * t.out_bytes // max(_weight_rows(t, t.shape[0]), 1))
    return kept + (64 << 20) + 2 * blk + BASE_BYTES


def disk_bytes(plan: QuantPlan) -> int:
    """Bytes the folder takes (shards with headers; the small files are under a MB)."""
    return sum(lay.size for lay in plan.layouts()) + (4 << 20)


def check_ram(need: int, what: str) -> None:
    """One line when less RAM is available now than `need`."""
    import psutil

    avail = psutil.virtual_memory().available
    if need > avail:
        raise QuantkitError(f"{what} needs {need / 1e9:.2f} GB of RAM, {avail / 1e9:.2f} GB is available; "
                            "close other programs or use a machine with more memory")


def write_quantized(out: Path, cfg: dict[str, Any], recipe: Recipe, copies: list[Path],
                    *, seed: int = 0, mode: str = "new", max_shard_size: int = 2_000_000_000,
                    slab_bytes: int = DEFAULT_SLAB_BYTES, progress: Progress | None = None) -> QuantPlan:
    """Write the quantized folder of `cfg` under `recipe` to `out` (module docstring). `copies` (tokenizer,
    generation config, the fixture's sidecar) are copied beside the shards and listed in the manifest. `mode`:
    "new", "resume" (continue an interrupted generation of the same options) or "overwrite"."""
    progress = progress or NoProgress()
    out = Path(out)
    plan = plan_for(cfg, recipe, max_shard_size)
    prepare_out(out, mode, [])
    layouts, names = plan.layouts(), plan.shard_names
    opts = QuantizeOptions(recipe, max_shard_size=max_shard_size)
    key = fingerprint({"generated": GENERATOR, "seed": seed, "config": cfg, "options": opts.fingerprint_data(),
                       "shards": [lay.header.hex() for lay in layouts]})
    journal, reused = open_journal(out, mode, key, names, layouts, 1 << 20, need_stats=False)
    todo = [(sn, shard, lay) for sn, shard, lay in zip(names, plan.shards, layouts, strict=True) if sn not in reused]
    progress.start(sum(len(s) for _, s, _ in todo), sum(t.out_bytes for _, s, _ in todo for t in s))
    times = StageTimes()
    try:
        with sigterm_as_interrupt():
            for sn, shard, lay in todo:
                with ShardWriter(out / sn, lay) as w:
                    for tp in shard:
                        _write_tensor(w, tp, seed, slab_bytes, progress)
                    commit_job(out, sn, w, [], journal, {}, times)()
    except KeyboardInterrupt:
        for p in out.glob(".*.tmp"):
            p.unlink(missing_ok=True)
        raise Interrupted(f"interrupted: {len(journal.done)} of {len(names)} shards are finished in {out}; "
                          "run the same command with --resume to continue") from None
    files = write_folder_files(out, plan, layouts, output_config(cfg, plan), copies, journal)
    seal_folder(out, names, journal, files, {"generated": GENERATOR, "seed": seed, "config_sha256": fingerprint(cfg)},
                opts.fingerprint_data())
    return plan


__all__ = ["write_quantized", "plan_for", "peak_bytes", "disk_bytes", "gatherable", "check_ram"]
