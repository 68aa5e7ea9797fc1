"""`quantkit plan`, `quantkit gpus`, `quantkit inspect`: parse, call budget/plan, render."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import typer
from rich import box
from rich.table import Table
from rich.text import Text

from quantkit.checkpoint.contract import read_quant_config
from quantkit.checkpoint.gguf_file import read_gguf
from quantkit.checkpoint.quantized import QuantizedFolder
from quantkit.checkpoint.reader import Checkpoint, spec_from_path
from quantkit.checkpoint.spec import DEFAULT_MODEL, ModelSpec, Role, load_config
from quantkit.cli import app, console, print_table
from quantkit.cli.options import CONTEXT, COUNT, COUNT0, MTP_DRAFT, NODES, PARALLEL, TFLOPS, renamed
from quantkit.errors import QuantkitError
from quantkit.export.gguf_types import check_type
from quantkit.export.launch import (
    DEFAULT_MTP_DRAFT,
    ENGINES,
    LaunchPlan,
    launch_plan,
    llama_cache_type,
    llama_launch,
)
from quantkit.export.llama_placement import LlamaPlacement, LlamaSettings, model_from_gguf
from quantkit.fileio import require_regular_file
from quantkit.outputs import guard_output
from quantkit.planner.budget import GB, GIB, SNAPSHOTS_PER_PROMPT, RunSettings, cache_dtype, compute_budget
from quantkit.planner.disk_cache import disk_cache_note, parse_disk_size
from quantkit.planner.hardware import DEFAULT_GPU_RESERVE, Hardware, build_hardware, load_catalog, parse_size
from quantkit.planner.host_costs import profile_for_plan
from quantkit.planner.placement import (
    DEFAULT_QUALITY_FLOOR,
    RECIPES,
    Plan,
    SchemeResult,
    choose,
    is_plan_file,
    plan_schemes,
    ram_needed_gib,
    solve,
)
from quantkit.planner.routing import RoutingReport, read_profile
from quantkit.recipe import Recipe, parse_recipe_names
from quantkit.termtext import plural

STATS_HINT = "make it with `quantkit stats MODEL --out FILE`"
MAX_SWEEP = 64  # contexts in one `--context` sweep: a plan per scheme each; a table of 64 rows a scheme is plenty


def parse_contexts(text: str, max_ctx: int) -> list[int]:
    """`4096`, `4k,32k,128k,262k`, `max`. k = 1024; `262k` (and any Nk that overshoots the model's
    maximum only because of the 1000/1024 difference) means the maximum."""
    parts = text.split(",")
    if len(parts) > MAX_SWEEP:  # each context plans every scheme again
        raise QuantkitError(f"--context {text[:40]}...: a sweep of {len(parts)} contexts; give at most {MAX_SWEEP}")
    out = []
    for part in parts:
        part = part.strip().lower()
        if part in ("max", "full"):
            out.append(max_ctx)
            continue
        m = re.fullmatch(r"(-?\d+)\s*(k?)", part)
        if not m:
            raise QuantkitError(f"context {part!r} does not parse; give tokens like 4096, 32k or max")
        n = int(m.group(1))
        if m.group(2):
            n = max_ctx if n * 1024 > max_ctx >= n * 1000 else n * 1024
        out.append(n)
    return out


def _settings(ctx: int, batch: int, cache: str, chunk: int, mtp: bool, spec: ModelSpec,
              snapshots: int = SNAPSHOTS_PER_PROMPT) -> RunSettings:
    s = RunSettings(context=ctx, batch=batch, cache_dtype=cache_dtype(cache), prefill_chunk=chunk, include_mtp=mtp,
                    prompt_cache_snapshots=snapshots)
    s.validate(spec.config)
    return s


def has_mtp(spec: ModelSpec) -> bool:
    """Whether the model (or folder) has an MTP layer: a quantized folder made with --no-mtp has none."""
    return any(t.role == Role.MTP for t in spec.tensors)


def mtp_used(spec: ModelSpec, draft: int | None, model: str | None = None) -> bool:
    """Whether a plan budgets the MTP layer: `--mtp N` (0: no; 1-3: yes, refused when the model has none),
    by default when the model has one (the runtime loads it whether or not it drafts with it)."""
    if draft is None:
        return has_mtp(spec)
    if draft and not has_mtp(spec):
        raise QuantkitError(f"--mtp {draft}: {model or spec.name} has no MTP layer (a folder quantized with "
                            "--no-mtp drops it); drop --mtp")
    return draft > 0


def _gb(n: float) -> str:
    return f"{n / GB:.1f}"


def _ctx(n: int) -> str:
    """A context in the one style of plan's output and of `-c`: whole k (1024 tokens), rounded down, so the
    figure shown always fits when given back as `-c`; below 1k, the tokens."""
    return f"{n // 1024}k" if n >= 1024 else f"{n}"


def _results_table(rows: list[SchemeResult], sweep: bool, recommended: str | None, runtime: bool = False) -> Table:
    t = Table(title="Schemes (sizes in GB)", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    t.add_column("scheme", no_wrap=True)
    if sweep:
        t.add_column("ctx", justify="right", no_wrap=True)
    cols = ("card", "exact", "fits", "where", "max ctx", "tok/s", "pp/s") + (("qk tok/s", "qk pp/s") if runtime else ())
    for col in cols:
        t.add_column(col, justify="left" if col in ("fits", "where") else "right", no_wrap=True)
    for r in rows:
        p = r.plan
        s = p.speed
        first = r is rows[0] or p.settings.context == rows[0].plan.settings.context
        name = p.scheme + (" *" if p.scheme == recommended and first else "")
        # a scheme that fits only at a shorter context than asked says so, as its max ctx does
        fits = (Text("yes", "green") if p.fits else Text(f"≤{_ctx(r.max_context)}", "yellow") if r.max_context
                else Text("no", "red"))
        where = Text(p.short_summary(), "" if p.fits else "red")
        cells = [name] + ([_ctx(p.settings.context)] if sweep else [])
        cells += [f"{p.card_estimate_gb:.1f}", _gb(p.total_bytes), fits, where,
                  _ctx(r.max_context) if r.max_context else "-",
                  f"{s.decode_tok_s:.0f}" if s and p.fits else "-", f"{s.prefill_tok_s:.0f}" if s and p.fits else "-"]
        if runtime:
            rs = p.runtime_speed
            cells.append(f"{rs.decode_tok_s:.1f}" if rs and p.fits else "-")
            cells.append(f"{rs.prefill_tok_s:.0f}" if rs and p.fits and rs.prefill_tok_s is not None else "-")
        t.add_row(*cells)
    return t


def _budget_table(spec: ModelSpec, plan: Plan) -> Table:
    b = compute_budget(spec, RECIPES[plan.scheme], plan.settings)
    t = Table(title=f"Exact budget: {plan.scheme} at {plan.settings.context} tokens, batch {plan.settings.batch}, "
              f"{plan.settings.cache_dtype} cache", title_justify="left")
    t.add_column("component")
    t.add_column("bytes", justify="right")
    t.add_column("GB", justify="right")
    t.add_column("of which scales/zeros", justify="right")
    for role, tb in sorted(b.weights_by_role.items(), key=lambda kv: -kv[1].total):
        t.add_row(f"weights: {role.value}", f"{tb.total:,}", _gb(tb.total),
                  f"{tb.scales + tb.zeros:,}" if tb.scales + tb.zeros else "")
    t.add_row("  (kept in high precision)", f"{b.kept_high_precision:,}", _gb(b.kept_high_precision), "")
    n_full = len(spec.config.full_attention_layers)
    mtp = " + the MTP layer's" if plan.settings.include_mtp and spec.config.mtp_num_hidden_layers else ""
    t.add_row(f"KV cache ({n_full} full-attention layers{mtp})", f"{b.kv_cache:,}", _gb(b.kv_cache), "")
    t.add_row("Gated DeltaNet recurrent state (fp32)", f"{b.recurrent_state:,}", _gb(b.recurrent_state), "")
    t.add_row("Gated DeltaNet conv state", f"{b.conv_state:,}", _gb(b.conv_state), "")
    t.add_row(f"prompt cache ({plural(plan.settings.prompt_cache_snapshots, 'snapshot')})", f"{b.prompt_cache:,}",
              _gb(b.prompt_cache), "")
    t.add_row(f"activations (prefill chunk {min(plan.settings.prefill_chunk, plan.settings.context)})",
              f"{b.activations:,}", _gb(b.activations), "")
    t.add_row("logits (fp32, last position)", f"{b.logits:,}", _gb(b.logits), "")
    reserve = sum(g.reserve for g in plan.gpus if g.used_bytes)
    if reserve:
        t.add_row(f"runtime reserve ({len([g for g in plan.gpus if g.used_bytes])} GPU)", f"{reserve:,}",
                  _gb(reserve), "")
    t.add_row(Text("total", "bold"), Text(f"{plan.total_bytes:,}", "bold"), Text(_gb(plan.total_bytes), "bold"), "")
    return t


def _placement_table(plan: Plan) -> Table:
    t = Table(title=f"Placement: {plan.scheme}", title_justify="left")
    for col in ("device", "holds", "used GB", "budget GB", "experts", "layers"):
        t.add_column(col, justify="right" if col not in ("device", "holds") else "left")
    counts = plan.expert_counts()
    for d in plan.devices:
        if not d.used_bytes and d.kind == "gpu":
            continue
        n_exp = sum(c.get(d.id, 0) for c in counts)
        layers = [L for L, x in enumerate(plan.layer_device) if x == d.id]
        span = f"{layers[0]}-{layers[-1]}" if layers else "-"
        holds = ", ".join(f"{k} {_gb(v)}" for k, v in sorted(d.used.items(), key=lambda kv: -kv[1]))
        over = d.used_bytes > d.capacity
        used = Text(_gb(d.used_bytes), "red" if over else "")
        t.add_row(f"{d.id} ({d.name})", holds, used, _gb(d.capacity), str(n_exp), span)
    return t


def _hardware_dict(hw: Hardware) -> dict:
    return {
        "gpus": [{"id": g.id, "name": g.name, "memory_gib": g.memory_gib, "bandwidth_gbs": g.bandwidth_gbs,
                  "unified": g.unified} for g in hw.gpus],
        "nodes": hw.nodes,
        "ram_gib": round(hw.host.ram_bytes / GIB, 2),
        "ram_source": hw.host.ram_source,
        "cpu_bandwidth_gbs": hw.host.cpu_bandwidth_gbs,
        "cpu_bandwidth_source": hw.host.bandwidth_source,
    }


def _model_sources(model: str | None) -> list[Path]:
    """What `plan --out` must stay out of: the --model path, and the checkpoint folder of a config.json."""
    if not model or not Path(model).exists():
        return []
    p = Path(model)
    return [p, p.parent] if p.is_file() and p.name == "config.json" else [p]


@app.command("plan")
def plan_cmd(
    model: str = typer.Option(None, "--model", "-m", help="config.json, checkpoint folder or cached HF id"),
    gpu: list[str] = typer.Option(None, "--gpu", "-g", help="GPU name, e.g. rtx4090, 2x3090; none (or cpu): no "
                                  "GPU; custom:VRAM[,GB/s] for a card outside the catalog; repeatable"),
    nodes: int = typer.Option(1, "--nodes", parser=NODES, help="identical nodes (for multi-node vLLM)"),
    ram: str = typer.Option(None, "--ram",
                            help="host RAM, e.g. 64GiB, 64 (GiB) or 68.7GB (GB = 10^9) (default: this machine's)"),
    cpu_bandwidth: str = typer.Option(None, "--cpu-bandwidth", help="host memory bandwidth in GB/s"),
    cpu_tflops: float = typer.Option(None, "--cpu-tflops", parser=TFLOPS,
                                     help="host prefill TFLOP/s (default 1.0)"),
    scheme: list[str] = typer.Option(None, "--scheme", "-s", help=f"one of {', '.join(RECIPES)}; repeatable"),
    context: str = typer.Option("4096", "--context", "-c", help="tokens; a sweep like 4k,32k,128k,262k"),
    batch: int = typer.Option(1, "--parallel", "--batch", "-b", parser=PARALLEL,
                              help="concurrent sequences, as `serve --parallel N` decodes them: K/V and recurrent "
                              "+ conv state for each, and the batch's activations"),
    cache: str = typer.Option("fp16", "--cache-dtype", help="KV cache: fp16, bf16, fp8, q8_0, q4_0"),
    prefill_chunk: int = typer.Option(512, "--prefill-chunk", parser=COUNT,
                                      help="tokens per prefill step (llama.cpp's -ub): RAM-resident experts "
                                      "cross PCIe once per step, so a larger step prefills faster"),
    gpu_reserve: str = typer.Option(None, "--gpu-reserve", help="runtime reserve per GPU (default 1GiB)"),
    mtp: int = typer.Option(None, "--mtp", parser=MTP_DRAFT,
                            help="tokens the MTP layer drafts per step (speculative decoding): 1-3 budget the "
                            "layer (weights and its KV cache) and draft that many in the --export lines, 0 leaves "
                            "it out (default: budgeted when the model has one, 1 drafted)"),
    prompt_snapshots: int = typer.Option(None, "--prompt-snapshots", parser=COUNT0, show_default=False,
                                         help="conversation-state snapshots to budget for (3 per conversation kept "
                                         f"across turns; 0: none) (default: {SNAPSHOTS_PER_PROMPT})"),
    old_prompt_cache: int = typer.Option(None, "--prompt-cache", parser=COUNT0, hidden=True),  # a count, not bytes
    disk_cache: str = typer.Option(None, "--prompt-cache-disk-size", help="also say what a prompt cache on disk "
                                   "of this size holds (serve/chat --prompt-cache-dir), e.g. 20GB"),
    n_cpu_moe: int = typer.Option(None, "--n-cpu-moe", parser=COUNT0,
                                  help="keep the routed experts of the first N layers on the CPU (llama.cpp's "
                                  "flag), in the plan and the llama.cpp line, instead of the fewest that fit"),
    min_quality: str = typer.Option(DEFAULT_QUALITY_FLOOR, "--min-quality",
                                    help="the recommendation is the fastest scheme that fits at this quality or "
                                    "above (order: bf16, fp16, int8, quality, int4, nf4, mxfp4, fp4)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
    out: Path = typer.Option(None, "--out", "-o", help="save the chosen plan for the runtime"),
    export: str = typer.Option(None, "--export", help="print launch flags: llama.cpp or vllm"),
    gguf_type: str = typer.Option(None, "--gguf-type", help="with --export llama.cpp: the GGUF --type to size the "
                                  "launch line for (default: the scheme's; e.g. q4_k_m)"),
    profile: Path = typer.Option(None, "--profile", help="runtime profile from `quantkit profile-host` (default: "
                                 "this host's, when planning for this machine)"),
    routing: Path = typer.Option(None, "--routing", help="statistics file from `quantkit stats` of this model: "
                                 "the GPUs take the most-routed experts first, speed uses the measured routing"),
    routing_heldout: Path = typer.Option(None, "--routing-heldout", help="with --routing: statistics of held-out "
                                         "text of the same corpus, to report how the placement transfers "
                                         "(default: --routing's own held-out part)"),
) -> None:
    """Memory budget per scheme, a placement over GPUs and RAM, and the speed it should reach."""
    prompt_cache = renamed(prompt_snapshots, old_prompt_cache, "--prompt-snapshots", "--prompt-cache",
                           SNAPSHOTS_PER_PROMPT)
    if out:
        guard_output(out, sources=_model_sources(model), kind="file",
                     overwrite=True, owned=is_plan_file, flag="--out ", create_parents=True)
    if gguf_type:
        gguf_type = check_type(gguf_type)
        if model and model.lower().endswith(".gguf"):
            raise QuantkitError(f"--gguf-type {gguf_type}: a GGUF --model is planned with its own types; drop "
                                "--gguf-type")
        if not export:
            raise QuantkitError(f"--gguf-type {gguf_type} sizes the --export llama.cpp line: add --export llama.cpp "
                                "or drop --gguf-type")
        if ENGINES.get(export.lower()) == "vllm":
            raise QuantkitError(f"--gguf-type {gguf_type} applies to --export llama.cpp only, not --export {export}: "
                                "drop --gguf-type")
    if routing_heldout and not routing:
        raise QuantkitError("--routing-heldout needs --routing FILE (the profile the placement is made from)")
    for flag, stats_path in (("--routing", routing), ("--routing-heldout", routing_heldout)):
        if stats_path:
            require_regular_file(stats_path, flag, "statistics file", STATS_HINT)
    if model and model.lower().endswith(".gguf"):
        if routing:
            raise QuantkitError("--routing applies to a safetensors model or config.json, not a GGUF file "
                                "(llama.cpp places whole expert tensors per layer)")
        return plan_gguf(Path(model), build_hardware(gpu, ram, cpu_bandwidth, nodes, cpu_tflops), context, batch,
                         cache, gpu_reserve, as_json, n_cpu_moe, mtp)
    spec = spec_from_path(model)
    hw = build_hardware(gpu, ram, cpu_bandwidth, nodes, cpu_tflops)
    if export and export.lower() not in ENGINES:
        raise QuantkitError(f"--export {export!r}: use llama.cpp or vllm")
    schemes: list[Any] = list(dict.fromkeys(parse_recipe_names(scheme)))  # a scheme named twice is planned once
    own = _own_recipe(model)
    if own is not None and not schemes:  # a quantized folder runs as it is stored: plan that, not the others
        schemes = [own]
        hw = replace(hw, notes=(*hw.notes, f"{model} is quantized ({own.name}): planning its own recipe "
                                "(--scheme compares others)"))
    min_quality = (parse_recipe_names([min_quality]) or [DEFAULT_QUALITY_FLOOR])[0]
    use_mtp = mtp_used(spec, mtp, model)
    if use_mtp:
        hw = replace(hw, notes=(*hw.notes, "the MTP layer (speculative decoding's drafter) is budgeted: its weights "
                                "and its KV cache; --mtp 0 leaves it out"))
    contexts = parse_contexts(context, spec.config.max_position_embeddings)
    if disk_cache is not None:
        hw = replace(hw, notes=(*hw.notes, disk_cache_note(spec.config, contexts[-1],
                                                           parse_disk_size(disk_cache))))
    this_host = not (gpu or ram or cpu_bandwidth or nodes > 1)
    prof, prof_src, prof_note = profile_for_plan(profile, spec.config, this_host)
    kw = {"gpu_reserve": parse_size(gpu_reserve, "--gpu-reserve") if gpu_reserve else DEFAULT_GPU_RESERVE,
          "profile": prof, "profile_source": prof_src}
    if n_cpu_moe is not None:
        kw["cpu_expert_layers"] = min(n_cpu_moe, spec.config.num_hidden_layers)
    if routing:
        kw["routing"] = read_profile(routing, spec.config.num_hidden_layers, spec.config.num_experts, routing_heldout)
    rows = [r for ctx in contexts
            for r in plan_schemes(spec, hw, _settings(ctx, batch, cache, prefill_chunk, use_mtp, spec, prompt_cache),
                                  schemes or None, **kw)]
    try:
        chosen = choose(rows, contexts[0], schemes, spec, hw, floor=min_quality, **kw)
    except QuantkitError:
        if not as_json:
            _print_notes(hw.notes)
        raise
    plan = chosen.plan
    if out:
        plan.save(out)
    launch = launch_plan(export, plan, hw, spec.name, model or f"<path to {DEFAULT_MODEL}>", spec,
                         gguf_type, n_cpu_moe, mtp) if export else None
    then = next_command(model, plan.scheme, own is not None, out, launch)
    if as_json:
        obj = _plan_json(spec, hw, contexts, rows, plan, prof_src, prof_note, out, launch)
        obj["next"] = then
        print(json.dumps(obj, indent=1))
        return
    _print_plan(spec, hw, contexts, rows, chosen, prof is not None, prof_src, prof_note, out)
    if launch:
        _print_launch(launch)
    console.print(Text.assemble(("next:", "bold"), f" {then}"), highlight=False, soft_wrap=True)


def _print_notes(notes: tuple[str, ...] | list[str]) -> None:
    for n in notes:
        console.print(n, style="dim")


def _plan_json(spec: ModelSpec, hw: Hardware, contexts: list[int], rows: list[SchemeResult], plan: Plan,
               prof_src: str, prof_note: str, out: Path | None, launch: LaunchPlan | None) -> dict:
    obj = {
        "model": spec.name,
        "spec_fingerprint": plan.fingerprint,
        "hardware": _hardware_dict(hw),
        "notes": list(hw.notes),
        "contexts": contexts,
        "schemes": [r.to_dict() for r in rows],
        "recommended": plan.scheme,
        "plan": {k: v for k, v in plan.to_dict().items() if k not in ("layers", "assumptions")},
        "assumptions": plan.assumptions,
        "runtime_profile": prof_src or None,
    }
    if prof_note:
        obj["notes"].append(prof_note)
    if out:
        obj["plan_file"] = str(out)
    if launch:
        obj["export"] = launch.to_dict()
    return obj


def _print_plan(spec: ModelSpec, hw: Hardware, contexts: list[int], rows: list[SchemeResult], chosen: SchemeResult,
                runtime: bool, prof_src: str, prof_note: str, out: Path | None) -> None:
    plan = chosen.plan
    _print_notes(hw.notes)
    console.print(Text.assemble((spec.name, "bold"), f" ({spec.text_params / 1e9:.2f}B params, "
                                f"{spec.active_params_per_token / 1e9:.2f}B active) on {hw.describe()}"))
    print_table(_results_table(rows, len(contexts) > 1, plan.scheme, runtime=runtime))
    console.print(f"card = the model card's formula (1.05 x weights + KV); exact = tensor by tensor, with "
                  f"caches, buffers and GPU reserve; fits = at --context {_ctx(contexts[0])} (≤Nk: only up to N k "
                  "tokens); max ctx = longest context that fits (k = 1024 tokens, as -c takes it); tok/s = "
                  "estimated decode (llama.cpp-grade), pp/s = estimated prefill tok/s; * = recommended: the fastest "
                  "that fits at --min-quality or better (default: the quality scheme)"
                  + ("; qk tok/s, qk pp/s = quantkit's own runtime here, composed from `quantkit profile-host`'s "
                     f"measured parts ({prof_src})" if runtime else ""), style="dim")
    print_table(_budget_table(spec, plan))
    print_table(_placement_table(plan))
    console.print(Text.assemble(("Recommended:", "bold green"), " " + recommended_line(chosen)))
    if prof_note or plan.runtime_note:
        console.print(prof_note or plan.runtime_note, style="dim")
    if plan.routing:
        console.print(routing_line(plan.routing), highlight=False)
    console.print("assumptions:", style="dim")
    for a in plan.assumptions:
        console.print(f"  - {a}", style="dim")
    if out:
        console.print(f"plan saved to {out}")


def recommended_line(chosen: SchemeResult) -> str:
    """The recommendation in one line; its max context is the table's `max ctx` of the same row, in the same
    style, and the context that keeps everything on the GPU is said as part of it."""
    plan, s = chosen.plan, chosen.plan.speed
    ctx, ctx_gpu = chosen.max_context, chosen.max_context_on_gpu
    gpu = (f" (all on the GPU up to {_ctx(ctx_gpu)}; beyond, experts move to RAM)"
           if plan.where == "gpu" and 0 < ctx_gpu < ctx else "")
    runtime = plan.runtime_speed
    return (f"{plan.scheme} ({RECIPES[plan.scheme].description}): {_gb(plan.total_bytes)} GB, {plan.summary()}; "
            f"~{s.decode_tok_s:.0f} tok/s decode, ~{s.prefill_tok_s:.0f} tok/s prefill; max context "
            f"{_ctx(ctx)}{gpu}"
            + (f"; quantkit's runtime here: ~{runtime.decode_tok_s:.1f} tok/s decode" if runtime else "")
            + (f", ~{runtime.prefill_tok_s:.0f} tok/s prefill"
               if runtime and runtime.prefill_tok_s is not None else ""))


def next_command(model: str | None, scheme: str, own: bool, out: Path | None, launch: LaunchPlan | None) -> str:
    """The command to run after this plan: the export its --export line needs, the download and the quantize
    of the recommended scheme, or (a folder already quantized, or the scheme is bf16) the chat."""
    if launch is not None:
        return launch.export_command or launch.command or ""
    plan_arg = f" --plan {out}" if out else ""
    if model is None:
        return ("hf download Qwen/Qwen-AgentWorld-35B-A3B --local-dir ~/models/agentworld, then "
                f"quantkit quantize ~/models/agentworld --scheme {scheme} --out ~/models/agentworld-{scheme}")
    if own or scheme == "bf16":
        return f"quantkit chat {model}{plan_arg}   (or quantkit serve {model}{plan_arg})"
    folder = str(Path(model).parent) if Path(model).name == "config.json" else model.rstrip("/")
    return f"quantkit quantize {folder} --scheme {scheme} --out {folder}-{scheme}"


def routing_line(r: RoutingReport) -> str:
    """"GPUs serve 41% of routed traffic (uniform placement: 25%; held-out: 38%)" for the console."""
    if not r.uniform_share:
        return f"no routed expert is on a GPU in this plan: the routing profile {r.source} changes nothing"
    held = (f"; on held-out tokens ({r.held_out_source}): {r.held_out_coverage:.0%}" if r.held_out_coverage is not None
            else "; no held-out counts to check how the profile transfers")
    return (f"GPUs serve {r.gpu_traffic_share:.0%} of routed traffic by the profile {r.source} "
            f"(uniform placement: {r.uniform_share:.0%}{held})")


def _print_launch(launch: LaunchPlan) -> None:
    for w in launch.warnings:
        console.print(Text.assemble(("warning:", "yellow"), f" {w}"))
    for n in launch.notes:
        console.print(f"note: {n}", highlight=False)
    if launch.export_command:
        console.print(launch.export_command, highlight=False, soft_wrap=True)
    if launch.command:
        console.print(launch.command, highlight=False, soft_wrap=True)
    if launch.placement:
        _print_llama(launch.placement, launch.decode_tok_s, launch.prefill_tok_s)
    if launch.vllm:
        v = launch.vllm
        parts = ", ".join(f"{k} {b / GIB:.2f}" for k, b in v.per_gpu.items())
        console.print(f"vLLM per GPU: {sum(v.per_gpu.values()) / GIB:.2f} GiB of {v.budget / GIB:.2f} GiB "
                      f"(GiB: {parts}); KV room for {v.max_tokens:,} tokens", highlight=False)
        for a in v.assumptions:
            console.print(f"  - {a}", style="dim")


def _print_llama(pl: LlamaPlacement, tok_s: float | None = None, prefill: float | None = None) -> None:
    """What a llama.cpp line puts on each card and in RAM, by the GGUF's bytes, and its estimated speed."""
    if tok_s is not None:
        pp = f"; prefill ~{prefill:.0f} tok/s in steps of -ub {pl.settings.ubatch}" if prefill else ""
        console.print(f"llama.cpp decode: ~{tok_s:.0f} tok/s estimated for this line (batch 1, empty cache; "
                      f"{len(pl.cpu_expert_layers)} layers' experts on the CPU){pp}", highlight=False)
    for i, (use, budget) in enumerate(zip(pl.gpu_bytes, pl.budgets, strict=True)):
        parts = ", ".join(f"{k} {v / GIB:.2f}" for k, v in use.items() if v)
        console.print(f"llama.cpp on GPU {i}: {sum(use.values()) / GIB:.2f} GiB of {budget / GIB:.2f} GiB "
                      f"(card minus {pl.reserve / GIB:.2f} GiB reserve; GiB: {parts})", highlight=False)
    parts = ", ".join(f"{k} {v / GIB:.2f}" for k, v in pl.cpu_bytes.items() if v)
    console.print(f"llama.cpp in RAM: {sum(pl.cpu_bytes.values()) / GIB:.2f} GiB (GiB: {parts})", highlight=False)
    for a in pl.assumptions:
        console.print(f"  - {a}", style="dim")


def plan_gguf(path: Path, hw: Hardware, context: str, batch: int, cache: str, gpu_reserve: str | None,
              as_json: bool, n_cpu_moe: int | None = None, mtp: int | None = None) -> None:
    """`quantkit plan --model FILE.gguf`: llama.cpp's budget and placement for an existing GGUF, from its
    header (no weights loaded); a file with an MTP layer (NextN block) drafts `mtp` tokens a step with it
    (default DEFAULT_MTP_DRAFT; 0: not), one without it refuses --mtp 1-3."""

    gm = model_from_gguf(read_gguf(path))
    if mtp and not gm.n_mtp:
        raise QuantkitError(f"--mtp {mtp}: {path.name} has no MTP layer (no NextN block: exported from a folder "
                            "without one, or with --no-mtp); drop --mtp")
    draft = (DEFAULT_MTP_DRAFT if mtp is None else mtp) if gm.n_mtp else 0
    ctx = parse_contexts(context, 1 << 30)[0]
    st = LlamaSettings(context=ctx, parallel=batch, cache_type=llama_cache_type(cache_dtype(cache)), mtp_draft=draft)
    reserve = parse_size(gpu_reserve, "GPU reserve") if gpu_reserve else DEFAULT_GPU_RESERVE
    launch = llama_launch(gm, st, hw, str(path), reserve, n_cpu_moe=n_cpu_moe)
    if as_json:
        print(json.dumps({"model": str(path), "file_bytes": gm.total, "hardware": _hardware_dict(hw),
                          "export": launch.to_dict()}, indent=1))
        return
    for n in hw.notes:
        console.print(n, style="dim")
    mtp_note = f", MTP layer: drafting {draft} a step" if draft else (", MTP layer not used" if gm.n_mtp else "")
    console.print(Text.assemble((path.name, "bold"), f" ({gm.total / GB:.2f} GB of tensors, {gm.n_layer} layers"
                                f"{mtp_note}) on {hw.describe()}"), highlight=False)
    for w in launch.warnings:
        console.print(Text.assemble(("warning:", "yellow"), f" {w}"))
    console.print(launch.command, highlight=False, soft_wrap=True)
    assert launch.placement is not None
    _print_llama(launch.placement, launch.decode_tok_s, launch.prefill_tok_s)
    console.print(Text.assemble(("next:", "bold"), f" {launch.command}"), highlight=False, soft_wrap=True)


@app.command("gpus")
def gpus_cmd(
    model: str = typer.Option(None, "--model", "-m", help="config.json, checkpoint folder or cached HF id"),
    context: int = typer.Option(4096, "--context", "-c", parser=CONTEXT, help="tokens of context to size the "
                                "caches for, e.g. 32k"),
    ram: str = typer.Option("128GiB", "--ram",
                            help="host RAM available for offload (default 128GiB; GB = 10^9)"),
    scheme: list[str] = typer.Option(None, "--scheme", "-s", help="the schemes to show, repeatable (default: bf16, "
                                     "int8, quality, int4, mxfp4)"),
    mtp: int = typer.Option(None, "--mtp", parser=MTP_DRAFT,
                            help="tokens the MTP layer drafts per step, as in `plan`: 0 leaves the MTP layer out "
                            "(default: budgeted when the model has one)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object (with estimated decode tok/s)"),
) -> None:
    """Which catalog GPUs run each scheme on the GPU alone, with expert offload (RAM needed), or not at all."""

    spec = spec_from_path(model)
    st = _settings(context, 1, "fp16", 512, mtp_used(spec, mtp, model), spec)
    names = parse_recipe_names(scheme) or [
        "bf16", "int8", "quality", "int4", "mxfp4"]
    budgets = {n: compute_budget(spec, RECIPES[n], st) for n in names}
    table = Table(title=f"GPUs x schemes at {context} tokens: GPU only, +RAM needed for expert offload, or no "
                  f"(not even with {ram} of RAM; Apple: its unified memory)", title_justify="left",
                  box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    table.add_column("gpu", no_wrap=True)
    table.add_column("GiB", justify="right", no_wrap=True)
    table.add_column("GB/s", justify="right", no_wrap=True)
    table.add_column("native")
    for n in names:
        table.add_column(n, no_wrap=True, min_width=len(n))
    data = []
    for g in load_catalog():
        hw = build_hardware([g.id], None if g.unified else ram, None, 1)
        row = {"gpu": g.id, "name": g.name, "memory_gib": g.memory_gib, "bandwidth_gbs": g.bandwidth_gbs,
               "native": list(g.native), "schemes": {}}
        cells = []
        for n in names:
            p = solve(spec, RECIPES[n], st, hw, budget=budgets[n])
            if not p.fits:
                row["schemes"][n] = {"runs": "no"}
                cells.append(Text("no", "red"))
            elif p.where == "gpu":
                row["schemes"][n] = {"runs": "gpu", "decode_tok_s": round(p.speed.decode_tok_s, 1)}
                cells.append(Text("GPU", "green"))
            else:
                need = ram_needed_gib(p)
                row["schemes"][n] = {"runs": "offload", "ram_gib": need,
                                     "decode_tok_s": round(p.speed.decode_tok_s, 1)}
                cells.append(Text(f"+{need}G", "yellow"))
        data.append(row)
        native = ",".join(x for x in g.native if x != "fp16") or "fp16"
        table.add_row(g.id, f"{g.memory_gib:g}", f"{g.bandwidth_gbs:g}", native, *cells)
    if as_json:
        print(json.dumps({"context": context, "ram": ram, "gpus": data}, indent=1))
        return
    print_table(table)
    console.print("GPU = fits on the GPU alone; +NG = with experts in RAM, needing N GiB of RAM (3 GiB for "
                  "the OS included); --json adds estimated decode tok/s; `quantkit plan --gpu X` for details",
                  style="dim")


def _own_recipe(model: str | None) -> Recipe | None:
    """The recipe a quantkit output folder was written with (None for any other --model)."""
    if not model or not (Path(model) / "config.json").is_file():
        return None
    qc = read_quant_config(Path(model), load_config(Path(model) / "config.json"))
    return Recipe.from_dict(qc["recipe"]) if qc else None


def _stored_by_role(model: str | None) -> dict[Role, int] | None:
    """Bytes on disk per role when `model` is a quantkit output folder (None otherwise)."""
    if not model or not Path(model).is_dir():
        return None
    ckpt = Checkpoint.open(model)
    try:
        q = QuantizedFolder.from_checkpoint(ckpt)
        if q is None:
            return None
        out: dict[Role, int] = {}
        for t in q.tensors():
            out[t.role] = out.get(t.role, 0) + q.stored_bytes(t.name)
        return out
    finally:
        ckpt.close()


@app.command("inspect")
def inspect_cmd(
    model: str = typer.Argument(None, help="config.json, checkpoint folder or cached HF id (default: embedded)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
) -> None:
    """The tensor breakdown by role: count, parameters, bytes (a quantized folder: also as stored)."""
    spec = spec_from_path(model)
    counts: dict[Role, int] = {}
    for t in spec.tensors:
        counts[t.role] = counts.get(t.role, 0) + 1
    params, nbytes = spec.params_by_role(), spec.bytes_by_role()
    stored = _stored_by_role(model)
    roles = sorted(counts, key=lambda r: -params.get(r, 0))
    if as_json:
        obj = {
            "model": spec.name, "exact": spec.exact, "total_params": spec.total_params,
            "text_params": spec.text_params, "active_params_per_token": spec.active_params_per_token,
            "roles": {r.value: {"tensors": counts[r], "params": params.get(r, 0), "bytes": nbytes.get(r, 0),
                                **({"stored_bytes": stored.get(r, 0)} if stored is not None else {})}
                      for r in roles},
        }
        if stored is not None:
            obj["stored_bytes"] = sum(stored.values())
        print(json.dumps(obj, indent=1))
        return
    src = "safetensors headers" if spec.exact else "config.json"
    title = f"{spec.name} (from {src}" + ("; quantized: stored = bytes on disk, bytes = the bf16 original)"
                                          if stored is not None else ")")
    t = Table(title=title, title_justify="left")
    cols = ("role", "tensors", "params", "share", "bytes", "GB") + (("stored", "stored GB") if stored else ())
    for col in cols:
        t.add_column(col, justify="left" if col == "role" else "right")
    total = spec.total_params

    def extra(n: int | None) -> tuple[str, ...]:
        return () if stored is None or n is None else (f"{n:,}", _gb(n))
    for r in roles:
        t.add_row(r.value, str(counts[r]), f"{params.get(r, 0):,}", f"{params.get(r, 0) / total:.1%}",
                  f"{nbytes.get(r, 0):,}", _gb(nbytes.get(r, 0)), *extra(stored.get(r, 0) if stored else None))
    t.add_row(Text("total", "bold"), str(len(spec.tensors)), Text(f"{total:,}", "bold"), "", f"{sum(nbytes.values()):,}",
              _gb(sum(nbytes.values())), *extra(sum(stored.values()) if stored else None))
    print_table(t)
    console.print(f"text model {spec.text_params / 1e9:.3f}B params, about "
                  f"{spec.active_params_per_token / 1e9:.2f}B active per token")
