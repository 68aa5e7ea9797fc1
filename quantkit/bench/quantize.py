"""`quantkit bench quantize`: quantizer throughput, error and peak memory, with peers in the same run.

On the routed-expert tensors of a generated realistic-shape checkpoint (hidden 2048, real expert sizes)
it times every quantkit format and, on the same tensors, bitsandbytes' `quantize_4bit` (nf4, fp4,
blocksize 64) and the `gguf` package's numpy quantizers (Q4_0, Q8_0, MXFP4), with a torch clone of the
same bytes as the memory-copy ceiling. It measures each method's error (relative Frobenius, SQNR) against
the bf16 source, the lm_head choice (int8 vs int4, weights and logits), and the peak RSS of a complete
`quantkit quantize` run on the multi-GB checkpoint against the bound (largest input tensor x 3 + 1 GB).
Throughput is MB/s of bf16 input (2 bytes per weight) for every method, so the figures compare per weight.
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from quantkit.bench import write_reports
from quantkit.formats import QuantSpec, get_format
from quantkit.model.checkpoint import Checkpoint

OUR_METHODS: list[tuple[str, QuantSpec]] = [
    ("int8", QuantSpec("int8", None, True)),
    ("int4 g32", QuantSpec("int4", 32, True)),
    ("int4 g64", QuantSpec("int4", 64, True)),
    ("int4 g128", QuantSpec("int4", 128, True)),
    ("int4 g64 asym", QuantSpec("int4", 64, False)),
    ("int4 g128 asym", QuantSpec("int4", 128, False)),
    ("nf4", QuantSpec("nf4", 64, True)),
    ("fp4", QuantSpec("fp4", 64, True)),
    ("mxfp4", QuantSpec("mxfp4", 32, True)),
]


@dataclass
class Row:
    method: str
    who: str  # "quantkit", "bitsandbytes", "gguf", "torch"
    bpw: float
    mb_s: float
    seconds: float
    rel_error: float | None = None
    sqnr_db: float | None = None
    note: str = ""


def machine_info() -> dict[str, Any]:
    import psutil

    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info: dict[str, Any] = {
        "cpu": cpu,
        "logical_cores": os.cpu_count(),
        "physical_cores": psutil.cpu_count(logical=False),
        "ram_gb": round(psutil.virtual_memory().total / 1e9, 1),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
    }
    from importlib.metadata import PackageNotFoundError, version

    for mod in ("bitsandbytes", "gguf", "numpy", "safetensors"):
        try:
            info[mod] = version(mod)  # the gguf package has no __version__
        except PackageNotFoundError:
            info[mod] = None
    return info


def _best_time(fn, reps: int) -> tuple[float, Any]:
    best, out = math.inf, None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def _err(ref: torch.Tensor, deq: torch.Tensor) -> tuple[float, float]:
    e = (deq.float() - ref).pow(2).sum(dtype=torch.float64)
    s = ref.pow(2).sum(dtype=torch.float64)
    rel = math.sqrt(float(e / s))
    return rel, (10 * math.log10(float(s / e)) if e > 0 else math.inf)


def bench_methods(tensors: list[torch.Tensor], reps: int = 2) -> list[Row]:
    """Every method on the same bf16 tensors; errors against the same tensors in fp32."""
    nbytes = sum(t.numel() * 2 for t in tensors)
    numel = sum(t.numel() for t in tensors)
    refs = [t.float() for t in tensors]
    rows: list[Row] = []

    sec, _ = _best_time(lambda: [t.clone() for t in tensors], reps)
    rows.append(Row("memory copy (torch clone)", "torch", 16.0, nbytes / sec / 1e6, sec, note="ceiling"))

    for label, spec in OUR_METHODS:
        fmt = get_format(spec.format)
        sec, parts = _best_time(lambda fmt=fmt, spec=spec: [fmt.quantize(t, spec) for t in tensors], reps)
        bits = sum(p.numel() * p.element_size() * 8 for ps in parts for p in ps.values())
        se = ss = 0.0
        for t, ps, ref in zip(tensors, parts, refs, strict=True):
            d = fmt.dequantize(ps, spec, tuple(t.shape), torch.float32)
            se += float((d - ref).pow(2).sum(dtype=torch.float64))
            ss += float(ref.pow(2).sum(dtype=torch.float64))
        rows.append(Row(label, "quantkit", bits / numel, nbytes / sec / 1e6, sec,
                        math.sqrt(se / ss), 10 * math.log10(ss / se) if se else math.inf))
        del parts

    try:
        import bitsandbytes.functional as bnbf

        for qt in ("nf4", "fp4"):
            sec, outs = _best_time(
                lambda qt=qt: [bnbf.quantize_4bit(t, blocksize=64, quant_type=qt) for t in tensors], reps)
            bits = sum((q.numel() * q.element_size() + s.absmax.numel() * s.absmax.element_size()) * 8
                       for q, s in outs)
            se = ss = 0.0
            for (q, s), ref in zip(outs, refs, strict=True):
                d = bnbf.dequantize_4bit(q, s).float()
                se += float((d - ref).pow(2).sum(dtype=torch.float64))
                ss += float(ref.pow(2).sum(dtype=torch.float64))
            rows.append(Row(f"bnb {qt} b64", "bitsandbytes", bits / numel, nbytes / sec / 1e6, sec,
                            math.sqrt(se / ss), 10 * math.log10(ss / se), "quantize_4bit on bf16"))
    except ImportError as e:
        rows.append(Row("bnb", "bitsandbytes", 0, 0, 0, note=f"not available: {e}"))

    try:
        from gguf import GGMLQuantizationType as GT
        from gguf import quants

        arrs = [t.float().numpy() for t in tensors]  # the gguf quantizers take fp32 numpy
        conv, _ = _best_time(lambda: [t.float().numpy() for t in tensors], reps)
        for name in ("Q4_0", "Q8_0", "MXFP4"):
            qt = getattr(GT, name)
            sec, outs = _best_time(lambda qt=qt: [quants.quantize(a, qt) for a in arrs], reps)
            bits = sum(o.nbytes * 8 for o in outs)
            se = ss = 0.0
            for o, ref in zip(outs, refs, strict=True):
                d = torch.from_numpy(quants.dequantize(o, qt).reshape(tuple(ref.shape)))
                se += float((d - ref).pow(2).sum(dtype=torch.float64))
                ss += float(ref.pow(2).sum(dtype=torch.float64))
            rows.append(Row(f"gguf {name}", "gguf", bits / numel, nbytes / sec / 1e6, sec,
                            math.sqrt(se / ss), 10 * math.log10(ss / se),
                            f"numpy, fp32 input (bf16->fp32 conversion {conv:.2f} s not counted)"))
    except ImportError as e:
        rows.append(Row("gguf", "gguf", 0, 0, 0, note=f"not available: {e}"))
    return rows


def lm_head_study(w: torch.Tensor, n_hidden: int = 64) -> list[dict[str, Any]]:
    """int8 vs int4 on lm_head: weight error and the error of the logits h @ W^T for random unit-RMS h."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(n_hidden, w.shape[1], generator=g)
    ref = h @ w.float().T
    top = ref.argmax(-1)
    out = []
    for label, spec in [("int8", QuantSpec("int8", None, True)), ("int4 g128", QuantSpec("int4", 128, True)),
                        ("int4 g32", QuantSpec("int4", 32, True)), ("nf4", QuantSpec("nf4", 64, True))]:
        fmt = get_format(spec.format)
        parts = fmt.quantize(w, spec)
        d = fmt.dequantize(parts, spec, tuple(w.shape), torch.float32)
        rel_w, sq_w = _err(w.float(), d)
        logits = h @ d.T
        rel_l, sq_l = _err(ref, logits)
        bits = sum(p.numel() * p.element_size() * 8 for p in parts.values())
        out.append({"format": label, "bits_per_weight": bits / w.numel(), "weight_rel_error": rel_w,
                    "weight_sqnr_db": sq_w, "logits_rel_error": rel_l, "logits_sqnr_db": sq_l,
                    "top1_agreement": float((logits.argmax(-1) == top).float().mean())})
    return out


def measure_quantize_rss(src: Path, out: Path, extra: list[str]) -> dict[str, Any]:
    """Run `quantkit quantize` in a child process that reports its own peak RSS (ru_maxrss)."""
    rss_file = out.parent / (out.name + ".maxrss")
    code = (
        "import resource, sys\n"
        "from quantkit.cli import main\n"
        f"sys.argv = ['quantkit', 'quantize', {str(src)!r}, '--out', {str(out)!r}, '--overwrite', *{extra!r}]\n"
        "try:\n"
        "    main()\n"
        "finally:\n"
        f"    open({str(rss_file)!r}, 'w').write(str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss))\n"
    )
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    sec = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"quantkit quantize failed: {proc.stderr.strip()[-2000:]}")
    maxrss = int(rss_file.read_text()) * 1024  # Linux reports KiB
    rss_file.unlink()
    return {"seconds": sec, "peak_rss_bytes": maxrss, "command": f"quantkit quantize {src} --out {out} " + " ".join(extra)}


def _source_stats(ckpt: Any) -> tuple[int, int, str]:
    total = largest = 0
    lname = ""
    for t in ckpt.canonical():
        n = math.prod(t.shape) * torch.empty((), dtype=getattr(torch, str(t.dtype).removeprefix("torch."))).element_size()
        total += n
        if n > largest:
            largest, lname = n, t.name
    return total, largest, lname


def _plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.8))
    colors = {"quantkit": "tab:blue", "bitsandbytes": "tab:orange", "gguf": "tab:green", "torch": "tab:gray"}
    for r in rows:
        if r.mb_s <= 0 or r.who == "torch":
            continue
        a1.scatter(r.bpw, r.mb_s, color=colors[r.who])
        a1.annotate(r.method, (r.bpw, r.mb_s), fontsize=7, xytext=(3, 3), textcoords="offset points")
        if r.sqnr_db is not None and math.isfinite(r.sqnr_db):
            a2.scatter(r.bpw, r.sqnr_db, color=colors[r.who])
            a2.annotate(r.method, (r.bpw, r.sqnr_db), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ceiling = next((r.mb_s for r in rows if r.who == "torch"), None)
    if ceiling:
        a1.axhline(ceiling, color="gray", ls="--", lw=1)
        a1.text(4.1, ceiling * 0.8, f"memory copy {ceiling:.0f} MB/s", fontsize=7, color="gray")
    a1.set_yscale("log")
    a1.set_xlabel("bits per weight")
    a1.set_ylabel("MB/s of bf16 input (log)")
    a1.set_title("quantize throughput")
    a2.set_xlabel("bits per weight")
    a2.set_ylabel("SQNR dB (higher is better)")
    a2.set_title("error on the same expert tensors")
    for who, c in colors.items():
        if who != "torch":
            a1.scatter([], [], color=c, label=who)
    a1.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def generate_checkpoint(path: Path, experts: int, layers: int) -> None:
    subprocess.run([sys.executable, "-m", "quantkit", "tiny-model", str(path), "--realistic",
                    "--experts", str(experts), "--layers", str(layers)], check=True, capture_output=True)


def run(reports: Path, workdir: Path, experts: int = 128, layers: int = 4, slab_experts: int = 16,
        reps: int = 2, checkpoint: Path | None = None, log: Any = print) -> dict[str, Any]:
    """Run the whole benchmark and write reports/bench-quantize.{md,json,png}."""

    t_all = time.perf_counter()
    reports.mkdir(parents=True, exist_ok=True)
    workdir.mkdir(parents=True, exist_ok=True)
    info = machine_info()
    src = checkpoint or (workdir / f"realistic-e{experts}-l{layers}")
    if checkpoint is None and not (src / "config.json").is_file():
        log(f"generating {src} ...")
        t0 = time.perf_counter()
        generate_checkpoint(src, experts, layers)
        log(f"  {time.perf_counter() - t0:.0f} s")
    ckpt = Checkpoint.open(src)
    total, largest, lname = _source_stats(ckpt)
    names = [t.name for t in ckpt.canonical()]
    gu = next(n for n in names if n.endswith("mlp.experts.gate_up_proj"))
    dn = next(n for n in names if n.endswith("mlp.experts.down_proj"))
    n_e = min(slab_experts, ckpt.config.get("text_config", ckpt.config).get("num_experts", slab_experts))
    tensors = [ckpt.load(gu, experts=slice(0, n_e)), ckpt.load(dn, experts=slice(0, n_e))]
    log(f"methods on {[tuple(t.shape) for t in tensors]} ...")
    rows = bench_methods(tensors, reps)
    del tensors

    log("lm_head study ...")
    lm = ckpt.load("lm_head.weight") if "lm_head.weight" in names else None
    lm_rows = lm_head_study(lm[: min(lm.shape[0], 65536)]) if lm is not None else []
    lm_shape = list(lm.shape) if lm is not None else None
    del lm

    log("full quantize run (peak RSS) ...")
    qout = workdir / "bench-q4"
    rss = measure_quantize_rss(src, qout, ["--bits", "4"])
    bound = 3 * largest + (1 << 30)
    rss.update({"source_bytes": total, "largest_tensor": lname, "largest_tensor_bytes": largest,
                "bound_bytes": bound, "within_bound": rss["peak_rss_bytes"] < bound,
                "throughput_mb_s": total / rss["seconds"] / 1e6})
    rep = json.loads((qout / "quantkit-report.json").read_text())
    rss["quantizer_report_total"] = rep["total"]

    data = _assemble(info, rows, lm_rows, lm_shape, rss, src, n_e, time.perf_counter() - t_all,
                     experts, layers)
    _plot(rows, reports / "bench-quantize.png")
    write_reports(reports, "bench-quantize", data, render_markdown(data))
    return data


def _assemble(info, rows, lm_rows, lm_shape, rss, src, n_e, seconds, experts, layers) -> dict[str, Any]:
    by = {r.method: r for r in rows}
    bnb = by.get("bnb nf4 b64")
    q40 = by.get("gguf Q4_0")
    ours = [r for r in rows if r.who == "quantkit" and r.method.startswith("int4")]
    targets = []
    for r in ours:
        t = {"method": r.method, "mb_s": r.mb_s}
        if bnb and bnb.mb_s:
            t["x_bnb_nf4"] = r.mb_s / bnb.mb_s
            t["meets_3x_bnb"] = r.mb_s >= 3 * bnb.mb_s
        if q40 and q40.mb_s:
            t["x_gguf_q4_0"] = r.mb_s / q40.mb_s
            t["meets_gguf_q4_0"] = r.mb_s >= q40.mb_s
        if bnb and bnb.sqnr_db is not None:
            t["sqnr_db"] = r.sqnr_db
            t["bpw"] = r.bpw
            t["in_4.25_4.5_bpw"] = 4.2 <= r.bpw <= 4.55
            t["sqnr_vs_bnb_nf4_db"] = r.sqnr_db - bnb.sqnr_db
        targets.append(t)
    ceiling = by.get("memory copy (torch clone)")
    return {
        "command": "quantkit bench quantize " + " ".join(sys.argv[3:]) if len(sys.argv) > 3 else
        "quantkit bench quantize",
        "machine": info,
        "checkpoint": {"path": str(src), "experts": experts, "layers": layers},
        "tensors": f"layer-0 routed experts 0..{n_e - 1}: gate_up_proj [{n_e}, 1024, 2048] + down_proj [{n_e}, 2048, 512]",
        "methods": [r.__dict__ | {"x_memcpy": (r.mb_s / ceiling.mb_s if ceiling and ceiling.mb_s else None)}
                    for r in rows],
        "targets": targets,
        "lm_head": {"shape_measured": lm_shape and [min(lm_shape[0], 65536), lm_shape[1]], "rows": lm_rows},
        "quantize_run": rss,
        "seconds": round(seconds, 1),
    }


def render_markdown(d: dict[str, Any]) -> str:
    m = d["machine"]
    L = ["# bench: quantize", "",
         f"Command: `{d['command']}` ({d['seconds']:.0f} s in all)", "",
         f"Machine: {m['cpu']}, {m['logical_cores']} logical / {m['physical_cores']} physical cores, "
         f"{m['ram_gb']} GB RAM; torch {m['torch']} ({m['torch_threads']} threads), bitsandbytes "
         f"{m['bitsandbytes']}, gguf {m['gguf']}, numpy {m['numpy']}; load average at start "
         f"{m['load_avg_at_start']} (the machine is shared with other work: absolute MB/s vary between runs, "
         "the ratios measured in the same run are the figures to read).", "",
         f"Checkpoint: generated realistic-shape qwen3_5_moe at `{d['checkpoint']['path']}`. Tensors timed: "
         f"{d['tensors']}; every method gets the same tensors; best of the repetitions.", "",
         "## Throughput and error", "",
         "| method | by | bits/weight | MB/s (bf16 input) | x memory copy | rel. error | SQNR dB | note |",
         "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in d["methods"]:
        L.append(f"| {r['method']} | {r['who']} | {r['bpw']:.3f} | {r['mb_s']:.0f} | "
                 f"{(r['x_memcpy'] or 0):.3f} | {'-' if r['rel_error'] is None else format(r['rel_error'], '.4f')} | "
                 f"{'-' if r['sqnr_db'] is None else format(r['sqnr_db'], '.2f')} | {r['note']} |")
    L += ["", "![throughput and SQNR vs bits per weight](bench-quantize.png)", "", "## Targets", "",
          "| ours | MB/s | x bnb nf4 (target >= 3) | x gguf Q4_0 (target >= 1) | bits/w | SQNR - bnb nf4 b64 dB |",
          "|---|---:|---:|---:|---:|---:|"]
    for t in d["targets"]:
        L.append(f"| {t['method']} | {t['mb_s']:.0f} | {t.get('x_bnb_nf4', 0):.2f} | {t.get('x_gguf_q4_0', 0):.2f} | "
                 f"{t.get('bpw', 0):.3f} | {t.get('sqnr_vs_bnb_nf4_db', 0):+.2f} |")
    L += ["", "## lm_head: int8 or 4-bit?", "",
          f"On lm_head rows of the generated checkpoint (shape measured {d['lm_head']['shape_measured']}), logits "
          "of 64 random hidden states against the bf16 weights:", "",
          "| format | bits/w | weight rel. error | weight SQNR dB | logits rel. error | logits SQNR dB | top-1 agreement |",
          "|---|---:|---:|---:|---:|---:|---:|"]
    for r in d["lm_head"]["rows"]:
        L.append(f"| {r['format']} | {r['bits_per_weight']:.3f} | {r['weight_rel_error']:.4f} | "
                 f"{r['weight_sqnr_db']:.2f} | {r['logits_rel_error']:.4f} | {r['logits_sqnr_db']:.2f} | "
                 f"{r['top1_agreement']:.3f} |")
    q = d["quantize_run"]
    L += ["", "## A full `quantkit quantize --bits 4` run", "",
          f"`{q['command']}`: {q['source_bytes'] / 1e9:.2f} GB of bf16 in {q['seconds']:.1f} s "
          f"({q['throughput_mb_s']:.0f} MB/s end to end: read, quantize, dequantize for the error figures, write, "
          "sha256), output "
          f"{q['quantizer_report_total']['bytes_after'] / 1e9:.2f} GB at "
          f"{q['quantizer_report_total']['bits_per_weight']:.3f} bits/weight.", "",
          f"Peak RSS {q['peak_rss_bytes'] / 1e9:.2f} GB; bound = 3 x largest input tensor "
          f"({q['largest_tensor']}, {q['largest_tensor_bytes'] / 1e9:.2f} GB) + 1 GiB = {q['bound_bytes'] / 1e9:.2f} GB: "
          f"{'within' if q['within_bound'] else 'OVER'} the bound.", ""]
    return "\n".join(L) + "\n"
