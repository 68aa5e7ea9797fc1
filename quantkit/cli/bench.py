"""`quantkit bench <name>`: benchmarks that write reports/ (markdown + JSON, peers side by side)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import typer

from quantkit.bench import calibrated as calibrated_bench
from quantkit.bench import decode as decode_bench
from quantkit.bench import engines as engines_bench
from quantkit.bench import full_size as full_size_bench
from quantkit.bench import gguf as gguf_bench
from quantkit.bench import gpu as gpu_bench
from quantkit.bench import kernel as kernel_bench
from quantkit.bench import mtp as mtp_bench
from quantkit.bench import quantize as quantize_bench
from quantkit.bench import serve as serve_bench
from quantkit.bench import serve_slots as serve_slots_bench
from quantkit.bench import session as session_bench
from quantkit.bench import soak as soak_bench
from quantkit.cli import DEV_PANEL, app, console, fail
from quantkit.cli.bench_options import BenchGroup, command, shared
from quantkit.cli.options import CONTEXT, COUNT, COUNT0, FRACTION, MAX_COUNT, MAX_TOKENS, SECONDS, count
from quantkit.errors import QuantkitError
from quantkit.outputs import guard_output, json_with_keys
from quantkit.threads import resolve_threads


def _is_bench_report(p: Path) -> bool:
    """An `owned` test: a report a bench wrote: its JSON (it records the command), or a markdown or PNG file
    beside such a JSON."""
    return json_with_keys("command")(p if p.suffix == ".json" else p.with_suffix(".json"))


def _guard_reports(ctx: typer.Context | object, reports: Path) -> Path:
    """--reports: the files this bench writes there go through the output guard before it runs (a file of the
    same name that a bench did not write is never replaced)."""
    for ext in (".md", ".json", ".png"):
        guard_output(reports / f"bench-{ctx.info_name}{ext}", overwrite=True, owned=_is_bench_report,
                     create_parents=True, flag="--reports ")
    return reports


def _shared(ctx: typer.Context) -> SimpleNamespace:
    """The shared options of this bench (bench_options), its reports folder guarded."""
    try:
        o = shared(ctx)
    except QuantkitError as e:
        fail(str(e))
        raise
    _guard_reports(ctx, o.reports)
    return o


bench_app = typer.Typer(help="Benchmarks that write reports/ (markdown + json).\n\nThe shared options below go "
                        "before or after the bench's name; each bench's help lists those it takes.",
                        no_args_is_help=True, cls=BenchGroup)
app.add_typer(bench_app, name="bench", rich_help_panel=DEV_PANEL)


@bench_app.callback()
def bench_options(
    reports: Path = typer.Option(None, "--reports", show_default=False,
                                 help="where the bench writes bench-NAME.{md,json,png} (default: reports)"),
    workdir: Path = typer.Option(None, "--workdir", help="generated checkpoints and files go here "
                                 "(default: the bench's own under /tmp)"),
    threads: int = typer.Option(None, "--threads", help="CPU threads (default: every physical core)"),
    reps: int = typer.Option(None, "--reps", parser=COUNT0, help="timed repetitions per point (the best is kept)"),
    rounds: int = typer.Option(None, "--rounds", parser=COUNT,
                               help="interleaved rounds over every engine or configuration (the best is kept)"),
    layers: int = typer.Option(None, "--layers", parser=COUNT, help="decoder layers of the generated checkpoint"),
    experts: int = typer.Option(None, "--experts", parser=COUNT,
                                help="routed experts per layer of the generated checkpoint"),
    vocab: int = typer.Option(None, "--vocab", parser=COUNT,
                              help="vocabulary rows of the generated checkpoint (248320: the real model's)"),
    model: Path = typer.Option(None, "--model", help="a checkpoint or quantized folder to run instead of "
                               "generating one"),
    prompt_tokens: int = typer.Option(None, "--prompt-tokens", parser=COUNT, help="prompt tokens (the prefill "
                                      "timed)"),
    new_tokens: int = typer.Option(None, "--new-tokens", parser=COUNT, help="greedy tokens generated per run"),
    llama: bool = typer.Option(None, "--llama/--no-llama", show_default=False,
                               help="run llama.cpp beside quantkit"),
) -> None:
    """Benchmarks that write reports/ (markdown + json)."""


@command(bench_app, "quantize", workdir=Path("/tmp/quantkit-bench"), experts=128, layers=4, reps=2, model=None)
def bench_quantize(
    ctx: typer.Context,
    slab: int = typer.Option(16, "--slab", parser=COUNT, help="experts of layer 0 the format timings run on"),
    large_layers: int = typer.Option(0, "--large-layers", parser=COUNT0,
                                     help="also time file to file on a generated checkpoint of this many layers "
                                          "(same experts), where fixed start-up costs amortise; 0: not"),
) -> None:
    """Quantizer throughput and error vs bitsandbytes and gguf, peak RSS of a full run, and file to file against
    llama.cpp's quantizer.

    --model: a realistic-shape checkpoint instead of the generated one."""
    o = _shared(ctx)
    d = quantize_bench.run(o.reports, o.workdir, o.experts, o.layers, slab, o.reps, o.model, log=console.print,
                           large_layers=large_layers)
    console.print(f"wrote {o.reports / 'bench-quantize.md'} ({d['seconds']:.0f} s)")


@command(bench_app, "serve", workdir=Path("/tmp/quantkit-bench-serve"), model=None, threads=None)
def bench_serve(
    ctx: typer.Context,
    clients: str = typer.Option("8", "--clients",
                                help="concurrent clients; a list (1,2,4,8) measures `serve --parallel N` per count "
                                "instead: total tok/s, time to first token and between tokens, a fifth client's long "
                                "prompt while four decode (reports/bench-serve-slots.json)"),
    llama_server: Path = typer.Option(None, "--llama-server", help="with a --clients list: llama-server binary "
                                      "run with -np N on the GGUF export of the same codes (default: quantkit alone)"),
    requests: int = typer.Option(10, "--requests", parser=COUNT, help="requests per client"),
    max_tokens: int = typer.Option(16, "--max-tokens", parser=MAX_TOKENS, help="tokens generated per request"),
    max_queue: int = typer.Option(4, "--max-queue", parser=COUNT,
                                  help="the server's --max-queue (fewer than clients: 429s)"),
    retries: int = typer.Option(20, "--retries", parser=COUNT0,
                                help="retries of a request after 429 (Retry-After apart)"),
    disconnects: int = typer.Option(3, "--disconnects", parser=COUNT0,
                                    help="clients that hang up mid-stream in the fault phase"),
    context: int = typer.Option(None, "--context", "-c", parser=CONTEXT, help="the server's --context (e.g. 32k)"),
) -> None:
    """Load and fault test of `quantkit serve`: latency percentiles, throughput, RSS before/after.

    --model: the checkpoint to serve (default: a tiny int4 one made in --workdir)."""
    o = _shared(ctx)
    counts = serve_slots_bench.parse_clients(clients)
    if len(counts) > 1 or llama_server is not None:
        d = serve_slots_bench.run(o.reports, o.model, o.workdir, counts, max_tokens, context or 4096,
                                  None if o.threads is None else _threads(o.threads), llama_server, log=console.print)
        console.print(f"wrote {o.reports / 'bench-serve.md'} and {o.reports / 'bench-serve-slots.json'}")
        return
    d = serve_bench.run(o.reports, o.model, o.workdir, counts[0], requests, max_tokens, max_queue, retries,
                        disconnects, context, log=console.print)
    for name, ok in d["checks"].items():
        console.print(f"{'PASS' if ok else 'FAIL'} {name}")
    console.print(f"wrote {o.reports / 'bench-serve.md'}")


def _threads(n: int | None) -> int:
    """--threads checked (one-line error for 0 or more than this machine has); default every physical core."""
    try:
        return resolve_threads(n)
    except QuantkitError as e:
        fail(str(e))
        raise


def _llama_builds(values: list[str]) -> dict[str, Path]:
    """--llama-build NAME=FOLDER checked: NAME a kernel table quantkit runs here, FOLDER a llama.cpp build."""
    from quantkit.bench.llama_worker import library_dir
    from quantkit.runtime import cpu_kernel

    mod = cpu_kernel.module()
    tables = list(mod.tables()) if mod else []
    out: dict[str, Path] = {}
    for v in values:
        name, sep, folder = v.partition("=")
        if not sep or not name or not folder:
            fail(f"--llama-build {v!r}: give NAME=FOLDER, e.g. avx2=.cache/llama-cpp-avx2")
        if name not in tables:
            fail(f"--llama-build {v!r}: {name!r} is not a kernel table this CPU runs ({', '.join(tables) or 'none'})")
        try:
            library_dir(Path(folder))
        except QuantkitError as e:
            fail(str(e))
        out[name] = Path(folder)
    return out


def _isas(value: str | None) -> list[str] | None:
    """--isa checked: known names this CPU (and build) can run, else one line and exit 2."""
    if value is None:
        return None
    from quantkit.runtime import cpu_kernel

    names = [v.strip().lower() for v in value.split(",") if v.strip()]
    mod = cpu_kernel.module()
    best = mod.detect_isa() if mod else -1
    for n in names or [value]:
        if n not in cpu_kernel.ISA_LEVELS:
            fail(f"--isa {value!r}: {n!r} is not one of {', '.join(cpu_kernel.ISA_LEVELS)}")
        if cpu_kernel.ISA_LEVELS[n] > best:
            fail(f"--isa {n}: this CPU (or this build of the kernel) cannot run it; leave it out")
    return list(dict.fromkeys(names))


@command(bench_app, "soak", workdir=Path("/tmp/quantkit-bench-serve"), model=None)
def bench_soak(
    ctx: typer.Context,
    clients: int = typer.Option(16, "--clients", parser=COUNT, help="concurrent clients"),
    seconds: float = typer.Option(120, "--seconds", parser=SECONDS, help="how long the soak runs"),
    max_queue: int = typer.Option(8, "--max-queue", parser=COUNT, help="the server's --max-queue"),
) -> None:
    """Soak `quantkit serve`: clients, hang-ups, oversized bodies, foreign hosts; /health and RSS watched.

    Writes bench-soak.json and its section of bench-serve.md."""
    o = _shared(ctx)
    d = soak_bench.run_soak(o.model, o.workdir, clients, seconds, max_queue, log=console.print)
    soak_bench.write_report(o.reports, d)
    for name, ok in d["checks"].items():
        console.print(f"{'PASS' if ok else 'FAIL'} {name}")
    r = d["rss"]
    console.print(f"{d['requests']} requests; RSS {r['start'] / 1e6:.0f} -> peak {r['peak'] / 1e6:.0f} -> "
                  f"{r['end'] / 1e6:.0f} MB; wrote {o.reports / 'bench-serve.md'}")
    if not all(d["checks"].values()):
        raise typer.Exit(1)


@command(bench_app, "engines", workdir=Path("/tmp/quantkit-bench"), layers=4, experts=64, vocab=248320,
         threads=None, reps=2, rounds=3, model=None, prompt_tokens=64)
def bench_engines(
    ctx: typer.Context,
    experts_per_token: int = typer.Option(8, "--experts-per-token", parser=COUNT,
                                          help="routed experts each token uses in the generated checkpoint"),
    isa: str = typer.Option(None, "--isa", help="quantkit's kernel at these instruction sets, side by side (comma "
                            "list of generic, avx2, avx512) [default: this CPU's best, and avx2 too on AVX512]"),
    llama_build: list[str] = typer.Option([], "--llama-build", help="NAME=FOLDER: llama.cpp rows from another "
                                          "build of its library too (scripts/build-llama-cpp.sh prints one), "
                                          "paired with quantkit's table NAME"),
) -> None:
    """llama.cpp on our GGUF export beside quantkit's runtime: decode tok/s and error vs bf16, same bits.

    --model: a bf16 checkpoint instead of the generated one."""
    o = _shared(ctx)
    threads = _threads(o.threads)
    d = engines_bench.run(o.reports, o.workdir, o.layers, o.experts, experts_per_token, o.vocab, o.model, threads,
                          o.reps, rounds=o.rounds, isas=_isas(isa), llama_builds=_llama_builds(llama_build),
                          prompt_tokens=o.prompt_tokens, log=console.print)
    console.print(f"wrote {o.reports / 'bench-engines.md'} ({d['seconds']:.0f} s)")


@command(bench_app, "mtp", workdir=Path("/tmp/quantkit-bench"), layers=4, experts=64, vocab=248320,
         new_tokens=mtp_bench.NEW_TOKENS, reps=2, rounds=2, threads=None)
def bench_mtp(
    ctx: typer.Context,
    draft_vocab: int = typer.Option(None, "--draft-vocab", min=0, max=MAX_COUNT, show_default=False,
                                    help="ids the draft head scores besides the top ones (Qwen3.5's most frequent "
                                         "at the default, else the lowest), 0: all (default: the runtime's)"),
    part: str = typer.Option("all", "--part", help="all; oracle: the realistic-shape checkpoint with an oracle "
                             "drafter; trained: a tiny model whose MTP layer is trained first (a real acceptance). "
                             "A part not run keeps its rows from the report already there"),
) -> None:
    """MTP speculative decoding: decode tok/s against draft acceptance (an oracle drafter), a verify's cost, and the
    acceptance of an MTP layer trained on its own model (a tiny one)."""
    if part not in ("all", *mtp_bench.PARTS):
        fail(f"--part {part!r}: use all, {', '.join(mtp_bench.PARTS)}")
    o = _shared(ctx)
    threads = _threads(o.threads)
    d = mtp_bench.run(o.reports, o.workdir, o.layers, o.experts, o.vocab, new_tokens=o.new_tokens, reps=o.reps,
                      rounds=o.rounds, threads=threads, log=console.print,
                      parts=mtp_bench.PARTS if part == "all" else (part,),
                      **({} if draft_vocab is None else {"draft_vocab": draft_vocab}))
    for x in d.get("trained", {}).get("layers", []) if part != "oracle" else []:
        console.print(f"{x['layer']} MTP layer, {mtp_bench.weights_label(x)}: acceptance "
                      + ", ".join(f"{r['acceptance']:.2f} ({r['draft']} draft{'s' if r['draft'] > 1 else ''})"
                                  for r in x["rows"]))
    secs = (d["seconds"] if part != "trained" else 0) + (d["trained"]["seconds"] if part != "oracle" else 0)
    console.print(f"wrote {o.reports / 'bench-mtp.md'} ({secs:.0f} s)")


@command(bench_app, "full-size", workdir=Path("/tmp/quantkit-bench-full-size"), model=None, threads=None,
         layers=None, experts=None, vocab=None, prompt_tokens=full_size_bench.DEFAULTS["prompt_tokens"],
         new_tokens=full_size_bench.DEFAULTS["new_tokens"], reps=full_size_bench.DEFAULTS["reps"], llama=True)
def bench_full_size(
    ctx: typer.Context,
    drop_gguf: bool = typer.Option(False, "--drop-gguf", help="delete the GGUF afterwards (disk)"),
) -> None:
    """The whole 35B shape on this CPU: generated, verified, planned, loaded and measured against the plan and
    llama.cpp, one engine process after the other.

    The generated folder (about 20 GB at full size) and its GGUF (21 GB) go in --workdir; --layers, --experts
    and --vocab shrink it for a trial run; --model: a quantized folder to run instead of generating one."""
    o = _shared(ctx)
    threads = _threads(o.threads)
    if o.model is not None and (o.layers or o.experts or o.vocab):
        fail("--model runs that folder: drop --layers/--experts/--vocab")
    d = full_size_bench.run(o.reports, o.workdir, o.model, threads, o.layers, o.experts, o.vocab, o.prompt_tokens,
                            o.new_tokens, o.reps, o.llama, not drop_gguf, log=console.print)
    for t in d["targets"]:
        console.print(f"{'met' if t['met'] else 'MISSED'}: {t['target']} ({t['ratio']:.2f}x)")
    console.print(f"wrote {o.reports / 'bench-full-size.md'}")


@command(bench_app, "gguf", min_reps=0, workdir=Path("/tmp/quantkit-bench-gguf"), threads=None, reps=2)
def bench_gguf(ctx: typer.Context) -> None:
    """KL divergence per GGUF type through llama.cpp (with and without an imatrix), size and decode tok/s.

    --reps 0: KL only."""
    o = _shared(ctx)
    d = gguf_bench.run(o.reports, o.workdir, _threads(o.threads), o.reps, log=console.print)
    console.print(f"default type: {d['default']}; wrote {o.reports / 'bench-gguf.md'} ({d['seconds']:.0f} s)")


@command(bench_app, "kernel", threads=None, layers=4, new_tokens=24, reps=5)
def bench_kernel(ctx: typer.Context) -> None:
    """One MoE layer at batch-1 decode: quantkit's CPU kernel vs torch's ops vs ggml, and the bandwidth bound.

    --layers: MoE layers with their own weights (tokens read them from DRAM); --new-tokens: tokens per timed
    pass."""
    o = _shared(ctx)
    d = kernel_bench.run(o.reports, _threads(o.threads), o.layers, o.new_tokens, o.reps, log=console.print)
    console.print(f"wrote {o.reports / 'bench-kernel.md'} ({d['seconds']:.0f} s)")


@command(bench_app, "decode", workdir=Path("/tmp/quantkit-bench"), layers=4, experts=64, vocab=None,
         prompt_tokens=128, new_tokens=16, reps=1, rounds=2, threads=None)
def bench_decode(
    ctx: typer.Context,
    configs: str = typer.Option(None, "--configs", help="comma-separated subset of the configurations"),
    spells: float = typer.Option(0.0, "--spells", min=0.0, help="then decode int4 for this many seconds between "
                                 "bandwidth reads, its share of the read grouped by the machine's spells (0: off)"),
) -> None:
    """Prefill/decode tok/s and peak RSS per format beside transformers bf16, the planner and the bandwidth bound.

    --vocab: by default the tiny tokenizer's."""
    o = _shared(ctx)
    threads = _threads(o.threads)
    names = [c.strip() for c in configs.split(",") if c.strip()] if configs else None
    unknown = [c for c in names or [] if c not in decode_bench.CONFIGS]
    if unknown:
        raise typer.BadParameter(f"unknown configuration(s) {unknown}; choose from {', '.join(decode_bench.CONFIGS)}",
                                 param_hint="--configs")
    d = decode_bench.run(o.reports, o.workdir, o.layers, o.experts, o.prompt_tokens, o.new_tokens, o.reps, names,
                         o.rounds, threads, o.vocab, log=console.print, spells_s=spells)
    console.print(f"wrote {o.reports / 'bench-decode.md'} ({d['seconds']:.0f} s)")


@command(bench_app, "session", workdir=Path("/tmp/quantkit-bench"), layers=4, experts=64, threads=None,
         new_tokens=8, llama=True, model=None)
def bench_session(
    ctx: typer.Context,
    turns: int = typer.Option(12, "--turns", parser=count(2), help="agent turns (action + observation) in the "
                              "session"),
    obs_tokens: int = typer.Option(250, "--obs-tokens", parser=COUNT, help="tokens of each recorded observation"),
    baseline_every: int = typer.Option(1, "--baseline-every", parser=COUNT, help="run the re-prefilling baselines "
                                       "(quantkit without reuse, llama.cpp) every N turns, and at the first and last"),
) -> None:
    """A multi-turn agent session: time to first token per turn with and without the prompt cache, and llama.cpp.

    --new-tokens: generated per turn; --model: a bf16 realistic-shape checkpoint instead of the generated one."""
    o = _shared(ctx)
    d = session_bench.run(o.reports, o.workdir, turns, obs_tokens, o.new_tokens, o.layers, o.experts,
                          checkpoint=o.model, threads=_threads(o.threads), llama=o.llama,
                          baseline_every=baseline_every, log=console.print)
    for name, ok in d["checks"].items():
        console.print(f"{'PASS' if ok else 'FAIL'} {name}")
    console.print(f"wrote {o.reports / 'bench-session.md'} ({d['seconds']:.0f} s)")


@command(bench_app, "calibrated")
def bench_calibrated(
    ctx: typer.Context,
    calib_tokens: int = typer.Option(8192, "--calib-tokens", parser=COUNT, help="calibration tokens (default "
                                     "corpus)"),
    eval_tokens: int = typer.Option(4096, "--eval-tokens", parser=COUNT,
                                    help="held-out tokens for perplexity and KLD"),
    realistic_dir: Path = typer.Option(None, "--realistic-dir", help="also time stats + GPTQ per layer on a "
                                       "realistic-shape checkpoint generated here, extrapolated to the 35B"),
) -> None:
    """RTN vs imatrix vs GPTQ on SmolLM2-135M (a real trained model): perplexity and KLD, int4 g128/g32, int8."""
    o = _shared(ctx)
    d = calibrated_bench.run(o.reports, calib_tokens, eval_tokens, log=console.print, realistic_dir=realistic_dir,
                             command="quantkit " + " ".join(sys.argv[1:]))
    console.print(f"wrote {o.reports / 'bench-calibrated.md'} ({d['seconds']:.0f} s)")


@command(bench_app, "gpu", workdir=Path("/tmp/quantkit-bench-gpu"), layers=4, experts=64, prompt_tokens=32,
         new_tokens=32)
def bench_gpu(
    ctx: typer.Context,
    scheme: str = typer.Option("int4", "--scheme", "-s", help="the quantization of the checkpoint (int4: experts "
                               "int4)"),
    cpu_share: float = typer.Option(0.5, "--cpu-share", parser=FRACTION,
                                    help="share of the expert bytes the GPU+CPU plan leaves in RAM, in (0, 1]"),
) -> None:
    """On a CUDA GPU: plan GPU alone and GPU+CPU, load, decode with and without CUDA graphs, check against the CPU."""
    o = _shared(ctx)
    d = gpu_bench.run(o.reports, o.workdir, o.layers, o.experts, o.prompt_tokens, o.new_tokens, scheme, cpu_share,
                      log=console.print)
    for name, ok in d.checks.items():
        console.print(f"{'PASS' if ok else 'FAIL'} {name}")
    console.print(f"wrote {o.reports / 'bench-gpu.md'} ({d.seconds:.0f} s)")
    if not all(d.checks.values()):
        raise typer.Exit(1)
