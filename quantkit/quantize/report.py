"""The quantization report: per role count, bytes before/after, bits per weight, error, time (md + JSON)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantkit.errors import QuantkitError
from quantkit.fileio import atomic_write_bytes
from quantkit.termtext import plural


@dataclass
class RoleRow:
    role: str
    formats: str
    count: int
    numel: int
    in_bytes: int
    out_bytes: int
    sq_err: float
    sq_ref: float
    seconds: float
    out_err: float = 0.0
    out_ref: float = 0.0
    fallbacks: int = 0

    @property
    def out_rel_error(self) -> float | None:
        """||(W - Q(W)) X|| / ||W X|| on held-out calibration activations (None without statistics)."""
        return math.sqrt(self.out_err / self.out_ref) if self.out_ref > 0 else None

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.out_bytes / self.numel if self.numel else 0.0

    @property
    def rel_error(self) -> float | None:
        if self.sq_ref <= 0:  # only quantized tensors are measured
            return None
        return math.sqrt(self.sq_err / self.sq_ref)

    @property
    def sqnr_db(self) -> float | None:
        if self.sq_ref <= 0 or self.sq_err <= 0:
            return None
        return 10 * math.log10(self.sq_ref / self.sq_err)

    def to_dict(self) -> dict[str, Any]:
        return {"role": self.role, "formats": self.formats, "count": self.count, "params": self.numel,
                "bytes_before": self.in_bytes, "bytes_after": self.out_bytes,
                "bits_per_weight": round(self.bits_per_weight, 4),
                "rel_error": self.rel_error, "sqnr_db": self.sqnr_db, "seconds": round(self.seconds, 3),
                "output_rel_error": self.out_rel_error, "rtn_fallbacks": self.fallbacks}


def report_paths(report: Path) -> tuple[Path, Path]:
    """The report's markdown and JSON paths (the JSON beside the markdown, same stem)."""
    if report.suffix.lower() == ".json":
        return report.with_suffix(".md"), report
    return report.with_suffix(".md") if report.suffix.lower() != ".md" else report, report.with_suffix(".json")


def role_rows(stats: list[Any]) -> list[RoleRow]:
    """Aggregate TensorStats per role (errors pooled: sum of squared errors over sum of squares)."""
    rows: dict[str, RoleRow] = {}
    fmts: dict[str, set[str]] = {}
    for s in stats:
        r = rows.setdefault(s.role, RoleRow(s.role, "", 0, 0, 0, 0, 0.0, 0.0, 0.0))
        fmts.setdefault(s.role, set()).add(s.format)
        r.count += 1
        r.numel += s.numel
        r.in_bytes += s.in_bytes
        r.out_bytes += s.out_bytes
        r.sq_err += s.sq_err
        r.sq_ref += s.sq_ref
        r.seconds += s.seconds
        r.out_err += getattr(s, "out_err", 0.0)
        r.out_ref += getattr(s, "out_ref", 0.0)
        r.fallbacks += getattr(s, "fallbacks", 0)
    for k, r in rows.items():
        r.formats = ", ".join(sorted(fmts[k]))
    return sorted(rows.values(), key=lambda r: -r.in_bytes)


def total_row(rows: list[RoleRow]) -> RoleRow:
    return RoleRow("total", "", sum(r.count for r in rows), sum(r.numel for r in rows),
                   sum(r.in_bytes for r in rows), sum(r.out_bytes for r in rows),
                   sum(r.sq_err for r in rows), sum(r.sq_ref for r in rows), sum(r.seconds for r in rows),
                   sum(r.out_err for r in rows), sum(r.out_ref for r in rows), sum(r.fallbacks for r in rows))


def _fmt_err(x: float | None, digits: int = 4) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _mtp_line(plan: Any) -> str:
    """The report's MTP line: kept (quantized by the roles its tensors play), dropped (--no-mtp-layer) or absent."""
    if plan.mtp == "kept":
        n = sum(1 for t in plan.tensors if t.name.startswith("mtp."))
        return f"kept, {n} tensors (quantized by the recipe of their decoder-layer roles; --no-mtp-layer drops them)"
    if plan.mtp == "dropped":
        return f"dropped (--no-mtp-layer), {len(plan.dropped)} tensors; config.json says mtp_num_hidden_layers 0"
    return "absent (the source has no MTP layer)"


def write_report(md_path: Path, plan: Any, stats: list[Any], seconds: float, src: Path, out: Path,
                 reused: list[str], calibration: dict[str, Any] | None = None) -> tuple[Path, Path]:
    """Write `md_path` and the JSON beside it (same stem). Atomic; returns both paths."""

    md_path, js_path = report_paths(Path(md_path))
    try:
        md_path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise QuantkitError(f"--report {md_path}: cannot create {md_path.parent} ({e.strerror})") from None
    rows = role_rows(stats)
    tot = total_row(rows)
    in_mb = tot.in_bytes / 1e6
    data = {
        "source": str(src),
        "output": str(out),
        "recipe": plan.recipe.to_dict(),
        "keep_mtp": plan.keep_mtp,
        "mtp": plan.mtp,
        "dropped": plan.dropped,
        "shards": len(plan.shards),
        "reused_shards": reused,
        "seconds": round(seconds, 3),
        "throughput_mb_s": round(in_mb / seconds, 2) if seconds > 0 else None,
        "roles": [r.to_dict() for r in rows],
        "total": tot.to_dict(),
        "fallbacks": {t.name: t.note for t in plan.tensors if t.note},
        "calibration": calibration,
        "tensors": [s.to_dict() | {"rel_error": s.rel_error if s.sq_ref else None,
                                   "sqnr_db": s.sqnr_db if s.sq_err else None} for s in stats],
    }
    lines = [
        "# quantkit quantization report",
        "",
        f"- source: `{src}`",
        f"- output: `{out}`",
        f"- recipe: `{plan.recipe.name}` ({plan.recipe.description})",
        f"- MTP: {_mtp_line(plan)}",
        f"- size: {tot.in_bytes / 1e9:.3f} GB -> {tot.out_bytes / 1e9:.3f} GB "
        f"({tot.bits_per_weight:.3f} bits/weight) in {plural(len(plan.shards), 'shard')}",
        f"- time: {seconds:.1f} s" + (f" ({in_mb / seconds:.1f} MB/s of input)" if seconds > 0 else "")
        + (f"; {plural(len(reused), 'shard')} reused from an interrupted run (their time is that run's)" if reused else ""),
        "",
    ]
    if calibration:
        lines[-1:-1] = [f"- method: `{calibration.get('method')}`"
                        + (f", statistics of {calibration['tokens']:,} tokens from `{calibration.get('data_source')}` "
                           f"(data sha256 {str(calibration.get('data_fingerprint'))[:16]}...)"
                           if calibration.get("tokens") else "")
                        + f"; {tot.fallbacks} matrices rounded to nearest instead"]
    lines += [
        "| role | formats | tensors | MB before | MB after | bits/weight | rel. error | SQNR dB | output rel. error "
        "(held-out) | RTN fallbacks | seconds |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in [*rows, tot]:
        lines.append(
            f"| {r.role} | {r.formats} | {r.count} | {r.in_bytes / 1e6:.2f} | {r.out_bytes / 1e6:.2f} | "
            f"{r.bits_per_weight:.3f} | {_fmt_err(r.rel_error)} | {_fmt_err(r.sqnr_db, 2)} | "
            f"{_fmt_err(r.out_rel_error)} | {r.fallbacks} | {r.seconds:.2f} |"
        )
    if data["fallbacks"]:
        lines += ["", "Fallbacks:", ""] + [f"- `{k}`: {v}" for k, v in data["fallbacks"].items()]
    lines += ["", "Errors are of the dequantized weights against the source weights, pooled over each role "
              "(rel. error = ||W - Q(W)||_F / ||W||_F; SQNR = 10 log10(||W||^2 / ||W - Q(W)||^2)). The output "
              "error, with --stats, is ||(W - Q(W)) X|| / ||W X|| on the statistics' held-out tokens X (routed "
              "experts: every held-out token through every expert).", ""]
    atomic_write_bytes(md_path, "\n".join(lines).encode())
    atomic_write_bytes(js_path, (json.dumps(finite(data), indent=2, allow_nan=False) + "\n").encode())
    return md_path, js_path


def finite(obj: Any) -> Any:
    """`obj` with every NaN or infinite float replaced by None: the JSON report stays valid JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj
