"""Hardware: the GPU catalog (profiles/gpus.json), forgiving name lookup, host RAM/bandwidth and detection."""

from __future__ import annotations

import difflib
import json
import math
import re
from dataclasses import dataclass, field, replace
from functools import lru_cache
from importlib import resources
from pathlib import Path

from quantkit import sizes
from quantkit.errors import QuantkitError

GIB = 1 << 30
# Peak of a dual-channel DDR5-4000 desktop. psutil cannot measure bandwidth, so this is an assumption
# the output states; pass --cpu-bandwidth for your machine (DDR4-3200 x2: 51, DDR5-6000 x2: 96,
# 8-channel DDR5-4800 server: 307 GB/s).
DEFAULT_CPU_BANDWIDTH_GBS = 64.0
# Effective dense matmul throughput of the CPU for prefill (TFLOP/s); a 16-core AVX-512 desktop running
# llama.cpp reaches about 1.3 (Qwen3-30B-A3B prefill, REFERENCE section 3).
DEFAULT_CPU_TFLOPS = 1.0
# Per-GPU runtime reserve: CUDA context, cuBLAS/kernels and allocator slack. llama.cpp --fit leaves
# 1024 MiB per device, Ollama 457 MiB + one layer, accelerate warns 1-2 GB for the first CUDA
# allocation, vLLM leaves 8% of the card: 1 GiB sits in the middle and matches llama.cpp.
DEFAULT_GPU_RESERVE = 1 * GIB
# Host RAM kept for the OS, Python + torch (about 1 GiB resident) and some page cache.
DEFAULT_HOST_RESERVE = 3 * GIB
# macOS wires at most about 75% of unified memory for the GPU by default (iogpu.wired_limit_mb).
APPLE_GPU_FRACTION = 0.75
_PCIE_LANE_GBS = {"3.0": 0.985, "4.0": 1.969, "5.0": 3.938}
# Bounds on the hardware a plan models, checked before any work: the planner builds one device per node and
# GPU and its placement walks all of them, so an unbounded count would make `plan` run and grow without end.
# Each is above real clusters: a server holds 8-16 GPUs (64 per node leaves room for any chassis); the largest
# deployments of a model this size span tens of nodes; 1024 GPUs in all already leave this model's 40 layers
# of 256 experts about ten experts a card.
MAX_NODES = 1024
MAX_GPUS_PER_NODE = 64
MAX_GPUS = 1024
# a custom card's bandwidth (GB/s): ten times the fastest HBM stack of today
MAX_BANDWIDTH_GBS = 100_000.0


@dataclass(frozen=True)
class GPU:
    id: str
    name: str
    vendor: str
    family: str
    compute: str
    memory_gib: float
    bandwidth_gbs: float
    fp16_tflops: float
    native: tuple[str, ...]
    pcie: str | None
    unified: bool = False
    aliases: tuple[str, ...] = ()
    detected: bool = False

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * GIB)

    @property
    def usable_bytes(self) -> int:
        """Memory the GPU may hold at all (Apple: the wired limit)."""
        return int(self.memory_bytes * APPLE_GPU_FRACTION) if self.unified else self.memory_bytes

    @property
    def pcie_gbs(self) -> float:
        """Host link bandwidth (GB/s); unified memory needs no copy (inf)."""
        if self.unified or not self.pcie:
            return float("inf")
        gen, lanes = self.pcie.split("x")
        return _PCIE_LANE_GBS.get(gen, 1.969) * int(lanes)

    def with_memory(self, gib: float) -> GPU:
        return replace(self, memory_gib=gib)


@dataclass(frozen=True)
class Host:
    ram_bytes: int
    cpu_bandwidth_gbs: float = DEFAULT_CPU_BANDWIDTH_GBS
    cpu_tflops: float = DEFAULT_CPU_TFLOPS
    ram_source: str = "--ram"
    bandwidth_source: str = "assumed"


@dataclass(frozen=True)
class Hardware:
    gpus: tuple[GPU, ...]
    host: Host
    nodes: int = 1
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def unified(self) -> bool:
        return any(g.unified for g in self.gpus)

    def describe(self) -> str:
        parts = []
        if self.gpus:
            counts: dict[str, int] = {}
            for g in self.gpus:
                counts[g.name] = counts.get(g.name, 0) + 1
            parts.append(" + ".join(f"{n}x {k}" if n > 1 else k for k, n in counts.items()))
            if self.nodes > 1:
                parts[-1] = f"{self.nodes} nodes x ({parts[-1]})"
        else:
            parts.append("no GPU")
        parts.append(f"{self.host.ram_bytes / GIB:.0f} GiB RAM ({self.host.ram_source})")
        parts.append(f"CPU {self.host.cpu_bandwidth_gbs:g} GB/s ({self.host.bandwidth_source})")
        return ", ".join(parts)


def _norm(s: str) -> str:
    s = s.lower()
    for w in ("nvidia", "geforce", "amd", "radeon", "apple", "tesla", "instinct", "generation", "graphics"):
        s = s.replace(w, "")
    return re.sub(r"[^a-z0-9]", "", s)


def _short(key: str) -> str:
    return re.sub(r"^(rtx|gtx|rx)", "", key)


@lru_cache(maxsize=1)
def load_catalog() -> tuple[GPU, ...]:
    path = resources.files("quantkit") / "profiles" / "gpus.json"
    data = json.loads(path.read_text())
    return tuple(
        GPU(
            id=d["id"], name=d["name"], vendor=d["vendor"], family=d["family"], compute=d["compute"],
            memory_gib=float(d["memory_gib"]), bandwidth_gbs=float(d["bandwidth_gbs"]),
            fp16_tflops=float(d["fp16_tflops"]), native=tuple(d["native"]), pcie=d.get("pcie"),
            unified=bool(d.get("unified", False)), aliases=tuple(d.get("aliases", ())),
        )
        for d in data["gpus"]
    )


@lru_cache(maxsize=1)
def _index() -> tuple[dict[str, GPU], dict[str, list[GPU]]]:
    """(explicit keys: id and aliases -> GPU, derived keys: names and prefix-less forms -> GPUs)."""
    explicit: dict[str, GPU] = {}
    derived: dict[str, list[GPU]] = {}
    for g in load_catalog():
        for k in (g.id, *g.aliases):
            explicit[_norm(k)] = g
        for k in {_norm(g.id), _norm(g.name), *(_norm(a) for a in g.aliases)}:
            for kk in {k, _short(k)}:
                if g not in derived.setdefault(kk, []):
                    derived[kk].append(g)
    for k, g in list(explicit.items()):
        explicit.setdefault(_short(k), g)
    return explicit, derived


def find_gpu(name: str) -> GPU:
    """Look a GPU up by id, alias or marketing name, forgiving case, spaces, dashes and vendor words."""
    key = _norm(name)
    explicit, derived = _index()
    if key in explicit:
        return explicit[key]
    hits = derived.get(key, [])
    if len(hits) == 1:
        return hits[0]
    if len(hits) > 1:
        raise QuantkitError(f"GPU {name!r} is ambiguous: use one of {', '.join(g.id for g in hits)}")
    # prefix match on a unique catalog entry ("rtx4060ti" -> rtx4060ti-8gb / -16gb is ambiguous)
    pref = [g for g in load_catalog() if _norm(g.id).startswith(key) or _short(_norm(g.id)).startswith(key)]
    if key and len(pref) == 1:
        return pref[0]
    if len(pref) > 1:
        raise QuantkitError(f"GPU {name!r} is ambiguous: use one of {', '.join(g.id for g in pref)}")
    close = difflib.get_close_matches(key, list(derived), n=5, cutoff=0.5)
    ids: list[str] = []
    for k in close:
        for g in derived[k]:
            if g.id not in ids:
                ids.append(g.id)
    hint = f"; did you mean {', '.join(ids[:4])}?" if ids else ""
    raise QuantkitError(f"unknown GPU {name!r}{hint} (`quantkit gpus` lists the catalog)")


_COUNT_RE = re.compile(r"^\s*(\d{1,2})\s*[x*]\s*(.+)$", re.I)


NO_GPU = ("none", "cpu")  # `--gpu none` / `--gpu cpu`: plan for the CPU alone
CUSTOM_BANDWIDTH_GBS = 500.0  # a custom card without a bandwidth (as for a detected card not in the catalog)
_BANDWIDTH_RE = re.compile(r"^\s*[-+]?(?:\d|\.\d|inf|nan)", re.I)


def custom_gpu(spec: str) -> GPU:
    """`custom:VRAM[,BANDWIDTH]` (VRAM by the size rule, a bare number in GiB; bandwidth in GB/s) -> a GPU
    outside the catalog."""
    body = spec.split(":", 1)[1] if ":" in spec else ""
    vram, _, bw = body.partition(",")
    if not vram.strip():
        raise QuantkitError(f"--gpu {spec!r}: give custom:VRAM[,BANDWIDTH], e.g. custom:24GiB,936")
    mem = sizes.parse_size(vram, f"--gpu {spec!r}: VRAM", bare_unit=GIB)
    if mem <= 0:
        raise QuantkitError(f"--gpu {spec!r}: VRAM must be more than 0")
    if bw.strip():
        m = re.match(r"^\s*(\S+?)\s*(?:gb/?s)?\s*$", bw, re.I)
        try:
            gbs = float(m.group(1)) if m else math.nan
        except ValueError:
            gbs = math.nan
        if not (math.isfinite(gbs) and 0 < gbs <= MAX_BANDWIDTH_GBS):
            raise QuantkitError(f"--gpu {spec!r}: bandwidth {bw.strip()!r} must be a finite number of GB/s above 0 "
                                f"and at most {MAX_BANDWIDTH_GBS:,.0f}, e.g. custom:24GiB,936")
        bw_text = f"{gbs:g} GB/s"
    else:
        gbs, bw_text = CUSTOM_BANDWIDTH_GBS, f"bandwidth assumed {CUSTOM_BANDWIDTH_GBS:.0f} GB/s"
    gib = mem / GIB
    return GPU(id=f"custom-{gib:g}gib", name=f"custom GPU ({gib:g} GiB, {bw_text})", vendor="nvidia",
               family="custom", compute="", memory_gib=gib, bandwidth_gbs=gbs, fp16_tflops=50.0 * gbs / 500.0,
               native=("fp16",), pcie="4.0x16")


def _gpu_parts(arg: str) -> list[str]:
    """`arg` split at commas, keeping `custom:VRAM,BANDWIDTH` together: after a custom card, a part that reads
    as a number (`936`, `936GB/s`, also `inf`, `-5` or `1e3`, which custom_gpu then refuses by name) is its
    bandwidth, never a GPU name."""
    out: list[str] = []
    for part in arg.split(","):
        if out and "custom:" in out[-1].lower() and "," not in out[-1] and _BANDWIDTH_RE.match(part) \
                and not _COUNT_RE.match(part):
            out[-1] += "," + part
        else:
            out.append(part)
    return out


def _check_per_node(n: int) -> None:
    if n > MAX_GPUS_PER_NODE:
        raise QuantkitError(f"--gpu names {n} GPUs per node; quantkit plans at most {MAX_GPUS_PER_NODE} per node "
                            "(--nodes N repeats them)")


def parse_gpu_arg(arg: str) -> list[GPU]:
    """`rtx4090`, `2x3090`, `"RTX 4090"`, `rtx3090,rtx3060`, `custom:24GiB,936`, `2xcustom:16` -> GPUs;
    `none` or `cpu` -> no GPU (only alone)."""
    if arg.strip().lower() in NO_GPU:
        return []
    out: list[GPU] = []
    for part in _gpu_parts(arg):
        part = part.strip()
        if not part:
            continue
        if part.lower() in NO_GPU:
            raise QuantkitError(f"--gpu {arg!r}: {part} means no GPU at all; give it alone")
        m = _COUNT_RE.match(part)
        n, name = (int(m.group(1)), m.group(2)) if m else (1, part)
        if n <= 0 or n > MAX_GPUS_PER_NODE:
            raise QuantkitError(f"GPU count in {part!r} must be between 1 and {MAX_GPUS_PER_NODE}")
        out += [custom_gpu(name) if name.strip().lower().startswith("custom") else find_gpu(name)] * n
        _check_per_node(len(out))
    if not out:
        raise QuantkitError(f"no GPU named in {arg!r}")
    return out


def parse_size(text: str, what: str = "--ram") -> int:
    """A memory size under quantkit's one size rule (quantkit/sizes.py: GB = 10^9, GiB = 2^30); a bare
    number is GiB (`--ram 64`)."""
    return sizes.parse_size(text, what, bare_unit=GIB)


def parse_bandwidth(text: str) -> float:
    """`80`, `80GB/s`, `80 GB/s` -> GB/s."""
    m = re.match(r"^\s*(\d+(?:\.\d+)?)\s*(gb/?s|g)?\s*$", text or "", re.I)
    if not m or float(m.group(1)) <= 0:
        raise QuantkitError(f"CPU bandwidth {text!r} does not parse; give GB/s, e.g. 80 or 80GB/s")
    return float(m.group(1))


def detect_gpus() -> tuple[list[GPU], list[str]]:
    """Local GPUs via torch (CUDA/ROCm, then Apple MPS), matched to the catalog for bandwidth."""
    notes: list[str] = []
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return [], ["torch is not importable: no GPU detection"]
    gpus: list[GPU] = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gib = p.total_memory / GIB
            try:
                g = find_gpu(p.name)
                g = replace(g, memory_gib=round(gib, 2), detected=True)
            except QuantkitError:
                g = GPU(id=f"cuda{i}", name=p.name, vendor="nvidia", family="unknown",
                        compute=f"sm_{p.major}{p.minor}", memory_gib=round(gib, 2), bandwidth_gbs=500.0,
                        fp16_tflops=50.0, native=("fp16",), pcie="4.0x16", detected=True)
                notes.append(f"{p.name} is not in the catalog: assuming 500 GB/s memory bandwidth")
            gpus.append(g)
    elif getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        import psutil

        gib = psutil.virtual_memory().total / GIB
        apple = [g for g in load_catalog() if g.unified]
        g = min(apple, key=lambda a: abs(a.memory_gib - gib))
        gpus.append(replace(g, memory_gib=round(gib, 1), detected=True,
                            name=f"Apple silicon ({gib:.0f} GiB unified; bandwidth as {g.name})"))
        notes.append(f"Apple GPU detected via MPS; chip model unknown, bandwidth taken from {g.name}")
    return gpus, notes


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux, else what platform knows)."""
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def detect_ram() -> int:
    import psutil

    return int(psutil.virtual_memory().total)


def build_hardware(gpu_args: list[str] | None, ram: str | None = None, cpu_bandwidth: str | None = None,
                   nodes: int = 1, cpu_tflops: float | None = None, *, ram_bytes: int | None = None) -> Hardware:
    """Hardware from CLI-style arguments (or `ram_bytes` measured by the caller); what is not given is detected,
    and the notes say so."""
    notes: list[str] = []
    if not 1 <= nodes <= MAX_NODES:
        raise QuantkitError(f"--nodes {nodes} must be between 1 and {MAX_NODES}")
    if gpu_args:
        if len(gpu_args) > 1 and any(a.strip().lower() in NO_GPU for a in gpu_args):
            raise QuantkitError("--gpu none (or cpu) means no GPU at all; give it alone")
        gpus = []
        for a in gpu_args:
            gpus += parse_gpu_arg(a)
            _check_per_node(len(gpus))
        if not gpus:
            notes.append("--gpu none: planning for the CPU alone")
    else:
        gpus, dnotes = detect_gpus()
        notes += dnotes
        found = ", ".join(g.name for g in gpus) if gpus else "no GPU"
        notes.append(f"no --gpu given: detected {found}")
    if len(gpus) * nodes > MAX_GPUS:
        raise QuantkitError(f"--nodes {nodes} x {len(gpus)} GPUs is {len(gpus) * nodes} GPUs; quantkit plans at "
                            f"most {MAX_GPUS} in all")
    if ram_bytes is not None:
        src = "free now"
    elif ram is not None:
        ram_bytes, src = parse_size(ram), "--ram"
    else:
        ram_bytes, src = detect_ram(), "detected"
        notes.append(f"no --ram given: this machine has {ram_bytes / GIB:.1f} GiB (psutil)")
    if gpus and any(g.unified for g in gpus) and ram is None and gpu_args:
        # an Apple chip named on the command line: its unified memory is the RAM
        ram_bytes, src = max(g.memory_bytes for g in gpus if g.unified), "unified"
        notes[-1] = f"unified memory: {ram_bytes / GIB:.0f} GiB shared by CPU and GPU"
    if cpu_bandwidth is not None:
        bw, bsrc = parse_bandwidth(cpu_bandwidth), "--cpu-bandwidth"
    elif gpus and all(g.unified for g in gpus):
        bw, bsrc = gpus[0].bandwidth_gbs, "unified"
    else:
        bw, bsrc = DEFAULT_CPU_BANDWIDTH_GBS, "assumed"
    host = Host(ram_bytes=ram_bytes, cpu_bandwidth_gbs=bw, cpu_tflops=cpu_tflops or DEFAULT_CPU_TFLOPS,
                ram_source=src, bandwidth_source=bsrc)
    return Hardware(gpus=tuple(gpus), host=host, nodes=nodes, notes=tuple(notes))
