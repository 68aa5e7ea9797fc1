"""`quantkit profile-host`: measure what quantkit's CPU runtime costs on this host, part by part, for the
planner (quantkit/planner/host_costs.py says how the parts compose).

Two measurements, each in isolation, on random weights of the model's real dimensions:

- kernels: for every (format, matrix shape) the recipes use, one prepared kernel is copied until the
  copies exceed `working_set` bytes (256 MiB: above the last-level cache of desktop and most server
  CPUs, so each call reads its weights from DRAM as in a real model; `--working-set` raises it), then batch-1 calls cycle over the copies; the best of
  `passes` passes, per call. Matrices taller than `ROW_CAP` rows (the lm_head) are timed on a slab of
  `ROW_CAP` rows and scaled by rows: one large matrix is a steady stream.
- fused MoE: where the runtime runs a layer's routed experts as one call (runtime/qexperts.py: quantkit's
  C++ kernel, `qk.moe`), a `QuantExperts` of the real shapes is built from copies of one prepared
  gate_up / down pair until they exceed `working_set`, and one-token forwards route to top_k experts
  cycling over the copies (each call reads its experts from DRAM, as in a model); the best of `passes`
  passes, per call. Formats the runtime does not fuse (its `_fused_table` says) get no entry: the
  planner then composes their 2 x top_k kernel calls (host_costs).
- layer ops: the runtime's own model (runtime/model/, built by quantkit's loader) with one layer of each
  type, the real expert count and a small vocabulary, every kernel call replaced by a stub that returns
  zeros and the experts' fused call switched off (else bf16 experts on an AVX512-BF16 CPU would run a real
  `qk.moe` over the untouched weights); matrices are `torch.empty` (never touched, so no memory). Decode
  steps run layer by layer on the kernel's fused ops (the one-call stack cannot run stubbed kernels) and
  are timed per decoder layer and per routed-experts call: a layer's ops exclude its routed experts, whose
  time (the unfused loop's small ops, kernels stubbed) is `expert_loop_s`; the rest of a step is the shell.
  The greedy argmax
  over the real vocabulary is timed on its own.
- prefill (one chunk of `prefill_tokens`, the runtime's chunk): each dense kernel on that many rows; a layer's
  routed experts as the experts module's multi-token forward over the real expert count, tokens routed
  uniformly; the layer ops and shell of a chunk through the stubbed model.
"""

from __future__ import annotations

import copy
import math
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from statistics import median
from typing import Any

import torch

from quantkit.checkpoint.spec import ModelSpec, Role, spec_from_config
from quantkit.formats import QuantSpec, get_format
from quantkit.planner.budget import DEFAULT_PREFILL_CHUNK
from quantkit.planner.host_costs import (
    ExpertPair,
    RuntimeProfile,
    host_id,
    model_dims,
    moe_shape_key,
    needed,
    needed_moe,
    shape_key,
)
from quantkit.recipe import Recipe
from quantkit.runtime import cpu_kernel, hugepages
from quantkit.runtime import kernels as K
from quantkit.runtime.loader import LoadReport, Placement, TensorSource, build_model
from quantkit.runtime.qexperts import ExpertGroup, QuantExperts

ROW_CAP = 16384
WORKING_SET = 256 << 20
MAX_COPIES = 1024
CAL_VOCAB = 1024


def time_kernel(q: QuantSpec | None, shape: tuple[int, int], working_set: int = WORKING_SET, passes: int = 3,
                seed: int = 0, tokens: int = 1) -> tuple[float, dict[str, Any]]:
    """Seconds per call of the runtime's kernel for a matrix of format `q` and `shape` on `tokens` rows of
    activations (1: a decode step; a prefill chunk: compute-bound, so two copies suffice), weights out of cache."""
    rows, cols = shape
    rows_cal = min(rows, ROW_CAP)
    g = torch.Generator().manual_seed(seed)
    k = _random_kernel(q, (rows_cal, cols), g)
    n = max(2, min(MAX_COPIES, math.ceil(working_set / max(1, k.nbytes)))) if tokens == 1 else 2
    copies = [k] + [_clone(k) for _ in range(n - 1)]
    x = torch.randn(tokens, cols, generator=g).to(torch.bfloat16)
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


def _random_kernel(q: QuantSpec | None, shape: tuple[int, int], g: torch.Generator) -> K.Kernel:
    """The runtime's kernel for a random matrix of format `q` (None: bf16) and `shape`, as the loader prepares it."""
    w = (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)
    return K.prepare(w if q is None else get_format(q.format).quantize(w, q), q, shape)


def moe_module(pair: ExpertPair, copies: int, seed: int = 0) -> QuantExperts:
    """A CPU `QuantExperts` of `copies` experts, each a copy of one random prepared (gate_up, down) pair."""
    q_gu, gu_shape, q_dn, dn_shape = pair
    g = torch.Generator().manual_seed(seed)
    gu, dn = _random_kernel(q_gu, gu_shape, g), _random_kernel(q_dn, dn_shape, g)
    group = ExpertGroup(torch.device("cpu"), list(range(copies)), [gu] + [_clone(gu) for _ in range(copies - 1)],
                        [dn] + [_clone(dn) for _ in range(copies - 1)])
    return QuantExperts(copies, gu_shape[1], dn_shape[1], [group], fmt=q_gu.format if q_gu else "bf16")


def runtime_fuses(experts: QuantExperts) -> bool:
    """Whether the runtime runs these experts' decode as one fused call (its own decision, not a copy of it)."""
    return experts._fused_table() is not None


def time_moe(pair: ExpertPair, top_k: int, working_set: int = WORKING_SET, passes: int = 3,
             seed: int = 0) -> tuple[float, dict[str, Any]] | None:
    """Seconds of one decode step through a layer's top_k routed experts of this (format, shape) pair
    where the runtime fuses them (the experts module's forward, weights out of cache); None where it does not."""
    probe = moe_module(pair, 1, seed)
    each = probe.nbytes
    if not runtime_fuses(probe):
        return None
    del probe
    n = max(2 * top_k, min(MAX_COPIES, math.ceil(working_set / max(1, each))))
    experts = moe_module(pair, n, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(1, experts.hidden_dim, generator=g).to(torch.bfloat16)
    wts = torch.softmax(torch.randn(1, top_k, generator=g), dim=-1)
    calls = max(2, n // top_k)
    routes = [torch.tensor([[(c * top_k + j) % n for j in range(top_k)]]) for c in range(calls)]
    best = float("inf")
    with torch.inference_mode():
        for idx in routes:  # warm-up: the fused table, first-call allocations, thread pool
            experts(x, idx, wts)
        for _ in range(passes):
            t0 = time.perf_counter()
            for idx in routes:
                experts(x, idx, wts)
            best = min(best, (time.perf_counter() - t0) / calls)
    return best, {"copies": n, "bytes_each": each, "calls": calls, "top_k": top_k,
                  "route": experts.groups[0].gate_up[0].route}


def time_moe_prefill(pair: ExpertPair, num_experts: int, top_k: int, tokens: int, passes: int = 3,
                     seed: int = 0) -> tuple[float, dict[str, Any]]:
    """Seconds of one prefill chunk of `tokens` through a layer's `num_experts` routed experts (the experts
    module's multi-token forward, as the runtime runs it), each token routed to `top_k` distinct experts
    drawn uniformly (the planner's routing assumption)."""
    experts = moe_module(pair, num_experts, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(tokens, experts.hidden_dim, generator=g).to(torch.bfloat16)
    ids = torch.rand(tokens, num_experts, generator=g).topk(top_k, dim=-1).indices
    wts = torch.softmax(torch.randn(tokens, top_k, generator=g), dim=-1)
    best = float("inf")
    with torch.inference_mode():
        experts(x, ids, wts)  # warm-up
        for _ in range(passes):
            t0 = time.perf_counter()
            experts(x, ids, wts)
            best = min(best, time.perf_counter() - t0)
    return best, {"experts": num_experts, "bytes_each": experts.nbytes // num_experts, "tokens": tokens,
                  "top_k": top_k}


def _clone(k: K.Kernel) -> K.Kernel:
    """A copy of a prepared kernel with its own weight memory (module references are shared), its large
    tensors on the memory the runtime gives them (runtime/hugepages.py), so the timing is the runtime's."""
    memo: dict[int, Any] = {id(v): v for v in vars(k).values() if isinstance(v, types.ModuleType)}
    for v in vars(k).values():  # large CPU tensors copied once, straight onto those pages
        if isinstance(v, torch.Tensor) and v.device.type == "cpu" and (c := hugepages.copy(v)) is not v:
            memo[id(v)] = c
    return copy.deepcopy(k, memo)


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
    """Within the block every Kernel call returns a cached zero tensor (one per kernel and row count),
    routed experts take the runtime's unfused path (their fused `qk.moe` call would read real weights) and
    Projections call their kernels one by one (their `linear_many` call would too)."""

    def __enter__(self) -> _StubbedKernels:
        self.saved: dict[type, Any] = {}
        todo = [K.Kernel]
        while todo:
            cls = todo.pop()
            todo += cls.__subclasses__()
            if "__call__" in cls.__dict__:
                self.saved[cls] = cls.__dict__["__call__"]
                cls.__call__ = _stub  # type: ignore[method-assign]
        self.fused_table = QuantExperts.__dict__["_fused_table"]
        QuantExperts._fused_table = _no_fused_table  # type: ignore[method-assign]
        self.projections = K.Projections.__dict__["__call__"]
        K.Projections.__call__ = _one_by_one  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: Any) -> None:
        for cls, fn in self.saved.items():
            cls.__call__ = fn  # type: ignore[method-assign]
        QuantExperts._fused_table = self.fused_table  # type: ignore[method-assign]
        K.Projections.__call__ = self.projections  # type: ignore[method-assign]


def _no_fused_table(self: Any) -> None:
    return None


def _one_by_one(self: Any, x: torch.Tensor) -> list[torch.Tensor]:
    """Projections through each (stubbed) kernel: the fused call would read real weights."""
    return [k(x) for k in self.kernels]


def _stub(self: Any, x: torch.Tensor) -> torch.Tensor:
    cache = self.__dict__.setdefault("_stub_out", {})
    key = (x.shape[0], x.dtype)
    if key not in cache:
        cache[key] = torch.zeros(x.shape[0], self.out_features, dtype=x.dtype, device=x.device)
    return cache[key]


@dataclass
class LayerOps:
    """What `time_layer_ops` measured: seconds per decode step."""

    ops_s: dict[str, float]  # layer type -> its ops, kernels and the routed experts excluded
    shell_s: float  # the step outside the decoder layers
    expert_loop_s: float  # the unfused routed experts' own ops (top_k experts), kernels stubbed
    detail: dict[str, Any]  # spreads and the path timed, for the report


def _spread(v: list[float]) -> dict[str, Any]:
    return {"median_ms": round(median(v) * 1e3, 4), "min_ms": round(min(v) * 1e3, 4),
            "max_ms": round(max(v) * 1e3, 4), "samples": len(v)}


Steps = Iterator[tuple[list[float], list[float], float]]  # per step: layer seconds, their experts', the step's


class _TimedLayer:
    """A layer that stores its seconds per call in took[index] (the model calls layers, nothing else)."""

    def __init__(self, layer: Any, took: list[float]):
        self.layer, self.took, self.device = layer, took, layer.device

    def __call__(self, *args: Any) -> torch.Tensor:
        t0 = time.perf_counter()
        y = self.layer(*args)
        self.took[self.layer.index] = time.perf_counter() - t0
        return y


def _instrument(model: Any) -> tuple[list[float], list[float]]:
    """Wrap `model`'s layers and routed-experts calls so each forward stores its seconds per layer and per
    routed-experts call in the two lists returned (index: the layer)."""
    n = len(model.layers)
    took, experts = [0.0] * n, [0.0] * n

    def timed_routed(i: int, routed: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def run(*args: Any) -> torch.Tensor:
            t0 = time.perf_counter()
            y = routed(*args)
            experts[i] = time.perf_counter() - t0
            return y
        return run

    for L in model.layers:
        L.moe.routed = timed_routed(L.index, L.moe.routed)  # type: ignore[method-assign]
    model.layers = [_TimedLayer(L, took) for L in model.layers]
    return took, experts


def _steps(model: Any, steps: int, prompt: int) -> Steps:
    """Decode steps of `model` (its route already chosen), timed per layer and per routed-experts call."""
    cache = model.new_cache(prompt + steps + 1)
    model.forward([0] * prompt, cache)
    took, experts = _instrument(model)
    for _ in range(steps):
        t0 = time.perf_counter()
        model.forward([0], cache)
        yield took, experts, time.perf_counter() - t0


def _chunks(model: Any, passes: int, tokens: int) -> Steps:
    """Prefill chunks of `tokens` tokens, each on a fresh cache, timed per layer and per routed-experts call."""
    took, experts = _instrument(model)
    for _ in range(passes):
        cache = model.new_cache(tokens + 1)
        t0 = time.perf_counter()
        model.forward([0] * tokens, cache)
        yield took, experts, time.perf_counter() - t0


def _stubbed_model(config: dict[str, Any]) -> tuple[Any, Any]:
    """The runtime's model of one layer of each type at the real dimensions (calibration_config), its
    matrices untouched `torch.empty`, and its config."""
    cal = calibration_config(config)
    spec = spec_from_config(cal, name="calibration")
    c = spec.config
    with hugepages.off():  # its matrices stay untouched `torch.empty`: no copies that would fault them in
        model = build_model(RandomSource(spec), cal, Placement.single(c.num_hidden_layers, c.num_experts), LoadReport())
    return model, c


def _ops(model: Any, c: Any, runs: Steps, warm: int) -> LayerOps:
    """Per layer type the median of its seconds without its routed experts, the experts' and the shell's."""
    n = len(model.layers)
    per_layer: list[list[float]] = [[] for _ in range(n)]
    loop: list[float] = []
    shell: list[float] = []
    for s, (took, experts, total) in enumerate(runs):
        if s < warm:
            continue
        for i in range(n):
            per_layer[i].append(took[i] - experts[i])
            loop.append(experts[i])
        shell.append(total - sum(took))
    by_type: dict[str, list[float]] = {}
    for i, t in enumerate(c.layer_types):
        by_type.setdefault(t, []).extend(per_layer[i])
    detail: dict[str, Any] = {t: _spread(v) for t, v in by_type.items()}
    detail["shell"] = {"median_ms": round(median(shell) * 1e3, 4), "samples": len(shell)}
    detail["expert_loop"] = _spread(loop)
    return LayerOps({t: median(v) for t, v in by_type.items()}, median(shell), median(loop), detail)


def time_layer_ops(config: dict[str, Any], steps: int = 24, prompt: int = 8, fused: bool = True) -> LayerOps:
    """Per layer type, seconds of one decode step with kernels stubbed and the routed experts apart; the
    experts' own (unfused) ops; and the shell's seconds. The step runs per layer as generation's route does
    where it cannot be one call (the kernel's fused ops on the CPU); `fused=False` times the torch route."""
    model, c = _stubbed_model(config)
    with _StubbedKernels(), torch.inference_mode():
        for L in model.layers:
            L.moe.fused_all = False  # the fused call would read the untouched weights
        route = model.set_route("fused" if fused else "torch")
        lo = _ops(model, c, _steps(model, steps + 4, prompt), warm=4)
    lo.detail["path"] = {"step": route.name}
    return lo


def time_prefill_ops(config: dict[str, Any], tokens: int, passes: int = 3) -> LayerOps:
    """Per layer type, seconds of one prefill chunk of `tokens` tokens with kernels stubbed and the routed
    experts apart (the chunked Gated DeltaNet, causal attention, norms, router); the shell's seconds."""
    model, c = _stubbed_model(config)
    with _StubbedKernels(), torch.inference_mode():
        lo = _ops(model, c, _chunks(model, passes + 1, tokens), warm=1)
    lo.detail["tokens"] = tokens
    return lo


def time_argmax(vocab: int, reps: int = 50) -> float:
    """Seconds of the greedy pick over one row of bf16 logits (what a greedy decode step does)."""
    logits = torch.randn(1, 1, vocab).to(torch.bfloat16)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        cpu_kernel.argmax(logits[0, -1])
        best = min(best, time.perf_counter() - t0)
    return best


def calibrate(spec: ModelSpec, recipes: list[Recipe], *, working_set: int = WORKING_SET, passes: int = 3,
              steps: int = 24, prefill_tokens: int = DEFAULT_PREFILL_CHUNK,
              on_item: Callable[[str, int, int], None] | None = None) -> RuntimeProfile:
    """Measure a RuntimeProfile for `spec` and the kernels `recipes` use, on this host: decode parts, and
    with `prefill_tokens` > 0 the same parts for one prefill chunk of that many tokens."""
    t_all = time.perf_counter()
    c = spec.config
    want = needed(spec, recipes)
    items = [(key, q, shape) for key, (q, shapes) in sorted(want.items()) for shape in sorted(shapes)]
    moe_items = [(key, pair) for key, pairs in sorted(needed_moe(spec, recipes).items()) for pair in pairs]
    pre_items = [(key, q, shape) for key, q, shape in items if shape[0] != c.vocab_size] if prefill_tokens else []
    pre_moe = moe_items if prefill_tokens else []
    total = len(items) + len(moe_items) + 2 + len(pre_items) + len(pre_moe) + (1 if prefill_tokens else 0)
    done = 0

    def step(what: str) -> None:
        nonlocal done
        if on_item:
            on_item(what, done, total)
        done += 1

    mm: dict[str, dict[str, float]] = {}
    kdetail: dict[str, dict[str, Any]] = {}
    moe: dict[str, dict[str, float]] = {}
    mdetail: dict[str, dict[str, Any]] = {}
    for key, q, shape in items:
        step(f"{key} {shape_key(shape)}")
        sec, d = time_kernel(q, shape, working_set, passes)
        mm.setdefault(key, {})[shape_key(shape)] = sec
        kdetail.setdefault(key, {})[shape_key(shape)] = d
    for key, pair in moe_items:
        step(f"fused MoE {key} {moe_shape_key(pair[1], pair[3])}")
        got = time_moe(pair, c.num_experts_per_tok, working_set, passes)
        mdetail.setdefault(key, {})[moe_shape_key(pair[1], pair[3])] = got[1] if got else {"fused": False}
        if got is not None:
            moe.setdefault(key, {})[moe_shape_key(pair[1], pair[3])] = got[0]
    step("layer ops (kernels stubbed)")
    lo = time_layer_ops(spec.raw_config, steps)
    step("argmax over the vocabulary")
    argmax = {str(c.vocab_size): time_argmax(c.vocab_size)}
    pre_mm: dict[str, dict[str, float]] = {}
    pre_moe_s: dict[str, dict[str, float]] = {}
    for key, q, shape in pre_items:
        step(f"prefill {key} {shape_key(shape)}")
        pre_mm.setdefault(key, {})[shape_key(shape)] = time_kernel(q, shape, passes=passes, tokens=prefill_tokens)[0]
    for key, pair in pre_moe:
        step(f"prefill MoE {key} {moe_shape_key(pair[1], pair[3])}")
        sec, _ = time_moe_prefill(pair, c.num_experts, c.num_experts_per_tok, prefill_tokens, passes)
        pre_moe_s.setdefault(key, {})[moe_shape_key(pair[1], pair[3])] = sec
    pre = None
    if prefill_tokens:
        step("prefill layer ops (kernels stubbed)")
        pre = time_prefill_ops(spec.raw_config, prefill_tokens, passes)
    if on_item:
        on_item("done", total, total)
    details = {"kernels": kdetail, "moe": mdetail, "layer_ops": lo.detail, "working_set_bytes": working_set,
               "passes": passes, "model": spec.name, "recipes": [r.name for r in recipes]}
    if pre is not None:
        details["prefill_ops"] = pre.detail
    return RuntimeProfile(
        host=host_id(), dims=model_dims(c), matmul_s=mm, layer_ops_s=lo.ops_s, shell_s=lo.shell_s,
        argmax_s=argmax, moe_s=moe, expert_loop_s=lo.expert_loop_s,
        measured_at=datetime.now(timezone.utc).isoformat(timespec="seconds"), seconds=time.perf_counter() - t_all,
        details=details, prefill_tokens=prefill_tokens if pre is not None else 0, prefill_matmul_s=pre_mm,
        prefill_moe_s=pre_moe_s, prefill_ops_s=pre.ops_s if pre is not None else {},
        prefill_shell_s=pre.shell_s if pre is not None else 0.0,
    )
