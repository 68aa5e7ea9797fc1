"""The streaming quantizer: a source checkpoint in, a quantized HF-style folder out, in bounded memory.

Flow: `make_plan` decides every tensor (recipe + eligibility), works out the exact shape and dtype of
every output part and assigns tensors to shards of bounded size, so shard names, headers and the total
output size are known before any weight is read. `run_quantize` then streams each tensor in blocks along
dim 0 (fused expert stacks: a slab of experts; big matrices, kept ones too: a block of rows), with reading,
quantizing (and measuring) and writing on their own threads over reused buffers (quantize/stream.py,
where the memory bound is stated). Shards are written under temporary names; a journal records each
finished shard (size, sha256) before it is renamed into place, so `--resume` reuses it; the manifest is
written last. Output bytes depend only on the source and the options (no timestamps, not the thread
count), so a resumed run is byte-identical to an uninterrupted one. A source file changed during the run
(rewritten in place, cut short, replaced) ends it in one line naming the file, before the shard that read it is
recorded and before the manifest (quantize/source_guard.py).

The default 4-bit recipe (`quality` in quantkit/recipe.py) keeps lm_head at int8: measured on the
realistic-shape checkpoint (reports/bench-quantize.md), int4 g128 on lm_head has ~20x the weight error
of int8 and the logits' error grows accordingly, for a saving of 0.24 GB out of ~19 GB. The embedding
stays bf16: it is gathered one row per token, so its bits do not cost bandwidth.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import math
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from quantkit.checkpoint.contract import INDEX_NAME, QUANT_METHOD, QUANT_VERSION, holds_quantize_run
from quantkit.checkpoint.reader import Checkpoint, check_finite
from quantkit.checkpoint.spec import Role, TensorSpec, role_of
from quantkit.errors import QuantkitError
from quantkit.fileio import atomic_write_json, fsync_dir, temp_name
from quantkit.formats import QuantSpec, get_format, stored_parts
from quantkit.formats.common import ErrorSums
from quantkit.outputs import check_free, check_not_source, guard_output, occupied
from quantkit.progress import NoProgress, Progress
from quantkit.quantize.calibrated import Calibration
from quantkit.quantize.manifest import (
    JOURNAL_NAME,
    MANIFEST_NAME,
    FileEntry,
    Journal,
    Manifest,
    check_file,
    file_entry,
    fingerprint,
)
from quantkit.quantize.report import report_paths, write_report
from quantkit.quantize.shards import ShardLayout, ShardWriter, TensorLayout, dtype_name, read_header
from quantkit.quantize.source_guard import SourceGuard
from quantkit.quantize.stream import (
    CHUNK_TEMP_BYTES,
    STAGE_OVERHEAD_BYTES,
    Block,
    BufferPool,
    Reader,
    StageTimes,
    Writer,
    align,
    keep_small_allocations,
    view_as,
)
from quantkit.recipe import Recipe, decide
from quantkit.termtext import plural
from quantkit.threads import resolve_threads, torch_threads

REPORT_STEM = "quantkit-report"
# Input bytes per slab of experts / block of rows. Two are in flight (one read ahead), with two output arenas
# (quantize/stream.py); 32 MB runs as fast as 64 MB file to file (reports/bench-quantize.md) at half the memory.
DEFAULT_SLAB_BYTES = 32 << 20
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle", ".gguf", ".h5",
                   ".msgpack", ".onnx", ".npz", ".npy")
NOT_COPIED = {"config.json", INDEX_NAME, MANIFEST_NAME, JOURNAL_NAME, "pytorch_model.bin.index.json"}


# --- parts: the exact output tensors of one quantized tensor -------------------------------------------

def part_layouts(name: str, spec: QuantSpec, shape: tuple[int, ...]) -> list[TensorLayout]:
    """The stored parts `name.<suffix>` of a tensor of `shape` [..., out, in] under `spec` (the format's own
    `parts`), in suffix order."""
    parts = stored_parts(spec, tuple(shape))
    return [TensorLayout(f"{name}.{k}", parts[k].shape, getattr(torch, parts[k].dtype)) for k in sorted(parts)]


@lru_cache(maxsize=64)
def rows_chunkable(spec: QuantSpec, in_features: int) -> bool:
    """True when a 2D matrix quantized in blocks of rows gives the same parts as quantized whole (every
    per-row or per-group format; checked, not assumed, because the contract only promises it for dim 0
    of expert stacks)."""
    one, two = stored_parts(spec, (1, in_features)), stored_parts(spec, (2, in_features))
    if any(two[k].shape[0] != 2 * one[k].shape[0] or one[k].shape[0] <= 0 for k in one):
        return False  # a part's first dim does not grow with the rows
    fmt = get_format(spec.format)
    w = torch.randn(4, in_features, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    whole = fmt.quantize(w, spec)
    halves = [fmt.quantize(w[:2], spec), fmt.quantize(w[2:], spec)]
    return all(torch.equal(whole[k], torch.cat([h[k] for h in halves])) for k in whole)


# --- the plan ------------------------------------------------------------------------------------------

@dataclass
class TensorPlan:
    name: str
    shape: tuple[int, ...]
    dtype: str
    role: Role
    spec: QuantSpec | None
    note: str
    outputs: list[TensorLayout]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def in_bytes(self) -> int:
        return self.numel * _torch_dtype(self.dtype).itemsize

    @property
    def out_bytes(self) -> int:
        return sum(o.nbytes for o in self.outputs)


@dataclass
class QuantPlan:
    recipe: Recipe
    tensors: list[TensorPlan]
    shards: list[list[TensorPlan]]
    dropped: list[str]
    keep_mtp: bool
    max_shard_size: int

    @property
    def mtp(self) -> str:
        """"kept" (the source's MTP layer is in the plan, quantized by its decoder-layer roles), "dropped"
        (--no-mtp-layer) or "absent" (the source has none)."""
        if self.dropped:
            return "dropped"
        return "kept" if any(t.role == Role.MTP for t in self.tensors) else "absent"

    @property
    def shard_names(self) -> list[str]:
        n = len(self.shards)
        return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]

    def layouts(self) -> list[ShardLayout]:
        return [ShardLayout([o for t in s for o in t.outputs]) for s in self.shards]

    @property
    def in_bytes(self) -> int:
        return sum(t.in_bytes for t in self.tensors)

    @property
    def out_bytes(self) -> int:
        return sum(t.out_bytes for t in self.tensors)

    def weight_map(self) -> dict[str, str]:
        return {o.name: sn for sn, s in zip(self.shard_names, self.shards, strict=True) for t in s for o in t.outputs}


def _torch_dtype(name: str) -> torch.dtype:
    d = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(d, torch.dtype):
        raise QuantkitError(f"unknown dtype {name!r}")
    return d


def make_plan(tensors: list[TensorSpec], recipe: Recipe, keep_mtp: bool = True,
              max_shard_size: int = 2_000_000_000) -> QuantPlan:
    """Decide every tensor and place it in a shard (greedy in checkpoint order; a tensor larger than the
    shard size gets a shard of its own). The MTP layer is kept (its tensors quantized by the recipe of the
    role each plays in a decoder layer: model.spec.mtp_subrole) unless `keep_mtp` is False (--no-mtp-layer)."""
    if max_shard_size <= 0:
        raise QuantkitError("--max-shard-size must be positive")
    planned: list[TensorPlan] = []
    dropped: list[str] = []
    for t in tensors:
        if t.role == Role.MTP and not keep_mtp:
            dropped.append(t.name)
            continue
        d = decide(recipe, t)
        dt = _torch_dtype(t.dtype)
        if d.spec is None:
            outs = [TensorLayout(t.name, tuple(t.shape), dt)]
        else:
            outs = part_layouts(t.name, d.spec, tuple(t.shape))
        planned.append(TensorPlan(t.name, tuple(t.shape), dtype_name(dt), t.role, d.spec, d.note, outs))
    shards: list[list[TensorPlan]] = []
    size = 0
    for tp in planned:
        if not shards or (size + tp.out_bytes > max_shard_size and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(tp)
        size += tp.out_bytes
    return QuantPlan(recipe, planned, shards, dropped, keep_mtp, max_shard_size)


def quantization_config(plan: QuantPlan, calibration: dict[str, Any] | None = None) -> dict[str, Any]:
    """config.json["quantization_config"] for the plan (the checkpoint contract); `calibration` is the
    method, data and fallbacks of a calibrated run."""
    tensors = {}
    for t in plan.tensors:
        if t.spec is not None:
            tensors[t.name] = {"format": t.spec.format, "group_size": t.spec.group_size,
                               "symmetric": t.spec.symmetric, "shape": list(t.shape), "dtype": t.dtype}
    return {
        "quant_method": QUANT_METHOD,
        "version": QUANT_VERSION,
        "recipe": plan.recipe.to_dict(),
        "mtp": plan.mtp,
        "fallbacks": {t.name: t.note for t in plan.tensors if t.note},
        **({"calibration": calibration} if calibration else {}),
        "tensors": tensors,
    }


def output_config(src_config: dict[str, Any], plan: QuantPlan,
                  calibration: dict[str, Any] | None = None) -> dict[str, Any]:
    cfg = copy.deepcopy(src_config)
    if plan.dropped:
        # The folder holds no MTP weights: say so, so loaders and the planner do not look for them.
        text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
        if "mtp_num_hidden_layers" in text:
            text["mtp_num_hidden_layers"] = 0
    cfg["quantization_config"] = quantization_config(plan, calibration)
    return cfg


# --- measuring ------------------------------------------------------------------------------------------

@dataclass
class TensorStats:
    name: str
    role: str
    format: str
    numel: int
    in_bytes: int
    out_bytes: int
    sq_err: float = 0.0
    sq_ref: float = 0.0
    seconds: float = 0.0
    note: str = ""
    out_err: float = 0.0  # squared output error on held-out calibration activations (with --stats)
    out_ref: float = 0.0
    fallbacks: int = 0  # matrices (experts) rounded to nearest instead of by the calibrated method

    @property
    def rel_error(self) -> float:
        return math.sqrt(self.sq_err / self.sq_ref) if self.sq_ref > 0 else 0.0

    @property
    def sqnr_db(self) -> float:
        if self.sq_err == 0:
            return math.inf
        return 10 * math.log10(self.sq_ref / self.sq_err) if self.sq_ref > 0 else -math.inf

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "role": self.role, "format": self.format, "numel": self.numel,
                "in_bytes": self.in_bytes, "out_bytes": self.out_bytes, "sq_err": self.sq_err,
                "sq_ref": self.sq_ref, "seconds": self.seconds, "note": self.note, "out_err": self.out_err,
                "out_ref": self.out_ref, "fallbacks": self.fallbacks}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TensorStats:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


def _sum_sq(x: torch.Tensor) -> float:
    """Sum of squares of a matrix or stack: fp32 norms per row, their squares summed in float64. As exact as
    one float64 sum (rows are at most a few thousand wide) and cheaper; one fp32 norm over a whole slab
    is not (its fp32 rounding grows with the slab)."""
    rows = torch.linalg.vector_norm(x.reshape(-1, x.shape[-1]), dim=1, dtype=torch.float32)
    return float(rows.double().pow_(2).sum())


def _error_sums(w: torch.Tensor, deq: torch.Tensor) -> tuple[float, float]:
    """(sum of squared error, sum of squared reference); overwrites `deq` (fp32, the caller's to drop)."""
    return _sum_sq(deq.sub_(w)), _sum_sq(w)


# --- running --------------------------------------------------------------------------------------------

@dataclass
class QuantizeOptions:
    recipe: Recipe
    keep_mtp: bool = True  # False: --no-mtp-layer drops the MTP layer
    max_shard_size: int = 2_000_000_000
    mode: str = "new"  # "new", "resume", "overwrite"
    report: Path | None = None
    slab_bytes: int = DEFAULT_SLAB_BYTES
    check_finite: bool = True
    calibration: Calibration | None = None  # --method/--stats (quantize/calibrated.py); None: plain RTN
    threads: int | None = None  # --threads: quantizing workers (None: every physical core); bytes do not depend on it

    def fingerprint_data(self, has_mtp: bool = True) -> dict[str, Any]:
        """What the output bytes depend on (not mode/report/slab size/threads: those do not change them).
        `has_mtp` False (a source without an MTP layer): the MTP choice changes nothing, so it is recorded
        as False, as runs made before the layer was kept by default recorded it, and their journals resume."""
        d = {"recipe": self.recipe.to_dict(), "keep_mtp": self.keep_mtp and has_mtp,
             "max_shard_size": self.max_shard_size}
        if self.calibration is not None and self.calibration.method != "rtn":
            d["calibration"] = self.calibration.fingerprint_data()
        return d


@dataclass
class QuantizeResult:
    out: Path
    plan: QuantPlan
    stats: list[TensorStats]
    seconds: float
    reused_shards: list[str]
    report_md: Path | None
    report_json: Path | None
    copied: list[str] = field(default_factory=list)
    stages: dict[str, float] = field(default_factory=dict)  # seconds per stage (quantize/stream.StageTimes)


class Interrupted(QuantkitError):
    """Raised (instead of KeyboardInterrupt) when a run is stopped; the folder can be resumed."""


def source_fingerprint(ckpt: Any) -> dict[str, Any]:
    """Names, sizes and header hashes of the source files: cheap, and any rewrite of a shard changes it."""
    import hashlib

    files = {}
    for p in sorted({Path(f) for f in ckpt.files}):  # each already under the checkpoint's folder
        with open(p, "rb") as fh:
            head = fh.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else 0
            hdr = fh.read(min(n, 100 << 20))
        files[p.name] = {"size": p.stat().st_size, "header_sha256": hashlib.sha256(head + hdr).hexdigest()}
    return {"config_sha256": fingerprint(ckpt.config), "files": files}


def copyable_files(src: Path) -> list[Path]:
    """Non-weight files of the source folder (tokenizer, chat template, generation config, README...)."""
    out = []
    for p in sorted(src.iterdir()):
        if p.name.startswith(".") or p.name in NOT_COPIED or not p.is_file():
            continue
        if p.suffix.lower() in WEIGHT_SUFFIXES or p.name.endswith(".index.json"):
            continue
        out.append(p)
    return out


def prepare_out(out: Path, mode: str, sources: list[Path], flag: str = "--out ") -> None:
    """The guarded output location (quantkit/outputs.py); "resume" continues quantkit's own run in place."""
    check_not_source(out, sources, flag)
    taken = out.is_dir() and occupied(out)  # a run killed before its journal leaves only temporaries
    if mode == "resume" and taken and not holds_quantize_run(out):
        raise QuantkitError(f"{out} holds no quantkit run to resume (no {JOURNAL_NAME}); pick an empty {flag.strip()}")
    if mode == "new" and taken:
        raise QuantkitError(f"{out} already exists; pass --resume to continue a run or --overwrite to replace it")
    guard_output(out, sources=sources, kind="folder", overwrite=mode != "new", owned=holds_quantize_run,
                 flag=flag, create_parents=True)
    if mode == "overwrite" and taken:
        shutil.rmtree(out)


def _is_report(p: Path) -> bool:
    try:
        with open(p, "rb") as f:
            head = f.read(64)
    except OSError:
        return False
    return head.startswith(b"# quantkit quantization report") or head.startswith(b'{\n  "source"')


def _guard_report(report: Path, src: Path) -> None:
    """A --report outside the output folder: never in the source, never over a file that is not a report."""
    for p in report_paths(report):
        guard_output(p, sources=[src], kind="file", overwrite=True, owned=_is_report, flag="--report ",
                     create_parents=True)


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM stops a run like Ctrl-C does (shards in place, temporaries removed, journal saved)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _chunks(tp: TensorPlan, slab_bytes: int) -> tuple[str, int]:
    """How to stream a tensor: ("experts", n) for fused stacks, ("rows", n) for big matrices (kept ones
    too: they are copied block by block), ("whole", 0)."""
    if tp.spec is None:
        if tp.shape and tp.in_bytes > slab_bytes and tp.shape[0] > 1:
            return ("rows", max(1, slab_bytes // max(tp.in_bytes // tp.shape[0], 1)))
        return ("whole", 0)
    if len(tp.shape) == 3:
        per = tp.in_bytes // tp.shape[0]
        return ("experts", max(1, slab_bytes // max(per, 1)))
    if tp.in_bytes > slab_bytes and rows_chunkable(tp.spec, tp.shape[-1]):
        per = tp.in_bytes // tp.shape[0]
        return ("rows", max(1, slab_bytes // max(per, 1)))
    return ("whole", 0)


def tensor_blocks(tp: TensorPlan, slab_bytes: int) -> list[Block]:
    """The blocks along dim 0 a tensor is read, quantized and written in."""
    mode, n = _chunks(tp, slab_bytes)
    if mode == "whole":
        return [Block(tp.name, 0, tp.shape[0] if tp.shape else 0, True)]
    return [Block(tp.name, s, min(s + n, tp.shape[0]), False) for s in range(0, tp.shape[0], n)]


def _part_rows(tp: TensorPlan, lay: TensorLayout) -> int:
    """Rows of a stored part per row of the input along dim 0 (1 for stacks; more for flattened layouts)."""
    return lay.shape[0] // tp.shape[0] if lay.shape and tp.shape and lay.shape[0] % tp.shape[0] == 0 else 1


def block_layout(tp: TensorPlan, blk: Block) -> list[tuple[str, tuple[int, ...], torch.dtype, int]]:
    """(suffix, shape, dtype, arena offset) of every part of one block, 64-byte aligned in one arena."""
    out, off = [], 0
    for lay in tp.outputs:
        shape = lay.shape if blk.whole else (blk.rows * _part_rows(tp, lay), *lay.shape[1:])
        out.append((lay.name[len(tp.name) + 1:], shape, lay.dtype, off))
        off = align(off + math.prod(shape) * lay.dtype.itemsize)
    return out


def _arena_bytes(tp: TensorPlan, blk: Block) -> int:
    lay = block_layout(tp, blk)
    return max((o + math.prod(sh) * dt.itemsize for _, sh, dt, o in lay), default=0)


@dataclass
class _Pipe:
    """The running stages of one run: the reader, the writer and the output arenas."""

    reader: Reader
    writer: Writer
    arenas: BufferPool
    in_pool: BufferPool
    times: StageTimes


def _quantize_tensor(pipe: _Pipe, tp: TensorPlan, shard: ShardWriter, opts: QuantizeOptions,
                     progress: Progress) -> TensorStats:
    """Quantize (or copy) one tensor, block by block, as the reader hands its blocks over."""
    st = TensorStats(tp.name, tp.role.value, tp.spec.format if tp.spec else tp.dtype, tp.numel, tp.in_bytes,
                     tp.out_bytes, note=tp.note)
    for blk in tensor_blocks(tp, opts.slab_bytes):
        got, w, buf = pipe.reader.get()
        if got != blk:
            raise QuantkitError(f"internal: the reader gave {got}, the quantizer expected {blk}")
        t0 = time.perf_counter()
        _check_shape(tp, w, None if blk.whole else (blk.rows,))
        if opts.check_finite and not _fused(tp, opts.calibration):  # fused: checked from the error sums
            with pipe.times.stage("check finite"):
                check_finite(tp.name, w)
        _emit(pipe, tp, blk, w, buf, shard, st, opts.calibration, opts.check_finite)
        st.seconds += time.perf_counter() - t0
        progress.advance(tp.name, w.numel() * w.element_size(), False)
        del w
    progress.advance(tp.name, 0, True)
    return st


def _check_shape(tp: TensorPlan, w: torch.Tensor, lead: tuple[int, ...] | None = None) -> None:
    want = tp.shape if lead is None else lead + tp.shape[1:]
    if tuple(w.shape) != tuple(want):
        raise QuantkitError(f"{tp.name}: the checkpoint gives shape {tuple(w.shape)}, its header says {want}")


def _fused(tp: TensorPlan, cal: Calibration | None) -> bool:
    """Whether the block goes through the fast path: the format fills buffers and sums its error."""
    return cal is None and tp.spec is not None and getattr(get_format(tp.spec.format), "fills_buffers", False)


def _emit(pipe: _Pipe, tp: TensorPlan, blk: Block, w: torch.Tensor, buf: torch.Tensor | None,
          shard: ShardWriter, st: TensorStats, cal: Calibration | None = None, finite: bool = True) -> None:
    """Quantize (or keep) one block and hand its parts to the writer, which writes them at row
    `blk.start` of each part and frees the buffers after."""
    if tp.spec is None:
        part = w if w.dtype == _torch_dtype(tp.dtype) else w.to(_torch_dtype(tp.dtype))
        with pipe.times.stage("wait for writes"):
            pipe.writer.submit(_write_job(shard, [(tp.name, part, blk.start)], [(pipe.in_pool, buf)], pipe.times))
        return
    fmt = get_format(tp.spec.format)
    arena = None
    if _fused(tp, cal):
        with pipe.times.stage("wait for writes"):
            arena = pipe.arenas.acquire()
        outs = {k: view_as(arena, sh, dt, off) for k, sh, dt, off in block_layout(tp, blk)}
        sums = ErrorSums()
        with pipe.times.stage("quantize"):
            parts = fmt.quantize(w, tp.spec, out=outs, sums=sums)
        e, r = sums.total()
        if finite and not (math.isfinite(e) and math.isfinite(r)):  # NaN/Inf in w make the sums non-finite
            check_finite(tp.name, w)  # names the tensor and counts them (passes on overflow alone)
    else:
        with pipe.times.stage("quantize"):
            parts, e, r = _quantize_slow(tp, blk, w, st, fmt, cal)
    st.sq_err += e
    st.sq_ref += r
    pipe.in_pool.release(buf)  # the source block is no longer needed
    a_of = {o.name: o for o in tp.outputs}
    writes = []
    for suffix, p in parts.items():
        name = f"{tp.name}.{suffix}"
        if name not in a_of:
            raise QuantkitError(f"internal: format {tp.spec.format} made an unplanned part {suffix}")
        writes.append((name, p, blk.start * _part_rows(tp, a_of[name])))
    with pipe.times.stage("wait for writes"):
        pipe.writer.submit(_write_job(shard, writes, [(pipe.arenas, arena)], pipe.times))


def _quantize_slow(tp: TensorPlan, blk: Block, w: torch.Tensor, st: TensorStats, fmt: Any,
                   cal: Calibration | None) -> tuple[dict[str, torch.Tensor], float, float]:
    """Formats without buffers and error sums, and calibrated methods: fresh parts, errors from a dense
    dequantized copy (which the calibrated output error needs anyway)."""
    if cal is None:
        parts = fmt.quantize(w, tp.spec)
    else:
        parts, fallbacks, why = cal.quantize(tp.name, w, blk.start, tp.spec)
        st.fallbacks += fallbacks
        if fallbacks and why:
            st.note = "; ".join(dict.fromkeys(filter(None, [*st.note.split("; "), f"round-to-nearest: {why}"])))
    deq = fmt.dequantize(parts, tp.spec, tuple(w.shape), torch.float32)
    e, r = _error_sums(w, deq)
    if cal is not None and len(tp.shape) >= 2:
        oe, orf = cal.output_error(tp.name, deq, w, blk.start)  # deq now holds the error
        st.out_err += oe
        st.out_ref += orf
    return parts, e, r


def _write_job(shard: ShardWriter, writes: list[tuple[str, torch.Tensor, int]],
               frees: list[tuple[BufferPool, torch.Tensor | None]], times: StageTimes) -> Callable[[], None]:
    def job() -> None:
        try:
            with times.stage("write"):
                for name, t, start in writes:
                    shard.write(name, t, start)
        except OSError as e:  # a full or failing disk: one line, the finished shards stay for --resume
            raise QuantkitError(f"cannot write {shard.path.parent} ({e.strerror or e}); the finished shards are "
                                "kept: free space or fix the disk, then run the same command with --resume") from None
        for pool, b in frees:
            pool.release(b)
    return job


def block_sizes(plan: QuantPlan, names: list[str], reused: list[str], slab_bytes: int) -> tuple[int, int]:
    """(largest block read, largest block's quantized parts) over the shards still to write."""
    b_in = b_out = 0
    for sn, shard in zip(names, plan.shards, strict=True):
        if sn in reused:
            continue
        for tp in shard:
            for blk in tensor_blocks(tp, slab_bytes)[:1]:  # the first block is the largest
                rows = (blk.rows if not blk.whole else (tp.shape[0] if tp.shape else 1)) or 1
                b_in = max(b_in, tp.in_bytes // max(tp.shape[0], 1) * rows if tp.shape else tp.in_bytes)
                if tp.spec is not None:
                    b_out = max(b_out, _arena_bytes(tp, blk))
    return align(b_in), align(b_out)


def peak_bound(b_in: int, b_out: int, threads: int) -> int:
    """Bytes a run may add to the process's RSS (module docstring of quantize/stream.py)."""
    return 2 * b_in + 2 * b_out + threads * CHUNK_TEMP_BYTES + STAGE_OVERHEAD_BYTES


def _run_shards(ckpt: Checkpoint, out: Path, plan: QuantPlan, names: list[str], layouts: list[ShardLayout],
                reused: list[str], opts: QuantizeOptions, progress: Progress, journal: Journal,
                stats_by_shard: dict[str, list[TensorStats]], times: StageTimes,
                check_source: Callable[[], None] | None = None) -> None:
    """Read, quantize and write every shard not reused (quantize/stream.py); the writer thread commits
    each shard, hashes it and records it in the journal while the next one is quantized (after
    `check_source`: every block of the shard has been read by then)."""
    todo = [(sn, shard, lay) for sn, shard, lay in zip(names, plan.shards, layouts, strict=True) if sn not in reused]
    keep_small_allocations()
    b_in, b_out = block_sizes(plan, names, reused, opts.slab_bytes)
    items = [(blk, tp.shape, tp.dtype) for _, shard, _ in todo for tp in shard for blk in tensor_blocks(tp, opts.slab_bytes)]
    writer = Writer()
    state: dict[str, Any] = {}

    def failed() -> BaseException | None:
        return writer.error or (state["reader"].error if "reader" in state else None)

    in_pool = BufferPool(2, b_in, failed)
    reader = state["reader"] = Reader(ckpt, items, in_pool, lambda n, w, shape: _check_shape(
        next(tp for _, sh, _ in todo for tp in sh if tp.name == n), w), times)
    pipe = _Pipe(reader, writer, BufferPool(2, b_out, failed), in_pool, times)
    open_shards: list[ShardWriter] = []
    try:
        for sn, shard, lay in todo:
            w = ShardWriter(out / sn, lay)
            open_shards.append(w)
            shard_stats = [_quantize_tensor(pipe, tp, w, opts, progress) for tp in shard]
            writer.submit(commit_job(out, sn, w, shard_stats, journal, stats_by_shard, times, check_source))
        with times.stage("wait for writes"):
            writer.finish()
    except BaseException:
        reader.close()
        pipe.arenas.closed.set()
        writer.abandon()
        for w in open_shards:
            w.abort()
        raise
    reader.close()


def _finish_and_hash(w: ShardWriter, times: StageTimes) -> FileEntry:
    """fsync the finished temporary on one thread while hashing it (from the page cache) on this one: the
    last shard's fsync and sha256 are the run's tail, and they wait on different things (disk, CPU)."""
    err: list[BaseException] = []

    def sync() -> None:
        try:
            with times.stage("fsync"):
                w.finish()
        except BaseException as e:  # raised below, on the writer thread
            err.append(e)

    t = threading.Thread(target=sync, name="quantkit-fsync", daemon=True)
    t.start()
    try:
        with times.stage("sha256"):
            digest = _sha256(w.tmp)
    finally:
        t.join()
    if err:
        raise err[0]
    return FileEntry(w.tmp.stat().st_size, digest)


def _sha256(path: Path, chunk: int = 4 << 20) -> str:
    """sha256 of a file, read into one reused buffer (a fresh 8 MiB bytes object per read was a fresh mapping)."""
    h = hashlib.sha256()
    buf = bytearray(chunk)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(view):
            h.update(view[:n])
    return h.hexdigest()


def commit_job(out: Path, sn: str, w: ShardWriter, shard_stats: list[TensorStats], journal: Journal,
                stats_by_shard: dict[str, list[TensorStats]], times: StageTimes,
                check_source: Callable[[], None] | None = None) -> Callable[[], None]:
    def job() -> None:
        # journal first, rename second: a kill between leaves a journaled name with no file (resume redoes
        # it), never a finished-looking shard that no record lists
        entry = _finish_and_hash(w, times)
        if check_source is not None:  # a source changed since it was opened: this shard is not recorded
            check_source()
        journal.done[sn] = entry
        journal.stats[sn] = [s.to_dict() for s in shard_stats]
        stats_by_shard[sn] = shard_stats
        journal.save(out)
        w.publish()
    return job


def open_journal(out: Path, mode: str, key: str, names: list[str], layouts: list[ShardLayout],
                 extra_bytes: int, need_stats: bool = True,
                 other_keys: dict[str, str] | None = None,
                 sources: dict[str, list[int]] | None = None) -> tuple[Journal, list[str]]:
    """The run's journal in `out` (a fresh one, or the interrupted run's when `key` matches) and the finished
    shards it lists that still check out (size and sha256); free disk for the rest is checked, leftover
    temporaries are removed. Refuses a finished folder under "resume" and another run's journal. `need_stats`:
    a shard is reused only with its recorded statistics (the quantizer's report needs them). `other_keys`:
    the keys of runs that differ by one known option, each with the refusal that names it. `sources`: the source
    files' identities (quantize/source_guard.py); shards an interrupted run read from files that have changed
    since (same header, other bytes maybe: a restored or re-downloaded copy) are not reused."""
    journal = Journal.load(out) if out.is_dir() else None
    if mode == "resume" and (out / MANIFEST_NAME).is_file() and journal is None:
        raise QuantkitError(f"{out} is already complete; check it with `quantkit verify {out}`")
    if journal is not None and journal.key != key and journal.key in (other_keys or {}):
        raise QuantkitError((other_keys or {})[journal.key])
    if journal is not None and journal.key != key:
        raise QuantkitError(
            f"{out} holds an interrupted run of a different source or different options; "
            "rerun with the same options, or pass --overwrite"
        )
    journal = journal or Journal(key)
    if sources is not None:
        if journal.sources and journal.sources != sources:
            journal.done.clear()
            journal.stats.clear()
        journal.sources = dict(sources)
    # Reuse finished shards only after checking them; anything else is rewritten.
    reused: list[str] = []
    for sn in list(journal.done):
        if sn in names and (sn in journal.stats or not need_stats) and check_file(out, sn, journal.done[sn]) is None:
            reused.append(sn)
        else:
            journal.done.pop(sn, None)
            journal.stats.pop(sn, None)
    need = sum(lay.size for sn, lay in zip(names, layouts, strict=True) if sn not in reused) + extra_bytes
    check_free(out, need, "--out ")
    out.mkdir(parents=True, exist_ok=True)
    for p in out.glob(".*.tmp"):
        p.unlink()
    journal.save(out)
    return journal, reused


def write_folder_files(out: Path, plan: QuantPlan, layouts: list[ShardLayout], config: dict[str, Any],
                       copies: list[Path], journal: Journal) -> dict[str, FileEntry]:
    """Copy `copies` (tokenizer, ...) in, write the index and config.json, each atomically; their entries. The
    journal lists them first, so a run killed among them is still resumable (the output guard refuses files no
    record lists)."""
    journal.files = sorted({p.name for p in copies} | {INDEX_NAME, "config.json"})
    journal.save(out)
    files: dict[str, FileEntry] = {}
    for p in copies:
        dst = out / p.name
        tmp = temp_name(dst)
        shutil.copyfile(p, tmp)
        os.replace(tmp, dst)
        files[p.name] = file_entry(dst)
    index = {"metadata": {"total_size": sum(lay.data_bytes for lay in layouts), "format": "quantkit"},
             "weight_map": dict(sorted(plan.weight_map().items()))}
    atomic_write_json(out / INDEX_NAME, index)
    atomic_write_json(out / "config.json", config)
    for n in (INDEX_NAME, "config.json"):
        files[n] = file_entry(out / n)
    return files


def seal_folder(out: Path, names: list[str], journal: Journal, files: dict[str, FileEntry], source: dict[str, Any],
                options: dict[str, Any]) -> None:
    """The manifest, written last (a folder without it is not finished); the journal goes after it."""
    Manifest(shards={sn: journal.done[sn] for sn in names}, files=files, source=source, options=options).write(out)
    (out / JOURNAL_NAME).unlink(missing_ok=True)
    fsync_dir(out)


def _run_key(src_fp: dict[str, Any], opts: QuantizeOptions, has_mtp: bool, layouts: list[ShardLayout]) -> str:
    """The journal key: the source, the options the bytes depend on and the shard plan."""
    return fingerprint({"source": src_fp, "options": opts.fingerprint_data(has_mtp),
                        "shards": [lay.header.hex() for lay in layouts]})


def run_quantize(ckpt: Checkpoint, out: Path, opts: QuantizeOptions, progress: Progress | None = None) -> QuantizeResult:
    """Quantize an opened Checkpoint into `out` (see the module docstring for the guarantees)."""
    progress = progress or NoProgress()
    t_start = time.perf_counter()
    src = Path(ckpt.path)
    guard = SourceGuard.of(ckpt)
    ckpt.spec()  # the model validated by the rules plan, inspect and verify apply, before anything is written
    plan = make_plan(list(ckpt.canonical()), opts.recipe, opts.keep_mtp, opts.max_shard_size)
    if opts.calibration is not None and opts.calibration.stats is not None:
        opts.calibration.stats.check_model(ckpt)
    if opts.report is not None:
        _guard_report(Path(opts.report), src)
    prepare_out(out, opts.mode, [src])
    layouts = plan.layouts()
    names = plan.shard_names
    src_fp = source_fingerprint(ckpt)
    has_mtp = plan.mtp != "absent"
    key = _run_key(src_fp, opts, has_mtp, layouts)
    other_keys = {}
    if has_mtp:  # a run with the other MTP choice (runs begun when dropping was the default) is named
        other = replace(opts, keep_mtp=not opts.keep_mtp)
        other_plan = make_plan(list(ckpt.canonical()), other.recipe, other.keep_mtp, other.max_shard_size)
        was = "dropped the MTP layer (--no-mtp-layer, the old default)" if opts.keep_mtp else "kept the MTP layer"
        other_keys[_run_key(src_fp, other, True, other_plan.layouts())] = (
            f"{out} holds an interrupted run that {was}; resume it "
            f"{'with --no-mtp-layer' if opts.keep_mtp else 'without --no-mtp-layer'}, or pass --overwrite to start again")

    copies = copyable_files(src)
    journal, reused = open_journal(out, opts.mode, key, names, layouts,
                                   sum(p.stat().st_size for p in copies) + (1 << 20), other_keys=other_keys,
                                   sources=guard.record())
    stats_by_shard: dict[str, list[TensorStats]] = {
        k: [TensorStats.from_dict(d) for d in v] for k, v in journal.stats.items() if k in reused
    }

    todo_bytes = sum(t.in_bytes for sn, s in zip(names, plan.shards, strict=True) if sn not in reused for t in s)
    progress.start(sum(len(s) for sn, s in zip(names, plan.shards, strict=True) if sn not in reused), todo_bytes)
    times = StageTimes()
    try:
        with torch_threads(resolve_threads(opts.threads)), sigterm_as_interrupt():
            _run_shards(ckpt, out, plan, names, layouts, reused, opts, progress, journal, stats_by_shard, times,
                        guard.check)
    except KeyboardInterrupt:
        for p in out.glob(".*.tmp"):
            p.unlink(missing_ok=True)
        raise Interrupted(
            f"interrupted: {len(journal.done)} of {plural(len(names), 'shard')} finished in {out}; "
            "run the same command with --resume to continue"
        ) from None

    # Everything below is small; the manifest goes last, each after the source is checked unchanged.
    guard.check()
    stats = [s for sn in names for s in stats_by_shard[sn]]
    cal = None
    if opts.calibration is not None:
        cal = {**opts.calibration.config(),
               "rtn_fallbacks": {s.name: {"matrices": s.fallbacks, "why": s.note} for s in stats if s.fallbacks}}
    files = write_folder_files(out, plan, layouts, output_config(ckpt.config, plan, cal), copies, journal)
    copied = [p.name for p in copies]
    seconds = time.perf_counter() - t_start
    md, js = write_report(opts.report or (out / f"{REPORT_STEM}.md"), plan, stats, seconds, src, out, reused, cal)
    guard.check()
    seal_folder(out, names, journal, files, {"path": str(src), **src_fp}, opts.fingerprint_data(has_mtp))
    return QuantizeResult(out, plan, stats, seconds, reused, md, js, copied, times.seconds)


def check_output_shards(out: Path, plan: QuantPlan) -> list[str]:
    """Problems where the shards' headers differ from the plan (used by tests and verify)."""
    problems = []
    for sn, lay in zip(plan.shard_names, plan.layouts(), strict=True):
        hdr = read_header(out / sn)
        want = {t.name for t in lay.tensors}
        if set(hdr) != want:
            problems.append(f"{sn}: tensors differ from the plan")
    return problems


__all__ = ["QuantizeOptions", "QuantizeResult", "Interrupted", "make_plan", "run_quantize", "part_layouts",
           "quantization_config", "role_of"]
