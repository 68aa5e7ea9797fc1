"""`quantkit tiny-model OUT_DIR`: parse, call quantkit.testing.tiny.make_tiny_model, render. `--full-size` is the
published 35B shape; `--quantized RECIPE` writes the quantized folder directly (quantkit.testing.generated);
`--mtp-layer --train-mtp` trains the MTP layer on the model's own greedy continuations (quantkit.testing.mtp_train;
with `--realistic`, its REALISTIC budget)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import typer
from rich.progress import (
    BarColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from quantkit.cli import DEV_PANEL, app, console, err_console, fail
from quantkit.cli.options import COUNT, SEED, renamed
from quantkit.cli.progress import RichProgress, tensor_progress
from quantkit.quantize.run import Interrupted
from quantkit.recipe import build_recipe
from quantkit.testing.mtp_train import REALISTIC, TrainOptions
from quantkit.testing.tiny import FULL_SIZE, SIDECAR, TinyOptions, estimate_bytes, make_tiny_model


@app.command("tiny-model", rich_help_panel=DEV_PANEL)
def tiny_model(
    out_dir: Path = typer.Argument(..., help="folder to write (refused if it exists and is not empty)"),
    layers: int = typer.Option(None, "--layers", parser=COUNT,
                               help="decoder layers (3 linear-attention + 1 full, repeated) [default: 4; 40 full size]"),
    experts: int = typer.Option(None, "--experts", parser=COUNT,
                                help="routed experts per layer [default: 8; 32 realistic; 256 full size]"),
    top_k: int = typer.Option(None, "--experts-per-token", parser=COUNT, show_default=False,
                              help="routed experts each token uses (default: 2; 8 realistic)"),
    old_top_k: int = typer.Option(None, "--top-k", parser=COUNT, hidden=True),  # old --experts-per-token
    hidden: int = typer.Option(64, "--hidden", parser=COUNT, help="hidden size (tiny mode; multiple of 16)"),
    intermediate: int = typer.Option(32, "--intermediate", parser=COUNT,
                                     help="expert intermediate size (tiny mode)"),
    layout: str = typer.Option("published", "--layout", help="published (fused experts) or transformers"),
    mtp_layer: bool = typer.Option(None, "--mtp-layer/--no-mtp-layer", show_default=False,
                                   help="write the MTP layer (published layout) (default: no; yes full size)"),
    old_mtp: bool = typer.Option(None, "--mtp/--no-mtp", hidden=True),  # old --mtp-layer (--mtp N: drafts)
    decisive: bool = typer.Option(False, "--decisive", help="routing and top-1 robust to quantization"),
    realistic: bool = typer.Option(False, "--realistic", help="real hidden/expert/head sizes, for benchmarks"),
    full_size: bool = typer.Option(False, "--full-size",
                                   help="the published 35B shape (40 layers, 256 experts, vocab 248,320); "
                                   "--layers/--experts/--vocab shrink it (tests)"),
    vocab: int = typer.Option(None, "--vocab", parser=COUNT,
                              help="vocabulary rows [default: the tokenizer's; 248,320 full size]"),
    quantized: str = typer.Option(None, "--quantized", help="write the folder `quantkit quantize --scheme RECIPE` "
                                  "would make, generated directly in the stored format (a recipe name, or a "
                                  "JSON recipe file)"),
    resume: bool = typer.Option(False, "--resume", help="continue an interrupted --quantized generation"),
    seed: int = typer.Option(0, "--seed", parser=SEED,
                             help="seed of the random weights (and of the MTP layer's training): the same seed, the "
                             "same checkpoint"),
    dtype: str = typer.Option("bfloat16", "--dtype", help="bfloat16, float16 or float32"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace a non-empty OUT_DIR"),
    train_mtp: bool = typer.Option(False, "--train-mtp", help="with --mtp-layer: train the MTP layer on the model's own "
                                   "greedy continuations (seeded self-distillation), so its drafts are accepted"),
    train_steps: int = typer.Option(None, "--train-steps", parser=COUNT, show_default=False,
                                    help=f"optimizer steps of --train-mtp [default: {TrainOptions.steps}; "
                                    f"{REALISTIC.steps} realistic]"),
) -> None:
    """Write a small random checkpoint of the real qwen3_5_moe architecture, with a working tokenizer."""
    import transformers

    transformers.logging.set_verbosity_error()  # its missing-fast-kernel notices are noise here
    top_k = renamed(top_k, old_top_k, "--experts-per-token", "--top-k")
    mtp = renamed(mtp_layer, old_mtp, "--mtp-layer" if old_mtp is not False else "--no-mtp-layer",
                  "--mtp" if old_mtp is not False else "--no-mtp", False)
    if full_size:
        if train_mtp:
            fail("--train-mtp trains at tiny and --realistic shapes; --full-size has no training budget")
        if decisive or layout != "published" or hidden != 64 or intermediate != 32:
            fail("--full-size is the published shape: drop --decisive/--layout/--hidden/--intermediate")
        realistic = True
        layers = layers if layers is not None else FULL_SIZE["layers"]
        experts = experts if experts is not None else FULL_SIZE["experts"]
        vocab = vocab if vocab is not None else FULL_SIZE["vocab"]
        top_k = top_k if top_k is not None else min(FULL_SIZE["top_k"], experts)
        mtp = True
    layers = layers if layers is not None else 4
    experts = experts if experts is not None else (32 if realistic else 8)
    top_k = top_k if top_k is not None else (min(8, experts) if realistic else min(2, experts))
    recipe = None
    if quantized is not None:
        recipe = build_recipe(recipe_file=quantized) if quantized.lower().endswith(".json") else \
            build_recipe(scheme=quantized)
    elif resume:
        fail("--resume continues a --quantized generation")
    kw = dict(layers=layers, experts=experts, top_k=top_k, hidden=hidden, intermediate=intermediate, layout=layout,
              mtp=mtp, decisive=decisive, realistic=realistic, seed=seed, dtype=dtype, overwrite=overwrite, vocab=vocab)
    if train_mtp:
        base = REALISTIC if realistic else TrainOptions()
        kw["train_mtp"] = replace(base, steps=train_steps or base.steps, seed=seed)
    elif train_steps is not None:
        fail("--train-steps sets the steps of --train-mtp")
    if recipe is not None:
        try:
            with tensor_progress(err_console) as p:
                out = make_tiny_model(out_dir, **kw, quantized=recipe, resume=resume,
                                      progress=RichProgress(p, "generating"))
        except Interrupted as e:
            fail(str(e), 130)
    elif realistic:
        with Progress(TextColumn("{task.description}"), BarColumn(), TransferSpeedColumn(), TimeElapsedColumn(),
                      TimeRemainingColumn(),
                      console=console, transient=True) as prog:
            opts = {k: v for k, v in kw.items() if k not in ("overwrite", "train_mtp")}
            task = prog.add_task("generating tensors", total=estimate_bytes(TinyOptions(**opts)))
            stages: dict[str, TaskID] = {}

            def on_train(stage: str, done: int, total: int) -> None:
                # minutes at realistic shapes: one bar per stage (prompts continued, then steps trained)
                if stage not in stages:
                    what = "continuing prompts" if stage == "continuing" else "training the MTP layer"
                    stages[stage] = prog.add_task(what, total=total)
                prog.update(stages[stage], completed=done)

            out = make_tiny_model(out_dir, **kw, on_tensor=lambda _n, b: prog.advance(task, b), on_train=on_train)
    else:
        out = make_tiny_model(out_dir, **kw)
    size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    what = f"quantized {recipe.name}" if recipe is not None else f"{layout} layout"
    console.print(f"wrote {out} ({what}, {layers} layers, {experts} experts, "
                  f"{size / 1e6:.1f} MB of safetensors)")
    if recipe is not None:
        console.print(f"random weights (a test fixture); check with `quantkit verify {out}`")
        return
    info = json.loads((out / SIDECAR).read_text())
    if "mtp_trained" in info:
        t = info["mtp_trained"]
        console.print(f"MTP layer trained: {t['options']['steps']} steps on {t['pairs']:,} positions of its own "
                      f"greedy continuations; top-1 agreement with the model on them {t['train_agreement']:.2f}, "
                      f"on held-out ones {t['held_out_before']:.2f} -> {t['held_out_after']:.2f} "
                      f"({t['seconds']:.0f} s)")
    if "decisive" in info:
        d = info["decisive"]
        console.print(f"decisive: min router gap {min(d['router']['min_gap_per_layer']):.3f} logits "
                      f"(relative {min(d['router']['min_rel_gap_per_layer']):.2f}); top-1 agreement under "
                      f"2% weight noise {d['check_2pct']['top1_agreement']:.3f}, under 10% "
                      f"{d['check_10pct']['top1_agreement']:.3f}")
