"""The quantizer's calibrated methods: which rounding each block of a tensor gets, and its output error.

Contract: `Calibration(method, stats)` is handed to the streaming quantizer (run.py) through
`QuantizeOptions.calibration`. For each block the quantizer streams (a whole matrix, a block of rows of
one, or a slab of experts [n, out, in] starting at expert `start`), `quantize(name, w, start, spec)`
returns the format's stored parts and the number of matrices that fell back to round-to-nearest:
- "rtn": the format's own round-to-nearest (statistics used only for the report's output error);
- "imatrix": importance-weighted scale search (imatrix.py) with importance in_sum2 / count;
- "gptq": GPTQ with static scales (gptq.py) on the calibration Hessian; a fused gate_up slab is one
  problem (all experts share the layer's Hessian), down_proj one problem per expert.
Falls back to round-to-nearest, counted: a routed expert that received fewer than `min_fraction` of the
calibration tokens (GPTQModel's rule, 0.5% by default), a tensor without statistics (embedding, MTP), a
Hessian GPTQ cannot factor even after raising the damping, a format without a grid (nf4/fp4/mxfp4).
`output_error(name, d, w, start)` gives (sum of squared output error, sum of squared output) of the
block on the HELD-OUT activations: tr(D H D^T) and tr(W H W^T) with H the held-out Hessian.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from quantkit.errors import QuantkitError
from quantkit.formats import QuantSpec, get_format
from quantkit.quantize.gptq import gptq
from quantkit.quantize.imatrix import imatrix_quantize, importance
from quantkit.quantize.stats import DOWN, GATE_UP, Stats

METHODS = ("rtn", "imatrix", "gptq")
DEFAULT_MIN_FRACTION = 0.005


@dataclass
class Calibration:
    method: str
    stats: Stats | None
    min_fraction: float = DEFAULT_MIN_FRACTION
    _cache: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    _cache_base: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise QuantkitError(f"--method {self.method!r}: use one of {', '.join(METHODS)}")
        if self.method != "rtn" and self.stats is None:
            raise QuantkitError(f"--method {self.method} needs --stats FILE (make it with "
                                "`quantkit stats SRC --out FILE`)")
        if not 0 <= self.min_fraction < 1:
            raise QuantkitError(f"--min-tokens {self.min_fraction} must be a fraction in [0, 1)")

    def fingerprint_data(self) -> dict[str, Any]:
        """What the output bytes depend on."""
        return {"method": self.method, "min_fraction": self.min_fraction,
                "data": self.stats.meta.get("data_fingerprint") if self.stats else None}

    def config(self) -> dict[str, Any]:
        """quantization_config["calibration"]."""
        d: dict[str, Any] = {"method": self.method}
        if self.stats is not None:
            m = self.stats.meta
            d.update({"data_fingerprint": m.get("data_fingerprint"), "data_source": m.get("data_source"),
                      "tokens": int(m.get("tokens", 0)), "min_expert_fraction": self.min_fraction})
        return d

    def _get(self, key: str) -> torch.Tensor | None:
        """A statistics tensor, or None. The statistics of one weight stay cached while its slabs stream."""
        if self.stats is None or not self.stats.has(key):
            return None
        base = key.rsplit(".", 1)[0]
        if base != self._cache_base:
            self._cache.clear()
            self._cache_base = base
        if key not in self._cache:
            self._cache[key] = self.stats.get(key)
        return self._cache[key]

    def quantize(self, name: str, w: torch.Tensor, start: int, spec: QuantSpec
                 ) -> tuple[dict[str, torch.Tensor], int, str]:
        """(stored parts of the block, matrices that fell back to RTN, a reason when some did)."""
        fmt = get_format(spec.format)
        if self.method == "rtn":
            return fmt.quantize(w, spec), 0, ""
        if w.dim() == 3:
            return self._experts(name, w, start, spec)
        cnt = self._get(f"{name}.count")
        if cnt is None:
            return fmt.quantize(w, spec), 1, "no statistics"
        if self.method == "imatrix":
            imp = importance(self._get(f"{name}.in_sum2"), int(cnt.sum()))
            if imp is None:
                return fmt.quantize(w, spec), 1, "no calibration token"
            return imatrix_quantize(w, imp, spec), 0, ""
        parts, info = gptq(w, self._get(f"{name}.hessian"), spec)
        return parts, int(bool(info.fallback)), info.fallback

    def _experts(self, name: str, w: torch.Tensor, start: int, spec: QuantSpec
                 ) -> tuple[dict[str, torch.Tensor], int, str]:
        fmt = get_format(spec.format)
        n = w.shape[0]
        counts = self._get(f"{name}.count")
        if counts is None:
            return fmt.quantize(w, spec), n, "no statistics"
        counts = counts[start:start + n]
        floor = self.min_fraction * self.stats.tokens
        rare = [int(c) < max(floor, 1) for c in counts]
        reasons = []
        if any(rare):
            reasons.append(f"under {self.min_fraction:.1%} of the calibration tokens")
        if self.method == "gptq" and name.endswith(GATE_UP) and not all(rare):
            h = self._get(f"{name}.hessian")  # one Hessian for the whole stack
            flat, info = gptq(w.reshape(-1, w.shape[-1]), h, spec)
            if info.fallback:
                return fmt.quantize(w, spec), n, info.fallback
            parts = {k: v.reshape(n, -1, *v.shape[1:]) if v.dim() > 1 else v.reshape(n, -1) for k, v in flat.items()}
            rtn = fmt.quantize(w[torch.tensor(rare)], spec) if any(rare) else None
            if rtn is not None:
                idx = torch.tensor(rare).nonzero().flatten()
                for k in parts:
                    parts[k][idx] = rtn[k]
            return parts, sum(rare), "; ".join(reasons)
        out: list[dict[str, torch.Tensor]] = []
        fallbacks = sum(rare)
        in_sum2 = self._get(f"{name}.in_sum2") if self.method == "imatrix" else None
        hs = self._get(f"{name}.hessian") if self.method == "gptq" else None
        for j in range(n):
            e = start + j
            if rare[j]:
                out.append(fmt.quantize(w[j], spec))
            elif self.method == "imatrix":
                out.append(imatrix_quantize(w[j], importance(in_sum2[e], int(counts[j])), spec))
            else:
                h = hs[e] if hs.dim() == 3 else hs
                p, info = gptq(w[j], h, spec)
                if info.fallback:
                    fallbacks += 1
                    reasons.append(info.fallback)
                out.append(p)
        parts = {k: torch.stack([o[k] for o in out]) for k in out[0]}
        return parts, fallbacks, "; ".join(dict.fromkeys(reasons))

    def output_error(self, name: str, d: torch.Tensor, w: torch.Tensor, start: int) -> tuple[float, float]:
        """(sum of squared output error, sum of squared output) of the block on held-out activations;
        (0, 0) without a held-out Hessian."""
        h = self._get(f"{name}.heldout_hessian") if self.stats is not None else None
        if h is None:
            return 0.0, 0.0
        wf = w.float()
        if h.dim() == 3:  # per expert (down_proj)
            hb = h[start:start + w.shape[0]]
            return float(((d @ hb) * d).sum()), float(((wf @ hb) * wf).sum())
        d2, w2 = d.reshape(-1, d.shape[-1]), wf.reshape(-1, wf.shape[-1])
        return float(((d2 @ h) * d2).sum()), float(((w2 @ h) * w2).sum())


__all__ = ["Calibration", "METHODS", "DEFAULT_MIN_FRACTION", "DOWN", "GATE_UP"]
