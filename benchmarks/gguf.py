"""`python -m benchmarks.gguf`: KL divergence per GGUF type through llama.cpp itself, with and without an importance
matrix, the file size it implies for the real model and llama.cpp's decode speed; it picks the default type.

On a decisive-routing tiny checkpoint of the real architecture whose rows take K-quant blocks (hidden and
expert width 512, 16 experts, top-4; routing decisive so rounding cannot flip expert choice and the KLD
measures quantization, not expert flips):
1. the bf16 export is the reference: llama.cpp's logits on a probe batch (chat-formatted corpus text);
2. every type is exported (quantkit's own writer for mixed / q8_0 / q4_0 / mxfp4, llama.cpp's quantizer for
   the K and IQ types) and, for the llama.cpp types, again with an importance matrix collected on OTHER text
   (quantkit.testing.imatrix); llama.cpp runs each file: mean and 99th-percentile per-token KL against the
   bf16 logits, top-1 agreement, greedy decode tok/s (best of `reps`);
3. the real model's file size under each type comes from the same type table the exporter writes by
   (quantkit.export.llama_placement.model_from_spec), since the tiny model's size is dominated by its
   embedding;
4. the default: among types whose real-model file is at most `SIZE_SLACK` x the q4_0 file (the 4-bit class:
   what fits the cards quantkit plans for), the lowest mean KL without an importance matrix (what a plain
   `quantkit export gguf` produces).
Reports: reports/bench-gguf.md, .json, .png (KL vs real-model size).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.cli import guard_reports, run_command, shared
from benchmarks.cli import threads as resolve_threads
from quantkit.bench import write_reports
from quantkit.bench.engines import describe_machine
from quantkit.bench.llama_worker import llama_decode, llama_logits
from quantkit.checkpoint.spec import default_spec
from quantkit.export.gguf import export_gguf
from quantkit.export.gguf_types import LLAMA_TYPES
from quantkit.export.llama_placement import model_from_spec
from quantkit.testing.imatrix import collect_expert_imatrix, write_imatrix_gguf
from quantkit.testing.tiny import load_reference_model, make_tiny_model, probe_ids
from quantkit.testing.tokenizer import build_tokenizer, tiny_corpus

SHAPE = {"layers": 4, "experts": 16, "top_k": 4, "hidden": 512, "intermediate": 512}
TYPES = ("q8_0", "q6_k", "q5_k_m", "q5_k_s", "mixed", "q4_k_m", "q4_k_s", "iq4_nl", "iq4_xs", "q4_0", "mxfp4",
         "q3_k_m")
SIZE_SLACK = 1.15
PROBE = (4, 96)


def kl_per_token(ref: np.ndarray, got: np.ndarray) -> np.ndarray:
    r = torch.log_softmax(torch.from_numpy(ref).double(), -1)
    g = torch.log_softmax(torch.from_numpy(got).double(), -1)
    return (r.exp() * (r - g)).sum(-1).flatten().numpy()


def _calibration_ids() -> torch.Tensor:

    tok = build_tokenizer()
    lines = tiny_corpus(400, seed=11)
    return torch.tensor([tok.encode("".join(lines[i * 25:(i + 1) * 25])).ids[:96] for i in range(8)])


def choose_default(rows: list[dict[str, Any]]) -> str:
    """The lowest-KL type without imatrix among those within SIZE_SLACK x q4_0's real-model size."""
    plain = [r for r in rows if not r["imatrix"]]
    cap = SIZE_SLACK * next(r["real_model_gb"] for r in plain if r["type"] == "q4_0")
    return min((r for r in plain if r["real_model_gb"] <= cap), key=lambda r: r["kl_mean"])["type"]


def run(reports: Path, workdir: Path, threads: int = 2, reps: int = 2, new_tokens: int = 32,
        log: Any = print) -> dict[str, Any]:

    t_start = time.perf_counter()
    workdir.mkdir(parents=True, exist_ok=True)
    reports.mkdir(parents=True, exist_ok=True)
    machine = describe_machine()
    src = workdir / "decisive-h512"
    if not (src / "config.json").is_file():
        log(f"generating {src}")
        make_tiny_model(src, decisive=True, overwrite=True, **SHAPE)
    imatrix = workdir / "imatrix.gguf"
    log("collecting the importance matrix (transformers fp32, calibration text)")
    write_imatrix_gguf(collect_expert_imatrix(load_reference_model(src), _calibration_ids()), imatrix, chunks=8,
                       chunk_size=96)
    probe = probe_ids(*PROBE)
    prompt = probe[0, :64].tolist()
    ref_path = export_gguf(src, workdir / "bf16.gguf", "bf16", overwrite=True).path
    ref = llama_logits(ref_path, probe, threads)
    spec = default_spec()
    real = {"bf16": model_from_spec(spec, "bf16").total / 1e9}
    rows: list[dict[str, Any]] = []
    for ty in TYPES:
        real[ty] = model_from_spec(spec, ty).total / 1e9
        for im in ([False, True] if ty in LLAMA_TYPES else [False]):
            log(f"{ty}{' + imatrix' if im else ''}")
            res = export_gguf(src, workdir / f"{ty}{'-im' if im else ''}.gguf", ty, overwrite=True,
                              imatrix=imatrix if im else None)
            got = llama_logits(res.path, probe, threads)
            k = kl_per_token(ref, got)
            got_top1 = float((got.argmax(-1) == ref.argmax(-1)).mean())
            d = llama_decode(res.path, prompt, new_tokens, threads, reps) if reps else {}
            rows.append({"type": ty, "imatrix": im, "tiny_file_mb": res.nbytes / 1e6, "real_model_gb": real[ty],
                         "kl_mean": float(k.mean()), "kl_p99": float(np.quantile(k, 0.99)), "top1": got_top1,
                         "decode_tps": d.get("decode_tps"), "prefill_tps": d.get("prefill_tps"),
                         "types": res.by_type()})
            res.path.unlink()
    default = choose_default(rows)
    data = {
        "command": f"python -m benchmarks.gguf --threads {threads} --reps {reps}",
        "machine": machine, "threads": threads, "shape": SHAPE, "probe": list(PROBE), "new_tokens": new_tokens,
        "reps": reps, "real_model_bf16_gb": real["bf16"], "rows": rows, "default": default,
        "size_slack": SIZE_SLACK, "seconds": time.perf_counter() - t_start,
    }
    write_reports(reports, "bench-gguf", data, render(data), indent=2)
    plot(data, reports / "bench-gguf.png")
    return data


def render(d: dict[str, Any]) -> str:
    m = d["machine"]
    s = d["shape"]
    lines = [
        "# GGUF types: KL divergence through llama.cpp, size and decode speed",
        "",
        f"Command: `{d['command']}` ({d['seconds']:.0f} s)",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['ram_gb']} GB RAM, load average {m['load_avg_at_start']:.2f} "
        f"at start; llama.cpp (llama-cpp-python) CPU build, {d['threads']} threads.",
        "",
        f"Checkpoint: decisive-routing tiny qwen3_5_moe, {s['layers']} layers, hidden {s['hidden']}, "
        f"{s['experts']} experts x {s['intermediate']} wide, top-{s['top_k']}. KL = per-token KL divergence of "
        f"llama.cpp's logits on each file against llama.cpp on the bf16 export ({d['probe'][0]} x {d['probe'][1]} "
        "tokens of chat-formatted text); imatrix = expert statistics collected on other text. `real GB` = the "
        f"file this type gives for Qwen-AgentWorld-35B-A3B (bf16: {d['real_model_bf16_gb']:.1f} GB), from the "
        "exporter's type table. tok/s = this tiny model's greedy decode (relative speed of the block formats "
        "on this CPU, not the 35B's speed; `-` = not timed: `--reps 0` measures quality only, without the "
        "benchmark lock).",
        "",
        "| type | imatrix | real GB | KL mean | KL p99 | top-1 | decode tok/s | experts (gate/up, down) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in d["rows"]:
        t = r["types"]
        ex = ", ".join(f"{k} {v}" for k, v in sorted(t.items()) if k not in ("F32",))
        lines.append(f"| {r['type']} | {'yes' if r['imatrix'] else 'no'} | {r['real_model_gb']:.2f} | "
                     f"{r['kl_mean']:.2e} | {r['kl_p99']:.2e} | {r['top1']:.3f} | {_tps(r['decode_tps'])} | {ex} |")
    lines += ["", f"**Default `--type`: {d['default']}** - the lowest mean KL without an importance matrix among "
              f"the types whose real-model file is at most {d['size_slack']}x the q4_0 file (the 4-bit class)."]
    return "\n".join(lines) + "\n"


def _tps(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def plot(d: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for im, marker in ((False, "o"), (True, "x")):
        rows = [r for r in d["rows"] if r["imatrix"] == im]
        ax.scatter([r["real_model_gb"] for r in rows], [r["kl_mean"] for r in rows], marker=marker,
                   label="with imatrix" if im else "without imatrix")
        if not im:
            for r in rows:
                ax.annotate(r["type"], (r["real_model_gb"], r["kl_mean"]), fontsize=8)
    ax.set_yscale("log")
    ax.set_xlabel("Qwen-AgentWorld-35B-A3B GGUF size (GB)")
    ax.set_ylabel("mean KL vs bf16 (llama.cpp, tiny decisive model)")
    ax.set_title(f"GGUF types; default {d['default']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cli(
    reports: Path = shared("reports", Path("reports")),
    workdir: Path = shared("workdir", Path("/tmp/quantkit-bench-gguf")),
    threads: int = shared("threads", None),
    reps: int = shared("reps", 2, zero=True),
) -> None:
    """KL divergence per GGUF type through llama.cpp (with and without an imatrix), size and decode tok/s.

    --reps 0: KL only."""
    guard_reports(reports, "gguf")
    d = run(reports, workdir, resolve_threads(threads), reps)
    print(f"default type: {d['default']}; wrote {reports / 'bench-gguf.md'} ({d['seconds']:.0f} s)")


def main(argv: list[str] | None = None) -> int:
    return run_command(cli, argv, "gguf")


if __name__ == "__main__":
    sys.exit(main())
