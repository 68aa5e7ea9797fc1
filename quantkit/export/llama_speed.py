"""Decode tok/s of a llama.cpp placement: the llama-server line `plan --export llama.cpp` and
`plan --model X.gguf` print, on the GGUF's own bytes.

The arithmetic is quantkit.planner.speed's on llama.cpp's layout: per token each device reads the dense
tensors of its layers, the routed experts' share top-k / E of each layer (on the CPU for the layers whose
experts stay there: `--n-cpu-moe` / `-ot exps=CPU`), the recurrent states (read and written) and the KV up
to the filled length, and the output layer; it pays a fixed cost per layer it computes, and every hand-off
of the hidden row between GPU and CPU costs a latency plus the bytes over PCIe. Devices run one after
another, so their times add.

Prefill (`llama_prefill_tok_s`): per -ub step, the weights kept in RAM cross PCIe and the GPU computes;
`fit_pcie_efficiency()` fits the share of the link's nominal rate the stream reaches to the public prefill
points: 0.68, with errors RTX 3060 pp512 -4%, RTX 3090 Q8_0 --n-cpu-moe 22 (ik_llama.cpp, -ub 2048 assumed)
-32%, RTX 5080 --cpu-moe +40% (a PCIe 5.0 card gains less than its link's nominal rate suggests).

`fit_gpu_layer_cost()` fits SpeedModel's per-GPU-layer cost to the public data points below (REFERENCE
sections 3 and 8) by least squares on log tok/s over a 1 us grid: 84 us (it was 150, which capped an RTX 3090
at 71 tok/s with any CPU). The hosts' RAM bandwidth is not reported; at an assumed 96 GB/s the errors are
(predicted / reported - 1): 5060 Ti 14 CPU layers +24% (a 48 GB/s host would match), 3060 all experts on
CPU -4%, 3090 Q8_0 --n-cpu-moe 22 -40% (ik_llama.cpp, faster than llama.cpp; no host bandwidth reaches it),
3090 all on the GPU -1% (no host in it: the point that pins the cost), 5080 --cpu-moe +39% (56 GB/s would
match). tests/planner/test_llama_speed.py holds each error to these figures and prints the fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cache

from quantkit.checkpoint.spec import default_spec
from quantkit.export.llama_placement import (
    LlamaModel,
    LlamaPlacement,
    LlamaSettings,
    kv_layer_bytes,
    model_from_spec,
    rs_layer_bytes,
)
from quantkit.planner.hardware import Hardware, build_hardware
from quantkit.planner.speed import SpeedModel

CPU = "cpu"


def _device_of(pl: LlamaPlacement) -> list[str]:
    dev = [CPU] * pl.n_layer
    for gi, layers in enumerate(pl.gpu_layers):
        for L in layers:
            dev[L] = f"gpu{gi}"
    return dev


def llama_decode_tok_s(pl: LlamaPlacement, m: LlamaModel, hw: Hardware, sm: SpeedModel | None = None,
                       filled: int = 0) -> float:
    """Batch-1 decode tok/s of placement `pl` of GGUF `m` on `hw` with `filled` tokens in the cache."""
    sm = sm or SpeedModel()
    st: LlamaSettings = pl.settings
    dev = _device_of(pl)
    cpu_exp = set(pl.cpu_expert_layers)
    share = m.n_expert_used / m.n_expert
    read: dict[str, float] = {}
    layers: dict[str, int] = {}
    kv_tok = kv_layer_bytes(m, replace(st, context=1, parallel=1))
    rs = rs_layer_bytes(m, replace(st, parallel=1))
    hops = 0
    for L in range(pl.n_layer):
        d = dev[L]
        state = kv_tok * filled if m.full_attention[L] else 2 * rs
        read[d] = read.get(d, 0.0) + m.layer_bytes(L, False) + state
        layers[d] = layers.get(d, 0) + 1
        e = CPU if L in cpu_exp else d
        read[e] = read.get(e, 0.0) + m.layer_bytes(L, True) * share
        if e != d:
            layers[e] = layers.get(e, 0) + 1
            hops += 2  # the hidden row to the CPU's experts and back
    out = f"gpu{len(pl.gpu_layers) - 1}" if pl.gpu_layers and pl.n_gpu_layers > pl.n_layer else CPU
    read[out] = read.get(out, 0.0) + m.output_bytes
    hops += sum(1 for a, b in zip(dev, dev[1:], strict=False) if a != b) + (dev[0] != CPU)  # embeddings on CPU
    t = 0.0
    for d, nbytes in read.items():
        gpu = d != CPU
        bw = hw.gpus[int(d[3:])].bandwidth_gbs if gpu else hw.host.cpu_bandwidth_gbs
        eff = sm.gpu_bw_efficiency if gpu else sm.cpu_bw_efficiency
        t += nbytes / (bw * 1e9 * eff) + layers.get(d, 0) * (sm.gpu_layer_overhead_s if gpu else sm.cpu_layer_overhead_s)
    if hw.gpus:
        pcie = min(g.pcie_gbs for g in hw.gpus)
        t += hops * (sm.transfer_latency_s + m.n_embd * 4 / (pcie * 1e9))
    return 1.0 / t


def llama_prefill_tok_s(pl: LlamaPlacement, m: LlamaModel, hw: Hardware, sm: SpeedModel | None = None) -> float:
    """Prefill tok/s of placement `pl` of GGUF `m` on `hw`, in steps of `-ub` tokens. llama.cpp runs the
    matrix products of a batch of 32 or more on the GPU, so every weight kept in RAM (routed experts of
    --n-cpu-moe layers, layers not offloaded) crosses PCIe once per step, before the GPU computes with it; each
    step costs that transfer plus 2 FLOPs per active weight per token at a share of the GPU's FP16 peak.
    Without a GPU, the CPU's FLOP rate (`--cpu-tflops`)."""
    sm = sm or SpeedModel()
    ub = pl.settings.ubatch
    dev = _device_of(pl)
    cpu_exp = set(pl.cpu_expert_layers)
    flops: dict[str, float] = {}
    streamed = 0
    for L in range(pl.n_layer):
        d = dev[L] if dev[L] != CPU or not hw.gpus else "gpu0"
        flops[d] = flops.get(d, 0.0) + 2.0 * ub * m.active_params(L)
        if hw.gpus:
            streamed += m.layer_bytes(L, True) if L in cpu_exp or dev[L] == CPU else 0
            streamed += m.layer_bytes(L, False) if dev[L] == CPU else 0
    t = 0.0
    for d, f in flops.items():
        rate = hw.host.cpu_tflops * 1e12 if d == CPU else \
            hw.gpus[int(d[3:])].fp16_tflops * 1e12 * sm.gpu_compute_efficiency
        t += f / rate
    if streamed:
        t += streamed / (min(g.pcie_gbs for g in hw.gpus) * 1e9 * sm.pcie_efficiency)
    return ub / t if t else 0.0


# --- the public data points the per-GPU-layer cost is fitted to --------------------------------------------

@dataclass(frozen=True)
class DataPoint:
    what: str  # the report, as REFERENCE quotes it
    gpu: str
    gguf_type: str
    cpu_expert_layers: int  # --n-cpu-moe (40: every layer, --cpu-moe)
    context: int
    tok_s: float
    cpu_bandwidth_gbs: float  # assumed: the reports do not state the host's RAM
    filled: int = 0


DATA_POINTS = (
    DataPoint("RTX 5060 Ti 16 GB, Q4_K_M, 14 layers' experts on CPU, 64k", "rtx5060ti-16gb", "q4_k_m", 14, 65536,
              52.0, 96.0),
    DataPoint("RTX 3060 12 GB, Q4_K_M, all experts on CPU", "rtx3060", "q4_k_m", 40, 4096, 42.3, 96.0),
    DataPoint("RTX 3090, Q8_0, --n-cpu-moe 22 (ik_llama.cpp)", "rtx3090", "q8_0", 22, 4096, 88.5, 96.0),
    DataPoint("RTX 3090, Q4_K_M, all on the GPU, 131k context", "rtx3090", "q4_k_m", 0, 131072, 141.0, 96.0),
    DataPoint("RTX 5080 16 GB, Q4_K_M, --cpu-moe", "rtx5080", "q4_k_m", 40, 4096, 36.5, 96.0),
)


@cache
def _setup(p: DataPoint) -> tuple[LlamaPlacement, LlamaModel]:
    m = model_from_spec(default_spec(), p.gguf_type)
    n = m.n_layer
    pl = LlamaPlacement(model=p.gguf_type, settings=LlamaSettings(context=p.context), n_layer=n,
                        n_gpu_layers=n + 1, gpu_layers=[list(range(n))],
                        cpu_expert_layers=list(range(min(p.cpu_expert_layers, n))), gpu_bytes=[{}], cpu_bytes={},
                        budgets=[0], reserve=0, fits=True)
    return pl, m


def predict(p: DataPoint, sm: SpeedModel | None = None, cpu_bandwidth_gbs: float | None = None) -> float:
    """The model's decode tok/s for a data point, its experts placed as the report says."""
    hw = build_hardware([p.gpu], "128GB", str(cpu_bandwidth_gbs or p.cpu_bandwidth_gbs))
    pl, m = _setup(p)
    return llama_decode_tok_s(pl, m, hw, sm, p.filled)


def implied_bandwidth(p: DataPoint, sm: SpeedModel | None = None) -> float | None:
    """The host RAM bandwidth (GB/s) at which the model meets the report (None: none in 10..800 does)."""
    grid = [10.0 * 1.02 ** i for i in range(106)]
    got = [(abs(math.log(predict(p, sm, bw) / p.tok_s)), bw) for bw in grid]
    err, bw = min(got)
    return bw if err < 0.02 else None


def fit_gpu_layer_cost(points: tuple[DataPoint, ...] = DATA_POINTS) -> tuple[float, list[tuple[DataPoint, float]]]:
    """(the per-GPU-layer cost in seconds minimising the squared log error, each point's predicted tok/s)."""
    best = None
    for us in range(5, 301):
        sm = SpeedModel(gpu_layer_overhead_s=us * 1e-6)
        err = sum(math.log(predict(p, sm) / p.tok_s) ** 2 for p in points)
        if best is None or err < best[0]:
            best = (err, us * 1e-6)
    assert best is not None
    sm = SpeedModel(gpu_layer_overhead_s=best[1])
    return best[1], [(p, predict(p, sm)) for p in points]


# --- the public prefill points the PCIe efficiency is fitted to (REFERENCE section 8) ---

@dataclass(frozen=True)
class PrefillPoint:
    point: DataPoint  # the same report's placement
    ubatch: int  # -ub: llama-bench's pp512 runs at 512
    tok_s: float


PREFILL_POINTS = (
    PrefillPoint(DATA_POINTS[1], 512, 431.0),  # RTX 3060, pp512
    # pp2048 with ik_llama.cpp: 18 GB of Q8_0 experts per 512-token step over PCIe 4.0 would cap it near 700
    # tok/s, so the report ran larger steps; assumed -ub 2048
    PrefillPoint(DATA_POINTS[2], 2048, 2234.0),
    PrefillPoint(DATA_POINTS[4], 512, 692.0),  # RTX 5080 --cpu-moe
)


def predict_prefill(p: PrefillPoint, sm: SpeedModel | None = None) -> float:
    """The model's prefill tok/s for a prefill point."""
    hw = build_hardware([p.point.gpu], "128GB", str(p.point.cpu_bandwidth_gbs))
    pl, m = _setup(p.point)
    pl = replace(pl, settings=replace(pl.settings, ubatch=p.ubatch))
    return llama_prefill_tok_s(pl, m, hw, sm)


def fit_pcie_efficiency(points: tuple[PrefillPoint, ...] = PREFILL_POINTS) -> tuple[float, list[tuple[PrefillPoint, float]]]:
    """(the share of nominal PCIe rate minimising the squared log error of the prefill points on a 0.01 grid,
    each point's predicted tok/s); the GPU's compute share stays SpeedModel's."""
    err, eff = min((sum(math.log(predict_prefill(p, SpeedModel(pcie_efficiency=e / 100)) / p.tok_s) ** 2
                        for p in points), e / 100) for e in range(10, 101))
    sm = SpeedModel(pcie_efficiency=eff)
    return eff, [(p, predict_prefill(p, sm)) for p in points]
