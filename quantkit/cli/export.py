"""`quantkit export gguf|vllm`: parse, call quantkit.export, render."""

from __future__ import annotations

import shlex
from pathlib import Path

import typer
from rich import box
from rich.table import Table

from quantkit.checkpoint.spec import load_config, parse_text_config
from quantkit.cli import app, console, err_console, print_table
from quantkit.cli.options import GROUP_SIZE, renamed
from quantkit.cli.progress import RichProgress, tensor_progress
from quantkit.errors import QuantkitError
from quantkit.export.compressed_tensors import export_vllm
from quantkit.export.gguf import export_gguf
from quantkit.export.gguf_types import default_type
from quantkit.export.launch import export_serve_line
from quantkit.export.vllm_cpu import TARGETS, check_rest, cpu_backend, target_group
from quantkit.termtext import plural
from quantkit.threads import set_threads

export_app = typer.Typer(help="Export for other engines: GGUF (llama.cpp, Ollama, LM Studio), "
                              "compressed-tensors (vLLM, SGLang).", no_args_is_help=True)
app.add_typer(export_app, name="export")


@export_app.command("gguf")
def export_gguf_cmd(
    src: Path = typer.Argument(..., help="bf16 checkpoint folder or quantkit quantized folder"),
    out: Path = typer.Argument(..., help="the .gguf file to write"),
    type: str = typer.Option(None, "--type", "-t",
                             help="default q4_k_m (measured best 4-bit, reports/bench-gguf.md; mixed without "
                             "llama-cpp-python); mixed (experts Q4_0, rest Q8_0), q8_0, q4_0, mxfp4, f16, bf16, f32, or through "
                             "llama.cpp's quantizer (needs llama-cpp-python): q4_k_m, q4_k_s, q5_k_m, q5_k_s, "
                             "q6_k, q3_k_m, iq4_xs, iq4_nl (experts at the type, attention, linear attention "
                             "and shared expert Q8_0)"),
    imatrix: Path = typer.Option(None, "--imatrix", help="llama.cpp importance-matrix GGUF (llama-imatrix, or "
                                 "quantkit's calibration statistics exported as one) for the llama.cpp types"),
    expert_type: str = typer.Option(None, "--expert-type", help="routed experts' type in mixed: q4_0 (default; "
                                    "MXFP4 when the source experts are MXFP4), mxfp4 or q8_0"),
    old_experts: str = typer.Option(None, "--experts", hidden=True),  # --experts elsewhere counts experts
    mtp_layer: bool = typer.Option(None, "--mtp-layer/--no-mtp-layer", show_default=False,
                                   help="write the MTP layer as llama.cpp's NextN block, for llama-server "
                                   "--spec-type draft-mtp (default: kept, when the source has one)"),
    old_no_mtp: bool = typer.Option(None, "--no-mtp", hidden=True),  # old --no-mtp-layer
    overwrite: bool = typer.Option(False, "--overwrite", help="replace an existing output file"),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="list every tensor"),
    threads: int = typer.Option(None, "--threads", help="CPU threads [default: every physical core]"),
) -> None:
    """Write a GGUF file for llama.cpp / Ollama / LM Studio (architecture qwen35moe)."""
    set_threads(threads)  # torch's pool and llama.cpp's quantizer; a bad count is one line
    experts = renamed(expert_type, old_experts, "--expert-type", "--experts")
    keep_mtp = renamed(mtp_layer, False if old_no_mtp else None, "--no-mtp-layer", "--no-mtp", True)

    note = ""
    if type is None:
        type, note = default_type()
    with tensor_progress(err_console) as p:
        res = export_gguf(src, out, type, overwrite=overwrite, progress=RichProgress(p, "exporting gguf"),
                          expert_type=experts, imatrix=imatrix, mtp=keep_mtp)
    t = Table(box=box.SIMPLE, title=f"{res.path} ({res.nbytes / 1e6:,.1f} MB, {res.seconds:.1f} s)")
    for col in ("tensors", "how", "types"):
        t.add_column(col)
    kinds: dict[str, dict[str, int]] = {}
    for x in res.tensors:
        kinds.setdefault(x.how, {}).setdefault(x.qtype.name, 0)
        kinds[x.how][x.qtype.name] += 1
    for how, types in kinds.items():
        t.add_row(str(sum(types.values())), how, ", ".join(f"{k} {v}" for k, v in sorted(types.items())))
    print_table(t)
    for x in res.tensors:
        if verbose or x.how == "fallback":
            console.print(f"  {x.name}: {x.qtype.name} ({x.how}; {x.note})", highlight=False,
                          soft_wrap=True)  # one line a tensor, whatever the width: people grep it
    tok = res.tokenizer
    console.print(f"tokenizer: {tok['tokens']} tokens, {tok['merges']} merges, pre-tokenizer {tok['pre']}, "
                  f"chat template {'yes' if tok['chat_template'] else 'no'}", highlight=False)
    for n in [*res.notes, note] if note else res.notes:
        console.print(f"note: {n}", highlight=False)


@export_app.command("vllm")
def export_vllm_cmd(
    src: Path = typer.Argument(..., help="bf16 checkpoint folder or quantkit quantized folder"),
    out: Path = typer.Argument(..., help="the folder to write"),
    group_size: int = typer.Option(None, "--group-size", parser=GROUP_SIZE,
                                   help="int4 group size for the experts (32, 64, 128); "
                                   "default: the source's, else 128; 128 for vLLM CPU (--target cpu)"),
    rest: str = typer.Option("bf16", "--rest", help="bf16 (every non-expert tensor) or int8 (attention, linear "
                             "attention and shared expert int8 per channel; GPUs only)"),
    target: str = typer.Option(None, "--target", show_default=False,
                               help="where vLLM runs it: gpu (the vllm package; --rest int8 loads there) or cpu "
                               "(vLLM's CPU build, vllm-cpu; --rest bf16 only) (default: this machine's: gpu with "
                               "a CUDA GPU, else cpu)"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace an existing output folder"),
    threads: int = typer.Option(None, "--threads", help="CPU threads [default: every physical core]"),
) -> None:
    """Write a compressed-tensors pack-quantized folder for vLLM / SGLang (experts int4, unfused)."""
    set_threads(threads)  # a bad count is one line
    target = vllm_target(target)
    check_rest(rest, target)  # before anything is written
    prefer = target_group(group_size, target)
    if target == "cpu":
        console.print(f"target: vLLM CPU. {cpu_backend().note}", highlight=False)

    with tensor_progress(err_console) as p:
        res = export_vllm(src, out, group_size=group_size, rest=rest, overwrite=overwrite,
                          progress=RichProgress(p, "exporting compressed-tensors"), prefer_group=prefer)
    t = Table(box=box.SIMPLE, title=f"{res.path} ({res.nbytes / 1e6:,.1f} MB in {plural(res.shards, 'shard')}, "
                                    f"{res.seconds:.1f} s)")
    t.add_column("source tensors")
    t.add_column("as")
    t.add_column("how")
    for key, n in sorted(res.counts().items()):
        kind, how = key.split(":")
        t.add_row(str(n), kind, how)
    print_table(t)
    tc = parse_text_config(load_config(res.path / "config.json"), str(res.path / "config.json"))
    line, notes = export_serve_line(tc, shlex.quote(str(res.path)), target, tc.mtp_num_hidden_layers > 0)
    console.print(f"experts int4 symmetric group {res.group_size}; rest {res.rest}. Serve with "
                  f"{'vLLM CPU (vllm-cpu)' if target == 'cpu' else 'vLLM on GPUs'}:", highlight=False)
    console.print(line, highlight=False, soft_wrap=True)  # one line, whatever the width: people copy it
    if prefer is not None and res.group_size != prefer:
        notes.append(f"the experts' rows do not split into groups of {prefer}, the group vLLM CPU's MoE kernels "
                     f"load: this folder (group {res.group_size}) may not start there")
    for n in [*notes, *res.notes]:
        console.print(f"note: {n}", highlight=False)


def vllm_target(target: str | None) -> str:
    """--target checked, or this machine's: gpu where torch sees a CUDA GPU, else cpu."""
    if target is None:
        import torch

        return "gpu" if torch.cuda.is_available() else "cpu"
    if target.lower() not in TARGETS:
        raise QuantkitError(f"--target {target!r}: use gpu or cpu")
    return target.lower()
