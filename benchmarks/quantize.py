"""`python -m benchmarks.quantize`: quantizer throughput, error and peak memory, with peers in the same run.

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
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import typer

from benchmarks import file_to_file
from benchmarks.cli import command_line, guard_reports, run_command, shared
from quantkit.bench import write_reports
from quantkit.bench.machine import machine_info
from quantkit.checkpoint.reader import Checkpoint
from quantkit.cli.options import COUNT, COUNT0
from quantkit.formats import QuantSpec, get_format
from quantkit.quantize.run import DEFAULT_SLAB_BYTES, block_sizes, make_plan, peak_bound
from quantkit.quantize.stream import CHUNK_TEMP_BYTES, STAGE_OVERHEAD_BYTES
from quantkit.recipe import build_recipe
from quantkit.threads import resolve_threads

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


# The file-to-file run before issue 30's changes (commit 6245de5, the one-thread loop), measured on this
# bench's machine with /usr/bin/time and py-spy (100 Hz, every thread): `quantkit quantize
# realistic-e64-l4 --out q4 --bits 4 --format int --group-size 32 --uniform`, llama.cpp Q4_0 right after.
BEFORE: dict[str, Any] = {
    "commit": "6245de5",
    "quantkit": {"wall": 18.86, "user": 12.77, "sys": 9.98, "peak_rss": 986852 * 1024, "minor_faults": 5051295},
    "llama.cpp": {"wall": 7.30, "user": 1.94, "sys": 2.64, "peak_rss": 515728 * 1024},
    "py_spy": [("Int4.dequantize for the error figures (main thread, dense fp32 copy)", 0.251),
               ("_error_sums / _sum_sq (main thread)", 0.198),
               ("Int4.quantize chunk work (2 pool threads)", 0.275),
               ("ShardWriter.write", 0.049), ("imports", 0.039), ("check_finite", 0.025),
               ("sha256 read-back", 0.015)],
    "note": "5.05 million minor page faults: every slab, result and temporary was a fresh mapping (10 s of system "
            "time); the dequantize and error sums ran on the main thread while the pool threads waited.",
}


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
    """Run `quantkit quantize` in a child process; its wall time and its own peak RSS (/usr/bin/time: a
    child's ru_maxrss as the parent reads it carries over the parent's RSS at fork, which overstated it)."""
    cmd = [sys.executable, "-m", "quantkit", "quantize", str(src), "--out", str(out), "--overwrite", *extra]
    r = file_to_file.timed(cmd)
    return {"seconds": r["wall"], "peak_rss_bytes": r["peak_rss"],
            "command": f"quantkit quantize {src} --out {out} " + " ".join(extra)}


def import_rss() -> int:
    """Peak RSS of the interpreter with quantkit's CLI and torch imported (what a run starts from)."""
    code = "import quantkit.cli as c; c._register()"
    return file_to_file.timed([sys.executable, "-c", code])["peak_rss"]


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
        reps: int = 2, checkpoint: Path | None = None, log: Any = print, large_layers: int = 0) -> dict[str, Any]:
    """Run the whole benchmark and write reports/bench-quantize.{md,json,png}. `large_layers`: also time file to
    file on a generated checkpoint of that many layers (same experts), where the fixed start-up amortises."""

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
    threads = resolve_threads(None)
    plan = make_plan(list(ckpt.canonical()), build_recipe(4))
    b_in, b_out = block_sizes(plan, plan.shard_names, [], DEFAULT_SLAB_BYTES)
    base = import_rss()
    bound = base + peak_bound(b_in, b_out, threads)
    rss.update({"source_bytes": total, "largest_tensor": lname, "largest_tensor_bytes": largest,
                "bound_bytes": bound, "within_bound": rss["peak_rss_bytes"] < bound,
                "bound_terms": {"import_rss": base, "block_in": b_in, "block_out": b_out, "threads": threads,
                                "chunk_temps": CHUNK_TEMP_BYTES, "stage_overhead": STAGE_OVERHEAD_BYTES},
                "throughput_mb_s": total / rss["seconds"] / 1e6})
    rep = json.loads((qout / "quantkit-report.json").read_text())
    rss["quantizer_report_total"] = rep["total"]
    shutil.rmtree(qout, ignore_errors=True)

    log(f"file to file against llama.cpp's quantizer, alternated, best of {max(reps, 2)} ...")
    f2f = file_to_file.run(src, workdir, threads, max(reps, 2), log)
    large = None
    if large_layers:
        src_l = workdir / f"realistic-e{experts}-l{large_layers}"
        if not (src_l / "config.json").is_file():
            log(f"generating {src_l} ...")
            generate_checkpoint(src_l, experts, large_layers)
        log(f"file to file on {src_l.name}, alternated, best of 2 ...")
        large = file_to_file.run(src_l, workdir, threads, 2, log)

    data = _assemble(info, rows, lm_rows, lm_shape, rss, src, n_e, time.perf_counter() - t_all,
                     experts, layers)
    data["file_to_file"] = f2f | {"history": HISTORY}
    if large is not None:
        data["file_to_file_large"] = large
    data["before"] = BEFORE
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
        "command": command_line("quantize", sys.argv[1:]),
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


# The file-to-file section's earlier runs and the before/after of the changes since (issue 30), newest first.
HISTORY: list[str] = [
    "llama.cpp in these tables: llama-cpp-python 0.3.36 as built on this machine during the session (CPU: AVX512, "
    "AVX512-BF16, AVX512-VNNI, OpenMP; `llama_print_system_info`).",
    "perf over one whole int4 g32 run on the issue's shape (CPU samples, every thread): the quantizer's kernel "
    "25%, the kernel's page-cache copies 21% (reads of the source 11%, writes of the output 10%), the interpreter "
    "22% (mostly the imports), sha256 (libcrypto) 7%, torch 5%. Before the CLI froze its imported objects, the "
    "cyclic collector's passes were another 8%. What is left at this size is fixed: torch's import (about 1.1 "
    "CPU-s) and the sha256 of the one output shard, which can only start when its last byte is written (the "
    "shard's layout puts every tensor's scales before the codes, so no prefix is complete earlier). The source "
    "blocks are mapped since (llama.cpp's quantizer maps its source too): alternated twice against the commit "
    "before at load 4.7-5.2, int4 g32 system time 1.29-1.39 s -> 0.79-1.06 s and peak RSS 351 -> 314 MB, the "
    "same shards (sha256); int8's system time is its output's page-cache writes (38% of its samples in "
    "copy_folio_from_iter_atomic), which llama.cpp pays for as many bytes.",
    "Before/after the quantizer's own kernel and the lazy CLI imports (commit 208cc7f against this branch), "
    "alternated 3 times on the issue's shape at load 5.6-7.1 (`quantkit quantize realistic-e64-l4 --out o "
    "--bits 4 --format int --group-size 32 --uniform --threads 2`, and `--bits 8 --uniform`), best wall: int4 g32 "
    "10.81 s -> 6.43 s (1.68x; user+sys 9.4 -> 5.0 s), int8 10.34 s -> 6.93 s (1.49x; user+sys 8.4 -> 5.0 s). "
    "One thread, CPU-seconds per element with the error sums (bf16 [2048, 2048]): int4 g32 4.2x the decode "
    "kernel's route and 9.3x torch's, int8 4.3x torch's.",
    "Commit 208cc7f on a quieter machine (load about 1.0-1.9): int4 g32 quantkit 4.16 s against llama.cpp 1.61 s "
    "(0.39x; start-up 1.12 s, quantize stage 2.13 s), int8 3.40 s against 2.47 s (0.73x).",
]


def render_file_to_file(f: dict[str, Any], before: dict[str, Any] | None,
                        title: str = "File to file against llama.cpp's quantizer") -> list[str]:
    """The file-to-file section: both engines alternated, best walls, ratios, and where quantkit's time goes."""
    L = [f"## {title}", "",
         f"Source {f['source']} ({f['source_bytes'] / 1e9:.2f} GB of bf16 safetensors; llama.cpp reads the bf16 GGUF "
         f"of the same weights, {f['gguf_bytes'] / 1e9:.2f} GB, written by `quantkit export gguf --type bf16`). "
         f"Each engine is its own process under /usr/bin/time, {f['threads']} threads each, alternated "
         f"quantkit / llama.cpp {f['reps']} times per case; best wall of each. Ratios above 1 favour quantkit "
         "(speed: llama.cpp's wall / quantkit's; memory: llama.cpp's peak RSS / quantkit's).", "",
         "| case | engine | best wall s | user s | sys s | peak RSS GB | output MB | every wall s |",
         "|---|---|---:|---:|---:|---:|---:|---|"]
    for c in f["cases"]:
        for who in ("quantkit", "llama.cpp"):
            b = c["best"][who]
            walls = ", ".join(f"{r['wall']:.1f}" for r in c["runs"][who])
            L.append(f"| {c['case']} | {who} | {b['wall']:.2f} | {b['user']:.2f} | {b['sys']:.2f} | "
                     f"{b['peak_rss'] / 1e9:.2f} | {c['out_bytes'][who] / 1e6:.0f} | {walls} |")
    loads = [r["load"] for c in f["cases"] for who in c["runs"] for r in c["runs"][who] if "load" in r]
    if loads:
        L += ["", f"Load average (1 min) before each run: {min(loads):.1f} to {max(loads):.1f} on "
              f"{os.cpu_count()} cores (other work shares the machine; both engines' runs alternate under it)."]
        if max(loads) > (os.cpu_count() or 1):
            L[-1] += (" Above the core count, llama.cpp's worker threads spin while they wait for their share of the "
                      "cores (OpenMP), so its user time grows with the load more than quantkit's: the ratios here are "
                      "a loaded machine's, not a quiet one's.")
    L += ["", "| case | speed vs llama.cpp (target >= 1.0) | memory: llama.cpp RSS / quantkit RSS (target >= 1.0) |",
          "|---|---:|---:|"]
    for c in f["cases"]:
        L.append(f"| {c['case']} ({c['llama_type']}) | {c['speed_ratio']:.2f}x | {1 / c['rss_ratio']:.2f}x |")
    L += ["", "Commands: " + "; ".join(f"`{c['quantkit_cmd']}` vs `{c['llama_cmd']}`" for c in f["cases"]) + ".", "",
          "### Where quantkit's time goes", "",
          "One more run per case in process (quantize/stream.StageTimes): seconds each stage spent. The reader, the "
          "quantizing threads and the writer overlap, so the stages add up to more than the run; `wait for ...` is "
          "the main thread idle. Start-up is the interpreter, torch and quantkit's imports before the run.", "",
          "| case | start-up s | run s | " + " | ".join(_STAGE_ORDER) + " |",
          "|---|---:|---:|" + "---:|" * len(_STAGE_ORDER)]
    for c in f["cases"]:
        p = c["profile"]
        if "stages" not in p:
            L.append(f"| {c['case']} | {p.get('error', 'no profile')} |")
            continue
        L.append(f"| {c['case']} | {p['wall'] - p['run']:.2f} | {p['run']:.2f} | "
                 + " | ".join(f"{p['stages'].get(k, 0):.2f}" for k in _STAGE_ORDER) + " |")
    for c in f["cases"]:
        p = c["profile"]
        if "stages" in p:
            L += ["", f"{c['case']}: start-up {p['wall'] - p['run']:.2f} s and the quantize stage "
                  f"{p['stages'].get('quantize', 0):.2f} s of quantkit's {p['wall']:.2f} s; llama.cpp's whole run "
                  f"{c['best']['llama.cpp']['wall']:.2f} s."]
    L += ["", "The int4 quantize stage is the clip search of formats/int4.py (three candidate scales per group, each "
          "scored on the group's rounding error), where ggml's Q4_0 takes the one scale of the block's largest "
          "magnitude; int4 and int8 of bf16 rows run on the quantizer's own kernel (kernels/quant.py: one "
          "pass per group, the search eight groups at once, the error sums inside). The start-up is mostly "
          "torch's import (the CLI imports only the command's module)."]
    for c in f["cases"]:
        spy = c["profile"].get("py_spy")
        if spy:
            L += ["", f"py-spy, {c['case']} (share of samples over every thread, innermost Python function; native "
                  "time counts to the Python frame that called it):", ""]
            L += [f"- {share:.1%} {name}" for name, share in spy]
    if f.get("history"):
        L += ["", "### Earlier runs", ""] + [f"- {h}" for h in f["history"]]
    if before:
        qb, lb = before["quantkit"], before["llama.cpp"]
        L += ["", f"### Before (commit {before['commit']}, int4 g32)", "",
              f"quantkit {qb['wall']:.2f} s wall, {qb['user']:.2f} user, {qb['sys']:.2f} sys, "
              f"{qb['peak_rss'] / 1e9:.2f} GB peak RSS; llama.cpp right after {lb['wall']:.2f} s, "
              f"{lb['peak_rss'] / 1e9:.2f} GB ({lb['wall'] / qb['wall']:.2f}x). {before['note']} py-spy:", ""]
        L += [f"- {share:.1%} {name}" for name, share in before["py_spy"]]
    return L + [""]


_STAGE_ORDER = ["read", "reader idle (buffers in use)", "quantize", "check finite", "write", "fsync", "sha256",
                "wait for reads", "wait for writes"]


def render_markdown(d: dict[str, Any]) -> str:
    m = d["machine"]
    L = ["# bench: quantize", "",
         f"Command: `{d['command']}` ({d['seconds']:.0f} s in all)", "",
         f"Machine: {m['cpu']} ({m.get('isa') or 'flags unknown'}), {m['logical_cores']} logical / "
         f"{m['physical_cores']} physical cores, "
         f"{m['ram_gb']} GB RAM; torch {m['torch']} ({m['torch_threads']} threads), bitsandbytes "
         f"{m['bitsandbytes']}, gguf {m['gguf']}, numpy {m['numpy']}; load average at start "
         f"{m['load_avg_at_start']} (the machine is shared with other work: absolute MB/s vary between runs, "
         "the ratios measured in the same run are the figures to read).", "",
         f"Checkpoint: realistic-shape qwen3_5_moe at `{d['checkpoint']['path']}` (`quantkit tiny-model --realistic "
         f"--layers {d['checkpoint']['layers']} --experts {d['checkpoint']['experts']}`). Tensors timed: "
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
    bt = q["bound_terms"]
    L += ["", "## A full `quantkit quantize --bits 4` run", "",
          f"`{q['command']}`: {q['source_bytes'] / 1e9:.2f} GB of bf16 in {q['seconds']:.1f} s "
          f"({q['throughput_mb_s']:.0f} MB/s end to end: start-up, read, quantize with the error figures, write, "
          "sha256), output "
          f"{q['quantizer_report_total']['bytes_after'] / 1e9:.2f} GB at "
          f"{q['quantizer_report_total']['bits_per_weight']:.3f} bits/weight.", "",
          f"Peak RSS {q['peak_rss_bytes'] / 1e9:.2f} GB (/usr/bin/time, the quantizer's process alone); bound = "
          f"interpreter with torch and the CLI imported ({bt['import_rss'] / 1e9:.2f} GB, measured) + 2 x largest "
          f"block read ({bt['block_in'] / 1e6:.0f} MB) + 2 x its quantized parts ({bt['block_out'] / 1e6:.0f} MB) + "
          f"{bt['threads']} threads x {bt['chunk_temps'] / 2**20:.0f} MiB of chunk temporaries + "
          f"{bt['stage_overhead'] / 2**20:.0f} MiB = {q['bound_bytes'] / 1e9:.2f} GB: "
          f"{'within' if q['within_bound'] else 'OVER'} the bound. The largest tensor "
          f"({q['largest_tensor']}, {q['largest_tensor_bytes'] / 1e9:.2f} GB) does not enter it: every tensor is "
          "read in blocks of the slab size (32 MB) along its first dimension.", ""]
    if "file_to_file" in d:
        L += render_file_to_file(d["file_to_file"], d.get("before"))
    if "file_to_file_large" in d:
        n = Path(d["file_to_file_large"]["source"]).name
        L += render_file_to_file(d["file_to_file_large"], None,
                                 f"File to file on a larger shape ({n}), where fixed start-up costs amortise")
    return "\n".join(L) + "\n"


def cli(
    reports: Path = shared("reports", Path("reports")),
    workdir: Path = shared("workdir", Path("/tmp/quantkit-bench")),
    experts: int = shared("experts", 128),
    layers: int = shared("layers", 4),
    reps: int = shared("reps", 2),
    model: Path = shared("model", None),
    slab: int = typer.Option(16, "--slab", parser=COUNT, help="experts of layer 0 the format timings run on"),
    large_layers: int = typer.Option(0, "--large-layers", parser=COUNT0,
                                     help="also time file to file on a generated checkpoint of this many layers "
                                          "(same experts), where fixed start-up costs amortise; 0: not"),
) -> None:
    """Quantizer throughput and error vs bitsandbytes and gguf, peak RSS of a full run, and file to file against
    llama.cpp's quantizer.

    --model: a realistic-shape checkpoint instead of the generated one."""
    guard_reports(reports, "quantize")
    d = run(reports, workdir, experts, layers, slab, reps, model, large_layers=large_layers)
    print(f"wrote {reports / 'bench-quantize.md'} ({d['seconds']:.0f} s)")


def main(argv: list[str] | None = None) -> int:
    return run_command(cli, argv, "quantize")


if __name__ == "__main__":
    sys.exit(main())
