"""The streaming quantizer: a source checkpoint in, a quantized HF-style folder out, in bounded memory.

Flow: `make_plan` decides every tensor (recipe + eligibility), works out the exact shape and dtype of
every output part and assigns tensors to shards of bounded size, so shard names, headers and the total
output size are known before any weight is read. `run_quantize` then streams: one tensor (fused expert
stacks: one slab of experts; big matrices: one block of rows) is read, quantized, measured and written
to its offset in the shard being written, then freed. Shards are written under temporary names and
renamed; a journal records each finished shard (size, sha256) so `--resume` reuses them; the manifest
is written last. Output bytes depend only on the source and the options (no timestamps), so a resumed
run is byte-identical to an uninterrupted one.

The default 4-bit recipe (`quality` in quantkit/recipe.py) keeps lm_head at int8: measured on the
realistic-shape checkpoint (reports/bench-quantize.md), int4 g128 on lm_head has ~20x the weight error
of int8 and the logits' error grows accordingly, for a saving of 0.24 GB out of ~19 GB. The embedding
stays bf16: it is gathered one row per token, so its bits do not cost bandwidth.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from quantkit.errors import QuantkitError
from quantkit.fileio import atomic_write_json, fsync_dir, temp_name
from quantkit.formats import QuantSpec, get_format, stored_parts
from quantkit.model.checkpoint import Checkpoint, check_finite
from quantkit.model.contract import INDEX_NAME, QUANT_METHOD, QUANT_VERSION, holds_quantize_run
from quantkit.model.spec import Role, TensorSpec, role_of
from quantkit.outputs import check_free, check_not_source, guard_output
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
from quantkit.quantize.shards import ShardLayout, ShardWriter, TensorLayout, dtype_name, read_header
from quantkit.recipe import Recipe, decide

REPORT_STEM = "quantkit-report"
# Input bytes per slab of experts / block of rows. Measured on a 256 MB bf16 slab of experts: int4's
# dequantize for the error figures peaks at 6x the input (fp32 result plus its temporaries), int8's at 4.5x;
# a 64 MB slab keeps that under 0.5 GB whatever the tensor size, and is still large enough to run at full speed.
DEFAULT_SLAB_BYTES = 64 << 20
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


def make_plan(tensors: list[TensorSpec], recipe: Recipe, keep_mtp: bool = False,
              max_shard_size: int = 2_000_000_000) -> QuantPlan:
    """Decide every tensor and place it in a shard (greedy in checkpoint order; a tensor larger than the
    shard size gets a shard of its own)."""
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
        "mtp": "kept" if plan.keep_mtp else ("dropped" if plan.dropped else "absent"),
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
    one float64 sum (rows are at most a few thousand wide) and 3x faster; one fp32 norm over a whole slab
    is not (3% off on 134M elements, measured)."""
    rows = torch.linalg.vector_norm(x.reshape(-1, x.shape[-1]), dim=1, dtype=torch.float32)
    return float(rows.double().pow_(2).sum())


def _error_sums(w: torch.Tensor, deq: torch.Tensor) -> tuple[float, float]:
    """(sum of squared error, sum of squared reference); overwrites `deq` (fp32, the caller's to drop)."""
    return _sum_sq(deq.sub_(w)), _sum_sq(w)


# --- running --------------------------------------------------------------------------------------------

@dataclass
class QuantizeOptions:
    recipe: Recipe
    keep_mtp: bool = False
    max_shard_size: int = 2_000_000_000
    mode: str = "new"  # "new", "resume", "overwrite"
    report: Path | None = None
    slab_bytes: int = DEFAULT_SLAB_BYTES
    check_finite: bool = True
    calibration: Calibration | None = None  # --method/--stats (quantize/calibrated.py); None: plain RTN

    def fingerprint_data(self) -> dict[str, Any]:
        """What the output bytes depend on (not mode/report/slab size: those do not change them)."""
        d = {"recipe": self.recipe.to_dict(), "keep_mtp": self.keep_mtp, "max_shard_size": self.max_shard_size}
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


def _prepare_out(src: Path, out: Path, mode: str) -> None:
    """The guarded output location (quantkit/outputs.py); --resume continues quantkit's own run in place."""
    check_not_source(out, [src], "--out ")
    resuming = mode == "resume" and out.is_dir() and any(out.iterdir())
    if resuming and not holds_quantize_run(out):
        raise QuantkitError(f"{out} holds no quantkit run to resume (no {JOURNAL_NAME}); pick an empty --out")
    if mode == "new" and out.is_dir() and any(out.iterdir()):
        raise QuantkitError(f"{out} already exists; pass --resume to continue a run or --overwrite to replace it")
    guard_output(out, sources=[src], kind="folder", overwrite=mode != "new", owned=holds_quantize_run,
                 flag="--out ", create_parents=True)
    if mode == "overwrite" and out.is_dir() and any(out.iterdir()):
        shutil.rmtree(out)


def report_paths(report: Path) -> tuple[Path, Path]:
    """The report's markdown and JSON paths (the JSON beside the markdown, same stem)."""
    if report.suffix.lower() == ".json":
        return report.with_suffix(".md"), report
    return report.with_suffix(".md") if report.suffix.lower() != ".md" else report, report.with_suffix(".json")


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
def _sigterm_as_interrupt() -> Iterator[None]:
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
    """How to stream a tensor: ("experts", n) for fused stacks, ("rows", n) for big matrices, ("whole", 0)."""
    if tp.spec is None:
        return ("whole", 0)
    if len(tp.shape) == 3:
        per = tp.in_bytes // tp.shape[0]
        return ("experts", max(1, slab_bytes // max(per, 1)))
    if tp.in_bytes > slab_bytes and rows_chunkable(tp.spec, tp.shape[-1]):
        per = tp.in_bytes // tp.shape[0]
        return ("rows", max(1, slab_bytes // max(per, 1)))
    return ("whole", 0)


def _quantize_tensor(ckpt: Checkpoint, tp: TensorPlan, writer: ShardWriter, opts: QuantizeOptions,
                     progress: Progress) -> TensorStats:
    t0 = time.perf_counter()
    st = TensorStats(tp.name, tp.role.value, tp.spec.format if tp.spec else tp.dtype, tp.numel, tp.in_bytes,
                     tp.out_bytes, note=tp.note)
    mode, n = _chunks(tp, opts.slab_bytes)
    if mode == "whole":
        w = ckpt.load(tp.name)
        _check_shape(tp, w)
        if opts.check_finite:
            check_finite(tp.name, w)
        _emit(tp, w, 0, writer, st, opts.calibration)
        progress.advance(tp.name, tp.in_bytes, False)
    elif mode == "experts":
        for e0 in range(0, tp.shape[0], n):
            w = ckpt.load(tp.name, experts=slice(e0, min(e0 + n, tp.shape[0])))
            _check_shape(tp, w, lead=(min(n, tp.shape[0] - e0),))
            if opts.check_finite:
                check_finite(tp.name, w)
            _emit(tp, w, e0, writer, st, opts.calibration)
            progress.advance(tp.name, w.numel() * w.element_size(), False)
            del w
    else:
        full = ckpt.load(tp.name)
        _check_shape(tp, full)
        if opts.check_finite:
            check_finite(tp.name, full)
        for r0 in range(0, tp.shape[0], n):
            w = full[r0:r0 + n]
            _emit(tp, w, r0, writer, st, opts.calibration)
            progress.advance(tp.name, w.numel() * w.element_size(), False)
        del full
    st.seconds = time.perf_counter() - t0
    progress.advance(tp.name, 0, True)
    return st


def _check_shape(tp: TensorPlan, w: torch.Tensor, lead: tuple[int, ...] | None = None) -> None:
    want = tp.shape if lead is None else lead + tp.shape[1:]
    if tuple(w.shape) != tuple(want):
        raise QuantkitError(f"{tp.name}: the checkpoint gives shape {tuple(w.shape)}, its header says {want}")


def _emit(tp: TensorPlan, w: torch.Tensor, start: int, writer: ShardWriter, st: TensorStats,
          cal: Calibration | None = None) -> None:
    """Quantize (or keep) one block along dim 0 and write it at row `start` of each part."""
    if tp.spec is None:
        writer.write(tp.name, w.to(_torch_dtype(tp.dtype)), start)
        return
    fmt = get_format(tp.spec.format)
    if cal is None:
        parts = fmt.quantize(w, tp.spec)
    else:
        parts, fallbacks, why = cal.quantize(tp.name, w, start, tp.spec)
        st.fallbacks += fallbacks
        if fallbacks and why:
            st.note = "; ".join(dict.fromkeys(filter(None, [*st.note.split("; "), f"round-to-nearest: {why}"])))
    deq = fmt.dequantize(parts, tp.spec, tuple(w.shape), torch.float32)
    e, r = _error_sums(w, deq)
    st.sq_err += e
    st.sq_ref += r
    if cal is not None and len(tp.shape) >= 2:
        oe, orf = cal.output_error(tp.name, deq, w, start)  # deq now holds the error
        st.out_err += oe
        st.out_ref += orf
    del deq
    a_of = {o.name: o for o in tp.outputs}
    for suffix, p in parts.items():
        name = f"{tp.name}.{suffix}"
        if name not in a_of:
            raise QuantkitError(f"internal: format {tp.spec.format} made an unplanned part {suffix}")
        # rows of a part per row of input along dim 0 (1 for expert stacks; a for flattened layouts)
        full0 = a_of[name].shape[0]
        scale = full0 // tp.shape[0] if full0 % tp.shape[0] == 0 else 1
        writer.write(name, p, start * scale)


def run_quantize(ckpt: Checkpoint, out: Path, opts: QuantizeOptions, progress: Progress | None = None) -> QuantizeResult:
    """Quantize an opened Checkpoint into `out` (see the module docstring for the guarantees)."""
    progress = progress or NoProgress()
    t_start = time.perf_counter()
    src = Path(ckpt.path)
    plan = make_plan(list(ckpt.canonical()), opts.recipe, opts.keep_mtp, opts.max_shard_size)
    if opts.calibration is not None and opts.calibration.stats is not None:
        opts.calibration.stats.check_model(ckpt)
    if opts.report is not None:
        _guard_report(Path(opts.report), src)
    _prepare_out(src, out, opts.mode)
    layouts = plan.layouts()
    names = plan.shard_names
    src_fp = source_fingerprint(ckpt)
    key = fingerprint({"source": src_fp, "options": opts.fingerprint_data(),
                       "shards": [lay.header.hex() for lay in layouts]})

    journal = Journal.load(out) if out.is_dir() else None
    if opts.mode == "resume" and (out / MANIFEST_NAME).is_file() and journal is None:
        raise QuantkitError(f"{out} is already complete; check it with `quantkit verify {out}`")
    if journal is not None and journal.key != key:
        raise QuantkitError(
            f"{out} holds an interrupted run of a different source or different options; "
            "rerun with the same options, or pass --overwrite"
        )
    journal = journal or Journal(key)
    stats_by_shard: dict[str, list[TensorStats]] = {
        k: [TensorStats.from_dict(d) for d in v] for k, v in journal.stats.items()
    }

    # Reuse finished shards only after checking them; anything else is rewritten.
    reused: list[str] = []
    for sn in list(journal.done):
        if sn in names and check_file(out, sn, journal.done[sn]) is None and sn in stats_by_shard:
            reused.append(sn)
        else:
            journal.done.pop(sn, None)
            stats_by_shard.pop(sn, None)
    copies = copyable_files(src)
    need = sum(lay.size for sn, lay in zip(names, layouts, strict=True) if sn not in reused)
    need += sum(p.stat().st_size for p in copies) + (1 << 20)
    check_free(out, need, "--out ")
    out.mkdir(parents=True, exist_ok=True)
    for p in out.glob(".*.tmp"):
        p.unlink()
    journal.stats = {k: [s.to_dict() for s in v] for k, v in stats_by_shard.items()}
    journal.save(out)

    todo_bytes = sum(t.in_bytes for sn, s in zip(names, plan.shards, strict=True) if sn not in reused for t in s)
    progress.start(sum(len(s) for sn, s in zip(names, plan.shards, strict=True) if sn not in reused), todo_bytes)
    try:
        with _sigterm_as_interrupt():
            for sn, shard, lay in zip(names, plan.shards, layouts, strict=True):
                if sn in reused:
                    continue
                with ShardWriter(out / sn, lay) as w:
                    shard_stats = []
                    for tp in shard:
                        shard_stats.append(_quantize_tensor(ckpt, tp, w, opts, progress))
                        # unmap the source files: pages read through safetensors' mmap would otherwise
                        # stay resident until the end, and RSS would grow to the size of the checkpoint
                        ckpt.close()
                    w.commit()
                journal.done[sn] = file_entry(out / sn)
                journal.stats[sn] = [s.to_dict() for s in shard_stats]
                stats_by_shard[sn] = shard_stats
                journal.save(out)
    except KeyboardInterrupt:
        for p in out.glob(".*.tmp"):
            p.unlink(missing_ok=True)
        raise Interrupted(
            f"interrupted: {len(journal.done)} of {len(names)} shards are finished in {out}; "
            "run the same command with --resume to continue"
        ) from None

    # Everything below is small; the manifest goes last.
    files: dict[str, FileEntry] = {}
    copied = []
    for p in copies:
        dst = out / p.name
        tmp = temp_name(dst)
        shutil.copyfile(p, tmp)
        os.replace(tmp, dst)
        files[p.name] = file_entry(dst)
        copied.append(p.name)
    index = {"metadata": {"total_size": sum(lay.data_bytes for lay in layouts), "format": "quantkit"},
             "weight_map": dict(sorted(plan.weight_map().items()))}
    atomic_write_json(out / INDEX_NAME, index)
    stats = [s for sn in names for s in stats_by_shard[sn]]
    cal = None
    if opts.calibration is not None:
        cal = {**opts.calibration.config(),
               "rtn_fallbacks": {s.name: {"matrices": s.fallbacks, "why": s.note} for s in stats if s.fallbacks}}
    atomic_write_json(out / "config.json", output_config(ckpt.config, plan, cal))
    for n in (INDEX_NAME, "config.json"):
        files[n] = file_entry(out / n)
    seconds = time.perf_counter() - t_start
    from quantkit.quantize.report import write_report  # lazy: report imports this module

    md, js = write_report(opts.report or (out / f"{REPORT_STEM}.md"), plan, stats, seconds, src, out, reused, cal)
    Manifest(
        shards={sn: journal.done[sn] for sn in names},
        files=files,
        source={"path": str(src), **src_fp},
        options=opts.fingerprint_data(),
    ).write(out)
    (out / JOURNAL_NAME).unlink(missing_ok=True)
    fsync_dir(out)
    return QuantizeResult(out, plan, stats, seconds, reused, md, js, copied)


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
