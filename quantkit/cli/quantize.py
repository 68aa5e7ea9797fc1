"""`quantkit quantize` and `quantkit verify`: parse, call quantkit.quantize.run / quantkit.quantize.verify, render."""

from __future__ import annotations

from pathlib import Path

import typer
from rich import box
from rich.table import Table
from rich.text import Text

from quantkit.checkpoint.reader import Checkpoint, resolve_model
from quantkit.checkpoint.spec import Role
from quantkit.cli import app, console, err_console, error_line, fail, print_table
from quantkit.cli.options import GROUP_SIZE, notice, renamed
from quantkit.cli.progress import RichProgress, tensor_progress
from quantkit.fileio import require_regular_file
from quantkit.outputs import free_disk
from quantkit.quantize.calibrated import Calibration
from quantkit.quantize.report import role_rows, total_row
from quantkit.quantize.run import (
    Interrupted,
    QuantizeOptions,
    TensorStats,
    make_plan,
    run_quantize,
)
from quantkit.quantize.stats import Stats
from quantkit.quantize.verify import verify_folder
from quantkit.recipe import build_recipe
from quantkit.sizes import parse_size
from quantkit.termtext import plural
from quantkit.threads import resolve_threads


def parse_shard_size(text: str) -> int:
    """`2GB` (10^9 bytes, as transformers' max_shard_size), `500MB`, `1GiB`, `1048576` (bytes)."""
    return parse_size(text, "--max-shard-size")


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f}"


def _roles_table(rows: list, title: str, measured: bool) -> Table:

    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    cols = ["role", "formats", "tensors", "MB before", "MB after", "bits/w"]
    if measured:
        cols += ["rel. err", "SQNR dB", "out err", "RTN fb", "s"]
    for c in cols:
        t.add_column(c, justify="left" if c in ("role", "formats") else "right")
    for r in [*rows, total_row(rows)]:
        cells = [r.role, r.formats, str(r.count), _mb(r.in_bytes), _mb(r.out_bytes), f"{r.bits_per_weight:.3f}"]
        if measured:
            cells += ["-" if r.rel_error is None else f"{r.rel_error:.4f}",
                      "-" if r.sqnr_db is None else f"{r.sqnr_db:.2f}",
                      "-" if r.out_rel_error is None else f"{r.out_rel_error:.4f}", str(r.fallbacks),
                      f"{r.seconds:.1f}"]
        t.add_row(*cells, style="bold" if r.role == "total" else None)
    return t


def _mtp_note(state: str, n: int) -> str:
    return {"kept": f"MTP layer kept ({n} tensors; --no-mtp-layer drops it)",
            "dropped": f"MTP layer dropped ({n} tensors; without --no-mtp-layer it is kept)"}.get(state, "no MTP layer")


@app.command()
def quantize(
    src: str = typer.Argument(..., help="checkpoint folder (sharded safetensors) or a model in the local HF cache"),
    out: Path = typer.Option(None, "--out", "-o",
                             help="output folder (must not exist, unless --resume/--overwrite)"),
    scheme: str = typer.Option(None, "--scheme", "-s", metavar="NAME|FILE", help="the quantization: a name "
                               "`plan` compares (quality: routed experts int4, attention int8; int4, int8, nf4, "
                               "fp4, mxfp4, bf16) or a JSON recipe file (default: quality)"),
    bits: int = typer.Option(None, "--bits", help="shorthand for --scheme: 4 = quality, 8 = int8"),
    override: list[str] = typer.Option([], "--override",
                                       help="ROLE=SPEC on top of the scheme, e.g. linear_attention=8, lm_head=bf16"),
    # the old ways to name the quantization: each works for one release, with a notice to write --scheme
    fmt: str = typer.Option(None, "--format", hidden=True),
    group_size: int = typer.Option(None, "--group-size", parser=GROUP_SIZE, hidden=True),
    uniform: bool = typer.Option(None, "--uniform", hidden=True),
    recipe_file: str = typer.Option(None, "--recipe", hidden=True),
    mtp_layer: bool = typer.Option(None, "--mtp-layer/--no-mtp-layer", show_default=False,
                                   help="keep the MTP layer (speculative decoding's drafter), quantized by the "
                                   "scheme of its roles (default: kept)"),
    old_no_mtp: bool = typer.Option(None, "--no-mtp", hidden=True),  # old --no-mtp-layer
    old_keep_mtp: bool = typer.Option(None, "--keep-mtp", hidden=True),  # the MTP layer is kept by default now
    resume: bool = typer.Option(False, "--resume", help="continue an interrupted run in --out"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace an earlier quantkit output in --out"),
    report: Path = typer.Option(None, "--report",
                                help="report path (.md, with .json beside it); default in --out"),
    dry_run: bool = typer.Option(False, "--dry-run", help="print the recipe and sizes; write nothing"),
    max_shard_size: str = typer.Option("2GB", "--max-shard-size", help="output shard size bound"),
    method: str = typer.Option("rtn", "--method", help="rtn, imatrix (importance-weighted scales) or gptq"),
    stats_file: Path = typer.Option(None, "--stats", help="statistics from `quantkit stats` (imatrix, gptq; "
                                    "with rtn: only the report's output error)"),
    min_fraction: float = typer.Option(0.005, "--min-expert-tokens",
                                       help="experts routed fewer than this fraction of the tokens get RTN"),
    threads: int = typer.Option(None, "--threads",
                                help="quantizing threads [default: every physical core]; the bytes do not depend on it"),
) -> None:
    """Quantize a checkpoint, streaming, into an HF-style folder with a manifest."""

    if resume and overwrite:
        fail("--resume and --overwrite exclude each other")
    if old_keep_mtp and (old_no_mtp or mtp_layer is False):
        fail("--keep-mtp and --no-mtp-layer exclude each other (the MTP layer is kept by default)")
    if old_keep_mtp:
        err_console.print("notice: --keep-mtp does nothing now: the MTP layer is kept by default "
                          "(--no-mtp-layer drops it); the flag goes in the next release", style="yellow",
                          highlight=False, soft_wrap=True)
    keep_mtp = renamed(mtp_layer, False if old_no_mtp else None, "--no-mtp-layer", "--no-mtp", True)
    old_ways = [flag for flag, value in (("--format", fmt), ("--group-size", group_size), ("--uniform", uniform),
                                         ("--recipe", recipe_file)) if value is not None]
    if scheme and (scheme.lower().endswith(".json") or Path(scheme).is_file()):
        if recipe_file:
            fail("--scheme FILE and --recipe FILE both name a recipe file: give --scheme only")
        scheme, recipe_file = None, scheme
    if out is None and not dry_run:
        fail("--out DIR is required (or --dry-run)")

    if (scheme or recipe_file) and (bits is not None or fmt is not None or uniform or group_size):
        fail("--scheme names the whole recipe: drop --bits/--format/--uniform/--group-size (or --scheme)")
    threads = resolve_threads(threads)  # a bad count is refused before anything is read
    recipe = build_recipe(4 if bits is None else bits, (fmt or "int").lower(), group_size, bool(uniform), override,
                          recipe_file, scheme)
    for flag in old_ways:  # once the recipe they name is known good: a bad value is its one error line
        notice(flag, "--scheme NAME|FILE")
    if stats_file:
        require_regular_file(stats_file, "--stats", "statistics file", "make it with `quantkit stats MODEL --out FILE`")
    calibration = Calibration(method.lower(), Stats.open(stats_file) if stats_file else None, min_fraction)
    shard = parse_shard_size(max_shard_size)
    ckpt = Checkpoint.open(resolve_model(src))
    ckpt.spec()  # the model is refused by the rules plan and inspect use, dry run or not
    if calibration.stats is not None:  # refused before the run: another model's shapes, NaN, forged counts
        calibration.stats.check_model(ckpt)
        calibration.stats.check_all()
    if dry_run:
        plan = make_plan(list(ckpt.canonical()), recipe, keep_mtp, shard)
        console.print(Text.assemble("recipe ", (recipe.name, "bold"), f": {recipe.description}"))
        for role, q in recipe.rules.items():
            console.print(f"  {role.value:17s} {q.format + (f' g{q.group_size}' if q.group_size else '') if q else recipe.keep_dtype}")
        stats = [TensorStats(t.name, t.role.value, t.spec.format if t.spec else t.dtype, t.numel, t.in_bytes,
                             t.out_bytes) for t in plan.tensors]
        print_table(_roles_table(role_rows(stats), f"{src}: dry run, nothing written", measured=False))
        console.print(f"{plural(len(plan.shards), 'shard')} of at most {shard / 1e9:.2f} GB; "
                      + _mtp_note(plan.mtp, len(plan.dropped) or sum(t.role == Role.MTP for t in plan.tensors)))
        for t in plan.tensors:
            if t.note:
                console.print(f"  note: {t.name}: {t.note}")
        if out is not None:
            console.print(f"free disk at {out}: {free_disk(out) / 1e9:.2f} GB; output {plan.out_bytes / 1e9:.2f} GB")
        return
    opts = QuantizeOptions(recipe=recipe, keep_mtp=keep_mtp, max_shard_size=shard,
                           mode="resume" if resume else "overwrite" if overwrite else "new", report=report,
                           calibration=calibration if (stats_file or method.lower() != "rtn") else None,
                           threads=threads)
    try:
        with tensor_progress(err_console) as p:
            res = run_quantize(ckpt, out, opts, RichProgress(p, "quantizing"))
    except Interrupted as e:
        fail(str(e), 130)
    print_table(_roles_table(role_rows(res.stats), f"{out}: {plural(len(res.plan.shards), 'shard')}", measured=True))
    if res.plan.mtp != "absent":
        console.print(_mtp_note(res.plan.mtp, len(res.plan.dropped) or
                                sum(t.role == Role.MTP for t in res.plan.tensors)))
    if res.reused_shards:
        console.print(f"reused {plural(len(res.reused_shards), 'finished shard')} from the interrupted run")
    for t in res.plan.tensors:
        if t.note:
            console.print(f"note: {t.name}: {t.note}")
    console.print(f"report: {res.report_md} and {res.report_json}")
    console.print(f"done in {res.seconds:.1f} s; check with `quantkit verify {out}`")


@app.command()
def verify(
    folder: Path = typer.Argument(..., help="a quantized folder written by `quantkit quantize`"),
    quick: bool = typer.Option(False, "--quick", help="check sizes only, not sha256"),
) -> None:
    """Check a quantized folder against its manifest, index and quantization_config."""

    res = verify_folder(folder, hash_files=not quick)
    if not res.ok:
        for p in res.problems:
            error_line(f"{folder}: {p}")
        raise typer.Exit(1)
    fm = ", ".join(f"{v} {k}" for k, v in sorted(res.formats.items())) or "none"
    console.print(
        f"{folder}: OK: {plural(res.shards, 'shard')}, {plural(res.tensors, 'stored tensor')}, {res.quantized} quantized ({fm}), "
        f"{res.bytes / 1e9:.3f} GB {'checked by size' if quick else 'checked by sha256'}"
    )
