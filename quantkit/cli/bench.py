"""`quantkit bench <name>`: benchmarks that write reports/ (markdown + JSON, peers side by side)."""

from __future__ import annotations

from pathlib import Path

import typer

from quantkit.cli import app, console

bench_app = typer.Typer(help="Benchmarks that write reports/ (markdown + json).", no_args_is_help=True)
app.add_typer(bench_app, name="bench")


@bench_app.command("quantize")
def bench_quantize(
    reports: Path = typer.Option(Path("reports"), "--reports", help="where bench-quantize.{md,json,png} go"),
    workdir: Path = typer.Option(Path("/tmp/quantkit-bench"), "--workdir", help="generated checkpoints go here"),
    experts: int = typer.Option(128, "--experts", help="experts per layer of the generated checkpoint"),
    layers: int = typer.Option(4, "--layers", help="layers of the generated checkpoint"),
    slab: int = typer.Option(16, "--slab", help="experts of layer 0 the format timings run on"),
    reps: int = typer.Option(2, "--reps", help="repetitions per method (best is reported)"),
    checkpoint: Path = typer.Option(None, "--checkpoint", help="use this realistic-shape checkpoint instead"),
) -> None:
    """Quantizer throughput and error vs bitsandbytes and gguf, and peak RSS of a full run."""
    from quantkit.bench.quantize import run

    d = run(reports, workdir, experts, layers, slab, reps, checkpoint, log=console.print)
    console.print(f"wrote {reports / 'bench-quantize.md'} ({d['seconds']:.0f} s)")


@bench_app.command("serve")
def bench_serve(
    reports: Path = typer.Option(Path("reports"), "--reports", help="where bench-serve.{md,json} go"),
    model: Path = typer.Option(None, "--model", help="checkpoint to serve (default: a tiny int4 one made in --workdir)"),
    workdir: Path = typer.Option(Path("/tmp/quantkit-bench-serve"), "--workdir", help="generated model and server log"),
    clients: int = typer.Option(8, "--clients", help="concurrent clients"),
    requests: int = typer.Option(10, "--requests", help="requests per client"),
    max_tokens: int = typer.Option(16, "--max-tokens", help="tokens generated per request"),
    max_queue: int = typer.Option(4, "--max-queue", help="the server's --max-queue (fewer than clients: 429s)"),
    retries: int = typer.Option(20, "--retries", help="retries of a request after 429 (Retry-After apart)"),
    disconnects: int = typer.Option(3, "--disconnects", help="clients that hang up mid-stream in the fault phase"),
    context: int = typer.Option(None, "--context", help="the server's --context"),
) -> None:
    """Load and fault test of `quantkit serve`: latency percentiles, throughput, RSS before/after."""
    from quantkit.bench.serve import run

    d = run(reports, model, workdir, clients, requests, max_tokens, max_queue, retries, disconnects, context,
            log=console.print)
    for name, ok in d["checks"].items():
        console.print(f"{'PASS' if ok else 'FAIL'} {name}")
    console.print(f"wrote {reports / 'bench-serve.md'}")


@bench_app.command("engines")
def bench_engines(
    reports: Path = typer.Option(Path("reports"), "--reports", help="where bench-engines.{md,json} go"),
    workdir: Path = typer.Option(Path("/tmp/quantkit-bench"), "--workdir", help="generated files go here"),
    layers: int = typer.Option(4, "--layers", help="layers of the generated realistic-shape checkpoint"),
    experts: int = typer.Option(64, "--experts", help="experts per layer of the generated checkpoint"),
    top_k: int = typer.Option(8, "--top-k", help="experts per token"),
    vocab: int = typer.Option(248320, "--vocab", help="vocabulary (embedding and lm_head rows)"),
    threads: int = typer.Option(None, "--threads", help="threads for both engines (default: torch's)"),
    reps: int = typer.Option(2, "--reps", help="decode repetitions per engine (best is reported)"),
    checkpoint: Path = typer.Option(None, "--checkpoint", help="use this bf16 checkpoint instead"),
) -> None:
    """llama.cpp on our GGUF export beside quantkit's runtime: decode tok/s and error vs bf16, same bits."""
    from quantkit.bench.engines import run

    d = run(reports, workdir, layers, experts, top_k, vocab, checkpoint, threads, reps, log=console.print)
    console.print(f"wrote {reports / 'bench-engines.md'} ({d['seconds']:.0f} s)")


@bench_app.command("gguf")
def bench_gguf(
    reports: Path = typer.Option(Path("reports"), "--reports", help="where bench-gguf.{md,json,png} go"),
    workdir: Path = typer.Option(Path("/tmp/quantkit-bench-gguf"), "--workdir", help="generated files go here"),
    threads: int = typer.Option(2, "--threads", help="llama.cpp threads"),
    reps: int = typer.Option(2, "--reps", help="decode repetitions per type (best is reported); 0: KL only"),
) -> None:
    """KL divergence per GGUF type through llama.cpp (with and without an imatrix), size and decode tok/s."""
    from quantkit.bench.gguf import run

    d = run(reports, workdir, threads, reps, log=console.print)
    console.print(f"default type: {d['default']}; wrote {reports / 'bench-gguf.md'} ({d['seconds']:.0f} s)")


@bench_app.command("decode")
def bench_decode(
    reports: Path = typer.Option(Path("reports"), "--reports", help="where bench-decode.{md,json,png} go"),
    workdir: Path = typer.Option(Path("/tmp/quantkit-bench"), "--workdir", help="generated checkpoints go here"),
    layers: int = typer.Option(4, "--layers", help="layers of the generated realistic-shape checkpoint"),
    experts: int = typer.Option(64, "--experts", help="experts per layer of the generated checkpoint"),
    prompt: int = typer.Option(128, "--prompt", help="prompt tokens (one prefill chunk)"),
    decode: int = typer.Option(16, "--decode", help="greedy decode steps per repetition"),
    reps: int = typer.Option(1, "--reps", help="timed repetitions per process (best is kept)"),
    rounds: int = typer.Option(2, "--rounds", help="interleaved rounds over the configurations (best is kept)"),
    threads: int = typer.Option(None, "--threads", help="torch threads in every run (default: torch's)"),
    configs: str = typer.Option(None, "--configs", help="comma-separated subset of the configurations"),
    vocab: int = typer.Option(None, "--vocab", help="vocabulary of the generated checkpoint (default: the tiny "
                              "tokenizer's; 248320 is the real model's)"),
) -> None:
    """Prefill/decode tok/s and peak RSS per format beside transformers bf16, the planner and the bandwidth bound."""
    from quantkit.bench.decode import CONFIGS, run

    names = [c.strip() for c in configs.split(",") if c.strip()] if configs else None
    unknown = [c for c in names or [] if c not in CONFIGS]
    if unknown:
        raise typer.BadParameter(f"unknown configuration(s) {unknown}; choose from {', '.join(CONFIGS)}",
                                 param_hint="--configs")
    d = run(reports, workdir, layers, experts, prompt, decode, reps, names, rounds, threads, vocab,
            log=console.print)
    console.print(f"wrote {reports / 'bench-decode.md'} ({d['seconds']:.0f} s)")
