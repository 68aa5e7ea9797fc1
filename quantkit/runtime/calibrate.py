"""`quantkit calibrate`: measure what quantkit's CPU runtime costs on this host, part by part, for the
planner (quantkit/planner/host_costs.py says how the parts compose).

Two measurements, each in isolation, on random weights of the model's real dimensions:

- kernels: for every (format, matrix shape) the recipes use, one prepared kernel is copied until the
  copies exceed `working_set` bytes (256 MiB: above the last-level cache of desktop and most server
  CPUs, so each call reads its weights from DRAM as in a real model; `--working-set` raises it), then batch-1 calls cycle over the copies; the best of
  `passes` passes, per call. Matrices taller than `ROW_CAP` rows (the lm_head) are timed on a slab of
  `ROW_CAP` rows and scaled by rows: one large matrix is a steady stream.
- layer ops: the runtime's own model (transformers' skeleton filled by quantkit's loader) with one
  layer of each type, the real expert count and a small vocabulary, every kernel call replaced by a
  stub that returns zeros; matrices are `torch.empty` (never touched, so no memory). Decode steps
  run the path generation runs (the lean step of quantkit.runtime.decode_step unless
  QUANTKIT_LEAN_DECODE=0, else transformers' forward) and are timed per decoder layer; the rest of a
  step is the shell. The greedy argmax
  over the real vocabulary is timed on its own.
"""

from __future__ import annotations

import copy
import math
import time
import types
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from statistics import median
from typing import Any

import torch

from quantkit.formats import QuantSpec, get_format
from quantkit.model.spec import ModelSpec, Role, spec_from_config
from quantkit.planner.host_costs import (
    RuntimeProfile,
    host_id,
    model_dims,
    needed,
    shape_key,
)
from quantkit.recipe import Recipe
from quantkit.runtime import decode_step, linear_attn
from quantkit.runtime import kernels as K
from quantkit.runtime.loader import LoadReport, Placement, TensorSource, build_skeleton, populate

ROW_CAP = 16384
WORKING_SET = 256 << 20
MAX_COPIES = 1024
CAL_VOCAB = 1024


def time_kernel(q: QuantSpec | None, shape: tuple[int, int], working_set: int = WORKING_SET, passes: int = 3,
                seed: int = 0) -> tuple[float, dict[str, Any]]:
    """Seconds per batch-1 call of the runtime's kernel for a matrix of format `q` and `shape`, weights
    out of cache."""
    rows, cols = shape
    rows_cal = min(rows, ROW_CAP)
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(rows_cal, cols, generator=g) * 0.02).to(torch.bfloat16)
    parts = w if q is None else get_format(q.format).quantize(w, q)
    k = K.prepare(parts, q, (rows_cal, cols))
    del w, parts
    n = max(2, min(MAX_COPIES, math.ceil(working_set / max(1, k.nbytes))))
    copies = [k] + [_clone(k) for _ in range(n - 1)]
    x = torch.randn(1, cols, generator=g).to(torch.bfloat16)
    best = float("inf")
    with torch.inference_mode():
        for kk in copies:  # warm-up: first-call allocations, thread pool
            kk(x)
        for _ in range(passes):
            t0 = time.perf_counter()
            for kk in copies:
                kk(x)
            best = min(best, (time.perf_counter() - t0) / n)
    sec = best * rows / rows_cal
    return sec, {"route": k.route, "copies": n, "bytes_each": k.nbytes, "rows_timed": rows_cal}


def _clone(k: K.Kernel) -> K.Kernel:
    """A copy of a prepared kernel with its own weight memory (module references are shared)."""
    return copy.deepcopy(k, {id(v): v for v in vars(k).values() if isinstance(v, types.ModuleType)})


class RandomSource(TensorSource):
    """Random small tensors where the model reads values (norms, router, conv, embedding); untouched
    `torch.empty` matrices where only a (stubbed) kernel would read them."""

    def __init__(self, spec: ModelSpec, seed: int = 0):
        self.tensors = {t.name: t for t in spec.tensors}
        self.g = torch.Generator().manual_seed(seed)

    def has(self, name: str) -> bool:
        return name in self.tensors

    def spec(self, name: str) -> tuple[QuantSpec | None, tuple[int, ...]]:
        return None, tuple(self.tensors[name].shape)

    def read(self, name: str, device: str, experts: slice | None = None) -> torch.Tensor:
        t = self.tensors[name]
        shape = list(t.shape)
        if experts is not None:
            shape[0] = experts.stop - experts.start
        kernel_only = t.is_matrix and t.role not in (Role.ROUTER, Role.EMBEDDING)
        if kernel_only:
            return torch.empty(shape, dtype=torch.bfloat16, device=device)
        return (torch.randn(shape, generator=self.g) * 0.02).to(torch.bfloat16).to(device)


def calibration_config(config: dict[str, Any]) -> dict[str, Any]:
    """The model's config cut to its first layers up to one of each layer type, a small vocabulary,
    no MTP: the same layers, experts and heads."""
    cfg = copy.deepcopy(config)
    tc = cfg.get("text_config", cfg)
    kinds = list(tc["layer_types"])
    n = next(i + 1 for i in range(len(kinds)) if set(kinds[:i + 1]) == set(kinds))
    tc["layer_types"] = kinds[:n]
    tc["num_hidden_layers"] = n
    tc["vocab_size"] = CAL_VOCAB
    tc["mtp_num_hidden_layers"] = 0
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if isinstance(tc.get(key), int) and tc[key] >= CAL_VOCAB:
            tc[key] = CAL_VOCAB - 1
    return cfg


class _StubbedKernels:
    """Within the block every Kernel call returns a cached zero tensor (one per kernel and row count)."""

    def __enter__(self) -> _StubbedKernels:
        self.saved: dict[type, Any] = {}
        todo = [K.Kernel]
        while todo:
            cls = todo.pop()
            todo += cls.__subclasses__()
            if "__call__" in cls.__dict__:
                self.saved[cls] = cls.__dict__["__call__"]
                cls.__call__ = _stub  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: Any) -> None:
        for cls, fn in self.saved.items():
            cls.__call__ = fn  # type: ignore[method-assign]


def _stub(self: Any, x: torch.Tensor) -> torch.Tensor:
    cache = self.__dict__.setdefault("_stub_out", {})
    key = (x.shape[0], x.dtype)
    if key not in cache:
        cache[key] = torch.zeros(x.shape[0], self.out_features, dtype=x.dtype, device=x.device)
    return cache[key]


def _transformers_steps(model: Any, cache: Any, steps: int, _prompt: int) -> Iterator[tuple[list[float], float]]:
    """Decode steps through transformers' forward: (seconds per decoder layer, seconds of the step)."""
    layers = model.model.layers
    start = [0.0] * len(layers)
    took = [0.0] * len(layers)

    def pre(i: int) -> Callable:
        def hook(*_a: Any, **_k: Any) -> None:
            start[i] = time.perf_counter()
        return hook

    def post(i: int) -> Callable:
        def hook(*_a: Any, **_k: Any) -> None:
            took[i] = time.perf_counter() - start[i]
        return hook

    handles = []
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(pre(i), prepend=True))
        handles.append(layer.register_forward_hook(post(i)))
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            model(input_ids=torch.zeros(1, 1, dtype=torch.long), cache=cache, use_cache=True, logits_to_keep=1)
            yield list(took), time.perf_counter() - t0
    finally:
        for h in handles:
            h.remove()


def _lean_steps(model: Any, cache: Any, steps: int, prompt: int) -> Iterator[tuple[list[float], float]]:
    """Decode steps through the lean step generation uses (quantkit.runtime.decode_step)."""
    dec = decode_step.LeanDecoder(model)
    dec.begin(cache, prompt + steps + 1)
    took = [0.0] * len(dec.layers)
    layer = dec._layer

    def timed(L: Any, *args: Any) -> torch.Tensor:
        t0 = time.perf_counter()
        y = layer(L, *args)
        took[L.index] = time.perf_counter() - t0
        return y

    dec._layer = timed  # type: ignore[method-assign]
    for _ in range(steps):
        t0 = time.perf_counter()
        dec.step(torch.zeros(1, 1, dtype=torch.long))
        yield list(took), time.perf_counter() - t0


def time_layer_ops(config: dict[str, Any], steps: int = 24, prompt: int = 8,
                   lean: bool | None = None) -> tuple[dict[str, float], float, dict]:
    """Per layer type, seconds of one decode step with kernels stubbed; and the shell's seconds. `lean`:
    time the step generation runs (quantkit.runtime.decode_step, unless QUANTKIT_LEAN_DECODE=0 when None),
    else transformers' forward."""
    from transformers import DynamicCache


    cal = calibration_config(config)
    spec = spec_from_config(cal, name="calibration")
    c = spec.config
    linear_attn.install()
    model = build_skeleton(cal)
    src = RandomSource(spec)
    populate(model, src, Placement.single(c.num_hidden_layers, c.num_experts), LoadReport())
    model.eval()
    layers = model.model.layers
    per_layer: list[list[float]] = [[] for _ in layers]
    shell: list[float] = []
    with _StubbedKernels(), torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(input_ids=torch.zeros(1, prompt, dtype=torch.long), cache=cache, use_cache=True, logits_to_keep=1)
        use_lean = decode_step.enabled_by_env() if lean is None else lean
        run = _lean_steps if use_lean else _transformers_steps
        for took, total in run(model, cache, steps + 4, prompt):
            for i in range(len(layers)):
                per_layer[i].append(took[i])
            shell.append(total - sum(took))
    per_layer = [v[4:] for v in per_layer]  # warm-up
    shell = shell[4:]
    by_type: dict[str, list[float]] = {}
    for i, t in enumerate(c.layer_types):
        by_type.setdefault(t, []).extend(per_layer[i])
    ops = {t: median(v) for t, v in by_type.items()}
    detail = {t: {"median_ms": round(median(v) * 1e3, 4), "min_ms": round(min(v) * 1e3, 4),
                  "max_ms": round(max(v) * 1e3, 4), "samples": len(v)} for t, v in by_type.items()}
    detail["shell"] = {"median_ms": round(median(shell) * 1e3, 4), "samples": len(shell)}
    detail["path"] = {"step": "lean" if use_lean else "transformers"}
    return ops, median(shell), detail


def time_argmax(vocab: int, reps: int = 50) -> float:
    """Seconds of the greedy pick over one row of bf16 logits (what a greedy decode step does)."""
    logits = torch.randn(1, 1, vocab).to(torch.bfloat16)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        int(logits[0, -1].argmax())
        best = min(best, time.perf_counter() - t0)
    return best


def calibrate(spec: ModelSpec, recipes: list[Recipe], *, working_set: int = WORKING_SET, passes: int = 3,
              steps: int = 24, on_item: Callable[[str, int, int], None] | None = None) -> RuntimeProfile:
    """Measure a RuntimeProfile for `spec` and the kernels `recipes` use, on this host."""
    t_all = time.perf_counter()
    want = needed(spec, recipes)
    items = [(key, q, shape) for key, (q, shapes) in sorted(want.items()) for shape in sorted(shapes)]
    total = len(items) + 2
    mm: dict[str, dict[str, float]] = {}
    kdetail: dict[str, dict[str, Any]] = {}
    for i, (key, q, shape) in enumerate(items):
        if on_item:
            on_item(f"{key} {shape_key(shape)}", i, total)
        sec, d = time_kernel(q, shape, working_set, passes)
        mm.setdefault(key, {})[shape_key(shape)] = sec
        kdetail.setdefault(key, {})[shape_key(shape)] = d
    if on_item:
        on_item("layer ops (kernels stubbed)", len(items), total)
    ops, shell, odetail = time_layer_ops(spec.raw_config, steps)
    if on_item:
        on_item("argmax over the vocabulary", len(items) + 1, total)
    argmax = {str(spec.config.vocab_size): time_argmax(spec.config.vocab_size)}
    if on_item:
        on_item("done", total, total)
    return RuntimeProfile(
        host=host_id(), dims=model_dims(spec.config), matmul_s=mm, layer_ops_s=ops, shell_s=shell, argmax_s=argmax,
        measured_at=datetime.now(timezone.utc).isoformat(timespec="seconds"), seconds=time.perf_counter() - t_all,
        details={"kernels": kdetail, "layer_ops": odetail, "working_set_bytes": working_set, "passes": passes,
                 "model": spec.name, "recipes": [r.name for r in recipes]},
    )

