"""Routing-aware placement: a measured routing profile (`quantkit stats`' routed-token counts per (layer,
expert)) and the arithmetic over it the planner needs.

- `read_profile` reads the counts of a statistics file through `quantkit.quantize.stats.Stats` (header read
  with its size bound; only the small int64 [E] routing tensors are read, their shapes checked against the
  header first) and refuses, with one line, a file that is not a statistics file, holds no routing counts or
  was made for another shape (layer count, expert count).
- `layer_shares`: each layer's counts as fractions of that layer's routed tokens (a layer with none: uniform).
- `device_traffic`: per layer, the share of its routed tokens each device's experts serve; the speed model
  uses it instead of (experts on the device / E).
- `gpu_traffic_share`: the share of all routed traffic the GPUs serve (every layer routes the same number of
  tokens, so the mean of the per-layer shares); `uniform_share` the same under uniform routing.
- `routing_report`: what the plan says about it, with the held-out coverage (the GPU share the placement
  made from one profile gets on held-out counts), since a profile from one workload transfers poorly.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from safetensors import SafetensorError

from quantkit.errors import QuantkitError
from quantkit.quantize.stats import LM, Stats

Ranges = list[list[tuple[str, int, int]]]  # Plan.expert_ranges: per layer (device, first id, last id + 1)


@dataclass(frozen=True)
class RoutingProfile:
    """Routed-token counts per layer and expert, and held-out counts to measure how the placement transfers."""

    source: str  # the file's name
    fingerprint: str  # the model fingerprint the statistics file records
    counts: list[list[int]]  # per layer, per expert
    heldout: list[list[int]] | None = None
    heldout_source: str = ""

    @cached_property
    def shares(self) -> list[list[float]]:
        return layer_shares(self.counts)

    def with_heldout(self, heldout: list[list[int]], source: str) -> RoutingProfile:
        return RoutingProfile(self.source, self.fingerprint, self.counts, heldout, source)


@dataclass(frozen=True)
class RoutingReport:
    """What the plan says about the measured routing (plan JSON `routing`)."""

    source: str
    fingerprint: str
    gpu_traffic_share: float  # of all routed traffic, by the profile's counts
    uniform_share: float  # the same placement under uniform routing (GPU experts / all experts)
    held_out_coverage: float | None  # the GPU share on held-out counts; None without any
    held_out_source: str | None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("gpu_traffic_share", "uniform_share", "held_out_coverage"):
            d[k] = None if d[k] is None else round(d[k], 4)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RoutingReport:
        return cls(str(d["source"]), str(d["fingerprint"]), float(d["gpu_traffic_share"]),
                   float(d["uniform_share"]),
                   None if d.get("held_out_coverage") is None else float(d["held_out_coverage"]),
                   d.get("held_out_source"))


def expert_order(counts: list[int]) -> list[int]:
    """Expert ids, most-routed first; ties by id (deterministic)."""
    return sorted(range(len(counts)), key=lambda i: (-counts[i], i))


def layer_shares(counts: list[list[int]]) -> list[list[float]]:
    """Each layer's counts over that layer's total; a layer that routed no token is uniform."""
    out = []
    for row in counts:
        total = sum(row)
        out.append([c / total for c in row] if total else [1 / len(row)] * len(row))
    return out


def device_traffic(ranges: Ranges, shares: list[list[float]]) -> list[dict[str, float]]:
    """Per layer: device -> share of the layer's routed tokens its experts serve."""
    out = []
    for L, rs in enumerate(ranges):
        t: dict[str, float] = {}
        for d, a, b in rs:
            t[d] = t.get(d, 0.0) + sum(shares[L][a:b])
        out.append(t)
    return out


def gpu_traffic_share(ranges: Ranges, counts: list[list[int]], gpu_ids: set[str]) -> float:
    """The share of routed traffic the experts on `gpu_ids` serve: the mean over layers of each layer's share
    (each token is routed to the same number of experts in every layer)."""
    per_layer = device_traffic(ranges, layer_shares(counts))
    return sum(sum(v for d, v in t.items() if d in gpu_ids) for t in per_layer) / max(1, len(per_layer))


def uniform_share(ranges: Ranges, num_experts: int, gpu_ids: set[str]) -> float:
    """The GPU share if every expert were equally routed: GPU experts / all experts."""
    on_gpu = sum(b - a for rs in ranges for d, a, b in rs if d in gpu_ids)
    return on_gpu / max(1, len(ranges) * num_experts)


def routing_report(profile: RoutingProfile, ranges: Ranges, num_experts: int, gpu_ids: set[str]) -> RoutingReport:
    held = None
    if profile.heldout is not None and any(sum(r) for r in profile.heldout):
        held = gpu_traffic_share(ranges, profile.heldout, gpu_ids)
    return RoutingReport(profile.source, profile.fingerprint, gpu_traffic_share(ranges, profile.counts, gpu_ids),
                         uniform_share(ranges, num_experts, gpu_ids), held,
                         (profile.heldout_source or profile.source) if held is not None else None)


def _flag_error(path: Path, flag: str, what: str) -> QuantkitError:
    return QuantkitError(f"{flag} {path}: {what}")


def read_counts(path: str | Path, n_layers: int, n_experts: int, flag: str = "--routing"
                ) -> tuple[str, list[list[int]], list[list[int]] | None]:
    """(model fingerprint, calibration counts, held-out counts or None) of a `quantkit stats` file, checked
    to be one for a model of `n_layers` MoE layers of `n_experts` experts."""
    p = Path(path)
    try:
        st = Stats.open(p)
    except QuantkitError as e:
        raise QuantkitError(f"{flag}: {e}") from None
    try:
        rows: dict[str, list[list[int]]] = {}
        for kind in ("routing", "heldout_routing"):
            names = {f"{LM}layers.{L}.mlp.{kind}" for L in range(n_layers)}
            found = sorted(k for k in st.names if k.startswith(f"{LM}layers.") and k.endswith(f".mlp.{kind}"))
            if not found:
                continue
            extra = [k for k in found if k not in names]
            if extra or len(found) != n_layers:
                layers = {int(k[len(f"{LM}layers."):].split(".")[0]) for k in found}
                n = max(layers) + 1 if extra else len(layers)
                raise _flag_error(p, flag, f"it holds routing counts of {n} layers, the model has "
                                  f"{n_layers}; run `quantkit stats` on this model")
            out = []
            for L in range(n_layers):
                shape = st.shapes.get(f"{LM}layers.{L}.mlp.{kind}")
                if shape != [n_experts]:
                    raise _flag_error(p, flag, f"routing counts of layer {L} have shape {shape}, the model has "
                                      f"{n_experts} experts; run `quantkit stats` on this model")
                try:
                    t = st.get(f"{LM}layers.{L}.mlp.{kind}")
                except SafetensorError as e:  # a header that does not cover the file
                    raise _flag_error(p, flag, f"is damaged ({str(e).splitlines()[0]}); rerun `quantkit stats`"
                                      ) from None
                if t.is_floating_point() or bool((t < 0).any()):
                    raise _flag_error(p, flag, f"routing counts of layer {L} are not token counts")
                out.append([int(x) for x in t.tolist()])
            rows[kind] = out
    finally:
        st.close()
    if "routing" not in rows or not any(sum(r) for r in rows["routing"]):
        raise _flag_error(p, flag, "it holds no routing counts; make it with `quantkit stats` on an MoE checkpoint")
    return st.meta.get("model_fingerprint", ""), rows["routing"], rows.get("heldout_routing")


def read_profile(path: str | Path, n_layers: int, n_experts: int, heldout: str | Path | None = None
                 ) -> RoutingProfile:
    """The profile of `--routing FILE`; held-out counts from `heldout` (all its tokens: `--routing-heldout`)
    or else from FILE's own held-out part (`quantkit stats --heldout`)."""
    fp, counts, held = read_counts(path, n_layers, n_experts)
    prof = RoutingProfile(Path(path).name, fp, counts, held, Path(path).name if held else "")
    if heldout is None:
        return prof
    fp2, c2, h2 = read_counts(heldout, n_layers, n_experts, "--routing-heldout")
    if fp and fp2 and fp != fp2:
        raise QuantkitError(f"--routing-heldout {heldout}: statistics of another model than --routing {path}; "
                            "collect both with `quantkit stats` on the same checkpoint")
    both = [[a + b for a, b in zip(r1, r2, strict=True)] for r1, r2 in zip(c2, h2, strict=True)] if h2 else c2
    return prof.with_heldout(both, Path(heldout).name)
