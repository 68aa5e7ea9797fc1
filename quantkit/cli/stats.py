"""`quantkit stats`: parse, call quantkit.quantize.stats (and the imatrix export), render."""

from __future__ import annotations

from pathlib import Path

import typer

from quantkit.checkpoint.reader import Checkpoint, resolve_model
from quantkit.cli import app, console, err_console
from quantkit.cli.export import export_app
from quantkit.cli.options import CHUNK, COUNT, renamed
from quantkit.cli.progress import RichProgress, tensor_progress
from quantkit.outputs import guard_output, has_magic
from quantkit.quantize.calib_data import load_tokens
from quantkit.quantize.imatrix import write_imatrix_gguf
from quantkit.quantize.stats import Stats, collect_stats, routing_coverage
from quantkit.runtime.engine import load_tokenizer
from quantkit.threads import set_threads


@app.command()
def stats(
    src: str = typer.Argument(..., help="bf16 checkpoint folder (or a model in the local HF cache)"),
    out: Path = typer.Option(..., "--out", "-o", help="statistics file to write (safetensors)"),
    data: Path = typer.Option(None, "--data", help="JSONL of chats or a plain-text file; default: quantkit's corpus"),
    calib_tokens: int = typer.Option(None, "--calib-tokens", parser=COUNT, show_default=False,
                                     help="calibration tokens to use at most (default: 16384)"),
    old_max_tokens: int = typer.Option(None, "--max-tokens", parser=COUNT, hidden=True),  # caps generation elsewhere
    chunk_size: int = typer.Option(512, "--chunk-size", parser=CHUNK,
                                   help="tokens per sequence (llama.cpp's imatrix chunk)"),
    heldout: float = typer.Option(0.125, "--heldout", help="fraction of chunks held out for measuring"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace an existing --out file"),
    imatrix: Path = typer.Option(None, "--imatrix", help="also write a llama.cpp imatrix GGUF here"),
    threads: int = typer.Option(None, "--threads", help="CPU threads [default: every physical core]"),
) -> None:
    """Collect activation statistics (Hessians, imatrix, routing counts), one decoder layer at a time;
    an interrupted run resumes when run again with the same arguments."""

    max_tokens = renamed(calib_tokens, old_max_tokens, "--calib-tokens", "--max-tokens", 16384)
    set_threads(threads)  # a bad count is one line, before anything is read
    folder = resolve_model(src)
    if imatrix is not None:  # refused before the long run, not after it
        guard_output(imatrix, sources=[folder, out], overwrite=overwrite, owned=has_magic(b"GGUF"),
                     flag="--imatrix ")
    ckpt = Checkpoint.open(folder)
    tok = load_tokenizer(folder)
    tokens = load_tokens(data, tok, chunk_size, max_tokens)
    console.print(f"calibration data {tokens.source}: {tokens.total_tokens:,} tokens, using {tokens.n_tokens:,} "
                  f"in {tokens.chunks.shape[0]} chunks of {chunk_size}")
    with tensor_progress(err_console) as p:
        res = collect_stats(ckpt, tokens, out, heldout, overwrite, RichProgress(p, "stats"))
    if res.resumed_layers:
        console.print(f"resumed after {res.resumed_layers} finished layers")
    console.print(f"{out}: statistics of {res.layers} layers from {res.n_tokens:,} tokens "
                  f"(+{res.n_heldout:,} held out) in {res.seconds:.1f} s")

    st = Stats.open(out)
    if st.routing():
        cov = [routing_coverage(st, f) for f in (0.125, 0.25, 0.5)]
        console.print("routing profile: the most-routed " + ", ".join(
            f"{c['fraction']:.1%} of (layer, expert) pairs serve {c['in_sample']:.1%} of routed tokens "
            f"({c.get('held_out', float('nan')):.1%} held out)" for c in cov))
    if imatrix is not None:

        write_imatrix_gguf(out, imatrix, ckpt=ckpt, overwrite=overwrite)
        console.print(f"{imatrix}: llama.cpp imatrix (GGUF)")


@export_app.command("imatrix")
def export_imatrix(
    stats_file: Path = typer.Argument(..., help="statistics written by `quantkit stats`"),
    out: Path = typer.Argument(..., help="imatrix GGUF to write (for llama-quantize --imatrix)"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace an existing output file"),
) -> None:
    """Write a statistics file as a llama.cpp imatrix GGUF."""

    write_imatrix_gguf(stats_file, out, overwrite=overwrite)
    console.print(f"{out}: llama.cpp imatrix (GGUF) from {stats_file}")
