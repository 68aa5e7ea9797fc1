"""What quantkit's own CPU runtime costs on this host, measured by `quantkit profile-host`, and the
per-layer decode costs the planner composes from it.

The planner's generic speed model (speed.py) has llama.cpp-grade rates: bytes over 60% of the memory
bandwidth plus 50 us per layer. quantkit's runtime is slower than that on a CPU, and not by a constant
factor: at batch 1 torch's int4 kernel is compute-bound, bitsandbytes' is not, and each layer pays
~100 small torch ops whose cost depends on the CPU and the Python build. So for plans on this host
the planner also gives a runtime estimate built from two kinds of measurement, each taken in isolation
on the host (quantkit/runtime/calibrate.py), never from a whole-model run:

- `matmul_s[spec][shape]`: one batch-1 call of the runtime's kernel for a matrix of that format and
  shape, with the weights out of the CPU caches (the call cycles over copies larger than the LLC);
- `moe_s[experts' spec key][gate_up shape + down shape]`: one decode step through a layer's routed
  experts where the runtime fuses them (runtime/qexperts.py: one `qk.moe` call runs the top_k experts
  on quantkit's C++ kernel: int4/int8 with AVX2 or AVX512-VNNI, bf16 with AVX512-BF16): the experts
  module's own forward, Python included, on real weights cycled out of the caches. Present exactly
  for the formats this host fuses;
- `layer_ops_s[layer type]`: a decode step through one decoder layer of the model's real dimensions
  with every kernel call replaced by a free stub and the routed experts' module excluded, i.e. norms,
  the Gated DeltaNet conv and recurrent step, rotary embedding, SDPA, the router and the shared expert's
  small ops; `expert_loop_s` the experts module's own small ops for top_k experts where it does NOT
  fuse (a Python loop of 2 kernel calls and ~6 small ops per expert, kernels stubbed); `shell_s` the
  rest of a step (embedding, final norm, cache bookkeeping) and `argmax_s` the greedy pick over the
  vocabulary.

- `prefill_*`: the same parts for one prefill chunk (the lm_head apart: it runs on the chunk's last
  token only), the routed experts as the experts module's multi-token forward.

A decode step on a CPU is then the sum over the layers it computes of ops + dense matrices + the
routed experts, the lm_head and the shell (`runtime_costs`). The routed experts of a layer are the
measured fused call where the profile has one for their format and shapes, else top_k x (gate_up +
down kernel calls) + the loop's ops (the runtime's unfused path: nf4/fp4/mxfp4, or a host without the
C++ kernel). A prefill chunk is the same sum over its prefill parts. Nothing here is fitted to a
whole-model measurement; `quantkit bench decode` and benchmarks/full_size.py check the composition against one.

Profiles of an older PROFILE_VERSION are refused (version 1 composed fused experts as 2k separate
calls and counted a real bf16 fused call inside the layer ops): `quantkit profile-host` again.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from quantkit.checkpoint.spec import ModelSpec, Role, TensorSpec, TextConfig
from quantkit.errors import QuantkitError
from quantkit.fileio import read_json_bounded
from quantkit.formats import QuantSpec
from quantkit.planner.hardware import cpu_name
from quantkit.recipe import Recipe, decide

PROFILE_VERSION = 2  # 2: fused MoE timings (moe_s), layer ops without the routed experts
# The runtime's kernels take these roles' matrices (nn.Linear of a layer, the experts, lm_head); the
# router (mlp.gate) stays transformers' own F.linear and is measured with the layer's ops.
KERNEL_ROLES = (Role.ATTENTION, Role.LINEAR_ATTENTION, Role.SHARED_EXPERT, Role.ROUTED_EXPERT, Role.LM_HEAD,
                Role.NORM)


def spec_key(q: QuantSpec | None) -> str:
    """The kernel-speed identity of a format choice: format, group, symmetry ("bf16" for kept)."""
    if q is None or q.format == "bf16":
        return "bf16"
    key = q.format + (f"-g{q.group_size}" if q.group_size else "")
    return key + ("" if q.symmetric else "-asym")


def shape_key(shape: tuple[int, ...]) -> str:
    return f"{shape[-2]}x{shape[-1]}"


def moe_key(gate_up: QuantSpec | None, down: QuantSpec | None) -> str:
    """The fused MoE call's speed identity: the experts' spec key ("a+b" when gate_up and down differ)."""
    a, b = spec_key(gate_up), spec_key(down)
    return a if a == b else f"{a}+{b}"


def moe_shape_key(gate_up: tuple[int, ...], down: tuple[int, ...]) -> str:
    return f"{shape_key(gate_up)}+{shape_key(down)}"


def model_dims(c: TextConfig) -> dict[str, Any]:
    """The config fields a layer's op cost depends on (not the layer count or vocabulary)."""
    keys = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "attn_output_gate",
            "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
            "linear_conv_kernel_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
            "shared_expert_intermediate_size")
    return {k: getattr(c, k) for k in keys}


def dims_id(c: TextConfig) -> str:
    return hashlib.sha256(json.dumps(model_dims(c), sort_keys=True).encode()).hexdigest()[:12]


def host_id() -> dict[str, Any]:
    """What makes a profile this host's: CPU, cores, torch build and thread count."""
    import platform

    import torch


    return {"cpu": cpu_name(), "cores": os.cpu_count(), "machine": platform.machine(),
            "torch": torch.__version__, "threads": torch.get_num_threads()}


def default_profile_dir() -> Path:
    base = os.environ.get("QUANTKIT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "quantkit")
    return Path(base) / "runtime-profiles"


def default_profile_path(c: TextConfig) -> Path:
    return default_profile_dir() / f"{dims_id(c)}.json"


@dataclass
class RuntimeProfile:
    host: dict[str, Any]
    dims: dict[str, Any]
    matmul_s: dict[str, dict[str, float]]  # spec key -> shape key -> seconds per batch-1 call
    layer_ops_s: dict[str, float]  # layer type -> seconds per decode step, kernels and routed experts excluded
    shell_s: float  # per decode step outside the layers, lm_head excluded
    argmax_s: dict[str, float]  # vocabulary size -> seconds of the greedy pick over the logits
    moe_s: dict[str, dict[str, float]] = field(default_factory=dict)  # moe key -> shapes -> s per layer-step
    expert_loop_s: float = 0.0  # the unfused experts loop's small ops for top_k experts, kernels excluded
    measured_at: str = ""
    seconds: float = 0.0  # how long the calibration took
    details: dict[str, Any] = field(default_factory=dict)  # spreads, copies, working set: for the report
    version: int = PROFILE_VERSION
    # one prefill chunk of `prefill_tokens` tokens (0: not measured, e.g. a profile from before it was):
    prefill_tokens: int = 0
    prefill_matmul_s: dict[str, dict[str, float]] = field(default_factory=dict)  # as matmul_s, the lm_head apart
    prefill_moe_s: dict[str, dict[str, float]] = field(default_factory=dict)  # a layer's routed experts module
    prefill_ops_s: dict[str, float] = field(default_factory=dict)  # as layer_ops_s
    prefill_shell_s: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "profile") -> RuntimeProfile:
        version = d.get("version") if isinstance(d, dict) else None
        if isinstance(version, int) and 0 < version < PROFILE_VERSION:
            raise QuantkitError(f"{source}: runtime profile of version {version}, measured before quantkit timed its "
                                f"fused MoE call (this quantkit reads version {PROFILE_VERSION}); run `quantkit "
                                "profile-host` again")
        if version != PROFILE_VERSION:
            raise QuantkitError(f"{source}: not a quantkit runtime profile of version {PROFILE_VERSION}; "
                                "run `quantkit profile-host` again")
        try:
            return cls(host=dict(d["host"]), dims=dict(d["dims"]),
                       matmul_s=_table(d["matmul_s"]), moe_s=_table(d["moe_s"]),
                       expert_loop_s=float(d["expert_loop_s"]),
                       layer_ops_s={k: float(v) for k, v in d["layer_ops_s"].items()}, shell_s=float(d["shell_s"]),
                       argmax_s={str(k): float(v) for k, v in d["argmax_s"].items()},
                       measured_at=str(d.get("measured_at", "")), seconds=float(d.get("seconds", 0.0)),
                       details=dict(d.get("details", {})), prefill_tokens=int(d.get("prefill_tokens", 0)),
                       prefill_matmul_s=_table(d.get("prefill_matmul_s", {})),
                       prefill_moe_s=_table(d.get("prefill_moe_s", {})),
                       prefill_ops_s={k: float(v) for k, v in d.get("prefill_ops_s", {}).items()},
                       prefill_shell_s=float(d.get("prefill_shell_s", 0.0)))
        except (KeyError, TypeError, ValueError, AttributeError):
            raise QuantkitError(f"{source}: malformed runtime profile; run `quantkit profile-host` again") from None

    def merged(self, other: RuntimeProfile) -> RuntimeProfile:
        """This profile with `other`'s matrix figures added (a later calibration of more formats)."""
        # prefill figures of another chunk size are replaced, not mixed with this one's
        same = self.prefill_tokens == other.prefill_tokens
        pre_mm, pre_moe = (self.prefill_matmul_s, self.prefill_moe_s) if same else ({}, {})
        return RuntimeProfile(other.host, other.dims, _merge(self.matmul_s, other.matmul_s), other.layer_ops_s,
                              other.shell_s, {**self.argmax_s, **other.argmax_s}, _merge(self.moe_s, other.moe_s),
                              other.expert_loop_s, other.measured_at, other.seconds, {**self.details, **other.details},
                              prefill_tokens=other.prefill_tokens,
                              prefill_matmul_s=_merge(pre_mm, other.prefill_matmul_s),
                              prefill_moe_s=_merge(pre_moe, other.prefill_moe_s),
                              prefill_ops_s=other.prefill_ops_s, prefill_shell_s=other.prefill_shell_s)


def fastest(profiles: list[RuntimeProfile]) -> RuntimeProfile:
    """One profile from calibrations of the same host and model at different moments: each part at its
    fastest. On a machine whose read bandwidth moves between spells, one calibration times every kernel
    in whichever spell it fell in; a decode measured as the best of several rounds is compared with the
    same kind of figure. The last profile's host, dims and details; `seconds` is the sum."""
    if not profiles:
        raise ValueError("no calibrations to take the fastest of")

    def low(tables: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for t in tables:
            for k, v in t.items():
                for sh, sec in v.items():
                    row = out.setdefault(k, {})
                    row[sh] = min(row.get(sh, sec), sec)
        return out

    def low1(ds: list[dict[str, float]]) -> dict[str, float]:
        out: dict[str, float] = {}
        for d in ds:
            for k, v in d.items():
                out[k] = min(out.get(k, v), v)
        return out

    last = profiles[-1]
    pre = [p for p in profiles if p.prefill_tokens and p.prefill_tokens == last.prefill_tokens]
    return RuntimeProfile(last.host, last.dims, low([p.matmul_s for p in profiles]), low1([p.layer_ops_s for p in profiles]),
                          min(p.shell_s for p in profiles), low1([p.argmax_s for p in profiles]),
                          low([p.moe_s for p in profiles]), min(p.expert_loop_s for p in profiles), last.measured_at,
                          sum(p.seconds for p in profiles), {**last.details, "calibrations": len(profiles)},
                          prefill_tokens=last.prefill_tokens if pre else 0,
                          prefill_matmul_s=low([p.prefill_matmul_s for p in pre]),
                          prefill_moe_s=low([p.prefill_moe_s for p in pre]),
                          prefill_ops_s=low1([p.prefill_ops_s for p in pre]),
                          prefill_shell_s=min((p.prefill_shell_s for p in pre), default=0.0))


def _table(d: dict[str, Any]) -> dict[str, dict[str, float]]:
    return {str(k): {str(s): float(t) for s, t in v.items()} for k, v in d.items()}


def _merge(a: dict[str, dict[str, float]], b: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    out = {k: dict(v) for k, v in a.items()}
    for k, v in b.items():
        out.setdefault(k, {}).update(v)
    return out


def load_profile(path: Path) -> RuntimeProfile:
    d = read_json_bounded(path, "runtime profile")
    return RuntimeProfile.from_dict(d, str(path))


def mismatch(p: RuntimeProfile, c: TextConfig, host: dict[str, Any]) -> str | None:
    """Why profile `p` does not describe this host running a model of config `c` (None: it does)."""
    if p.dims != model_dims(c):
        return "it was measured for another model shape"
    for k in ("cpu", "cores", "torch", "threads"):
        if p.host.get(k) != host.get(k):
            return f"it was measured with {k} {p.host.get(k)!r}, this host has {host.get(k)!r}"
    return None


@dataclass(frozen=True)
class RuntimeCosts:
    """Seconds per batch-1 decode step of quantkit's runtime on one CPU, by part."""

    layer_s: list[float]  # per layer: ops + its dense matrices (everything but the routed experts)
    expert_s: list[float]  # per layer: one routed expert (the fused call's top_k share, or gate_up + down + loop ops)
    head_s: float  # lm_head + shell + argmax over the vocabulary
    source: str = ""
    fused: list[bool] = field(default_factory=list)  # per layer: its experts composed from the fused call
    # one prefill chunk of `prefill_tokens` tokens (0: the profile has no prefill figures for this recipe)
    prefill_tokens: int = 0
    prefill_layer_s: list[float] = field(default_factory=list)  # per layer: ops + dense matrices
    prefill_expert_s: list[float] = field(default_factory=list)  # per layer: the routed experts module
    prefill_head_s: float = 0.0  # the chunk's shell + the lm_head and argmax for its last token

    def to_dict(self) -> dict[str, Any]:
        return {"layer_ms": [round(x * 1e3, 4) for x in self.layer_s],
                "expert_ms": [round(x * 1e3, 4) for x in self.expert_s],
                "head_ms": round(self.head_s * 1e3, 4), "fused": list(self.fused), "source": self.source,
                "prefill_tokens": self.prefill_tokens,
                "prefill_layer_ms": [round(x * 1e3, 3) for x in self.prefill_layer_s],
                "prefill_expert_ms": [round(x * 1e3, 3) for x in self.prefill_expert_s],
                "prefill_head_ms": round(self.prefill_head_s * 1e3, 3)}


def kernel_matrices(spec: ModelSpec, recipe: Recipe) -> list[tuple[TensorSpec, QuantSpec | None, tuple[int, int]]]:
    """(tensor, its QuantSpec as the loader decides it, 2-D shape of one kernel) for every matrix the
    runtime runs through a kernel. A layer's experts appear once (one expert's matrix)."""
    out: list[tuple[TensorSpec, QuantSpec | None, tuple[int, int]]] = []
    for t in spec.tensors:
        if t.role not in KERNEL_ROLES or len(t.shape) not in (2, 3) or t.name.endswith("conv1d.weight"):
            continue
        if t.role == Role.NORM and ".shared_expert_gate." not in t.name:
            continue
        out.append((t, decide(recipe, t).spec, (t.shape[-2], t.shape[-1])))
    c = spec.config
    if c.tie_word_embeddings:  # the loader runs the bf16 embedding table as the lm_head
        out.append((TensorSpec("lm_head.weight", (c.vocab_size, c.hidden_size), c.dtype, Role.LM_HEAD), None,
                    (c.vocab_size, c.hidden_size)))
    return out


def needed(spec: ModelSpec, recipes: list[Recipe]) -> dict[str, tuple[QuantSpec | None, set[tuple[int, int]]]]:
    """spec key -> (a QuantSpec of that key, the kernel shapes) a calibration must time for these recipes."""
    want: dict[str, tuple[QuantSpec | None, set[tuple[int, int]]]] = {}
    for r in recipes:
        for _, q, shape in kernel_matrices(spec, r):
            want.setdefault(spec_key(q), (q, set()))[1].add(shape)
    return want


ExpertPair = tuple[QuantSpec | None, tuple[int, int], QuantSpec | None, tuple[int, int]]


def expert_pairs(spec: ModelSpec, recipe: Recipe) -> dict[int, ExpertPair]:
    """Per layer, its routed experts' (gate_up spec, gate_up shape, down spec, down shape): what one fused
    MoE call of the layer runs."""
    parts: dict[int, dict[str, tuple[QuantSpec | None, tuple[int, int]]]] = {}
    for t, q, shape in kernel_matrices(spec, recipe):
        if t.role == Role.ROUTED_EXPERT and t.layer is not None:
            parts.setdefault(t.layer, {})["down" if "down" in t.name else "gate_up"] = (q, shape)
    return {L: (d["gate_up"][0], d["gate_up"][1], d["down"][0], d["down"][1])
            for L, d in parts.items() if set(d) == {"gate_up", "down"}}


def needed_moe(spec: ModelSpec, recipes: list[Recipe]) -> dict[str, tuple[ExpertPair, ...]]:
    """moe key -> the distinct expert pairs of that key a calibration times through the fused call."""
    want: dict[str, set[ExpertPair]] = {}
    for r in recipes:
        for pair in expert_pairs(spec, r).values():
            want.setdefault(moe_key(pair[0], pair[2]), set()).add(pair)
    return {k: tuple(sorted(v, key=lambda x: (x[1], x[3]))) for k, v in want.items()}


def fused_moe_s(p: RuntimeProfile, pair: ExpertPair) -> float | None:
    """The measured fused call for this layer's experts, or None where this host's runtime does not fuse them."""
    return p.moe_s.get(moe_key(pair[0], pair[2]), {}).get(moe_shape_key(pair[1], pair[3]))


def runtime_costs(p: RuntimeProfile, spec: ModelSpec, recipe: Recipe, source: str = "") -> RuntimeCosts:
    """Compose a profile into per-layer decode costs for `recipe` on `spec` (module docstring)."""
    c = spec.config
    n, top_k = c.num_hidden_layers, c.num_experts_per_tok
    missing = sorted(set(c.layer_types) - set(p.layer_ops_s))
    if missing:
        raise QuantkitError(f"the runtime profile has no {missing[0]} layer cost; run `quantkit profile-host` again")
    layer = [p.layer_ops_s[c.layer_types[L]] for L in range(n)]
    expert = [0.0] * n
    head = p.shell_s
    for t, q, shape in kernel_matrices(spec, recipe):
        k = spec_key(q)
        sec = p.matmul_s.get(k, {}).get(shape_key(shape))
        if sec is None:
            raise QuantkitError(f"the runtime profile has no {k} {shape_key(shape)} kernel time; run "
                                f"`quantkit profile-host --scheme {recipe.name}`")
        if t.layer is None:  # the lm_head (MTP is not among the kernel matrices)
            head += sec
        elif t.role == Role.ROUTED_EXPERT:
            expert[t.layer] += sec
        else:
            layer[t.layer] += sec
    fused = [False] * n
    for L, pair in expert_pairs(spec, recipe).items():
        moe = fused_moe_s(p, pair)
        if moe is not None:  # one call for the top_k experts: each expert's share of it
            expert[L], fused[L] = moe / top_k, True
        else:  # the unfused loop: 2 kernel calls per expert (summed above) and its small ops
            expert[L] += p.expert_loop_s / top_k
    vocab = str(c.vocab_size)
    if vocab not in p.argmax_s:
        raise QuantkitError(f"the runtime profile has no argmax time for vocabulary {vocab}; run `quantkit profile-host` again")
    head += p.argmax_s[vocab]
    pre = prefill_costs(p, spec, recipe, head - p.shell_s)
    return RuntimeCosts(layer, expert, head, source, fused, *(pre or ()))


def prefill_costs(p: RuntimeProfile, spec: ModelSpec, recipe: Recipe,
                  last_token_s: float) -> tuple[int, list[float], list[float], float] | None:
    """(tokens, per layer ops + dense matrices, per layer routed experts, shell + `last_token_s`) of one prefill
    chunk, or None where the profile lacks a figure this recipe needs (a calibration without prefill)."""
    c = spec.config
    n = c.num_hidden_layers
    if not p.prefill_tokens or set(c.layer_types) - set(p.prefill_ops_s):
        return None
    layer = [p.prefill_ops_s[c.layer_types[L]] for L in range(n)]
    for t, q, shape in kernel_matrices(spec, recipe):
        if t.layer is None or t.role == Role.ROUTED_EXPERT:
            continue  # the lm_head runs on the last token only; the experts are timed as a module
        sec = p.prefill_matmul_s.get(spec_key(q), {}).get(shape_key(shape))
        if sec is None:
            return None
        layer[t.layer] += sec
    expert = [0.0] * n
    pairs = expert_pairs(spec, recipe)
    for L in range(n):
        pair = pairs.get(L)
        sec = p.prefill_moe_s.get(moe_key(pair[0], pair[2]), {}).get(moe_shape_key(pair[1], pair[3])) if pair else None
        if sec is None:
            return None
        expert[L] = sec
    return p.prefill_tokens, layer, expert, p.prefill_shell_s + last_token_s


def profile_for_plan(path: Path | None, c: TextConfig, this_host: bool) -> tuple[RuntimeProfile | None, str, str]:
    """(profile, its source, a note for the user) for `quantkit plan`. An explicit `path` must load and
    match this host and model shape (else one-line error); without one, this host's default profile is
    used when the plan is for this machine, and a note says why when it is not."""
    if path is not None:
        p = load_profile(path)
        why = mismatch(p, c, host_id())
        if why:
            raise QuantkitError(f"{path}: runtime profile does not apply: {why}; run `quantkit profile-host`")
        return p, f"{path} ({p.measured_at})", ""
    if not this_host:
        return None, "", ""
    default = default_profile_path(c)
    if not default.is_file():
        return None, "", ("quantkit's own runtime is not calibrated on this host: `quantkit profile-host` (about a "
                          "minute) adds its measured-part estimate beside the llama.cpp-grade tok/s")
    try:
        p = load_profile(default)
    except QuantkitError as e:
        return None, "", f"runtime profile ignored: {e}"
    why = mismatch(p, c, host_id())
    if why:
        return None, "", f"runtime profile {default} ignored: {why}; run `quantkit profile-host` again"
    return p, f"{default} ({p.measured_at})", ""
