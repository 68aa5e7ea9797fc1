"""`quantkit tiny-model OUT_DIR`: parse, call quantkit.testing.tiny.make_tiny_model, render."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.progress import (
    BarColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from quantkit.cli import app, console
from quantkit.cli.options import COUNT, SEED
from quantkit.testing.tiny import SIDECAR, TinyOptions, estimate_bytes, make_tiny_model


@app.command("tiny-model")
def tiny_model(
    out_dir: Path = typer.Argument(..., help="folder to write (refused if it exists and is not empty)"),
    layers: int = typer.Option(4, "--layers", parser=COUNT,
                               help="decoder layers (3 linear-attention + 1 full, repeated)"),
    experts: int = typer.Option(None, "--experts", parser=COUNT,
                                help="routed experts per layer [default: 8; 32 realistic]"),
    top_k: int = typer.Option(None, "--top-k", parser=COUNT,
                              help="experts per token [default: 2; 8 realistic]"),
    hidden: int = typer.Option(64, "--hidden", parser=COUNT, help="hidden size (tiny mode; multiple of 16)"),
    intermediate: int = typer.Option(32, "--intermediate", parser=COUNT,
                                     help="expert intermediate size (tiny mode)"),
    layout: str = typer.Option("published", "--layout", help="published (fused experts) or transformers"),
    mtp: bool = typer.Option(False, "--mtp/--no-mtp", help="include the MTP layer (published layout)"),
    decisive: bool = typer.Option(False, "--decisive", help="routing and top-1 robust to quantization"),
    realistic: bool = typer.Option(False, "--realistic", help="real hidden/expert/head sizes, for benchmarks"),
    seed: int = typer.Option(0, "--seed", parser=SEED),
    dtype: str = typer.Option("bfloat16", "--dtype", help="bfloat16, float16 or float32"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace a non-empty OUT_DIR"),
) -> None:
    """Write a small random checkpoint of the real qwen3_5_moe architecture, with a working tokenizer."""
    import transformers


    transformers.logging.set_verbosity_error()  # its missing-fast-kernel notices are noise here
    experts = experts if experts is not None else (32 if realistic else 8)
    top_k = top_k if top_k is not None else (min(8, experts) if realistic else min(2, experts))
    kw = dict(layers=layers, experts=experts, top_k=top_k, hidden=hidden, intermediate=intermediate, layout=layout,
              mtp=mtp, decisive=decisive, realistic=realistic, seed=seed, dtype=dtype, overwrite=overwrite)
    if realistic:
        with Progress(TextColumn("{task.description}"), BarColumn(), TransferSpeedColumn(), TimeElapsedColumn(),
                      TimeRemainingColumn(),
                      console=console, transient=True) as prog:
            opts = {k: v for k, v in kw.items() if k != "overwrite"}
            task = prog.add_task("generating tensors", total=estimate_bytes(TinyOptions(**opts)))
            out = make_tiny_model(out_dir, **kw, on_tensor=lambda _n, b: prog.advance(task, b))
    else:
        out = make_tiny_model(out_dir, **kw)
    size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    console.print(f"wrote {out} ({layout} layout, {layers} layers, {experts} experts, "
                  f"{size / 1e6:.1f} MB of safetensors)")
    info = json.loads((out / SIDECAR).read_text())
    if "decisive" in info:
        d = info["decisive"]
        console.print(f"decisive: min router gap {min(d['router']['min_gap_per_layer']):.3f} logits "
                      f"(relative {min(d['router']['min_rel_gap_per_layer']):.2f}); top-1 agreement under "
                      f"2% weight noise {d['check_2pct']['top1_agreement']:.3f}, under 10% "
                      f"{d['check_10pct']['top1_agreement']:.3f}")
