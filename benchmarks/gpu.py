"""`python -m benchmarks.gpu`: the check to run when a CUDA GPU is at hand (`bash scripts/gpu-check.sh`, one
command under a time limit). Writes reports/bench-gpu.{md,json}.

What it does, in this order:

1. Refuses at once, with one line (`no CUDA GPU: ...`), when torch sees no CUDA device: nothing is
   generated or loaded first.
2. A realistic-shape checkpoint (real hidden, expert and head sizes; `layers` layers of `experts`
   experts, top-8, the tiny tokenizer's vocabulary; random weights), quantized with `recipe` (default
   int4: every matrix, experts included, in int4 g128), both kept in `workdir` and reused by later runs.
3. Two plans from quantkit's own planner (`quantkit.planner.placement.solve`) for the detected GPU:
   `gpu` (the card as it is: everything on the GPU) and `gpu+cpu` (the same card with its memory cut so
   that `cpu_share` of the expert bytes no longer fit: those experts stay in RAM and compute on the CPU,
   the first layers' first, as the planner does on a smaller card). A CPU-only plan is the reference.
4. Each plan is saved beside the checkpoint and loaded with `quantkit.runtime.load_model(path, plan=...)`
   on the route the runtime chooses, and the `gpu` plan a second time on the `cuda-graph` route
   (`forced_route="cuda-graph"`: the one-token step captured once and replayed). Each load does one
   short warm-up generation, then one greedy generation of `decode` tokens (ignore_eos) from a fixed
   prompt of `prompt` token ids, through the runtime's own generation path (`Runtime.generate_ids`).
5. Per run: decode tok/s (the runtime's own figure: steps after the first token over their time),
   prefill tok/s, the greedy tokens, `torch.cuda.max_memory_allocated` per CUDA device while loading
   and, apart, from the end of the load through the generations (load transients such as a layer's
   expert slab show in the first), and the loader's resident weight bytes per device, beside the plan's
   bytes per device.
6. Checks: every run completed; graphs on and off give the same tokens; each GPU placement's greedy
   tokens agree with the CPU's for the first `AGREE_MIN` tokens (random weights have small logit
   margins, and the CPU kernel quantizes activations to int8 where the GPU's take bf16, so a later
   divergence is reported, not failed); each CUDA device's load and decode peaks stay within the plan's
   bytes for it plus `MEMORY_SLACK`.

Defaults (4 layers x 64 experts, 32-token prompt, 32 decode tokens, 5 loads) keep the whole command short
enough for a lent GPU's time; the checkpoint and its quantization are most of it on a first run.
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import typer

from benchmarks.cli import guard_reports, run_command, shared
from quantkit.bench import write_reports
from quantkit.checkpoint.reader import Checkpoint
from quantkit.checkpoint.spec import ModelSpec, load_config, spec_from_config
from quantkit.cli.options import FRACTION
from quantkit.errors import QuantkitError
from quantkit.planner.budget import RunSettings
from quantkit.planner.hardware import GIB, GPU, Hardware, Host, cpu_name, detect_gpus
from quantkit.planner.placement import Plan, solve
from quantkit.quantize.run import QuantizeOptions, run_quantize
from quantkit.recipe import Recipe, get_recipe
from quantkit.runtime import load_model
from quantkit.runtime.generate import SamplingParams
from quantkit.testing.tiny import make_tiny_model

AGREE_MIN = 8  # leading greedy tokens a GPU placement must share with the CPU
MEMORY_SLACK = 0.10  # a CUDA device's peak allocation may exceed the plan's bytes by this fraction
WARMUP_TOKENS = 4
PROMPT_VOCAB = 768  # prompt ids are drawn below this (ordinary tokens of the tiny tokenizer)


@dataclass(frozen=True)
class CudaInfo:
    """What torch sees of the CUDA devices."""

    name: str
    memory_bytes: int
    count: int
    torch: str
    cuda: str


def detect_cuda() -> CudaInfo:
    """The first CUDA device, or a one-line QuantkitError saying why there is none."""
    if not torch.cuda.is_available():
        why = ("this torch is a CPU-only build" if torch.version.cuda is None
               else f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no device")
        raise QuantkitError(f"no CUDA GPU: {why}; `python -m benchmarks.gpu` checks the runtime on a CUDA GPU, run it "
                            "on a machine with one (scripts/gpu-check.sh)")
    p = torch.cuda.get_device_properties(0)
    return CudaInfo(p.name, int(p.total_memory), torch.cuda.device_count(), torch.__version__,
                    str(torch.version.cuda))


def detected_gpu() -> GPU:
    """The planner's view of CUDA device 0 (the catalog entry with the detected memory)."""
    gpus, _ = detect_gpus()
    if not gpus:
        raise QuantkitError("no CUDA GPU: the planner's detection found none")
    return gpus[0]


# ---- plans ------------------------------------------------------------------------------------------

@dataclass
class PlannedPlacement:
    """One plan the check loads."""

    name: str  # "cpu", "gpu", "gpu+cpu"
    plan: Plan
    gpu_limit_bytes: int | None = None  # the GPU memory the plan was made for, when cut below the card's

    @property
    def planned_bytes(self) -> dict[str, int]:
        return {d.id: d.used_bytes for d in self.plan.devices if d.used_bytes}

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "summary": self.plan.summary(), "where": self.plan.where,
                "planned_bytes": self.planned_bytes, "gpu_limit_bytes": self.gpu_limit_bytes,
                "experts_on_cpu": self.plan.experts_on_cpu,
                "experts_total": len(self.plan.layer_device) * self.plan.num_experts}


def plan_placements(spec: ModelSpec, recipe: Recipe, gpu: GPU, ram_bytes: int, context: int = 1024,
                    cpu_share: float = 0.5) -> list[PlannedPlacement]:
    """CPU alone (the reference), `gpu` alone, and `gpu` with its memory cut so that `cpu_share` of the
    expert bytes go to the CPU. One-line error when the model does not give those three placements."""
    if not 0 < cpu_share <= 1:
        raise QuantkitError(f"--cpu-share {cpu_share}: give a share of the expert bytes in (0, 1]")
    settings = RunSettings(context=context)
    host = Host(ram_bytes=ram_bytes, ram_source="free now")
    cpu = solve(spec, recipe, settings, Hardware((), host))
    alone = solve(spec, recipe, settings, Hardware((gpu,), host))
    if not cpu.fits:
        raise QuantkitError(f"the check model does not fit this host's RAM for the CPU reference: {cpu.reason}")
    if not alone.fits or alone.where != "gpu":
        raise QuantkitError(f"the check model does not fit {gpu.name} alone ({alone.summary()}; {alone.reason or 'fits'})")
    card = alone.device("cuda:0")
    limit = card.reserve + card.used_bytes - int(card.used.get("experts", 0) * cpu_share)
    split = solve(spec, recipe, settings, Hardware((gpu.with_memory(limit / GIB),), host))
    if not split.fits or split.where != "gpu+cpu" or not split.experts_on_cpu:
        raise QuantkitError(f"{gpu.name} cut to {limit / GIB:.2f} GiB does not give a GPU+CPU plan "
                            f"({split.summary()}; {split.reason or 'fits'})")
    return [PlannedPlacement("cpu", cpu), PlannedPlacement("gpu", alone), PlannedPlacement("gpu+cpu", split, limit)]


# ---- runs -------------------------------------------------------------------------------------------

@dataclass
class DecodeRun:
    """One load of one placement and one greedy generation."""

    placement: str
    graphs: bool
    tokens: list[int] = field(default_factory=list)
    decode_tok_s: float = 0.0
    prefill_tok_s: float = 0.0
    load_s: float = 0.0
    load_peak_bytes: dict[str, int] = field(default_factory=dict)  # CUDA device -> max_memory_allocated, loading
    decode_peak_bytes: dict[str, int] = field(default_factory=dict)  # the same from the end of the load on
    resident_bytes: dict[str, int] = field(default_factory=dict)  # device -> the loader's weight bytes
    planned_bytes: dict[str, int] = field(default_factory=dict)  # device -> the plan's bytes
    error: str = ""

    @property
    def label(self) -> str:
        return self.placement + (", graphs" if self.graphs else "")


def load_runtime(folder: Path, plan: Path, graphs: bool | None, loader: Callable[..., Any] | None = None) -> Any:
    """`load_model(folder, plan=plan)` on the runtime's own route choice, or with `graphs` on the cuda-graph
    route; a placement that route cannot hold is this run's one-line error (the loader's note)."""
    loader = loader or load_model
    if not graphs:
        return loader(folder, plan=plan, verify="quick")
    rt = loader(folder, plan=plan, verify="quick", forced_route="cuda-graph")
    if rt.route()["name"] != "cuda-graph":
        raise QuantkitError("; ".join(rt.report.notes) or "the cuda-graph route was not taken")
    return rt


def greedy(rt: Any, prompt: list[int], n: int) -> Any:
    """The runtime's GenerationResponse for `n` greedy tokens from `prompt`, end-of-turn ignored."""
    sp = SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)
    resp = None
    for e in rt.generate_ids(prompt, sampling=sp):
        resp = e.response or resp
    if resp is None:
        raise QuantkitError("the generation ended without a response")
    return resp


def _cuda_devices(planned: dict[str, int]) -> list[str]:
    return [d for d in planned if d.startswith("cuda")]


def _peaks(cudas: list[str]) -> dict[str, int]:
    """torch.cuda.max_memory_allocated per device since the last call (or the reset before the load)."""
    out = {d: int(torch.cuda.max_memory_allocated(d)) for d in cudas}
    for d in cudas:
        torch.cuda.reset_peak_memory_stats(d)
    return out


def _release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def run_placement(folder: Path, plan_file: Path, p: PlannedPlacement, graphs: bool, prompt: list[int],
                  decode: int) -> DecodeRun:
    """Load `p` from its saved plan and decode. A failure becomes the run's `error` (a QuantkitError's line;
    anything else, e.g. a CUDA out-of-memory or a graph capture error, its type and first line), so the
    other runs go on and the report still comes out."""
    run = DecodeRun(p.name, graphs, planned_bytes=p.planned_bytes)
    cudas = _cuda_devices(run.planned_bytes)
    rt = None
    try:
        _release()
        for d in cudas:
            torch.cuda.reset_peak_memory_stats(d)
        t0 = time.perf_counter()
        rt = load_runtime(folder, plan_file, graphs if cudas else None)
        run.load_s = time.perf_counter() - t0
        run.load_peak_bytes = _peaks(cudas)
        greedy(rt, prompt, WARMUP_TOKENS)
        resp = greedy(rt, prompt, decode)
        run.tokens, run.decode_tok_s, run.prefill_tok_s = list(resp.token_ids), resp.generation_tps, resp.prompt_tps
        run.decode_peak_bytes = _peaks(cudas)
        run.resident_bytes = {str(k): int(v) for k, v in rt.memory().items()}
    except QuantkitError as e:
        run.error = str(e)
    except Exception as e:  # noqa: BLE001 - any failure of one run is that run's result, reported
        run.error = f"{type(e).__name__}: {(str(e).strip().splitlines() or ['?'])[0][:300]}"
    finally:
        del rt
        _release()
    return run


def agreement(ref: list[int], got: list[int]) -> int:
    """How many leading tokens `got` shares with `ref`."""
    n = 0
    for a, b in zip(ref, got, strict=False):
        if a != b:
            break
        n += 1
    return n


def checks(runs: list[DecodeRun], decode: int) -> dict[str, bool]:
    """The verdicts the report lists (module docstring, step 6)."""
    out: dict[str, bool] = {f"{r.label}: ran": not r.error for r in runs}
    ref = next((r for r in runs if r.placement == "cpu" and not r.error), None)
    want = min(AGREE_MIN, decode)
    for name in dict.fromkeys(r.placement for r in runs if r.placement != "cpu"):
        pair = {r.graphs: r for r in runs if r.placement == name}
        if all(g in pair and not pair[g].error for g in (False, True)):
            out[f"{name}: graphs on and off give the same tokens"] = pair[True].tokens == pair[False].tokens
        for r in pair.values():
            if r.error:
                continue
            if ref is not None:
                out[f"{r.label}: first {want} greedy tokens agree with the CPU"] = agreement(ref.tokens, r.tokens) >= want
            for when, peaks in (("load", r.load_peak_bytes), ("decode", r.decode_peak_bytes)):
                for d, peak in peaks.items():
                    ok = peak <= r.planned_bytes.get(d, 0) * (1 + MEMORY_SLACK)
                    out[f"{r.label}: {d} {when} peak within the plan (+{MEMORY_SLACK:.0%})"] = ok
    return out


# ---- the whole check --------------------------------------------------------------------------------

@dataclass
class GpuBenchResult:
    command: str
    machine: dict[str, Any]
    checkpoint: dict[str, Any]
    recipe: str
    prompt_tokens: int
    decode_tokens: int
    placements: list[dict[str, Any]]
    runs: list[DecodeRun]
    checks: dict[str, bool]
    seconds: float = 0.0
    skipped: list[str] = field(default_factory=list)  # runs not made, each with why, one line

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        ref = next((r for r in self.runs if r.placement == "cpu" and not r.error), None)
        for r, rd in zip(self.runs, d["runs"], strict=True):
            rd["agree_with_cpu"] = agreement(ref.tokens, r.tokens) if ref and not r.error else None
        return d


def ensure_checkpoint(workdir: Path, layers: int, experts: int, recipe: str,
                      log: Callable[[str], None]) -> Path:
    """The realistic-shape checkpoint quantized with `recipe`, made once in `workdir` (as bench decode does)."""
    src = workdir / f"realistic-{layers}x{experts}"
    if not (src / "config.json").is_file():
        log(f"writing the realistic-shape checkpoint {src}")
        make_tiny_model(src, realistic=True, layers=layers, experts=experts, top_k=8, overwrite=True)
    out = workdir / f"q-{layers}x{experts}-{recipe}"
    if not (out / "quantkit-manifest.json").is_file():
        log(f"quantizing with {recipe} -> {out}")
        with Checkpoint.open(src) as ck:
            run_quantize(ck, out, QuantizeOptions(get_recipe(recipe), mode="overwrite"))
    return out


def fixed_prompt(n: int, vocab: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, min(vocab, PROMPT_VOCAB), (n,), generator=g).tolist()


def run(reports: Path, workdir: Path, layers: int = 4, experts: int = 64, prompt_len: int = 32, decode: int = 32,
        recipe: str = "int4", cpu_share: float = 0.5, context: int = 1024,
        log: Callable[[str], None] = print) -> GpuBenchResult:
    """The check (module docstring); writes reports/bench-gpu.{md,json}."""
    import psutil

    t_all = time.perf_counter()
    rec = get_recipe(recipe)
    info = detect_cuda()  # before any work: without a GPU nothing is generated
    folder = ensure_checkpoint(workdir, layers, experts, recipe, log)
    cfg = load_config(folder / "config.json")
    spec = spec_from_config(cfg, name=folder.name)
    placements = plan_placements(spec, rec, detected_gpu(), int(psutil.virtual_memory().available), context, cpu_share)
    prompt = fixed_prompt(prompt_len, spec.config.vocab_size)
    runs: list[DecodeRun] = []
    skipped: list[str] = []
    for p in placements:
        plan_file = workdir / f"plan-{p.name.replace('+', '-')}.json"
        p.plan.save(plan_file)
        log(f"{p.name}: {p.plan.summary()}")
        with_graphs = p.name == "gpu"  # a graph cannot hold the CPU experts' hand-off of gpu+cpu
        for graphs in ((False, True) if with_graphs else (False,)):
            r = run_placement(folder, plan_file, p, graphs, prompt, decode)
            log(f"  {r.label}: " + (f"failed: {r.error}" if r.error else
                                    f"decode {r.decode_tok_s:.1f} tok/s, load {r.load_s:.1f} s"))
            runs.append(r)
    tc = cfg.get("text_config", cfg)
    res = GpuBenchResult(
        command=f"python -m benchmarks.gpu --layers {layers} --experts {experts} --prompt-tokens {prompt_len} --new-tokens {decode} "
                f"--scheme {recipe} --cpu-share {cpu_share}",
        machine={"gpu": info.name, "gpu_memory_bytes": info.memory_bytes, "gpus": info.count, "torch": info.torch,
                 "cuda": info.cuda, "cpu": cpu_name(), "cores": psutil.cpu_count(), "threads": torch.get_num_threads()},
        checkpoint={"layers": layers, "experts": experts, "top_k": tc.get("num_experts_per_tok"),
                    "hidden": tc.get("hidden_size"), "vocab": tc.get("vocab_size"), "folder": str(folder)},
        recipe=recipe, prompt_tokens=prompt_len, decode_tokens=decode,
        placements=[p.to_dict() for p in placements], runs=runs, checks=checks(runs, decode), skipped=skipped,
    )
    res.seconds = time.perf_counter() - t_all
    d = res.to_dict()
    write_reports(reports, "bench-gpu", d, render_md(d))
    return res


# ---- report -----------------------------------------------------------------------------------------

def _gb(n: int | None) -> str:
    return f"{n / 1e9:.2f} GB" if n else "-"


def _memory_cells(r: dict[str, Any]) -> str:
    """'cuda:0 load 1.30 / decode 1.20 GB peak, 1.31 GB planned (99%, 92%)' per CUDA device; CPU: the
    loader's bytes vs the plan."""
    parts = []
    for d, planned in sorted(r["planned_bytes"].items()):
        if d in r["decode_peak_bytes"]:
            load, dec = r["load_peak_bytes"].get(d, 0), r["decode_peak_bytes"][d]
            parts.append(f"{d} load {load / 1e9:.2f} / decode {_gb(dec)} peak, {_gb(planned)} planned "
                         f"({load / planned:.0%}, {dec / planned:.0%})")
        elif d in r["resident_bytes"]:
            parts.append(f"{d} {_gb(r['resident_bytes'][d])} weights / {_gb(planned)} planned")
    return "; ".join(parts) or "-"


def render_md(d: dict[str, Any]) -> str:
    m, c = d["machine"], d["checkpoint"]
    out = [
        "# GPU check: quantkit's runtime on one CUDA GPU, alone and with experts on the CPU",
        "",
        f"Command: `{d['command']}` ({d['seconds']:.0f} s in all).",
        "",
        f"Machine: {m['gpu']} ({m['gpu_memory_bytes'] / GIB:.0f} GiB, {m['gpus']} visible), torch {m['torch']} "
        f"(CUDA {m['cuda']}), CPU {m['cpu']} ({m['cores']} cores, {m['threads']} threads).",
        "",
        f"Checkpoint: realistic shapes (hidden {c['hidden']}), {c['layers']} layers x {c['experts']} experts, "
        f"top-{c['top_k']}, vocab {c['vocab']}, random weights, quantized with `{d['recipe']}`. Each run: load "
        f"from the saved plan, {WARMUP_TOKENS} warm-up tokens, then {d['decode_tokens']} greedy tokens from a "
        f"{d['prompt_tokens']}-token prompt; decode tok/s is the runtime's own (steps after the first token).",
        "",
        "## Placements",
        "",
        "| plan | summary | planned bytes per device | GPU memory planned for |",
        "|---|---|---|---|",
    ]
    for p in d["placements"]:
        planned = ", ".join(f"{k} {_gb(v)}" for k, v in sorted(p["planned_bytes"].items()))
        limit = f"{p['gpu_limit_bytes'] / GIB:.2f} GiB (cut)" if p.get("gpu_limit_bytes") else "the card's own"
        out.append(f"| {p['name']} | {p['summary']} | {planned} | {limit if p['name'] != 'cpu' else '-'} |")
    out += ["", "## Runs", "",
            "| run | decode tok/s | prefill tok/s | load s | greedy tokens agreeing with the CPU | memory (peak vs plan) |",
            "|---|---:|---:|---:|---:|---|"]
    for r in d["runs"]:
        label = r["placement"] + (", graphs" if r["graphs"] else "")
        if r["error"]:
            out.append(f"| {label} | failed: {r['error']} | | | | |")
            continue
        agree = "-" if r["placement"] == "cpu" or r.get("agree_with_cpu") is None else \
            f"{r['agree_with_cpu']}/{len(r['tokens'])}"
        out.append(f"| {label} | {r['decode_tok_s']:.1f} | {r['prefill_tok_s']:.1f} | {r['load_s']:.1f} | {agree} | "
                   f"{_memory_cells(r)} |")
    out += [f"- skipped: {why}" for why in d.get("skipped") or []]
    out += ["", "## Checks", ""]
    out += [f"- {'PASS' if ok else 'FAIL'} {name}" for name, ok in d["checks"].items()]
    out += ["", f"Agreement: random weights have small logit margins and the CPU kernel takes int8 activations where "
            f"the GPU takes bf16, so greedy tokens may part after a while; the check asks for the first "
            f"{AGREE_MIN}. Memory: CUDA peaks are `torch.cuda.max_memory_allocated` while loading (reset before the "
            "load) and from the end of the load through the generations (reset after it), each "
            f"allowed {MEMORY_SLACK:.0%} over the plan's bytes for the device; CPU figures are the loader's "
            "resident weights.", ""]
    return "\n".join(out)


def cli(
    reports: Path = shared("reports", Path("reports")),
    workdir: Path = shared("workdir", Path("/tmp/quantkit-bench-gpu")),
    layers: int = shared("layers", 4),
    experts: int = shared("experts", 64),
    prompt_tokens: int = shared("prompt_tokens", 32),
    new_tokens: int = shared("new_tokens", 32),
    scheme: str = typer.Option("int4", "--scheme", "-s", help="the quantization of the checkpoint (int4: experts "
                               "int4)"),
    cpu_share: float = typer.Option(0.5, "--cpu-share", parser=FRACTION,
                                    help="share of the expert bytes the GPU+CPU plan leaves in RAM, in (0, 1]"),
) -> None:
    """On a CUDA GPU: plan GPU alone and GPU+CPU, load, decode with and without CUDA graphs, check against the CPU."""
    guard_reports(reports, "gpu")
    d = run(reports, workdir, layers, experts, prompt_tokens, new_tokens, scheme, cpu_share)
    for name, ok in d.checks.items():
        print(f"{'PASS' if ok else 'FAIL'} {name}")
    print(f"wrote {reports / 'bench-gpu.md'} ({d.seconds:.0f} s)")
    if not all(d.checks.values()):
        raise typer.Exit(1)


def main(argv: list[str] | None = None) -> int:
    return run_command(cli, argv, "gpu")


if __name__ == "__main__":
    sys.exit(main())
