"""`quantkit generate` and `quantkit chat`: parse, load through quantkit.runtime, render."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from quantkit import sizes
from quantkit.cli import app, console, err_console, fail
from quantkit.cli.chat_input import enable_bracketed_paste, multiline
from quantkit.cli.options import (
    CONTEXT,
    MAX_TOKENS,
    MTP_DRAFT,
    MTP_HELP,
    SEED,
    TEMPERATURE,
    TOP_K,
    TOP_P,
    renamed,
)
from quantkit.cli.progress import step_status
from quantkit.cli.prompt_cache_options import CACHE_DIR, DISK_SIZE, parse_disk_cache
from quantkit.cli.signals import Terminated, on_sigterm_raise
from quantkit.errors import QuantkitError
from quantkit.fileio import read_text_bounded
from quantkit.outputs import guard_output
from quantkit.runtime import SamplingParams, load_model
from quantkit.runtime.chat import SESSION_LIMIT, Chat, ChatSession, check_text
from quantkit.runtime.session_file import is_session_file, load_session, save_session
from quantkit.runtime.worlds import world_prompt
from quantkit.termtext import plural, printable
from quantkit.threads import set_threads

_PLAN = typer.Option(None, "--plan", help="a plan from `quantkit plan --out` (default: plan for this machine)")
_SCHEME = typer.Option(None, "--scheme", "-s", help="quantize an unquantized checkpoint while loading (int8, "
                       "int4, quality, nf4, fp4, mxfp4; as `plan --scheme`; default: keep bf16)")
_OLD_RECIPE = typer.Option(None, "--recipe", hidden=True)  # the old spelling of --scheme
_CONTEXT = typer.Option(None, "--context", "-c", parser=CONTEXT, show_default=False,
                        help="context length to plan for, e.g. 32768 or 32k [default: a --plan's, else the longest "
                        "that fits here, up to 32k]")
_OLD_MAX_NEW = typer.Option(None, "--max-new-tokens", parser=MAX_TOKENS, hidden=True)  # the old --max-tokens
_VERIFY = typer.Option("auto", "--verify",
                       help="check a quantized folder first: auto (the sha256 of every shard when the folder's "
                       "shards total under 4 GB, else sizes and headers), full, quick (sizes and headers), off")
_MODEL = typer.Argument(..., metavar="MODEL", show_default=False,
                        help="a quantized folder (quantkit quantize) or a bf16 checkpoint (with --scheme: quantized "
                        "while loading)")
# one sampling vocabulary for chat and generate
_TEMPERATURE = typer.Option(0.6, "--temperature", parser=TEMPERATURE,
                            help="sampling temperature, 0 = greedy; 0.6 as the model card evaluates")
_TOP_P = typer.Option(0.95, "--top-p", parser=TOP_P, help="nucleus sampling: the smallest set of tokens whose "
                      "probabilities reach this sum")
_TOP_K = typer.Option(20, "--top-k", parser=TOP_K, help="sample from the k likeliest tokens (0 = off)")
_SEED = typer.Option(None, "--seed", parser=SEED, show_default=False,
                     help="random seed of the sampling, for a reply that repeats [default: a fresh one]")
_THINK = typer.Option(True, "--think/--no-think", help="let the model reason before it answers (its thinking is "
                      "shown apart); --no-think turns it off, as the chat template's enable_thinking=false")
# a prompt on stdin: 16M characters is far beyond any context (262k tokens is ~1 MB of text)
PROMPT_LIMIT = 16 << 20
_THREADS = typer.Option(None, "--threads", help="CPU threads [default: every physical core]")
_CACHE_SIZE = typer.Option("auto", "--prompt-cache-size",
                           help="memory for snapshots of the conversation state, so each turn prefills only its "
                           "new tokens: e.g. 2GB, 512MB; 0 turns it off; auto = a quarter of the free memory "
                           "of the device holding the states")


def parse_cache_size(text: str) -> int | None:
    """--prompt-cache-size: 'auto' -> None (the runtime's default), '0' -> 0 (off), else a size under the one
    size rule (2GB = 2e9 bytes, 1GiB = 2^30)."""
    t = (text or "").strip().lower()
    if t == "auto":
        return None
    if t.rstrip("kmgtib ") in ("0", "0.0"):
        return 0
    return sizes.parse_size(text, "--prompt-cache-size")


def warn_line(line: str) -> None:
    """A one-line warning of the disk prompt cache (the run goes on)."""
    err_console.print(f"warning: {line}", style="yellow", highlight=False, markup=False, soft_wrap=True)


def _load(model: str, plan: Path | None, recipe: str | None, context: int | None, verify: str,
          threads: int | None = None):

    import transformers

    # transformers' own warnings (a prompt longer than the tokenizer's model_max_length, ...) would come raw
    # before quantkit's line on the same case: the runtime checks the context itself and says so in one line
    transformers.logging.set_verbosity_error()
    set_threads(threads)
    if verify not in ("auto", "full", "quick", "off"):
        raise QuantkitError(f"--verify {verify!r}: use auto, full, quick or off")
    with step_status(err_console, f"loading {model}") as say:
        rt = load_model(model, plan=plan, recipe=recipe, context=context, verify=verify, progress=say)
    for note in rt.report.notes:  # e.g. a forced route this machine cannot run, and the one used instead
        err_console.print(note, highlight=False, markup=False)
    return rt


@app.command("generate")
@on_sigterm_raise
def generate_cmd(
    model: str = _MODEL,
    prompt: str = typer.Option(None, "--prompt", "-p", help="the user message (default: read stdin)"),
    system: str = typer.Option(None, "--system", help="system prompt"),
    world: str = typer.Option(None, "--world", help="AgentWorld domain system prompt: mcp, search, terminal, "
                              "swe, android, web, os"),
    max_tokens: int = typer.Option(None, "--max-tokens", "-n", parser=MAX_TOKENS,
                                   help="most tokens to generate [default: 512]"),
    old_max_new_tokens: int = _OLD_MAX_NEW,
    temperature: float = _TEMPERATURE, top_p: float = _TOP_P, top_k: int = _TOP_K, seed: int = _SEED,
    think: bool = _THINK,
    as_json: bool = typer.Option(False, "--json", help="one JSON object: text, thinking, token counts, tok/s, "
                                 "finish reason, the CPU route (instruction set, fused ops, one call), MTP counts"),
    mtp: int = typer.Option(None, "--mtp", parser=MTP_DRAFT, help=MTP_HELP),
    prompt_cache_dir: Path = CACHE_DIR, prompt_cache_disk_size: str = DISK_SIZE,
    plan: Path = _PLAN, scheme: str = _SCHEME, old_recipe: str = _OLD_RECIPE, context: int = _CONTEXT,
    verify: str = _VERIFY,
    threads: int = _THREADS,
) -> None:
    """Generate one reply for scripts: the answer on stdout, the thinking apart on stderr (or --json)."""

    try:
        if prompt is None:
            if sys.stdin is None or sys.stdin.isatty():
                raise QuantkitError("no prompt: pass --prompt TEXT or pipe it on stdin")
            prompt = sys.stdin.read(PROMPT_LIMIT + 1)
            if len(prompt) > PROMPT_LIMIT:
                raise QuantkitError(f"the prompt on stdin is longer than {PROMPT_LIMIT:,} characters; shorten it")
        if not prompt.strip():
            raise QuantkitError("empty prompt: give some text with --prompt or on stdin")
        check_text(prompt, "the prompt")
        if world and system:
            raise QuantkitError("--world sets the system prompt; drop --system or --world")
        sys_prompt = world_prompt(world) if world else system
        max_new_tokens = renamed(max_tokens, old_max_new_tokens, "--max-tokens", "--max-new-tokens", 512)
        recipe = renamed(scheme, old_recipe, "--scheme", "--recipe")
        sp = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                            max_new_tokens=max_new_tokens)
        sp.validate()
        disk_bytes = parse_disk_cache(prompt_cache_dir, prompt_cache_disk_size, model)
        rt = _load(model, plan, recipe, context, verify, threads)
        note = rt.set_mtp(mtp)
        if note:
            err_console.print(note, highlight=False, markup=False)
        if prompt_cache_dir is not None:
            rt.set_prompt_cache(None, prompt_cache_dir, disk_bytes, warn_line)
        msgs = ([{"role": "system", "content": sys_prompt}] if sys_prompt else []) + \
            [{"role": "user", "content": prompt}]
        resp = None
        thinking = False  # the thinking is being written (stderr, apart from the answer on stdout)
        answering = False  # the answer's line is open on stdout
        try:
            for ev in rt.generate_stream(msgs, enable_thinking=think, sampling=sp):
                if ev.response is not None:
                    resp = ev.response
                elif not as_json and ev.text:
                    if ev.channel == "thinking":
                        if not thinking:
                            err_console.print("thinking:", style="bold dim")
                            thinking = True
                        err_console.print(printable(ev.text), end="", style="dim", highlight=False)
                        continue
                    if thinking:
                        err_console.print()
                        thinking = False
                    sys.stdout.write(printable(ev.text))
                    sys.stdout.flush()
                    answering = True
        except (KeyboardInterrupt, Terminated):  # cut mid-line: the line ends before `interrupted`/`terminated`
            if thinking:
                err_console.print()
            elif answering:
                sys.stdout.write("\n")
                sys.stdout.flush()
            raise
    except QuantkitError as e:
        fail(str(e))
        return
    assert resp is not None
    if as_json:
        d = resp.to_dict()
        d["model"] = str(rt.folder)
        d["memory_weights"] = rt.memory()
        d["route"] = rt.route()
        console.print_json(json.dumps(d))
    else:
        if thinking:
            err_console.print()
        sys.stdout.write("\n")
        sys.stdout.flush()
        err_console.print(f"prompt {resp.prompt_tokens} tok at {resp.prompt_tps:.1f} tok/s, generated "
                          f"{resp.generation_tokens} at {resp.generation_tps:.1f} tok/s, {resp.finish_reason}",
                          style="dim", highlight=False)
    if not resp.text and resp.thinking and resp.finish_reason == "length":
        err_console.print(f"note: all {resp.generation_tokens} tokens went to thinking, none to an answer: raise "
                          "--max-tokens, or pass --no-think", style="yellow", highlight=False)


@app.command("chat")
@on_sigterm_raise
def chat_cmd(
    model: str = _MODEL,
    system: str = typer.Option(None, "--system", help="system prompt"),
    world: str = typer.Option(None, "--world", help="be the world model of a domain: mcp, search, terminal, "
                              "swe, android, web, os (type the agent's actions)"),
    max_tokens: int = typer.Option(None, "--max-tokens", "-n", parser=MAX_TOKENS,
                                   help="most tokens to generate [default: 2048]"),
    old_max_new_tokens: int = _OLD_MAX_NEW,
    temperature: float = _TEMPERATURE, top_p: float = _TOP_P, top_k: int = _TOP_K, seed: int = _SEED,
    think: bool = _THINK,
    mtp: int = typer.Option(None, "--mtp", parser=MTP_DRAFT, help=MTP_HELP),
    load: Path = typer.Option(None, "--load", help="start from a conversation saved with /save"),
    session_file: Path = typer.Option(None, "--session", help="keep the conversation and its cached state in this "
                                      "file after every turn, and resume from it (no re-prefill after a restart)"),
    prompt_cache_size: str = _CACHE_SIZE,
    prompt_cache_dir: Path = CACHE_DIR, prompt_cache_disk_size: str = DISK_SIZE,
    plan: Path = _PLAN, scheme: str = _SCHEME, old_recipe: str = _OLD_RECIPE, context: int = _CONTEXT,
    verify: str = _VERIFY,
    threads: int = _THREADS,
) -> None:
    '''Talk to the model: streamed replies, thinking shown apart, /help for commands.

    A message of several lines goes between """ and """ (or is pasted, where the terminal supports
    bracketed paste).'''
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass

    try:
        if world and system:
            raise QuantkitError("--world sets the system prompt; drop --system or --world")
        if load and session_file:
            raise QuantkitError("--session resumes its own file; drop --load or --session")
        max_new_tokens = renamed(max_tokens, old_max_new_tokens, "--max-tokens", "--max-new-tokens", 2048)
        recipe = renamed(scheme, old_recipe, "--scheme", "--recipe")
        sp = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                            max_new_tokens=max_new_tokens)
        sp.validate()
        cache_bytes = parse_cache_size(prompt_cache_size)
        disk_bytes = parse_disk_cache(prompt_cache_dir, prompt_cache_disk_size, model)
        session = ChatSession(system=world_prompt(world) if world else system, thinking=think)
        if load:
            session = ChatSession.from_json(read_text_bounded(load, "chat session", SESSION_LIMIT), str(load))
        if session_file:  # before the model loads: a file the user cares about is refused, never replaced
            guard_output(session_file, sources=[Path(model)] if Path(model).exists() else [], overwrite=True,
                         owned=is_session_file, flag="--session ")
        rt = _load(model, plan, recipe, context, verify, threads)
        note = rt.set_mtp(mtp)
        if note:
            err_console.print(note, highlight=False, markup=False)
        rt.set_prompt_cache(cache_bytes, prompt_cache_dir, disk_bytes, warn_line)
        autosave = None
        if session_file:
            resumed = load_session(session_file, rt)
            if resumed.notice:
                err_console.print(resumed.notice, style="yellow", highlight=False, markup=False, soft_wrap=True)
            if resumed.session is not None:
                session = resumed.session
                err_console.print(f"resumed {plural(len(session.messages), 'message')} from {session_file} "
                                  f"({resumed.restored_tokens} tokens of state restored)", highlight=False)

            def autosave(s: ChatSession) -> None:
                save_session(session_file, rt, s)
        enable_bracketed_paste()
        Chat(rt, session, sp, console, read=multiline(input), autosave=autosave).run()
    except QuantkitError as e:
        fail(str(e))
