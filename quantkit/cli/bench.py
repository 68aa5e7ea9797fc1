"""`quantkit bench <name>`: benchmarks that write reports/ (markdown + JSON, peers side by side)."""

from __future__ import annotations

import sys
from pathlib import Path

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
from quantkit.bench import session as session_bench
from quantkit.bench import soak as soak_bench
from quantkit.cli import app, console, fail
from quantkit.cli.options import CONTEXT, COUNT, COUNT0, FRACTION, MAX_COUNT, MAX_TOKENS, SECONDS, renamed
from quantkit.errors import QuantkitError
from quantkit.outputs import guard_output, json_with_keys
from quantkit.threads import resolve_threads


def _is_bench_report(p: Path) -> bool:
    """An `owned` test: a report a bench wrote: its JSON (it records the command), or a markdown or PNG file
    beside such a JSON."""
    return json_with_keys("command")(p if p.suffix == ".json" else p.with_suffix(".json"))


def _guard_reports(ctx: typer.Context, reports: Path) -> Path:
    """--reports: the files this bench writes there go through the output guard before it runs (a file of the
    same name that a bench did not write is never replaced)."""
    for ext in (".md", ".json", ".png"):
        guard_output(reports / f"bench-{ctx.info_name}{ext}", overwrite=True, owned=_is_bench_report,
                     create_parents=True, flag="--reports ")
    return reports


bench_app = typer.Typer(help="Benchmarks that write reports/ (markdown + json).", no_args_is_help=True)
app.add_typer(bench_app, name="bench")


@bench_app.command("quantize")
def bench_quantize(
    reports: Path = typer.Option(Path("reports"), "--reports", callback=_guard_reports,
                                 help="where bench-quantize.{md,json,png} go"),
    workdir: Path = typer.Option(Path("/tmp/quantkit-bench"), "--workdir",
                                 help="generated checkpoints go here"),
    experts: int = typer.Option(128, "--experts", parser=COUNT,
                                help="experts per layer of the generated checkpoint"),
    layers: int = typer.Option(4, "--layers", parser=COUNT, help="layers of the generated checkpoint"),
    slab: int = typer.Option(16, "--slab", parser=COUNT, help="experts of layer 0 the format timings run on"),
    reps: int = typer.Option(2, "--reps", parser=COUNT, help="repetitions per method (best is reported)"),
    checkpoint: Path = typer.Option(None, "--checkpoint", help="use this realistic-shape checkpoint instead"),
    large_layers: int = typer.Option(0, "--large-layers", parser=COUNT0,
                                     help="also time file to file on a generated checkpoint of this many layers "
                                          "(same experts), where fixed start-up costs amortise; 0: not"),
) -> None:
    """Quantizer throughput and error vs bitsandbytes and gguf, peak RSS of a full run, and file to file against
    llama.cpp's quantizer."""
    d = quantize_bench.run(reports, workdir, experts, layers, slab, reps, checkpoint, log=console.print,
                           large_layers=large_layers)
    console.print(f"wrote {reports / 'bench-quantize.md'} ({d['seconds']:.0f} s)")


@bench_app.command("serve")
def bench_serve(
    reports: Path = typer.Option(Path("reports"), "--reports", callback=_guard_reports,
                                 help="where bench-serve.{md,json} go"),
    model: Path = typer.Option(None, "--model",
                               help="checkpoint to serve (default: a tiny int4 one made in --workdir)"),
    workdir: Path = typer.Option(Path("/tmp/quantkit-bench-serve"), "--workdir",
                                 help="generated model and server log"),
    clients: int = typer.Option(8, "--clients", parser=COUNT, help="concurrent clients"),
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
    """Load and fault test of `quantkit serve`: latency percentiles, throughput, RSS before/after."""
    d = serve_bench.run(reports, model, workdir, clients, requests, max_tokens, max_queue, retries, disconnects, context,
            log=console.print)
    for name, ok in d["checks"].items():
        console.print(f"{'PASS' if ok else 'FAIL'} {name}")
    console.print(f"wrote {reports / 'bench-serve.md'}")


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


@bench_app.command("soak")
def bench_soak(
    reports: Path = typer.Option(Path("reports"), "--reports", callback=_guard_reports,
                                 help="where bench-soak.json and bench-serve.md go"),
    model: Path = typer.Option(None, "--model",
                               help="checkpoint to serve (default: a tiny int4 one made in --workdir)"),
    workdir: Path = typer.Option(Path("/tmp/quantkit-bench-serve"), "--workdir",
                                 help="generated model and server log"),
    clients: int = typer.Option(16, "--clients", parser=COUNT, help="concurrent clients"),
    seconds: float = typer.Option(120, "--seconds", parser=SECONDS, help="how long the soak runs"),
    max_queue: int = typer.Option(8, "--max-queue", parser=COUNT, help="the server's --max-queue"),
) -> None:
    """Soak `quantkit serve`: clients, hang-ups, oversized bodies, foreign hosts; /health and RSS watched."""
    d = soak_bench.run_soak(model, workdir, clients, seconds, max_queue, log=console.print)
    soak_bench.write_report(reports, d)
    for name, ok in d["checks"].items():
        console.print(f"{'PASS' if ok else 'FAIL'} {name}")
    r = d["rss"]
    console.print(f"{d['requests']} requests; RSS {r['start'] / 1e6:.0f} -> peak {r['peak'] / 1e6:.0f} -> "
                  f"{r['end'] / 1e6:.0f} MB; wrote {reports / 'bench-serve.md'}")
    if not all(d["checks"].values()):
        raise typer.Exit(1)


@bench_app.command("engines")
def bench_engines(
    reports: Path = typer.Option(Path("reports"), "--reports", callback=_guard_reports,
                                 help="where bench-engines.{md,json} go"),
    workdir: Path = typer.Option(Path("/tmp/quantkit-bench"), "--workdir", help="generated files go here"),
    layers: int = typer.Option(4, "--layers", parser=COUNT,
                               help="layers of the generated realistic-shape checkpoint"),
    experts: int = typer.Option(64, "--experts", parser=COUNT,
                                help="experts per layer of the generated checkpoint"),
    top_k: int = typer.Option(8, "--top-k", parser=COUNT, help="experts per token"),
    vocab: int = typer.Option(248320, "--vocab", parser=COUNT, help="vocabulary (embedding and lm_head rows)"),
    threads: int = typer.Option(None, "--threads", help="threads for both engines [default: every physical core]"),
    reps: int = typer.Option(2, "--reps", parser=COUNT,
                             help="decode repetitions per engine and round (best is reported)"),
    rounds: int = typer.Option(3, "--rounds", parser=COUNT,
                               help="rounds, each running every engine once (interleaved; best is reported)"),
    checkpoint: Path = typer.Option(None, "--checkpoint", help="use this bf16 checkpoint instead"),
    isa: str = typer.Option(None, "--isa", help="quantkit's kernel at these instruction sets, side by side (comma "
                            "list of generic, avx2, avx512) [default: this CPU's best, and avx2 too on AVX512]"),
    llama_build: list[str] = typer.Option([], "--llama-build", help="NAME=FOLDER: llama.cpp rows from another "
                                          "build of its library too (scripts/build-llama-cpp.sh prints one), "
                                          "paired with quantkit's table NAME"),
    prompt: int = typer.Option(64, "--prompt", parser=COUNT, help="prompt tokens (the prefill timed)"),
) -> None:
    """llama.cpp on our GGUF export beside quantkit's runtime: decode tok/s and error vs bf16, same bits."""
    threads = _threads(threads)
    d = engines_bench.run(reports, workdir, layers, experts, top_k, vocab, checkpoint, threads, reps,
                          rounds=rounds, isas=_isas(isa), llama_builds=_llama_builds(llama_build),
                          prompt_tokens=prompt, log=console.print)
    console.print(f"wrote {reports / 'bench-engines.md'} ({d['seconds']:.0f} s)")


@bench_app.command("mtp")
def bench_mtp(
    reports: Path = typer.Option(Path("reports"), "--reports", callback=_guard_reports,
                                 help="where bench-mtp.{md,json,png} go"),
    workdir: Path = typer.Option(Path("/tmp/quantkit-bench"), "--workdir", help="generated files go here"),
    layers: int = typer.Option(4, "--layers", parser=COUNT, help="layers of the generated realistic-shape checkpoint"),
    experts: int = typer.Option(64, "--experts", parser=COUNT, help="experts per layer of the generated checkpoint"),
    vocab: int = typer.Option(248320, "--vocab", parser=COUNT, help="vocabulary (embedding and lm_head rows)"),
    new_tokens: int = typer.Option(mtp_bench.NEW_TOKENS, "--new-tokens", parser=COUNT,
                                   help="greedy tokens per generation"),
    reps: int = typer.Option(2, "--reps", parser=COUNT, help="generations per point and round (best is reported)"),
    rounds: int = typer.Option(2, "--rounds", parser=COUNT, help="rounds over every point (interleaved)"),
    threads: int = typer.Option(None, "--threads", help="CPU threads [default: every physical core]"),
    draft_vocab: int = typer.Option(None, "--draft-vocab", min=0, max=MAX_COUNT, show_default=False,
                                    help="ids the draft head scores besides the top ones (Qwen3.5's most frequent at the default, else the lowest), 0: all "
                                         "[default: the runtime's]"),
    part: str = typer.Option("all", "--part", help="all; oracle: the realistic-shape checkpoint with an oracle "
                             "drafter; trained: a tiny model whose MTP layer is trained first (a real acceptance). "
                             "A part not run keeps its rows from the report already there"),
) -> None:
    """MTP speculative decoding: decode tok/s against draft acceptance (an oracle drafter), a verify's cost, and the
    acceptance of an MTP layer trained on its own model (a tiny one)."""
    if part not in ("all", *mtp_bench.PARTS):
        fail(f"--part {part!r}: use all, {', '.join(mtp_bench.PARTS)}")
    threads = _threads(threads)
    d = mtp_bench.run(reports, workdir, layers, experts, vocab, new_tokens=new_tokens, reps=reps, rounds=rounds,
                      threads=threads, log=console.print,
                      parts=mtp_bench.PARTS if part == "all" else (part,),
                      **({} if draft_vocab is None else {"draft_vocab": draft_vocab}))
    for x in d.get("trained", {}).get("layers", []) if part != "oracle" else []:
        console.print(f"{x['layer']} MTP layer, {mtp_bench.weights_label(x)}: acceptance "
                      + ", ".join(f"{r['acceptance']:.2f} ({r['draft']} draft{'s' if r['draft'] > 1 else ''})"
                                  for r in x["rows"]))
    secs = (d["seconds"] if part != "trained" else 0) + (d["trained"]["seconds"] if part != "oracle" else 0)
    console.print(f"wrote {reports / 'bench-mtp.md'} ({secs:.0f} s)")


@bench_app.command("full-size")
def bench_full_size(
    reports: Path = typer.Option(Path("reports"), "--reports", callback=_guard_reports,
                                 help="where bench-full-size.{md,json} go"),
    workdir: Path = typer.Option(Path("/tmp/quantkit-bench-full-size"), "--workdir",
                                 help="the generated folder (about 20 GB at full size), its GGUF (21 GB) and the "
                                 "children's files go here"),
    folder: Path = typer.Option(None, "--folder", help="a quantized folder to run instead of generating one"),
    threads: int = typer.Option(None, "--threads", help="threads for both engines [default: every CPU]"),
    layers: int = typer.Option(None, "--layers", parser=COUNT, help="shrink the generated model (a trial run)"),
    experts: int = typer.Option(None, "--experts", parser=COUNT, help="shrink the generated model (a trial run)"),
    vocab: int = typer.Option(None, "--vocab", parser=COUNT, help="shrink the generated model (a trial run)"),
    prompt_tokens: int = typer.Option(full_size_bench.DEFAULTS["prompt_tokens"], "--prompt-tokens", parser=COUNT,
                                      help="the chat prompt whose TTFT is measured"),
    new_tokens: int = typer.Option(full_size_bench.DEFAULTS["new_tokens"], "--new-tokens", parser=COUNT,
                                   help="greedy tokens per generation"),
    reps: int = typer.Option(full_size_bench.DEFAULTS["reps"], "--reps", parser=COUNT, help="short-prompt decode runs"),
    llama: bool = typer.Option(True, "--llama/--no-llama", help="export the GGUF and run llama.cpp beside"),
    drop_gguf: bool = typer.Option(False, "--drop-gguf", help="delete the GGUF afterwards (disk)"),
) -> None:
    """The whole 35B shape on this CPU: generated, verified, planned, loaded and measured against the plan and
    llama.cpp, one engine process after the other."""
    threads = _threads(threads)
    if folder is not None and (layers or experts or vocab):
        fail("--folder runs that folder: drop --layers/--experts/--vocab")
    d = full_size_bench.run(reports, workdir, folder, threads, layers, experts, vocab, prompt_tokens, new_tokens,
                            reps, llama, not drop_gguf, log=console.print)
    for t in d["targets"]:
        console.print(f"{'met' if t['met'] else 'MISSED'}: {t['target']} ({t['ratio']:.2f}x)")
    console.print(f"wrote {reports / 'bench-full-size.md'}")


@bench_app.command("gguf")
def bench_gguf(
    reports: Path = typer.Option(Path("reports"), "--reports", callback=_guard_reports,
                                 help="where bench-gguf.{md,json,png} go"),
    workdir: Path = typer.Option(Path("/tmp/quantkit-bench-gguf"), "--workdir", help="generated files go here"),
    threads: int = typer.Option(None, "--threads", help="llama.cpp threads [default: every physical core]"),
    reps: int = typer.Option(2, "--reps", help="decode repetitions per type (best is reported); 0: KL only"),
) -> None:
    """KL divergence per GGUF type through llama.cpp (with and without an imatrix), size and decode tok/s."""
    d = gguf_bench.run(reports, workdir, _threads(threads), reps, log=console.print)
    console.print(f"default type: {d['default']}; wrote {reports / 'bench-gguf.md'} ({d['seconds']:.0f} s)")


@bench_app.command("kernel")
def bench_kernel(
    reports: Path = typer.Option(Path("reports"), "--reports", callback=_guard_reports,
                                 help="where bench-kernel.{md,json} go"),
    threads: int = typer.Option(None, "--threads", help="threads for every route [default: every physical core]"),
    layers: int = typer.Option(4, "--layers", help="MoE layers with their own weights (tokens read them from DRAM)"),
    tokens: int = typer.Option(24, "--tokens", help="tokens per timed pass"),
    reps: int = typer.Option(5, "--reps", help="timed passes per route (best is reported)"),
) -> None:
    """One MoE layer at batch-1 decode: quantkit's CPU kernel vs torch's ops vs ggml, and the bandwidth bound."""
    d = kernel_bench.run(reports, _threads(threads), layers, tokens, reps, log=console.print)
    console.print(f"wrote {reports / 'bench-kernel.md'} ({d['seconds']:.0f} s)")


@bench_app.command("decode")
def bench_decode(
    reports: Path = typer.Option(Path("reports"), "--reports", callback=_guard_reports,
                                 help="where bench-decode.{md,json,png} go"),
    workdir: Path = typer.Option(Path("/tmp/quantkit-bench"), "--workdir",
                                 help="generated checkpoints go here"),
    layers: int = typer.Option(4, "--layers", parser=COUNT,
                               help="layers of the generated realistic-shape checkpoint"),
    experts: int = typer.Option(64, "--experts", parser=COUNT,
                                help="experts per layer of the generated checkpoint"),
    prompt: int = typer.Option(128, "--prompt", parser=COUNT, help="prompt tokens (one prefill chunk)"),
    decode: int = typer.Option(16, "--decode", parser=COUNT, help="greedy decode steps per repetition"),
    reps: int = typer.Option(1, "--reps", parser=COUNT, help="timed repetitions per process (best is kept)"),
    rounds: int = typer.Option(2, "--rounds", parser=COUNT,
                               help="interleaved rounds over the configurations (best is kept)"),
    threads: int = typer.Option(None, "--threads", help="torch threads in every run [default: every physical core]"),
    configs: str = typer.Option(None, "--configs", help="comma-separated subset of the configurations"),
    vocab: int = typer.Option(None, "--vocab", parser=COUNT,
                              help="vocabulary of the generated checkpoint (default: the tiny "
                              "tokenizer's; 248320 is the real model's)"),
    spells: float = typer.Option(0.0, "--spells", min=0.0, help="then decode int4 for this many seconds between "
                                 "bandwidth reads, its share of the read grouped by the machine's spells (0: off)"),
) -> None:
    """Prefill/decode tok/s and peak RSS per format beside transformers bf16, the planner and the bandwidth bound."""
    threads = _threads(threads)
    names = [c.strip() for c in configs.split(",") if c.strip()] if configs else None
    unknown = [c for c in names or [] if c not in decode_bench.CONFIGS]
    if unknown:
        raise typer.BadParameter(f"unknown configuration(s) {unknown}; choose from {', '.join(decode_bench.CONFIGS)}",
                                 param_hint="--configs")
    d = decode_bench.run(reports, workdir, layers, experts, prompt, decode, reps, names, rounds, threads, vocab,
                         log=console.print, spells_s=spells)
    console.print(f"wrote {reports / 'bench-decode.md'} ({d['seconds']:.0f} s)")


@bench_app.command("session")
def bench_session(
    reports: Path = typer.Option(Path("reports"), "--reports", callback=_guard_reports,
                                 help="where bench-session.{md,json,png} go"),
    workdir: Path = typer.Option(Path("/tmp/quantkit-bench"), "--workdir", help="generated files go here"),
    turns: int = typer.Option(12, "--turns", help="agent turns (action + observation) in the session"),
    obs_tokens: int = typer.Option(250, "--obs-tokens", help="tokens of each recorded observation"),
    new_tokens: int = typer.Option(8, "--new-tokens", help="greedy tokens generated per turn"),
    layers: int = typer.Option(4, "--layers", help="layers of the generated realistic-shape checkpoint"),
    experts: int = typer.Option(64, "--experts", help="experts per layer of the generated checkpoint"),
    threads: int = typer.Option(None, "--threads", help="threads for every engine [default: every physical core]"),
    llama: bool = typer.Option(True, "--llama/--no-llama", help="run llama.cpp (llama-cpp-python) beside quantkit"),
    baseline_every: int = typer.Option(1, "--baseline-every", help="run the re-prefilling baselines (quantkit "
                                       "without reuse, llama.cpp) every N turns, and at the first and last"),
    checkpoint: Path = typer.Option(None, "--checkpoint", help="use this bf16 realistic-shape checkpoint instead"),
) -> None:
    """A multi-turn agent session: time to first token per turn with and without the prompt cache, and llama.cpp."""
    if turns < 2 or obs_tokens < 1 or new_tokens < 1 or baseline_every < 1:
        fail("--turns must be at least 2, --obs-tokens, --new-tokens and --baseline-every at least 1")
    d = session_bench.run(reports, workdir, turns, obs_tokens, new_tokens, layers, experts, checkpoint=checkpoint, threads=_threads(threads),
            llama=llama, baseline_every=baseline_every, log=console.print)
    for name, ok in d["checks"].items():
        console.print(f"{'PASS' if ok else 'FAIL'} {name}")
    console.print(f"wrote {reports / 'bench-session.md'} ({d['seconds']:.0f} s)")


@bench_app.command("calibrated")
def bench_calibrated(
    reports: Path = typer.Option(Path("reports"), "--reports", callback=_guard_reports,
                                 help="where bench-calibrated.{md,json,png} go"),
    calib_tokens: int = typer.Option(8192, "--calib-tokens", help="calibration tokens (default corpus)"),
    eval_tokens: int = typer.Option(4096, "--eval-tokens", help="held-out tokens for perplexity and KLD"),
    realistic_dir: Path = typer.Option(None, "--realistic-dir", help="also time stats + GPTQ per layer on a "
                                       "realistic-shape checkpoint generated here, extrapolated to the 35B"),
) -> None:
    """RTN vs imatrix vs GPTQ on SmolLM2-135M (a real trained model): perplexity and KLD, int4 g128/g32, int8."""
    d = calibrated_bench.run(reports, calib_tokens, eval_tokens, log=console.print, realistic_dir=realistic_dir,
            command="quantkit " + " ".join(sys.argv[1:]))
    console.print(f"wrote {reports / 'bench-calibrated.md'} ({d['seconds']:.0f} s)")


@bench_app.command("gpu")
def bench_gpu(
    reports: Path = typer.Option(Path("reports"), "--reports", callback=_guard_reports,
                                 help="where bench-gpu.{md,json} go"),
    workdir: Path = typer.Option(Path("/tmp/quantkit-bench-gpu"), "--workdir",
                                 help="the generated checkpoint and the plans go here"),
    layers: int = typer.Option(4, "--layers", parser=COUNT, help="layers of the generated realistic-shape checkpoint"),
    experts: int = typer.Option(64, "--experts", parser=COUNT, help="experts per layer of the generated checkpoint"),
    prompt: int = typer.Option(32, "--prompt", parser=COUNT, help="prompt tokens"),
    decode: int = typer.Option(32, "--decode", parser=COUNT, help="greedy tokens per run"),
    scheme: str = typer.Option(None, "--scheme", "-s", help="the quantization of the checkpoint (int4: experts "
                               "int4) [default: int4]"),
    old_recipe: str = typer.Option(None, "--recipe", hidden=True),  # the old spelling of --scheme
    cpu_share: float = typer.Option(0.5, "--cpu-share", parser=FRACTION,
                                    help="share of the expert bytes the GPU+CPU plan leaves in RAM, in (0, 1]"),
) -> None:
    """On a CUDA GPU: plan GPU alone and GPU+CPU, load, decode with and without CUDA graphs, check against the CPU."""
    recipe = renamed(scheme, old_recipe, "--scheme", "--recipe", "int4")
    d = gpu_bench.run(reports, workdir, layers, experts, prompt, decode, recipe, cpu_share, log=console.print)
    for name, ok in d.checks.items():
        console.print(f"{'PASS' if ok else 'FAIL'} {name}")
    console.print(f"wrote {reports / 'bench-gpu.md'} ({d.seconds:.0f} s)")
    if not all(d.checks.values()):
        raise typer.Exit(1)
