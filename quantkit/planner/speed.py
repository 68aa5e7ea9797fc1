"""Speed model: decode and prefill tok/s of a placement, from bytes read per token over bandwidth.

Decode is memory-bound at batch 1: each step every device reads its weights for the token (all dense
weights of its layers, the routed experts expected on it, the lm_head), its caches (KV up to the filled
length, Gated DeltaNet states read and written) and pays a fixed per-layer cost (kernel launches, thread
sync). Devices run one after another, so their times add; every change of device along the layer
sequence moves one hidden-state row across the host link. Prefill takes, per device, the larger of
compute (2 FLOPs per active parameter per token) and one pass over its weights per chunk; CPU-resident
experts are either computed on the CPU or streamed to the GPU over PCIe (llama.cpp's choice at
batch >= 32), whichever is faster.

The efficiency factors below were set with users' published llama.cpp decode figures in view (listed with
their sources in tests/planner/test_plan.py, which checks the model against them within a stated factor); they are
assumptions, printed with each plan.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from quantkit.checkpoint.spec import TextConfig
from quantkit.planner.budget import Budget, kv_bytes_per_token
from quantkit.planner.host_costs import RuntimeCosts


@dataclass(frozen=True)
class SpeedModel:
    gpu_bw_efficiency: float = 0.8  # batch-1 GEMV kernels reach ~80% of peak DRAM bandwidth
    cpu_bw_efficiency: float = 0.6  # llama.cpp CPU matvec: ~60% of peak (STREAM-like) DDR bandwidth
    # launches of ~30 small kernels per Gated DeltaNet/MoE layer: fitted to public llama.cpp decode figures by
    # quantkit.export.llama_speed.fit_gpu_layer_cost (84 us; the figures and each one's error are there)
    gpu_layer_overhead_s: float = 84e-6
    cpu_layer_overhead_s: float = 50e-6  # thread-pool sync per layer that computes on the CPU
    transfer_latency_s: float = 10e-6  # one small PCIe copy + stream sync
    # prefill: MoE GEMMs with ~16 tokens per expert per 512-token chunk run far below tensor peak; no GPU
    # prefill data point calibrates this, so treat GPU prefill figures as rough
    gpu_compute_efficiency: float = 0.15
    # share of the link's nominal rate a stream of weights from host RAM reaches: fitted to public llama.cpp
    # prefill figures by quantkit.export.llama_speed.fit_pcie_efficiency (the figures and errors are there)
    pcie_efficiency: float = 0.68
    routing: str = "uniform"  # each expert equally likely; "measured (FILE)" with a routing profile

    def assumptions(self) -> list[str]:
        return [
            f"decode: bytes read per token / bandwidth; GPU at {self.gpu_bw_efficiency:.0%} and CPU at "
            f"{self.cpu_bw_efficiency:.0%} of peak bandwidth, plus {self.gpu_layer_overhead_s * 1e6:.0f} us "
            f"per GPU layer and {self.cpu_layer_overhead_s * 1e6:.0f} us per CPU layer",
            (f"routing {self.routing}: a device holding n of E experts of a layer serves n/E of the top-k"
             if self.routing == "uniform" else
             f"routing {self.routing}: a device serves the share of each layer's routed tokens its experts got "
             "in the profile (at batch > 1 the distinct experts touched are still counted as uniform)"),
            f"each GPU<->CPU hand-off of a hidden row costs {self.transfer_latency_s * 1e6:.0f} us + bytes/PCIe",
            "decode tok/s at an empty cache (as llama-bench tg128); *_full_context with the cache full",
            f"prefill: max(2 FLOPs/param/token at {self.gpu_compute_efficiency:.0%} of FP16 tensor peak, one "
            "weight pass per chunk); CPU experts computed on CPU or streamed over PCIe (at "
            f"{self.pcie_efficiency:.0%} of its nominal rate), whichever is faster",
            "these rates are llama.cpp-grade (its reported speeds set them); quantkit's own CPU runtime has "
            "its own: on this machine `quantkit profile-host` measures it and plan shows it as qk tok/s",
        ]

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class DeviceRates:
    id: str
    kind: str  # "gpu" | "cpu"
    bandwidth_gbs: float
    tflops: float
    pcie_gbs: float = float("inf")


@dataclass
class Speed:
    decode_tok_s: float
    decode_tok_s_full_context: float
    prefill_tok_s: float
    decode_ms_by_device: dict[str, float] = field(default_factory=dict)
    transfers_per_token: int = 0

    def to_dict(self) -> dict:
        return {
            "decode_tok_s": round(self.decode_tok_s, 1),
            "decode_tok_s_full_context": round(self.decode_tok_s_full_context, 1),
            "prefill_tok_s": round(self.prefill_tok_s, 1),
            "decode_ms_by_device": {k: round(v, 3) for k, v in self.decode_ms_by_device.items()},
            "transfers_per_token": self.transfers_per_token,
        }


@dataclass(frozen=True)
class Layout:
    """What the speed model needs of a placement."""

    layer_device: list[str]
    expert_counts: list[dict[str, int]]  # per layer: device -> number of experts
    embedding_device: str
    lm_head_device: str
    traffic: list[dict[str, float]] | None = None  # per layer: device -> share of routed tokens; None: uniform

    def routed(self, x: float, layer: int, dev: str, cnt: int, e: int) -> float:
        """`x` (a per-token quantity of the layer's routed experts) scaled to the part `dev` serves:
        by its experts' measured traffic share, or cnt/E under uniform routing."""
        if self.traffic is None:
            return x * cnt / e
        return x * self.traffic[layer].get(dev, 0.0)


def _distinct_experts(e: int, k: int, batch: int) -> float:
    """Expected distinct experts a layer touches for `batch` tokens under uniform routing."""
    return e * (1 - (1 - k / e) ** batch)


def estimate(b: Budget, layout: Layout, rates: dict[str, DeviceRates], cfg: TextConfig,
             model: SpeedModel | None = None) -> Speed:
    """Decode and prefill estimates for `layout` under budget `b`."""
    m = model or SpeedModel()
    s = b.settings
    batch = s.batch
    e = b.num_experts
    hidden, top_k = cfg.hidden_size, cfg.num_experts_per_tok
    kv_tok = kv_bytes_per_token(cfg, s.cache_dtype)
    n = len(layout.layer_device)
    distinct = _distinct_experts(e, top_k, batch)

    def decode_time(filled: int) -> tuple[float, dict[str, float], int]:
        read: dict[str, float] = {d: 0.0 for d in rates}
        layers_on: dict[str, int] = {d: 0 for d in rates}
        for L in range(n):
            dev = layout.layer_device[L]
            if cfg.layer_types[L] == "full_attention":
                cache_read = kv_tok * filled * batch  # K and V up to the filled length
            else:
                cache_read = 2 * b.layer_cache[L]  # recurrent + conv state read and written each step
            read[dev] += b.layer_dense[L] + cache_read
            touched = {dev}
            for d, cnt in layout.expert_counts[L].items():
                if cnt:
                    read[d] += layout.routed(b.expert_bytes[L] * distinct, L, d, cnt, e)
                    touched.add(d)
            for d in touched:
                layers_on[d] += 1
        read[layout.lm_head_device] += b.lm_head + b.final_norm
        read[layout.embedding_device] += hidden * 2 * batch
        per_dev: dict[str, float] = {}
        for d, r in rates.items():
            eff = m.gpu_bw_efficiency if r.kind == "gpu" else m.cpu_bw_efficiency
            oh = m.gpu_layer_overhead_s if r.kind == "gpu" else m.cpu_layer_overhead_s
            t = read[d] / (r.bandwidth_gbs * 1e9 * eff) + layers_on[d] * oh
            if read[d] or layers_on[d]:
                per_dev[d] = t
        t_xfer, hops = _transfers(layout, rates, hidden * 2 * batch, m)
        return sum(per_dev.values()) + t_xfer, per_dev, hops

    t0, per_dev, hops = decode_time(0)
    t_full, _, _ = decode_time(s.context)
    prefill = _prefill_tok_s(b, layout, rates, top_k, m)
    return Speed(
        decode_tok_s=batch / t0,
        decode_tok_s_full_context=batch / t_full,
        prefill_tok_s=prefill,
        decode_ms_by_device={d: t * 1e3 for d, t in per_dev.items()},
        transfers_per_token=hops,
    )


@dataclass
class RuntimeSpeed:
    """quantkit's own runtime on this host: CPU parts from a calibration (runtime_profile.py), GPU parts
    from the generic model (no GPU was calibrated). Greedy batch-1 decode; prefill where the whole model
    runs on calibrated CPUs (None elsewhere)."""

    decode_tok_s: float
    decode_tok_s_full_context: float
    decode_ms_by_device: dict[str, float]
    source: str
    prefill_tok_s: float | None = None

    def to_dict(self) -> dict:
        return {"decode_tok_s": round(self.decode_tok_s, 1),
                "decode_tok_s_full_context": round(self.decode_tok_s_full_context, 1),
                "decode_ms_by_device": {k: round(v, 3) for k, v in self.decode_ms_by_device.items()},
                "source": self.source,
                "prefill_tok_s": round(self.prefill_tok_s, 1) if self.prefill_tok_s is not None else None}


def estimate_runtime(b: Budget, layout: Layout, rates: dict[str, DeviceRates], cfg: TextConfig,
                     costs: RuntimeCosts, model: SpeedModel | None = None) -> RuntimeSpeed | None:
    """Batch-1 decode of quantkit's runtime for `layout`: on a CPU, the calibrated cost of each layer it
    computes (ops + dense matrices), of the routed experts it is expected to serve and of the head; the
    KV cache read at the filled length over the bandwidth; GPUs and hand-offs as in `estimate`.
    None for batch > 1 (the calibration times batch-1 calls)."""
    m = model or SpeedModel()
    if b.settings.batch != 1:
        return None
    e, top_k = b.num_experts, cfg.num_experts_per_tok
    kv_tok = kv_bytes_per_token(cfg, b.settings.cache_dtype)
    n = len(layout.layer_device)

    def decode_time(filled: int) -> tuple[float, dict[str, float]]:
        t: dict[str, float] = {d: 0.0 for d in rates}
        read: dict[str, float] = {d: 0.0 for d in rates}  # GPU bytes (generic model)
        layers_on: dict[str, int] = {d: 0 for d in rates}
        used: set[str] = set()
        for L in range(n):
            dev = layout.layer_device[L]
            kv = kv_tok * filled if cfg.layer_types[L] == "full_attention" else 0
            if rates[dev].kind == "cpu":
                t[dev] += costs.layer_s[L] + kv / (rates[dev].bandwidth_gbs * 1e9 * m.cpu_bw_efficiency)
            else:
                cache = kv if cfg.layer_types[L] == "full_attention" else 2 * b.layer_cache[L]
                read[dev] += b.layer_dense[L] + cache
                layers_on[dev] += 1
            used.add(dev)
            for d, cnt in layout.expert_counts[L].items():
                if not cnt:
                    continue
                share = layout.routed(top_k, L, d, cnt, e)
                if rates[d].kind == "cpu":
                    t[d] += share * costs.expert_s[L]
                else:
                    read[d] += share * b.expert_bytes[L]
                    if d != dev:
                        layers_on[d] += 1
                used.add(d)
        head = layout.lm_head_device
        if rates[head].kind == "cpu":
            t[head] += costs.head_s
        else:
            read[head] += b.lm_head + b.final_norm
        used.add(head)
        for d, r in rates.items():
            if r.kind == "gpu":
                t[d] += read[d] / (r.bandwidth_gbs * 1e9 * m.gpu_bw_efficiency) + layers_on[d] * m.gpu_layer_overhead_s
        per_dev = {d: t[d] for d in rates if d in used}
        xfer, _ = _transfers(layout, rates, cfg.hidden_size * 2, m)
        return sum(per_dev.values()) + xfer, per_dev

    t0, per_dev = decode_time(0)
    t_full, _ = decode_time(b.settings.context)
    return RuntimeSpeed(1 / t0, 1 / t_full, {d: x * 1e3 for d, x in per_dev.items()}, costs.source,
                        _runtime_prefill_tok_s(layout, rates, costs))


def _runtime_prefill_tok_s(layout: Layout, rates: dict[str, DeviceRates], costs: RuntimeCosts) -> float | None:
    """One calibrated prefill chunk over its seconds (every layer, expert and the head on a CPU), else None."""
    on = set(layout.layer_device) | {layout.lm_head_device} | {d for c in layout.expert_counts for d, n in c.items() if n}
    if not costs.prefill_tokens or any(rates[d].kind != "cpu" for d in on):
        return None
    t = sum(costs.prefill_layer_s) + sum(costs.prefill_expert_s) + costs.prefill_head_s
    return costs.prefill_tokens / t


def _hop_cost(a: str, b: str, rates: dict[str, DeviceRates], nbytes: int, m: SpeedModel) -> float:
    link = min(rates[a].pcie_gbs, rates[b].pcie_gbs)
    if link == float("inf"):
        return 0.0
    return m.transfer_latency_s + nbytes / (link * 1e9)


def _sites(layout: Layout) -> list[str]:
    seq = [layout.embedding_device]
    for L, dev in enumerate(layout.layer_device):
        seq.append(dev)
        for d, cnt in layout.expert_counts[L].items():
            if cnt and d != dev:
                seq += [d, dev]
    seq.append(layout.lm_head_device)
    return seq


def _transfers(layout: Layout, rates: dict[str, DeviceRates], nbytes: int, m: SpeedModel) -> tuple[float, int]:
    seq = _sites(layout)
    t, hops = 0.0, 0
    for a, c in zip(seq, seq[1:], strict=False):
        if a != c:
            t += _hop_cost(a, c, rates, nbytes, m)
            hops += 1
    return t, hops


def _prefill_tok_s(b: Budget, layout: Layout, rates: dict[str, DeviceRates], top_k: int, m: SpeedModel) -> float:
    chunk = min(b.settings.prefill_chunk, b.settings.context)
    e = b.num_experts
    flops: dict[str, float] = {d: 0.0 for d in rates}
    wbytes: dict[str, float] = {d: 0.0 for d in rates}
    layers_on: dict[str, int] = {d: 0 for d in rates}
    cpu_exp_flops = cpu_exp_bytes = 0.0
    gpus = [d for d, r in rates.items() if r.kind == "gpu"]
    for L, dev in enumerate(layout.layer_device):
        flops[dev] += 2 * chunk * b.layer_dense_params[L]
        wbytes[dev] += b.layer_dense[L]
        layers_on[dev] += 1
        for d, cnt in layout.expert_counts[L].items():
            if not cnt:
                continue
            f = layout.routed(2 * chunk * top_k * b.expert_params[L], L, d, cnt, e)
            if rates[d].kind == "cpu" and rates[dev].kind == "gpu":
                cpu_exp_flops += f
                cpu_exp_bytes += b.expert_bytes[L] * cnt
            else:
                flops[d] += f
                wbytes[d] += b.expert_bytes[L] * cnt
    flops[layout.lm_head_device] += 2 * b.lm_head_params  # the last position only
    wbytes[layout.lm_head_device] += b.lm_head
    total = 0.0
    for d, r in rates.items():
        if not (flops[d] or wbytes[d]):
            continue
        if r.kind == "gpu":
            t_c = flops[d] / (r.tflops * 1e12 * m.gpu_compute_efficiency)
            t_m = wbytes[d] / (r.bandwidth_gbs * 1e9 * m.gpu_bw_efficiency)
            total += max(t_c, t_m) + layers_on[d] * m.gpu_layer_overhead_s
        else:
            t_c = flops[d] / (r.tflops * 1e12)
            t_m = wbytes[d] / (r.bandwidth_gbs * 1e9 * m.cpu_bw_efficiency)
            total += max(t_c, t_m) + layers_on[d] * m.cpu_layer_overhead_s
    if cpu_exp_flops:
        cpu = rates["cpu"]
        on_cpu = max(cpu_exp_flops / (cpu.tflops * 1e12),
                     cpu_exp_bytes / (cpu.bandwidth_gbs * 1e9 * m.cpu_bw_efficiency))
        g = rates[gpus[0]]
        streamed = cpu_exp_bytes / (g.pcie_gbs * 1e9 * m.pcie_efficiency) + cpu_exp_flops / (g.tflops * 1e12 * m.gpu_compute_efficiency)
        total += min(on_cpu, streamed)
    return chunk / total if total else 0.0
