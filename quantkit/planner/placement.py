"""Placement: where every component of one scheme lives, and the speed that placement should reach.

The solver puts the non-expert weights of each decoder layer, its caches and the buffers on the GPU(s),
split by layers in proportion to each GPU's free memory, then fills each GPU with the routed experts of
its own layers, expert by expert, until its budget (capacity minus reserve) is full. The rest of the
experts stay resident in CPU RAM and compute there. Experts of the first layers go to the CPU first,
as llama.cpp's --n-cpu-moe does, so at most one layer per GPU is split between GPU and CPU. The
embedding lives in CPU RAM (one row is gathered per token; llama.cpp does the same). Layers whose dense
part does not fit any GPU run whole on the CPU (the first layers, like llama.cpp's -ngl).

With a routing profile (`quantkit plan --routing STATS`, planner/routing.py) each GPU takes the same bytes of
experts, but as the most-routed (layer, expert) pairs of its own layers first (ranked by their share of the
layer's routed tokens; ties: later layer, then lower id, which is the order above), so its expert sets may
be non-contiguous and several layers may be split; the speed estimate then uses the measured share of
routed tokens each device serves instead of its share of the experts.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from quantkit.checkpoint.spec import ModelSpec, Role
from quantkit.errors import QuantkitError
from quantkit.fileio import write_atomic
from quantkit.planner.budget import (
    GB,
    GIB,
    Budget,
    RunSettings,
    card_estimate_gb,
    card_params,
    compute_budget,
    with_settings,
)
from quantkit.planner.hardware import DEFAULT_GPU_RESERVE, DEFAULT_HOST_RESERVE, Hardware
from quantkit.planner.host_costs import RuntimeProfile, runtime_costs
from quantkit.planner.routing import RoutingProfile, RoutingReport, device_traffic, routing_report
from quantkit.planner.speed import (
    DeviceRates,
    Layout,
    RuntimeSpeed,
    Speed,
    SpeedModel,
    estimate,
    estimate_runtime,
)
from quantkit.recipe import QUALITY_RANK, RECIPES, Recipe
from quantkit.sizes import format_size

PLAN_VERSION = 1
COMMON_RAM_GIB = (8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)


def spec_fingerprint(spec: ModelSpec) -> str:
    """sha256 over the names and shapes of the language-model tensors (MTP and vision left out, so a
    checkpoint with or without them matches), sorted."""
    h = hashlib.sha256()
    for t in sorted((t for t in spec.tensors if t.role not in (Role.MTP, Role.VISION)), key=lambda t: t.name):
        h.update(f"{t.name}:{','.join(map(str, t.shape))}\n".encode())
    return h.hexdigest()


@dataclass
class Device:
    id: str  # "cuda:0", "mps", "node1.cuda:3", "cpu"
    kind: str  # "gpu" | "cpu"
    name: str
    capacity: int  # bytes the plan may fill (memory minus reserve)
    reserve: int
    bandwidth_gbs: float
    tflops: float
    pcie_gbs: float = float("inf")
    unified: bool = False
    used: dict[str, int] = field(default_factory=dict)

    @property
    def used_bytes(self) -> int:
        return sum(self.used.values())

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used_bytes

    def add(self, what: str, nbytes: int) -> None:
        if nbytes:
            self.used[what] = self.used.get(what, 0) + nbytes

    def rates(self) -> DeviceRates:
        return DeviceRates(self.id, self.kind, self.bandwidth_gbs, self.tflops, self.pcie_gbs)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["pcie_gbs"] = None if self.pcie_gbs == float("inf") else self.pcie_gbs
        d["used_bytes"] = self.used_bytes
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Device:
        d = {k: v for k, v in d.items() if k != "used_bytes"}
        d["pcie_gbs"] = float("inf") if d.get("pcie_gbs") is None else d["pcie_gbs"]
        return cls(**d)


@dataclass
class Plan:
    model: str
    fingerprint: str
    scheme: str
    recipe: dict[str, Any]
    settings: RunSettings
    devices: list[Device]
    layer_device: list[str]  # device of each decoder layer's non-expert weights and caches
    expert_ranges: list[list[tuple[str, int, int]]]  # per layer: (device, first id, last id + 1)
    embedding_device: str
    lm_head_device: str
    num_experts: int
    fits: bool
    reason: str
    total_bytes: int  # what the devices hold (weights, caches, buffers) + reserves of the GPUs used
    card_estimate_gb: float
    speed: Speed | None = None
    assumptions: list[str] = field(default_factory=list)
    components: dict[str, int] = field(default_factory=dict)
    runtime_speed: RuntimeSpeed | None = None  # quantkit's runtime on this host, from a calibration
    runtime_note: str = ""  # why there is no runtime estimate, when a profile was given
    routing: RoutingReport | None = None  # with a routing profile: the traffic the GPUs serve
    traffic: list[dict[str, float]] | None = field(default=None, repr=False)  # per layer: device -> share

    def device(self, dev_id: str) -> Device:
        for d in self.devices:
            if d.id == dev_id:
                return d
        raise KeyError(dev_id)

    def experts_on(self, layer: int, dev_id: str) -> list[int]:
        return [i for d, a, b in self.expert_ranges[layer] if d == dev_id for i in range(a, b)]

    def expert_counts(self) -> list[dict[str, int]]:
        out = []
        for ranges in self.expert_ranges:
            c: dict[str, int] = {}
            for d, a, b in ranges:
                c[d] = c.get(d, 0) + b - a
            out.append(c)
        return out

    @property
    def experts_on_cpu(self) -> int:
        return sum(c.get("cpu", 0) for c in self.expert_counts())

    @property
    def cpu_expert_layers(self) -> int:
        """Layers with at least one expert on the CPU (what llama.cpp's --n-cpu-moe needs)."""
        return sum(1 for c in self.expert_counts() if c.get("cpu", 0))

    @property
    def gpus(self) -> list[Device]:
        return [d for d in self.devices if d.kind == "gpu"]

    @property
    def where(self) -> str:
        """One-word summary: gpu, gpu+cpu or cpu."""
        if not self.gpus or all(d == "cpu" for d in self.layer_device):
            return "cpu"
        if self.experts_on_cpu or any(d == "cpu" for d in self.layer_device):
            return "gpu+cpu"
        return "gpu"

    def summary(self) -> str:
        """Short text: where the model goes."""
        n = len(self.layer_device)
        gpu_layers = sum(1 for d in self.layer_device if d != "cpu")
        if self.where == "cpu":
            return "CPU only"
        if self.where == "gpu":
            return "GPU" if len(self.gpus) == 1 else f"{len(self.gpus)} GPUs"
        exp_gb = self.device("cpu").used.get("experts", 0) / GB
        s = f"GPU + {self.experts_on_cpu}/{n * self.num_experts} experts in RAM ({exp_gb:.1f} GB)"
        if gpu_layers < n:
            s = f"{gpu_layers}/{n} layers on GPU, " + s
        return s

    def short_summary(self) -> str:
        if self.where != "gpu+cpu":
            return self.summary()
        ram = self.device("cpu").used_bytes / GB
        gpu_layers = sum(1 for d in self.layer_device if d != "cpu")
        pre = "" if gpu_layers == len(self.layer_device) else f"{gpu_layers}L "
        return f"{pre}GPU+{ram:.1f}GB RAM"

    def layout(self) -> Layout:
        return Layout(list(self.layer_device), self.expert_counts(), self.embedding_device, self.lm_head_device,
                      self.traffic)

    # -- serialization: the file the runtime consumes -------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        layers = []
        for L, dev in enumerate(self.layer_device):
            layers.append({
                "layer": L,
                "device": dev,
                "experts": {d: self.experts_on(L, d) for d in dict.fromkeys(r[0] for r in self.expert_ranges[L])},
            })
        out = {
            "quantkit_plan": PLAN_VERSION,
            "model": self.model,
            "spec_fingerprint": self.fingerprint,
            "scheme": self.scheme,
            "recipe": self.recipe,
            "settings": asdict(self.settings),
            "num_experts": self.num_experts,
            "devices": [d.to_dict() for d in self.devices],
            "non_expert": {"embedding": self.embedding_device, "lm_head": self.lm_head_device,
                           "final_norm": self.lm_head_device},
            "layers": layers,
            "fits": self.fits,
            "reason": self.reason,
            "total_bytes": self.total_bytes,
            "card_estimate_gb": self.card_estimate_gb,
            "components": self.components,
            "estimates": self.speed.to_dict() if self.speed else None,
            "runtime_estimates": self.runtime_speed.to_dict() if self.runtime_speed else None,
            "assumptions": self.assumptions,
        }
        if self.routing:
            out["routing"] = self.routing.to_dict()
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, data: str | dict[str, Any]) -> Plan:
        try:
            d = json.loads(data) if isinstance(data, str) else data
            if d.get("quantkit_plan") != PLAN_VERSION:
                raise QuantkitError(f"plan version {d.get('quantkit_plan')!r} is not {PLAN_VERSION}")
            ranges = []
            for layer in d["layers"]:
                rs: list[tuple[str, int, int]] = []
                for dev, ids in layer["experts"].items():
                    rs += [(dev, a, b) for a, b in contiguous_runs(ids)]
                ranges.append(rs)
            est = d.get("estimates")
            speed = None
            if est:
                speed = Speed(est["decode_tok_s"], est["decode_tok_s_full_context"], est["prefill_tok_s"],
                              est.get("decode_ms_by_device", {}), est.get("transfers_per_token", 0))
            rt = d.get("runtime_estimates")
            rspeed = None
            if rt:
                rspeed = RuntimeSpeed(rt["decode_tok_s"], rt["decode_tok_s_full_context"],
                                      rt.get("decode_ms_by_device", {}), rt.get("source", ""), rt.get("prefill_tok_s"))
            return cls(
                model=d["model"], fingerprint=d["spec_fingerprint"], scheme=d["scheme"], recipe=d["recipe"],
                settings=RunSettings(**d["settings"]), devices=[Device.from_dict(x) for x in d["devices"]],
                layer_device=[x["device"] for x in d["layers"]], expert_ranges=ranges,
                embedding_device=d["non_expert"]["embedding"], lm_head_device=d["non_expert"]["lm_head"],
                num_experts=d["num_experts"], fits=d["fits"], reason=d.get("reason", ""),
                total_bytes=d["total_bytes"], card_estimate_gb=d["card_estimate_gb"], speed=speed,
                assumptions=d.get("assumptions", []), components=d.get("components", {}), runtime_speed=rspeed,
                routing=RoutingReport.from_dict(d["routing"]) if d.get("routing") else None,
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise QuantkitError(f"plan file is malformed ({type(e).__name__}: {e})") from None

    def recipe_obj(self) -> Recipe:
        return Recipe.from_dict(self.recipe)

    def save(self, path: Path) -> None:
        write_atomic(Path(path), self.to_json())


def is_plan_file(path: Path) -> bool:
    """True for a file `Plan.save` wrote (so `plan --out` may replace it)."""
    try:
        with open(path, "rb") as f:
            return b'"quantkit_plan"' in f.read(256)
    except OSError:
        return False


def contiguous_runs(ids: list[int]) -> list[tuple[int, int]]:
    """Sorted ids as half-open runs: [0, 1, 2, 5] -> [(0, 3), (5, 6)]."""
    runs: list[tuple[int, int]] = []
    for i in sorted(ids):
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def make_devices(hw: Hardware, gpu_reserve: int = DEFAULT_GPU_RESERVE,
                 host_reserve: int = DEFAULT_HOST_RESERVE) -> list[Device]:
    devs: list[Device] = []
    per_node = len(hw.gpus)
    for node in range(hw.nodes):
        for i, g in enumerate(hw.gpus):
            base = "mps" if g.unified else f"cuda:{i}"
            if g.unified and per_node > 1:
                base = f"mps:{i}"
            dev_id = f"node{node}.{base}" if hw.nodes > 1 else base
            devs.append(Device(dev_id, "gpu", g.name, max(0, g.usable_bytes - gpu_reserve), gpu_reserve,
                               g.bandwidth_gbs, g.fp16_tflops, g.pcie_gbs, g.unified))
    h = hw.host
    devs.append(Device("cpu", "cpu", "host RAM", max(0, h.ram_bytes - host_reserve), host_reserve,
                       h.cpu_bandwidth_gbs, h.cpu_tflops, float("inf"), hw.unified))
    return devs


def _place_head(gpus: list[Device], b: Budget, tied: bool) -> str:
    """lm_head, final norm and logits (and a tied embedding, and MTP if it fits) on the last GPU when they fit
    beside one activation buffer; else they stay for the CPU. Returns the head's device."""
    if not gpus:
        return "cpu"
    last = gpus[-1]
    head = b.lm_head + b.final_norm + b.logits + (b.embedding if tied else 0)
    if head + b.activations > last.capacity:
        return "cpu"
    last.add("lm_head+norm", b.lm_head + b.final_norm)
    last.add("logits", b.logits)
    if tied:
        last.add("embedding", b.embedding)
    if b.mtp and b.mtp + head + b.activations <= last.capacity:
        last.add("mtp", b.mtp)
    return last.id


def _assign_layers(gpus: list[Device], b: Budget, n: int, e: int) -> list[str]:
    """Each layer's device: contiguous runs of layers over the GPUs in proportion to their free memory, the
    first layers on the CPU when even their dense part does not fit."""
    layer_dev = ["cpu"] * n
    if not gpus:
        return layer_dev
    dense = [b.layer_dense[L] + b.layer_cache[L] for L in range(n)]
    full = [dense[L] + e * b.expert_bytes[L] for L in range(n)]
    # each GPU that computes layers holds its own activation buffer
    free = [max(0, g.free_bytes - b.activations) for g in gpus]
    first = 0
    while first < n and sum(dense[first:]) > sum(free):
        first += 1
    total_full = sum(full[first:]) or 1
    bounds, acc = [], 0
    for f in free:
        acc += f
        bounds.append(acc / (sum(free) or 1) * total_full)
    gi, cum = 0, 0
    dense_used = [0] * len(gpus)
    for L in range(first, n):
        while gi < len(gpus) - 1 and (cum + full[L] / 2 > bounds[gi] or dense_used[gi] + dense[L] > free[gi]):
            gi += 1
        if dense_used[gi] + dense[L] > free[gi]:
            continue  # no GPU left with room: this layer stays on the CPU
        layer_dev[L] = gpus[gi].id
        dense_used[gi] += dense[L]
        cum += full[L]
    return layer_dev


def _fill_gpus(gpus: list[Device], b: Budget, layer_dev: list[str], e: int,
               cpu_expert_layers: int | None, shares: list[list[float]] | None = None) -> list[list[int]]:
    """Charge each GPU its layers' dense parts, then as many of their experts as fit, from the last layer
    backwards so the CPU gets the first layers' experts (with routing `shares`: most-routed pairs first,
    `_fill_by_traffic`). Returns the expert ids per layer on its GPU."""
    n = len(layer_dev)
    gpu_experts: list[list[int]] = [[] for _ in range(n)]  # experts of layer L on its layer device (a GPU)
    forced = set(range(cpu_expert_layers)) if cpu_expert_layers is not None else set()
    for g in gpus:
        mine = [L for L in range(n) if layer_dev[L] == g.id]
        if mine:
            g.add("activations", b.activations)
        for L in mine:
            g.add("dense", b.layer_dense[L])
            g.add("cache", b.layer_cache[L])
        order = [L for L in reversed(mine) if L not in forced]
        if shares is not None:
            _fill_by_traffic(g, b, order, shares, gpu_experts)
            continue
        for L in order:
            k = min(e, max(0, g.free_bytes) // b.expert_bytes[L]) if b.expert_bytes[L] else e
            gpu_experts[L] = list(range(k))
            g.add("experts", k * b.expert_bytes[L])
    return gpu_experts


def _fill_by_traffic(g: Device, b: Budget, order: list[int], shares: list[list[float]],
                     gpu_experts: list[list[int]]) -> None:
    """Fill `g` with the (layer, expert) pairs of the layers `order` by their share of the layer's routed
    tokens, highest first (ties: `order`, then expert id), each one that still fits."""
    rank = {L: i for i, L in enumerate(order)}
    pairs = sorted(((L, x) for L in order for x in range(len(shares[L]))),
                   key=lambda p: (-shares[p[0]][p[1]], rank[p[0]], p[1]))
    for L, x in pairs:
        if not b.expert_bytes[L] or b.expert_bytes[L] <= g.free_bytes:
            gpu_experts[L].append(x)
            g.add("experts", b.expert_bytes[L])
    for L in order:
        gpu_experts[L].sort()


def _fill_cpu(cpu: Device, gpus: list[Device], b: Budget, layer_dev: list[str], gpu_experts: list[list[int]], e: int,
              head_dev: str, tied: bool) -> None:
    """The CPU takes everything the GPUs did not; on unified memory what the GPU holds is not free for it."""
    if not tied or head_dev == "cpu":
        cpu.add("embedding", b.embedding)
    if head_dev == "cpu":
        cpu.add("lm_head+norm", b.lm_head + b.final_norm)
        cpu.add("logits", b.logits)
    if b.mtp and not any(g.used.get("mtp") for g in gpus):
        cpu.add("mtp", b.mtp)
    cpu_compute = False
    for L in range(len(layer_dev)):
        if layer_dev[L] == "cpu":
            cpu.add("dense", b.layer_dense[L])
            cpu.add("cache", b.layer_cache[L])
            gpu_experts[L] = []
        k_cpu = e - len(gpu_experts[L])
        if k_cpu:
            cpu.add("experts", k_cpu * b.expert_bytes[L])
            cpu_compute = True
    if cpu_compute or not gpus:
        cpu.add("activations", b.activations)
    if cpu.unified:
        shared = sum(g.used_bytes + g.reserve for g in gpus)
        cpu.capacity = max(0, cpu.capacity - shared)


def _expert_ranges(layer_dev: list[str], gpu_experts: list[list[int]], e: int) -> list[list[tuple[str, int, int]]]:
    """Per layer: its GPU's experts, then the CPU's, each as contiguous runs of ids."""
    ranges = []
    for L, ids in enumerate(gpu_experts):
        on_gpu = set(ids)
        rs = [(layer_dev[L], a, b) for a, b in contiguous_runs(ids)]
        rs += [("cpu", a, b) for a, b in contiguous_runs([x for x in range(e) if x not in on_gpu])]
        ranges.append(rs)
    return ranges


def _verdict(devs: list[Device], hw: Hardware, layer_dev: list[str]) -> tuple[bool, str, int]:
    """(fits, reason, total bytes): the budget's weights, caches and buffers plus each used GPU's reserve."""
    gpus = [d for d in devs if d.kind == "gpu"]
    cpu = devs[-1]
    total = sum(d.used_bytes for d in devs) + sum(g.reserve for g in gpus if g.used_bytes)
    if any(d.used_bytes > d.capacity for d in devs):
        # sized to the difference, so a near miss reads as one (26.5 MB more), never as "0.0 GB more"
        ram, usable = format_size(cpu.used_bytes), format_size(cpu.capacity)
        return False, (f"needs {total / GB:.1f} GB: the GPUs hold {sum(g.used_bytes for g in gpus) / GB:.1f} GB and "
                       f"{ram} would go to RAM, {format_size(cpu.used_bytes - cpu.capacity)} more than the "
                       f"{usable} usable"), total
    if hw.nodes > 1 and (cpu.used.get("experts") or any(d == "cpu" for d in layer_dev)):
        return False, "a multi-node plan must fit in GPU memory (vLLM does not keep experts in host RAM)", total
    return True, "", total


def _add_speed(plan: Plan, b: Budget, spec: ModelSpec, recipe: Recipe, hw: Hardware, sm: SpeedModel,
               gpu_reserve: int, host_reserve: int, profile: RuntimeProfile | None, profile_source: str) -> None:
    """The llama.cpp-grade speed estimate, and with a calibrated `profile` quantkit's own runtime's."""
    layout, rates = plan.layout(), {d.id: d.rates() for d in plan.devices}
    plan.speed = estimate(b, layout, rates, spec.config, sm)
    plan.assumptions = assumptions(hw, sm, gpu_reserve, host_reserve)
    if profile is None:
        return
    try:
        costs = runtime_costs(profile, spec, recipe, profile_source)
    except QuantkitError as e:
        plan.runtime_note = str(e)
        return
    plan.runtime_speed = estimate_runtime(b, layout, rates, spec.config, costs, sm)
    if plan.runtime_speed is None:
        plan.runtime_note = "the calibrated runtime estimate is for batch 1"


def solve(spec: ModelSpec, recipe: Recipe, settings: RunSettings, hw: Hardware, *,
          gpu_reserve: int = DEFAULT_GPU_RESERVE, host_reserve: int = DEFAULT_HOST_RESERVE,
          cpu_expert_layers: int | None = None, speed_model: SpeedModel | None = None,
          budget: Budget | None = None, with_speed: bool = True, profile: RuntimeProfile | None = None,
          profile_source: str = "", routing: RoutingProfile | None = None) -> Plan:
    """Place one scheme. `cpu_expert_layers` forces the experts of the first N layers onto the CPU
    (llama.cpp's --n-cpu-moe) instead of filling the GPUs greedily. With a runtime `profile` of this
    host (`quantkit profile-host`), the plan also gets quantkit's own runtime decode estimate. With a
    `routing` profile the GPUs take the most-routed experts first and the speed uses the measured traffic."""
    b = budget or compute_budget(spec, recipe, settings)
    c = spec.config
    n, e, tied = c.num_hidden_layers, c.num_experts, c.tie_word_embeddings
    devs = make_devices(hw, gpu_reserve, host_reserve)
    gpus, cpu = [d for d in devs if d.kind == "gpu"], devs[-1]
    head_dev = _place_head(gpus, b, tied)
    layer_dev = _assign_layers(gpus, b, n, e)
    shares = routing.shares if routing else None
    if shares is not None and (len(shares) != n or any(len(r) != e for r in shares)):
        raise QuantkitError(f"routing profile {routing.source} is for {len(shares)} layers x {len(shares[0]) if shares else 0} "
                            f"experts, the model has {n} x {e}")
    gpu_experts = _fill_gpus(gpus, b, layer_dev, e, cpu_expert_layers, shares)
    _fill_cpu(cpu, gpus, b, layer_dev, gpu_experts, e, head_dev, tied)
    fits, reason, total = _verdict(devs, hw, layer_dev)
    plan = Plan(
        model=spec.name, fingerprint=spec_fingerprint(spec), scheme=recipe.name, recipe=recipe.to_dict(),
        settings=settings, devices=devs, layer_device=layer_dev, expert_ranges=_expert_ranges(layer_dev, gpu_experts, e),
        embedding_device=head_dev if tied else "cpu", lm_head_device=head_dev, num_experts=e, fits=fits,
        reason=reason, total_bytes=total,
        card_estimate_gb=card_estimate_gb(recipe.nominal_bits, settings.context, card_params(spec)),
        components=b.components(),
    )
    sm = speed_model or SpeedModel()
    if routing is not None and shares is not None:
        plan.traffic = device_traffic(plan.expert_ranges, shares)
        plan.routing = routing_report(routing, plan.expert_ranges, e, {g.id for g in gpus})
        sm = replace(sm, routing=f"measured ({routing.source})")
    if with_speed:
        _add_speed(plan, b, spec, recipe, hw, sm, gpu_reserve, host_reserve, profile, profile_source)
    return plan


def assumptions(hw: Hardware, sm: SpeedModel, gpu_reserve: int, host_reserve: int) -> list[str]:
    h = hw.host
    out = [
        f"runtime reserve {gpu_reserve / GIB:.2f} GiB per GPU (llama.cpp --fit leaves 1 GiB, Ollama 457 MiB "
        f"+ a layer, vLLM 8% of the card); {host_reserve / GIB:.0f} GiB of RAM kept for the OS and Python",
        f"CPU memory bandwidth {h.cpu_bandwidth_gbs:g} GB/s ({h.bandwidth_source}"
        + ("; pass --cpu-bandwidth for yours" if h.bandwidth_source == "assumed" else "")
        + f"), CPU prefill {h.cpu_tflops:g} TFLOP/s",
        "logits for the last position of each sequence only; attention via SDPA/flash (no score matrix)",
    ]
    if hw.unified:
        out.append("unified memory: the GPU may wire 75% of it (macOS default); CPU and GPU share one pool")
    return out + sm.assumptions()


def max_context(spec: ModelSpec, recipe: Recipe, settings: RunSettings, hw: Hardware, *, on_gpu: bool = False,
                **kw: Any) -> int:
    """The longest context (a multiple of 256 above 256, up to the model's maximum) that still fits (with
    `on_gpu`: fits with nothing but the embedding off the GPUs); 0 if none."""
    hi = spec.config.max_position_embeddings
    kw.pop("budget", None)
    base = compute_budget(spec, recipe, settings)

    def ok(ctx: int) -> bool:
        st = _with(settings, context=ctx)
        p = solve(spec, recipe, st, hw, with_speed=False, budget=with_settings(base, spec.config, st), **kw)
        return p.fits and (not on_gpu or p.where == "gpu")

    if ok(hi):
        return hi
    if not ok(1):
        return 0
    lo = 1  # ok(lo), not ok(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo - lo % 256 if lo >= 256 else lo


def _with(s: RunSettings, **kw: Any) -> RunSettings:
    d = asdict(s)
    d.update(kw)
    return RunSettings(**d)


@dataclass
class SchemeResult:
    plan: Plan
    max_context: int
    max_context_on_gpu: int = 0

    def to_dict(self) -> dict[str, Any]:
        p = self.plan
        s = p.speed
        gpu_used = {g.id: round(g.used_bytes / GB, 2) for g in p.gpus}
        return {
            "scheme": p.scheme,
            "context": p.settings.context,
            "card_estimate_gb": p.card_estimate_gb,
            "total_gb": round(p.total_bytes / GB, 2),
            "fits": p.fits,
            "placement": {
                "where": p.where,
                "summary": p.summary(),
                "gpu_gb": gpu_used,
                "ram_gb": round(p.device("cpu").used_bytes / GB, 2),
                "experts_on_cpu": p.experts_on_cpu,
                "cpu_expert_layers": p.cpu_expert_layers,
                "gpu_layers": sum(1 for d in p.layer_device if d != "cpu"),
            },
            "max_context": self.max_context,
            "max_context_on_gpu": self.max_context_on_gpu,
            "est_decode_tok_s": round(s.decode_tok_s, 1) if s else None,
            "est_decode_tok_s_full_context": round(s.decode_tok_s_full_context, 1) if s else None,
            "est_prefill_tok_s": round(s.prefill_tok_s, 1) if s else None,
            "runtime_decode_tok_s": round(p.runtime_speed.decode_tok_s, 1) if p.runtime_speed else None,
            "runtime_prefill_tok_s": (round(p.runtime_speed.prefill_tok_s, 1)
                                      if p.runtime_speed and p.runtime_speed.prefill_tok_s is not None else None),
            "components_bytes": p.components,
            "reason": p.reason,
        }


def plan_schemes(spec: ModelSpec, hw: Hardware, settings: RunSettings, schemes: list[str | Recipe] | None = None,
                 **kw: Any) -> list[SchemeResult]:
    """One result per scheme (a name in RECIPES, or a Recipe: a quantized folder's own)."""
    out = []
    for name in schemes or list(RECIPES):
        r = name if isinstance(name, Recipe) else RECIPES[name]
        p = solve(spec, r, settings, hw, **kw)
        on_gpu = max_context(spec, r, settings, hw, on_gpu=True, **kw) if hw.gpus else 0
        out.append(SchemeResult(p, max_context(spec, r, settings, hw, **kw), on_gpu))
    return out


# The quality floor of a recommendation: routed experts at 4 bits with attention, linear attention and the
# shared expert at 8 (the `quality` recipe; REFERENCE section 3: such a Q4_K_M is at KL 0.010 against bf16,
# a uniform 4-bit file at 0.052). Schemes ranked below it are recommended only when nothing above fits.
DEFAULT_QUALITY_FLOOR = "quality"


def recommend(results: list[SchemeResult], floor: str = DEFAULT_QUALITY_FLOOR) -> SchemeResult | None:
    """The fastest scheme (by the plan's own decode estimate) that fits with quality at or above `floor`
    (QUALITY_RANK); ties go to the higher quality. Below the floor only when nothing at or above it fits."""
    ok = [r for r in results if r.plan.fits and r.plan.speed]
    if not ok:
        return None
    least = QUALITY_RANK.get(floor, 0)
    pool = [r for r in ok if QUALITY_RANK.get(r.plan.scheme, 0) >= least] or ok
    return max(pool, key=lambda r: (round(r.plan.speed.decode_tok_s, 1), QUALITY_RANK.get(r.plan.scheme, 0)))


def choose(rows: list[SchemeResult], context: int, schemes: list[str], spec: ModelSpec, hw: Hardware,
           floor: str = DEFAULT_QUALITY_FLOOR, **kw: Any) -> SchemeResult:
    """The plan to recommend at `context`: the one scheme asked for when it fits, else `recommend`'s.
    When none does, one error line says why and what would fit."""
    first = [r for r in rows if r.plan.settings.context == context]
    chosen = recommend(first, floor)
    if schemes and len(schemes) == 1:
        chosen = first[0] if first[0].plan.fits else None
    if chosen is not None:
        return chosen
    failed = first[0].plan if schemes else max(first, key=lambda r: -r.plan.total_bytes).plan
    alts = suggestions(spec, hw, failed.settings, failed, **kw)
    what = f"{failed.scheme} does not fit" if schemes else "no scheme fits"
    hint = ("; what fits: " + "; ".join(alts)) if alts else "; nothing fits this hardware, add RAM or GPUs"
    raise QuantkitError(f"{what} on {hw.describe()}: {failed.reason}{hint}")


def ram_needed_gib(plan: Plan, host_reserve: int = DEFAULT_HOST_RESERVE) -> int:
    """The smallest common RAM size that would hold what this plan puts in RAM."""
    cpu = plan.device("cpu")
    need = cpu.used_bytes + host_reserve + (sum(g.used_bytes + g.reserve for g in plan.gpus) if cpu.unified else 0)
    for size in COMMON_RAM_GIB:
        if size * GIB >= need:
            return size
    return -(-need // GIB)


def suggestions(spec: ModelSpec, hw: Hardware, settings: RunSettings, failed: Plan, **kw: Any) -> list[str]:
    """What would fit instead of `failed`: other schemes, a shorter context, more RAM."""
    out = []
    others = [r for r in plan_schemes(spec, hw, settings, **kw) if r.plan.fits]
    others.sort(key=lambda r: -QUALITY_RANK.get(r.plan.scheme, 0))
    for r in others[:3]:
        p = r.plan
        out.append(f"{p.scheme} ({p.total_bytes / GB:.1f} GB, {p.summary()}, ~{p.speed.decode_tok_s:.0f} tok/s)")
    mc = max_context(spec, RECIPES[failed.scheme], settings, hw, **kw)
    if 0 < mc < settings.context:
        out.append(f"{failed.scheme} at --context {mc}")
    if not failed.fits and hw.nodes == 1:
        out.append(f"{failed.scheme} with --ram {ram_needed_gib(failed)}GiB")
    return out
