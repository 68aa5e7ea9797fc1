"""`quantkit bench decode`: prefill and decode tok/s and peak memory of the runtime per format, beside
plain transformers bf16, the planner's prediction and the bandwidth bound, on a realistic-shape
checkpoint (real hidden/expert/head sizes, fewer layers and experts). Writes reports/bench-decode.{md,json}.

Each configuration runs in its own subprocess (so peak RSS is its own): load, one prefill of `prompt`
tokens (one chunk), then `decode` greedy steps, `reps` times. The machine is shared with other jobs whose
load comes and goes, so the configurations run in `rounds` interleaved rounds (A B C .. A B C ..) and each
keeps its best round: a burst of load then hurts one round of every configuration rather than all rounds
of one. Every round's figure stays in the JSON. The bandwidth bound is the bytes one decode step reads --
the weights (every non-expert matrix, top_k experts per layer, lm_head; the embedding one row) plus the
caches (Gated DeltaNet recurrent and conv states read and written, K and V up to the filled length) --
over the measured read bandwidth of this machine (the best of the streaming reads of a 1 GiB tensor at
the start and before each round, and of 256 MiB in each configuration's process right after its decode).
The planner's figures come from `quantkit.planner.placement.solve` for a CPU-only host with that bandwidth: its estimate for quantkit's own
runtime, composed from `quantkit profile-host` runs made at the start of each round (parts timed in
isolation: quantkit/planner/host_costs.py; each part at its fastest over the rounds, as each decode is its
best round), which the target judges; and its llama.cpp-grade estimate.

`int4-avx2` is the int4 folder again with the kernel forced to its AVX2 table (QUANTKIT_CPU_ISA=avx2 in its
process): on an AVX512 CPU the default run includes it, so the figure most users' CPUs get sits beside the
native one (its planner estimate is left out: the calibration times the native table).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from quantkit.bench import read_bandwidth_gbs, spells, write_reports
from quantkit.checkpoint.reader import Checkpoint
from quantkit.checkpoint.spec import load_config, spec_from_config
from quantkit.errors import QuantkitError
from quantkit.kernels import cpu as kernel_cpu
from quantkit.planner.budget import RunSettings
from quantkit.planner.hardware import build_hardware, cpu_name
from quantkit.planner.host_costs import fastest, load_profile
from quantkit.planner.placement import solve
from quantkit.quantize.run import QuantizeOptions, run_quantize
from quantkit.recipe import get_recipe
from quantkit.runtime import cpu_kernel, load_model
from quantkit.runtime.calibrate import time_layer_ops
from quantkit.runtime.loader import QuantEmbedding
from quantkit.runtime.model.qwen3_5_moe import Attention, Model
from quantkit.runtime.qexperts import QuantExperts
from quantkit.testing.tiny import make_tiny_model

# name -> (how it runs, recipe for the quantizer or None)
CONFIGS: dict[str, tuple[str, str | None]] = {
    "transformers-bf16": ("transformers", None),
    "quantkit-bf16": ("quantkit", None),
    "int8": ("quantkit", "int8"),
    "quality": ("quantkit", "quality"),
    "int4": ("quantkit", "int4"),
    "nf4": ("quantkit", "nf4"),
    "fp4": ("quantkit", "fp4"),
    "mxfp4": ("quantkit", "mxfp4"),
    "int4-avx2": ("quantkit", "int4"),
    "int4-avx2-plain": ("quantkit", "int4"),
}
# configurations run with the kernel forced to a lower instruction set (QUANTKIT_CPU_ISA in their process)
FORCED_ISA = {"int4-avx2": "avx2", "int4-avx2-plain": "avx2-plain"}


def default_configs() -> list[str]:
    """Every configuration; the forced-ISA ones only where they run a table below this CPU's: int4-avx2 on
    AVX512 CPUs, int4-avx2-plain (no AVX-VNNI, as AMD Zen 2/3) where AVX2 has AVX-VNNI."""
    level = kernel_cpu.ISA_LEVELS.get(kernel_cpu.isa(), -1)
    plain = kernel_cpu.best_table("avx2") == "avx2vnni"
    return [n for n in CONFIGS if n not in FORCED_ISA
            or (kernel_cpu.ISA_LEVELS["avx2"] < level and (n == "int4-avx2" or plain))]


def timed(model: Any, prompt: list[int], decode: int) -> tuple[float, list[float], list[int]]:
    """Prefill seconds, each decode step's seconds, and the greedy tokens. A quantkit `Model` runs as
    generation runs it: `forward` over its own `HybridCache`, the one-token steps on the route chosen at
    load; a transformers model runs its own forward over a `DynamicCache`."""
    if isinstance(model, Model):
        return _timed_quantkit(model, prompt, decode)
    from transformers import DynamicCache

    steps: list[float] = []
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        t0 = time.perf_counter()
        out = model(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True, logits_to_keep=1)
        t_pre = time.perf_counter() - t0
        toks = [int(out.logits[0, -1].argmax())]
        for _ in range(decode):
            t1 = time.perf_counter()
            logits = model(input_ids=torch.tensor([[toks[-1]]]), cache=cache, use_cache=True,
                           logits_to_keep=1).logits[0, -1]
            toks.append(int(logits.argmax()))
            steps.append(time.perf_counter() - t1)
    return t_pre, steps, toks


def _timed_quantkit(model: Model, prompt: list[int], decode: int) -> tuple[float, list[float], list[int]]:
    steps: list[float] = []
    with torch.inference_mode():
        cache = model.new_cache(len(prompt) + decode + 1)
        t0 = time.perf_counter()
        logits = model.forward(prompt, cache)
        t_pre = time.perf_counter() - t0
        toks = [cpu_kernel.argmax(logits)]
        for _ in range(decode):
            t1 = time.perf_counter()
            logits = model.forward([toks[-1]], cache)
            toks.append(cpu_kernel.argmax(logits))  # generation's greedy pick
            steps.append(time.perf_counter() - t1)
    return t_pre, steps, toks


def cache_bytes_per_step(cfg: Any, filled: int) -> int:
    """Cache bytes one decode step reads and writes at `filled` cached positions, batch 1: per Gated
    DeltaNet layer the fp32 recurrent state [Hv, K, V] and the conv state [conv_dim, kernel] (model dtype;
    `kernel` positions, as both quantkit's HybridCache and transformers keep), each read and written; per
    full-attention layer K and V of `filled` positions read (model dtype) and one position written."""
    ebytes = 2  # bf16 activations and caches
    total = 0
    for kind in cfg.layer_types:
        if kind == "linear_attention":
            hv, kd, vd = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
            conv_dim = 2 * cfg.linear_num_key_heads * kd + hv * vd
            total += 2 * (hv * kd * vd * 4 + conv_dim * cfg.linear_conv_kernel_dim * ebytes)
        else:
            total += (filled + 1) * 2 * cfg.num_key_value_heads * cfg.head_dim * ebytes
    return total


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def step_bytes(model: Any, top_k: int) -> int:
    """Weight bytes one decode step reads in a loaded model: a quantkit `Model` or a transformers model."""
    if isinstance(model, Model):
        return model_step_bytes(model, top_k)
    total = 0
    seen: set[int] = set()
    for mod in model.modules():
        if type(mod).__name__ == "Qwen3_5MoeExperts":
            b = sum(p.numel() * p.element_size() for p in mod.parameters(recurse=False))
            total += b * top_k // mod.num_experts
            seen.update(id(p) for p in mod.parameters(recurse=False))
        if isinstance(mod, torch.nn.Embedding):
            total += _nbytes(mod.weight[0])  # one row; a head tied to it still reads all of it
            continue
        for p in mod.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                total += _nbytes(p)
    return total


def model_step_bytes(model: Model, top_k: int) -> int:
    """Weight bytes one decode step of quantkit's `Model` reads, as loaded: per layer its norms, its mixer's
    kernels and vectors (attention q/k norm scales; Gated DeltaNet conv taps, A, dt bias, gated-norm
    weight), the router, the shared expert's kernels and top_k / num_experts of the routed experts' bytes;
    then one embedding row, the final norm and the whole head (read in full even where it is tied to the
    embedding). A tensor held by two of these counts once."""
    seen: set[int] = set()

    def once(t: torch.Tensor) -> int:
        if id(t) in seen:
            return 0
        seen.add(id(t))
        return _nbytes(t)

    def kernel(k: Any) -> int:  # a Kernel's nbytes is its tensors'
        return sum(once(t) for t in k.tensors())

    total = 0
    for L in model.layers:
        m, moe = L.mixer, L.moe
        total += once(L.pre) + once(L.post)
        if isinstance(m, Attention):
            total += sum(kernel(k) for k in (m.q, m.k, m.v, m.o)) + once(m.qk_scale)
        else:
            total += sum(kernel(k) for k in (m.qkv, m.z, m.b, m.a, m.out))
            total += sum(once(t) for t in (m.conv_taps, m.neg_a, m.dt_bias, m.norm_w))
        total += once(moe.router_w)
        total += sum(kernel(k) for k in (moe.shared_gate, moe.shared_up, moe.shared_down, moe.shared_sigmoid))
        ex: QuantExperts = moe.experts
        total += ex.nbytes * top_k // ex.num_experts
    emb = model.embed
    if isinstance(emb, QuantEmbedding):
        total += emb.nbytes // emb.num_embeddings
    else:
        total += _nbytes(emb[0])
    return total + once(model.final) + model.head.nbytes


def run_one(mode: str, folder: Path, prompt_len: int, decode: int, reps: int,
            threads: int | None = None) -> dict[str, Any]:
    """One configuration, in this process. Returns figures and the kernel routes."""
    import resource


    if threads:
        torch.set_num_threads(threads)

    t0 = time.perf_counter()
    if mode == "transformers":
        import transformers
        from transformers import Qwen3_5MoeForCausalLM

        transformers.logging.set_verbosity_error()
        model = Qwen3_5MoeForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16, local_files_only=True).eval()
        routes = {"transformers": 1}
    else:
        rt = load_model(folder, verify="quick")
        model, routes = rt.model, rt.report.routes
    load_s = time.perf_counter() - t0
    cfg = text_config(model)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, min(cfg.vocab_size, 768), (prompt_len,), generator=g).tolist()
    best_p = best_d = 0.0
    median_d, toks = 0.0, []
    for _ in range(reps):
        t_pre, steps, toks = timed(model, prompt, decode)
        best_p = max(best_p, prompt_len / t_pre)
        if len(steps) / sum(steps) > best_d:
            best_d = len(steps) / sum(steps)
            median_d = 1 / sorted(steps)[len(steps) // 2]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    import psutil

    rss_after = psutil.Process().memory_info().rss
    # the read bandwidth right after the decode (peak RSS already taken): a shared machine's read bandwidth moves
    # between spells of a slow and a fast rate, so a probe from another moment can belong to the other spell
    probe = read_bandwidth_gbs(gib=spells.READ_GIB)
    wbytes, cbytes = decode_bytes(model, prompt_len, decode)
    return {"mode": mode, "prefill_tok_s": best_p, "decode_tok_s": best_d, "decode_median_step_tok_s": median_d,
            "peak_rss": rss, "rss_after": rss_after, "load_s": load_s, "weight_bytes_per_step": wbytes, "cache_bytes_per_step": cbytes,
            "step_bytes": wbytes + cbytes, "probe_gbs": round(probe, 2), "routes": routes, "threads": torch.get_num_threads(), "tokens": toks,
            "table": _table(), "step_route": model.route.name if isinstance(model, Model) else "transformers"}


def text_config(model: Any) -> Any:
    """The text config of a quantkit `Model` (the planner's TextConfig) or of a transformers model: the
    fields the bytes and prompts read (vocab_size, num_experts_per_tok, layer_types, head sizes) are named
    alike in both."""
    return model.cfg.text if isinstance(model, Model) else model.config


def decode_bytes(model: Any, prompt_len: int, decode: int) -> tuple[int, int]:
    """(weight bytes, cache bytes) one decode step of this run reads: top_k experts per layer, the caches at
    the mean filled length of `decode` steps after a `prompt_len` prompt."""
    cfg = text_config(model)
    return step_bytes(model, cfg.num_experts_per_tok), cache_bytes_per_step(cfg, prompt_len + decode // 2)


def _child(cmd: list[str], isa: str | None = None) -> tuple[dict[str, Any] | None, str]:
    """Run one measuring process (its kernel at `isa` where given): (the JSON of its last stdout line, "") or
    (None, its last stderr line)."""
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", **({"QUANTKIT_CPU_ISA": isa} if isa else {})}
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        return None, (p.stderr.strip().splitlines() or ["?"])[-1]
    return json.loads(p.stdout.strip().splitlines()[-1]), ""


def calibrate_subprocess(src: Path, recipes: list[str], out: Path, threads: int | None) -> Any:
    """`quantkit profile-host` for the checkpoint's shapes and these recipes, in its own process (as the
    configurations run), into a fresh profile file."""

    out.unlink(missing_ok=True)
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    cmd = [sys.executable, "-m", "quantkit", "profile-host", "--model", str(src), "--scheme", ",".join(recipes),
           "--out", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise QuantkitError("quantkit profile-host failed: " + (p.stderr.strip().splitlines() or ["?"])[-1])
    return load_profile(out)


def planner_estimate(folder: Path, recipe: Any, bandwidth: float, prompt_len: int,
                     profile: Any = None) -> dict[str, float | None]:
    """The planner on a CPU-only host with this bandwidth: its llama.cpp-grade decode and prefill, and
    (with a calibrated profile of this host) its estimate for quantkit's own runtime."""

    spec = spec_from_config(load_config(folder / "config.json"), name=folder.name)
    hw = build_hardware(None, ram="24GB", cpu_bandwidth=f"{bandwidth:.1f}")
    p = solve(spec, recipe, RunSettings(context=4096, prefill_chunk=prompt_len), hw, profile=profile)
    return {"decode_tok_s": p.speed.decode_tok_s, "prefill_tok_s": p.speed.prefill_tok_s,
            "runtime_decode_tok_s": p.runtime_speed.decode_tok_s if p.runtime_speed else None}


# the paths layer_overhead times: quantkit's model on its torch route and on the kernel's fused ops
OVERHEAD_PATHS = (("torch", False), ("fused", True))
OVERHEAD_LABELS = {"torch": "quantkit's model, torch route",
                   "fused": "quantkit's model, the kernel's fused ops per layer"}


def layer_overhead(config: dict[str, Any], rounds: int = 3) -> dict[str, dict[str, float]]:
    """Per-layer decode cost besides the weight reads, ms, for quantkit's model on its torch route and on
    the kernel's fused ops (`time_layer_ops`: kernels stubbed, routed experts apart), in interleaved rounds,
    the best of each. transformers' forward is not timed: stubbing its kernels layer by layer took the
    patches the runtime no longer has."""
    best: dict[str, dict[str, float]] = {}
    for _ in range(rounds):
        for path, fused in OVERHEAD_PATHS:
            lo = time_layer_ops(config, fused=fused)
            cur = {**lo.ops_s, "shell": lo.shell_s}
            prev = best.get(path)
            best[path] = cur if prev is None else {k: min(prev[k], v) for k, v in cur.items()}
    return {p: {k: round(v * 1e3, 3) for k, v in d.items()} for p, d in best.items()}


def run(reports: Path, workdir: Path, layers: int = 4, experts: int = 64, prompt_len: int = 128, decode: int = 16,
        reps: int = 1, configs: list[str] | None = None, rounds: int = 2, threads: int | None = None,
        vocab: int | None = None, log: Callable[[str], None] = print, spells_s: float = 0.0) -> dict[str, Any]:

    t_all = time.perf_counter()
    names = configs or default_configs()
    tag = f"{layers}x{experts}" + (f"-v{vocab}" if vocab else "")
    src = workdir / f"realistic-{tag}"
    if not (src / "config.json").is_file():
        log(f"writing the realistic-shape checkpoint {src}")
        make_tiny_model(src, realistic=True, layers=layers, experts=experts, top_k=8, vocab=vocab, overwrite=True)
    folders: dict[str, Path] = {}
    for name in names:
        mode, recipe = CONFIGS[name]
        if recipe is None:
            folders[name] = src
            continue
        out = workdir / f"q-{tag}-{recipe}"
        if not (out / "quantkit-manifest.json").is_file():
            log(f"quantizing with {recipe} -> {out}")
            with Checkpoint.open(src) as ck:
                run_quantize(ck, out, QuantizeOptions(get_recipe(recipe), mode="overwrite"))
        folders[name] = out
    bws = [read_bandwidth_gbs()]  # one probe per round too: it moves on a shared VM, the best is the bound
    log(f"read bandwidth {bws[0]:.1f} GB/s")
    recipes = sorted({CONFIGS[n][1] or "bf16" for n in names if CONFIGS[n][0] == "quantkit"})
    calibrations = []
    cal_s = 0.0  # not part of the timed runs
    log("per-layer overhead: quantkit's model, torch route vs the kernel's fused ops (kernels stubbed)")
    if threads:
        torch.set_num_threads(threads)
    overhead = layer_overhead(json.loads((src / "config.json").read_text()))
    load_before = os.getloadavg()
    t_bench = time.perf_counter()
    rows: dict[str, dict[str, Any]] = {}
    for rnd in range(rounds):
        if rnd:
            bws.append(read_bandwidth_gbs())
        if recipes:
            log(f"round {rnd + 1}/{rounds}: calibrating the runtime's parts for {', '.join(recipes)} (quantkit profile-host)")
            t_cal = time.perf_counter()
            calibrations.append(calibrate_subprocess(src, recipes, workdir / f"profile-{tag}-{rnd}.json", threads))
            cal_s += time.perf_counter() - t_cal
        for name in names:
            mode, recipe = CONFIGS[name]
            slow = mode == "transformers" and not cpu_has_avx512_bf16()
            if slow and rnd:
                continue  # without AVX512-BF16 plain transformers' bf16 conv is seconds per step: one short round
            n_dec = 2 if slow else decode
            log(f"round {rnd + 1}/{rounds}: {name}")
            cmd = [sys.executable, "-m", "quantkit.bench.decode", "--one", mode, str(folders[name]), str(prompt_len),
                   str(n_dec), str(reps), str(threads or 0)]
            r, err = _child(cmd, FORCED_ISA.get(name))
            if r is None:
                if name not in rows:
                    rows[name] = {"error": err}
                log(f"  failed: {err}")
                continue
            r["decode_steps"] = n_dec
            bws.append(r["probe_gbs"])
            log(f"  prefill {r['prefill_tok_s']:.1f} tok/s, decode {r['decode_tok_s']:.2f} tok/s, "
                f"peak RSS {r['peak_rss'] / 1e9:.2f} GB")
            prev = rows.get(name, {})
            history = prev.get("decode_tok_s_rounds", []) + [round(r["decode_tok_s"], 3)]
            pre_hist = prev.get("prefill_tok_s_rounds", []) + [round(r["prefill_tok_s"], 2)]
            rss_hist = prev.get("peak_rss_rounds", []) + [r["peak_rss"]]
            probe_hist = prev.get("probe_gbs_rounds", []) + [r["probe_gbs"]]
            if r["decode_tok_s"] < prev.get("decode_tok_s", 0.0):
                r = prev  # keep the best round
            else:
                r["prefill_tok_s"] = max(r["prefill_tok_s"], prev.get("prefill_tok_s", 0.0))
            r["decode_tok_s_rounds"], r["prefill_tok_s_rounds"], r["peak_rss_rounds"] = history, pre_hist, rss_hist
            r["probe_gbs_rounds"] = probe_hist
            rows[name] = r
    bench_s = time.perf_counter() - t_bench - cal_s
    profile = fastest(calibrations) if calibrations else None
    spell = None
    if spells_s > 0 and "int4" in folders:
        log(f"int4 decoding for {spells_s:g} s between bandwidth reads (--spells)")
        cmd = [sys.executable, "-m", "quantkit.bench.spell_poll", str(folders["int4"]), str(spells_s), str(prompt_len),
               str(decode), str(threads or 0)]
        polled, err = _child(cmd)
        if polled is not None:
            spell = {"config": "int4", "seconds": spells_s, **spells.summarize(polled), "polled": polled["samples"]}
            bws.extend(r for smp in polled["samples"] for r in (smp["read_before_gbs"], smp["read_after_gbs"]))
        else:
            log(f"  failed: {err}")
    bw = max(bws)
    for name, r in rows.items():
        if "error" in r:
            continue
        mode, recipe = CONFIGS[name]
        r["bound_tok_s"] = bw * 1e9 / r["step_bytes"]
        if mode == "quantkit" and name not in FORCED_ISA:
            est = planner_estimate(src, get_recipe(recipe or "bf16"), bw, prompt_len, profile)
            r["planner_decode_tok_s"] = est["runtime_decode_tok_s"]
            r["generic_planner_decode_tok_s"] = est["decode_tok_s"]
            r["planner_prefill_tok_s"] = est["prefill_tok_s"]
    add_ratios(rows)
    cfg = json.loads((src / "config.json").read_text())["text_config"]
    rounds_part = (f" --rounds {rounds}" + (f" --threads {threads}" if threads else "") + (f" --vocab {vocab}" if vocab else "")
                   + (f" --spells {spells_s:g}" if spells_s > 0 else ""))
    sub = f" --configs {','.join(names)}" if configs else ""
    d = {
        "command": f"quantkit bench decode --layers {layers} --experts {experts} --prompt-tokens {prompt_len} "
                   f"--new-tokens {decode} --reps {reps}{rounds_part}{sub}",
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "torch": torch.__version__,
                    "threads": threads or torch.get_num_threads(), "python": platform.python_version(),
                    "avx512_bf16": cpu_has_avx512_bf16(), "isa": _isa_line(),
                    "read_bandwidth_gbs": round(bw, 2),
                    "read_bandwidth_probes_gbs": [round(b, 2) for b in bws], "loadavg_before": [round(x, 2) for x in load_before],
                    "loadavg_after": [round(x, 2) for x in os.getloadavg()]},
        "checkpoint": {"layers": layers, "experts": experts, "top_k": cfg["num_experts_per_tok"],
                       "hidden": cfg["hidden_size"], "moe_intermediate": cfg["moe_intermediate_size"],
                       "vocab": cfg["vocab_size"], "bf16_bytes": sum(f.stat().st_size for f in src.glob("*.safetensors"))},
        "prompt_tokens": prompt_len, "decode_steps": decode, "reps": reps, "rounds": rounds,
        "targets": targets(rows),
        "spells": spell,
        "calibration": profile_summary(profile) if profile else None,
        "layer_overhead_ms": overhead,
        "rows": rows, "bench_seconds": bench_s, "seconds": time.perf_counter() - t_all,
    }
    reports.mkdir(parents=True, exist_ok=True)
    plot(d, reports / "bench-decode.png")
    write_reports(reports, "bench-decode", d, render_md(d), indent=1)
    return d


REFERENCE = "transformers-bf16"  # plain transformers from_pretrained in bf16, its own forward and cache
PLANNER_TOLERANCE = 0.25
SPEEDUP_TARGET = 2.0
BOUND_TARGET = 0.6  # int4 decode as a share of the read-bandwidth bound (issue 12)


def add_ratios(rows: dict[str, dict[str, Any]]) -> None:
    """Each row's decode tok/s over the transformers reference and as a share of the bandwidth bound
    (the best probe of the run; and the probe read right after the row's kept decode), and the planner's
    error (estimate / measured - 1), in place."""
    base = rows.get(REFERENCE, {}).get("decode_tok_s")
    for r in rows.values():
        if "decode_tok_s" not in r:
            continue
        if r.get("bound_tok_s"):
            r["of_bound"] = r["decode_tok_s"] / r["bound_tok_s"]
        if r.get("probe_gbs") and r.get("step_bytes"):  # the probe read right after the kept round's decode
            r["of_own_probe"] = r["decode_tok_s"] * r["step_bytes"] / (r["probe_gbs"] * 1e9)
        r["vs_transformers"] = r["decode_tok_s"] / base if base else None
        if r.get("planner_decode_tok_s"):
            r["planner_error"] = r["planner_decode_tok_s"] / r["decode_tok_s"] - 1
        if r.get("generic_planner_decode_tok_s"):
            r["generic_planner_error"] = r["generic_planner_decode_tok_s"] / r["decode_tok_s"] - 1
        if r.get("planner_prefill_tok_s"):
            r["planner_prefill_error"] = r["planner_prefill_tok_s"] / r["prefill_tok_s"] - 1


def profile_summary(p: Any) -> dict[str, Any]:
    """What the report shows of the calibration the planner's runtime estimate is composed from."""
    return {"seconds": round(p.seconds, 1), "calibrations": p.details.get("calibrations", 1), "host": p.host, "layer_ops_ms": {k: round(v * 1e3, 3) for k, v in
                                                                           p.layer_ops_s.items()},
            "shell_ms": round(p.shell_s * 1e3, 3), "argmax_ms": {k: round(v * 1e3, 4) for k, v in p.argmax_s.items()},
            "matmul_us": {k: {s: round(t * 1e6, 1) for s, t in v.items()} for k, v in p.matmul_s.items()},
            "moe_us": {k: {s: round(t * 1e6, 1) for s, t in v.items()} for k, v in p.moe_s.items()},
            "expert_loop_ms": round(p.expert_loop_s * 1e3, 3),
            "layer_ops_spread": p.details.get("layer_ops", {}), "working_set_bytes": p.details.get("working_set_bytes")}


def targets(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The targets, judged on these rows: int4 decode >= 2x the transformers bf16 reference, each planner
    estimate within 25%, and int4 decode at least BOUND_TARGET of the bandwidth bound at the run's best
    probe (its own round's probe beside it)."""
    i4 = rows.get("int4", {})
    ratio = i4.get("vs_transformers")
    errs = {n: r["planner_error"] for n, r in rows.items() if r.get("planner_error") is not None}
    return {
        "int4_vs_transformers_bf16": ratio,
        "speedup_met": None if ratio is None else ratio >= SPEEDUP_TARGET,
        "planner_errors": errs,
        "planner_within_25pct": {n: abs(e) <= PLANNER_TOLERANCE for n, e in errs.items()},
        "planner_met": bool(errs) and all(abs(e) <= PLANNER_TOLERANCE for e in errs.values()),
        "int4_of_bound": i4.get("of_bound"), "int4_of_own_probe": i4.get("of_own_probe"),
        "bound_met": None if i4.get("of_bound") is None else i4["of_bound"] >= BOUND_TARGET,
        **{f"{name.replace('-', '_')}_of_bound": rows.get(name, {}).get("of_bound") for name in FORCED_ISA},
        **{f"bound_{name.removeprefix('int4-').replace('-', '_')}_met": (
            None if rows.get(name, {}).get("of_bound") is None else rows[name]["of_bound"] >= BOUND_TARGET)
           for name in FORCED_ISA},
    }


def plot(d: dict[str, Any], path: Path) -> None:
    """Decode tok/s per configuration (measured bars, planner and bandwidth-bound markers) beside peak RSS."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {n: r for n, r in d["rows"].items() if "decode_tok_s" in r}
    names = list(rows)
    y = list(range(len(names)))[::-1]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 0.55 * len(names) + 2), sharey=True,
                                 gridspec_kw={"width_ratios": [3, 1]})
    meas = [rows[n]["decode_tok_s"] for n in names]
    colors = ["#888888" if n.startswith("transformers") else "#1f77b4" for n in names]
    a1.barh(y, meas, color=colors, label="measured")
    for yi, n in zip(y, names, strict=True):
        r = rows[n]
        a1.text(r["decode_tok_s"] * 0.96, yi, f"{r['decode_tok_s']:.1f}", va="center", ha="right", fontsize=8,
                color="white")  # inside the bar: the planner markers sit just past its end
        if r.get("planner_decode_tok_s"):
            a1.plot(r["planner_decode_tok_s"], yi, "o", color="#d62728", ms=6)
        if r.get("generic_planner_decode_tok_s"):
            a1.plot(r["generic_planner_decode_tok_s"], yi, "o", mfc="none", color="#d62728", ms=6)
        a1.plot(r["bound_tok_s"], yi, "|", color="black", ms=14, mew=2)
    a1.plot([], [], "o", color="#d62728", label="planner (quantkit runtime, calibrated)")
    a1.plot([], [], "o", mfc="none", color="#d62728", label="planner (llama.cpp-grade)")
    a1.plot([], [], "|", color="black", ms=10, mew=2, label="bandwidth bound")
    a1.set_xscale("log")
    a1.set_xlim(left=min(5.0, min(meas) / 2))
    a1.set_xlabel("decode tok/s (log scale)")
    a1.set_yticks(y, names)
    a1.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=4, fontsize=8, frameon=False)
    a1.grid(axis="x", alpha=0.3, which="both")
    a2.barh(y, [min(rows[n].get("peak_rss_rounds") or [rows[n]["peak_rss"]]) / 1e9 for n in names], color=colors)
    a2.set_xlabel("peak RSS (GB)")
    a2.grid(axis="x", alpha=0.3)
    c = d["checkpoint"]
    fig.suptitle(f"Decode, batch 1, {d['machine']['cores']}-core CPU, {d['machine']['threads']} threads: "
                 f"{c['layers']} layers x {c['experts']} experts (realistic shapes)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _table() -> str:
    """The kernel table this process runs (QUANTKIT_CPU_ISA lowers it)."""
    return kernel_cpu.isa_name()


def _isa_line() -> str:
    """This CPU's instruction sets and the kernel table the runs use."""
    mod = kernel_cpu.module()
    if mod is None:
        return "no CPU kernel"
    return f"{', '.join(mod.cpu_features()) or 'no AVX2'}; kernel table {mod.table()}"


def cpu_has_avx512_bf16() -> bool:
    try:
        return " avx512_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def _probes(m: dict[str, Any]) -> str:
    """The run's bandwidth probes in a few words (every one is in the JSON)."""
    p = m.get("read_bandwidth_probes_gbs") or [m["read_bandwidth_gbs"]]
    return f"{len(p)} probes, {min(p):.1f}-{max(p):.1f} GB/s" if len(p) > 1 else f"one probe, {p[0]:.1f} GB/s"


def _f(v: Any, fmt: str = "{:.2f}") -> str:
    return fmt.format(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else "-"


def render_md(d: dict[str, Any]) -> str:
    m, c, t = d["machine"], d["checkpoint"], d["targets"]
    rows = d["rows"]
    out = [
        "# Decode benchmark: quantkit runtime per format vs transformers bf16",
        "",
        f"Command: `{d['command']}` ({d['seconds']:.0f} s in all, {d['bench_seconds']:.0f} s of timed runs).",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, instruction sets {m.get('isa', '?')}, torch {m['torch']} "
        f"({m['threads']} threads), measured read "
        f"bandwidth {m['read_bandwidth_gbs']} GB/s (streaming reads of 1 GiB at the start and before each round, "
        f"and of 256 MiB after each configuration's decode{' and in --spells' if d.get('spells') else ''}: "
        f"the best of {_probes(m)}); load average {m['loadavg_before']} before, "
        f"{m['loadavg_after']} after. Other jobs share this machine, so absolute figures are low and noisy: each "
        f"configuration ran in {d['rounds']} interleaved rounds (its own process each time) and keeps its best; "
        "the ratios within this one run are the result, and every round's figure is in the JSON.",
        "",
        f"Checkpoint: realistic shapes (hidden {c['hidden']}, expert intermediate {c['moe_intermediate']}, "
        f"16 q / 2 kv heads x 256, Gated DeltaNet 16/32 heads x 128), {c['layers']} layers x {c['experts']} "
        f"experts, top-{c['top_k']}, vocab {c['vocab']}; {c['bf16_bytes'] / 1e9:.2f} GB in bf16; random weights. "
        f"Prefill of {d['prompt_tokens']} tokens (one chunk), then {d['decode_steps']} greedy decode steps, "
        f"{d['reps']} rep(s) per process; decode tok/s = steps / their total time.",
        "",
        "![decode tok/s per configuration with planner estimate and bandwidth bound; peak RSS](bench-decode.png)",
        "",
        "| config | prefill tok/s | decode tok/s | vs transformers bf16 | "
        "planner decode tok/s | planner error | llama.cpp-grade planner tok/s | its error | "
        "bandwidth bound tok/s | of bound | of its probe | bytes/step | peak RSS | RSS after |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in rows.items():
        if "error" in r:
            out.append(f"| {name} | failed: {r['error']} | | | | | | | | | | | | |")
            continue
        out.append(
            f"| {name} | {_f(r['prefill_tok_s'], '{:.1f}')} | {_f(r['decode_tok_s'])} | "
            f"{_f(r.get('vs_transformers'), '{:.1f}')}x | "
            f"{_f(r.get('planner_decode_tok_s'), '{:.1f}')} | {_f(r.get('planner_error'), '{:+.0%}')} | "
            f"{_f(r.get('generic_planner_decode_tok_s'), '{:.1f}')} | {_f(r.get('generic_planner_error'), '{:+.0%}')} | "
            f"{_f(r['bound_tok_s'], '{:.1f}')} | {_f(r.get('of_bound'), '{:.0%}')} | "
            f"{_f(r.get('of_own_probe'), '{:.0%}')} | "
            f"{r['step_bytes'] / 1e6:.1f} MB | {min(r.get('peak_rss_rounds') or [r['peak_rss']]) / 1e9:.2f} GB | "
            f"{_f(r['rss_after'] / 1e9) + ' GB' if r.get('rss_after') else '-'} |")
    ratio = t.get("int4_vs_transformers_bf16")
    out += ["", "## Targets", ""]
    if ratio is None:
        out.append("- int4 decode vs transformers bf16: not measured in this run.")
    else:
        verdict = "met" if t["speedup_met"] else "MISSED"
        out.append(f"- int4 decode at least {SPEEDUP_TARGET:.0f}x transformers bf16: **{verdict}**, "
                   f"{ratio:.2f}x ({rows['int4']['decode_tok_s']:.2f} vs "
                   f"{rows[REFERENCE]['decode_tok_s']:.2f} tok/s).")
    share = t.get("int4_of_bound")
    if share is not None:
        verdict = "met" if t["bound_met"] else "MISSED"
        i4 = rows["int4"]
        own = t.get("int4_of_own_probe")
        out.append(f"- int4 decode at least {BOUND_TARGET:.0%} of the read-bandwidth bound: **{verdict}**, {share:.0%} "
                   f"of the bound at the run's best probe ({m['read_bandwidth_gbs']} GB/s)"
                   + (f"; {own:.0%} of the {i4['probe_gbs']} GB/s read right after its best round's decode." if own else ".")
                   + (" Against the read of the same moment, spell by spell: "
                      + ", ".join(f"{n} {v['share_of_read']:.0%} ({v['read_gbs']:.1f} GB/s)"
                                  for n, v in d["spells"]["spells"].items()) + " (section below)."
                      if d.get("spells") and d["spells"]["spells"] else ""))
    for name, what in (("int4-avx2", "AVX2 (with AVX-VNNI where the CPU has it, as Intel Core 12th gen on)"),
                       ("int4-avx2-plain", "plain AVX2 (no AVX-VNNI, as AMD Zen 2/3)")):
        share2 = t.get(f"{name.replace('-', '_')}_of_bound")
        if share2 is not None:
            met = t[f"bound_{name.removeprefix('int4-').replace('-', '_')}_met"]
            out.append(f"- the same with the kernel forced to {what} (`{name}`): **{'met' if met else 'MISSED'}**, "
                       f"{share2:.0%} of the bound ({rows[name]['decode_tok_s']:.2f} tok/s, table "
                       f"{rows[name].get('table', '?')}).")
    errs = t.get("planner_errors", {})
    if errs:
        bad = {n: e for n, e in errs.items() if abs(e) > PLANNER_TOLERANCE}
        verdict = "met" if t["planner_met"] else f"MISSED for {len(bad)} of {len(errs)}"
        out.append(f"- planner decode estimate within {PLANNER_TOLERANCE:.0%} of the measurement: **{verdict}** "
                   "(" + ", ".join(f"{n} {e:+.0%}" for n, e in errs.items()) + ").")
        gerr = {n: r["generic_planner_error"] for n, r in rows.items() if r.get("generic_planner_error") is not None}
        if gerr:
            out.append("- (not a target) the planner's llama.cpp-grade estimate, the `tok/s` column of `quantkit plan`, "
                       "vs quantkit's runtime: " + ", ".join(f"{n} {e:+.0%}" for n, e in gerr.items()) + ".")
        perr = {n: r["planner_prefill_error"] for n, r in rows.items() if r.get("planner_prefill_error") is not None}
        out.append("- (not a target) planner prefill estimate (llama.cpp-grade) vs measured: "
                   + ", ".join(f"{n} {e:+.0%}" for n, e in perr.items()) + ".")
    if d.get("spells"):
        out += spells.render(d["spells"]["config"], d["spells"], d["spells"]["seconds"])
    ov = d.get("layer_overhead_ms")
    if ov:
        first = next(iter(ov.values()))
        kinds = [k for k in ("full_attention", "linear_attention", "shell") if k in first]
        out += ["", "## Per-layer decode overhead: quantkit's model, torch route vs the kernel's fused ops", "",
                "What a decode step costs besides reading the weights: `time_layer_ops` on one layer of each type "
                "with every kernel stubbed and the routed experts timed apart (the shell: embedding, final norm, "
                "head call and cache bookkeeping outside the layers), best of 3 interleaved rounds. The default "
                "route on a CPU with the kernel runs the whole stack in one call, which cannot be timed per layer; "
                "the fused ops are what it computes layer by layer. transformers' forward is not in this table: "
                "timing it with its kernels stubbed took patches the runtime no longer carries.", "",
                "| path | " + " | ".join(f"{k} ms" for k in kinds) + " |", "|---|" + "---:|" * len(kinds)]
        for path, label in OVERHEAD_LABELS.items():
            if path in ov:
                out.append(f"| {label} | " + " | ".join(f"{ov[path][k]:.3f}" for k in kinds) + " |")
    cal = d.get("calibration")
    if cal:
        lo = ", ".join(f"{k} {v:.2f} ms" for k, v in sorted(cal["layer_ops_ms"].items()))
        out += ["", "## How the planner's estimate is made", "",
                "`planner decode tok/s` is `quantkit plan`'s estimate for quantkit's own runtime on this host "
                "(the `qk tok/s` column), composed by quantkit/planner/host_costs.py from parts that `quantkit "
                f"calibrate` timed in isolation in this run ({cal.get('calibrations', 1)} calibrations, one at the "
                f"start of each round, each part at its fastest; {cal['seconds']:.0f} s), never from a whole-model "
                "run: per layer its ops with every kernel stubbed and the routed experts apart (" + lo + "), the "
                f"unfused experts' loop {cal.get('expert_loop_ms', 0):.2f} ms, the rest of a step "
                f"{cal['shell_ms']:.2f} ms, and each matrix's kernel per batch-1 call with the weights cycled "
                f"over {(cal.get('working_set_bytes') or 0) / 2**20:.0f} MiB of copies (out of the CPU caches):", "",
                "| kernel, us per call | " + " | ".join(sorted(cal["matmul_us"])) + " |",
                "|---|" + "---:|" * len(cal["matmul_us"])]
        shapes = sorted({sh for v in cal["matmul_us"].values() for sh in v}, key=lambda x: [int(i) for i in x.split("x")])
        for sh in shapes:
            out.append(f"| {sh} | " + " | ".join(_f(cal["matmul_us"][k].get(sh), "{:.0f}")
                                                  for k in sorted(cal["matmul_us"])) + " |")
        moe = cal.get("moe_us") or {}
        if moe:
            out += ["", "and, for the formats this host's runtime fuses, one decode step through a layer's top_k routed "
                    "experts (one `qk.moe` call, the experts module's forward) with the weights cycled the same way: "
                    + ", ".join(f"{k} {sh} {t / 1e3:.2f} ms" for k, v in sorted(moe.items()) for sh, t in sorted(v.items()))
                    + "."]
        out += ["", "A decode step = the sum over layers of ops + dense matrices + the routed experts (the fused call "
                "where the format fuses, else top_k x (expert gate_up + down) + the loop's ops), "
                "plus lm_head, the rest of the step and the argmax over the vocabulary. The llama.cpp-grade "
                "estimate (bytes / 60% of the read bandwidth + 50 us per layer) is what llama.cpp's kernels reach; "
                "quantkit's runtime is further from the bandwidth bound than that: torch's batch-1 int4/int8 "
                "kernels are compute-bound on this CPU, and each layer spends about a millisecond in small ops."]
    out += [
        "",
        "Columns: `transformers-bf16` is plain `Qwen3_5MoeForCausalLM` from `from_pretrained` in bf16, its own "
        "forward over its `DynamicCache` (its torch fallbacks; "
        + ("this CPU has AVX512-BF16, so its depthwise causal conv runs at full speed through oneDNN"
           if m.get("avx512_bf16") else
           "its depthwise causal conv goes through oneDNN's slow bf16 path on this CPU without AVX512-BF16, so it "
           f"decodes only {rows.get(REFERENCE, {}).get('decode_steps', '?')} steps in one round")
        + "), the reference the speed target is judged on. The other rows are quantkit's own model "
        "(quantkit/runtime/model/: `forward` over its `HybridCache`, one-token steps on the route chosen at load, "
        "named per row below); `quantkit-bf16` is it without quantization; the rest are uniform recipes "
        "(every matrix in that format; router, norms and in_proj_a/b bf16) and `quality` is the default `--bits 4` recipe "
        "(experts int4, the rest int8). Bandwidth bound: bytes one decode step reads (weights as loaded, with "
        "top_k of the experts; caches read and written) over the measured read bandwidth; `of bound` is the "
        "measured decode over it; `of its probe` is the same share of the bandwidth read right after the row's "
        "kept decode, in its process (this machine's bandwidth moves between runs, so both are shown; the target is judged on "
        "the first). Peak RSS: the smallest peak over the rounds (it includes load-time transients and "
        "varies between rounds); RSS after: resident at the end of the run. Planner errors are estimate / "
        "measured - 1; the llama.cpp-grade figure is quantkit.planner.placement's generic model for a CPU-only host with the "
        "measured bandwidth.",
        "",
        "Kernels used (matrices per route):",
        "",
    ]
    for name, r in rows.items():
        if "routes" in r:
            step = f" (one-token route {r['step_route']})" if r.get("step_route") not in (None, "transformers") else ""
            out.append(f"- {name}{step}: " + "; ".join(f"{k} x{v}" for k, v in r["routes"].items()))
    out += ["", "Every round (decode tok/s):", ""]
    for name, r in rows.items():
        if "decode_tok_s_rounds" in r:
            out.append(f"- {name}: " + ", ".join(f"{v:.2f}" for v in r["decode_tok_s_rounds"]))
    if d.get("notes"):  # written by whoever ran it, kept in the JSON with the figures they are about
        out += ["", "## Notes on this run", ""] + [f"- {n}" for n in d["notes"]]
    out.append("")
    return "\n".join(out)


def _main_one(argv: list[str]) -> None:
    mode, folder, prompt_len, decode, reps, threads = argv
    r = run_one(mode, Path(folder), int(prompt_len), int(decode), int(reps), int(threads) or None)
    print(json.dumps(r))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--one":
        _main_one(sys.argv[2:])
    else:
        print("usage: quantkit bench decode (this module's --one is internal)", file=sys.stderr)
        sys.exit(2)
