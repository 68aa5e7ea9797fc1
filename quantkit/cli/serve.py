"""`quantkit serve MODEL`: the OpenAI-compatible server (quantkit/server) on the quantized runtime."""

from __future__ import annotations

import errno
import ipaddress
import re
import socket
from pathlib import Path
from urllib.parse import urlsplit

import typer
from rich.text import Text

from quantkit.checkpoint.spec import TextConfig
from quantkit.cli import app, console, err_console, fail
from quantkit.cli.options import (
    CONTEXT,
    COUNT,
    MAX_N_CHOICES,
    MAX_TOKENS,
    MTP_DRAFT,
    MTP_HELP,
    PARALLEL,
    PORT,
    SECONDS,
    renamed,
)
from quantkit.cli.progress import step_status
from quantkit.cli.prompt_cache_options import CACHE_DIR, DISK_SIZE, parse_disk_cache
from quantkit.cli.runtime import parse_cache_size, warn_line
from quantkit.cli.signals import Terminated, on_sigterm_raise
from quantkit.errors import QuantkitError
from quantkit.planner.budget import states_held
from quantkit.planner.slots import DEFAULT_PARALLEL_MAX
from quantkit.runtime.chat import context_line
from quantkit.runtime.options import PREFILL_KINDS
from quantkit.server.parallel import choose_parallel
from quantkit.server.runtime_backend import load_backend
from quantkit.server.security import API_KEY_ENV, check_api_key, is_loopback
from quantkit.sizes import format_size, parse_size
from quantkit.termtext import plural
from quantkit.threads import set_threads

# the states a conversation's next turn resumes from, kept per slot: the start of its generation prompt and the
# end of its answer (a prompt's other points are evicted first: runtime/state_cache.py `put(spare=)`)
STATES_PER_SLOT = 2
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
_HOSTNAME = re.compile(r"^(?=.{1,253}$)([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*$",
                       re.I)


def check_origin(origin: str) -> str:
    """A CORS origin as browsers send it (scheme://host[:port], no path), or `*`; else one clear error."""
    o = origin.strip().rstrip("/")
    if o == "*":
        return o
    u = urlsplit(o)
    ok = u.scheme in ("http", "https") and u.hostname and not u.path and not u.query and not u.fragment
    try:
        u.port  # noqa: B018 - raises on a port out of range
    except ValueError:
        ok = False
    if not ok:
        raise QuantkitError(f"--cors-origin {origin!r} is not an origin: give scheme://host[:port] as the browser "
                            "sends it (e.g. http://localhost:3000), or * for any page")
    return o


def check_alias(alias: str) -> str:
    a = alias.strip()
    if not a or len(a) > 256 or any(c.isspace() or not c.isprintable() for c in a):
        raise QuantkitError(f"--alias {alias!r}: give a model name without spaces (at most 256 characters)")
    return a


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads: an address that is not this machine's (or a port
    in use) is one error line, not a server log after minutes of loading."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        infos = socket.getaddrinfo(host, port, family if ":" in host else socket.AF_UNSPEC, socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise QuantkitError(f"--host {host!r}: cannot resolve it ({e.strerror})") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        why = ("it is not an address of this machine" if e.errno == errno.EADDRNOTAVAIL
               else "the port is in use" if e.errno == errno.EADDRINUSE else e.strerror or str(e))
        raise QuantkitError(f"cannot listen on {host} port {port}: {why}") from None
    return sock


def check_host(host: str) -> str:
    """An IP address or a valid host name to bind, else one clear error."""
    h = host.strip()
    try:
        ipaddress.ip_address(h.strip("[]"))
        return h.strip("[]")
    except ValueError:
        pass
    if not _HOSTNAME.match(h):
        raise QuantkitError(f"--host {host!r} is not an IP address or a host name; use e.g. 127.0.0.1")
    return h


@app.command()
@on_sigterm_raise
def serve(
    model_dir: Path = typer.Argument(..., metavar="MODEL", show_default=False,
                                     help="a quantized folder (quantkit quantize) or a bf16 checkpoint"),
    plan: Path = typer.Option(None, "--plan",
                              help="placement plan from `quantkit plan --out` (default: plan here)"),
    host: str = typer.Option("127.0.0.1", "--host", help="address to bind (loopback by default)"),
    port: int = typer.Option(8000, "--port", parser=PORT, help="TCP port (0: any free port)"),
    max_queue: int = typer.Option(8, "--max-queue", parser=COUNT,
                                  help="requests that may wait for a slot, beyond the --parallel running; more get "
                                  "429"),
    max_body: str = typer.Option("8MB", "--max-body", help="largest request body accepted (413 beyond)"),
    model_name: str = typer.Option(None, "--served-model-name",
                                   help="model id /v1/models lists first (default: folder name); requests may "
                                   "name any model"),
    aliases: list[str] = typer.Option([], "--alias", help="another model name /v1/models lists (repeatable), "
                                      "e.g. the name a client is configured for"),
    cors_origins: list[str] = typer.Option([], "--cors-origin", help="let web pages from this origin call the "
                                           "API (repeatable; e.g. http://localhost:3000, or *); off by default"),
    body_timeout: float = typer.Option(30.0, "--body-timeout", parser=SECONDS,
                                       help="seconds a client has to send its request body (408 after)"),
    max_n: int = typer.Option(8, "--max-n", parser=MAX_N_CHOICES, help="most choices (n) one request may ask for"),
    parallel: int = typer.Option(None, "--parallel", parser=PARALLEL, show_default=False,
                                 help="requests decoded together, each in its own slot, one forward per token "
                                 "for all of them (1: one request at a time); refused when the slots' K/V and "
                                 f"recurrent state at --context do not fit the free memory (default: as many as "
                                 f"fit, up to {DEFAULT_PARALLEL_MAX}; 1 where two do not fit)"),
    context: int = typer.Option(None, "--context", "-c", parser=CONTEXT, show_default=False,
                                help="context length of each request, e.g. 32k [default: a --plan's, else the "
                                "longest at which --parallel slots (1 when not given) fit here, up to 32k]"),
    max_tokens: int = typer.Option(None, "--max-tokens", "-n", parser=MAX_TOKENS,
                                   help="max_tokens when a request gives none (default: rest of context)"),
    old_max_tokens: int = typer.Option(None, "--default-max-tokens", parser=MAX_TOKENS, hidden=True),
    log_level: str = typer.Option("info", "--log-level", help=f"uvicorn log level: {', '.join(LOG_LEVELS)}"),
    allowed_hosts: list[str] = typer.Option([], "--allowed-hosts", help="more Host header names to answer "
                                            "(repeatable; loopback names and --host always; '*' for any)"),
    api_key: str = typer.Option(None, "--api-key", envvar=API_KEY_ENV, show_envvar=True,
                                help="require 'Authorization: Bearer KEY' on every endpoint but /health"),
    threads: int = typer.Option(None, "--threads", help="CPU threads [default: every physical core]"),
    prompt_cache_size: str = typer.Option("auto", "--prompt-cache-size",
                                          help="memory for snapshots of conversation states, reused when a client "
                                          "resends the history: e.g. 2GB; 0 turns it off; auto = a quarter of "
                                          "the free memory of the device holding the states"),
    mtp: int = typer.Option(None, "--mtp", parser=MTP_DRAFT, help=MTP_HELP),
    prompt_cache_dir: Path = CACHE_DIR, prompt_cache_disk_size: str = DISK_SIZE,
    prefill: str = typer.Option("rows", "--prefill", help="how prompts compute, packed into the decoding steps "
                                "either way: rows (each token as a decode step computes it; prompts that share a "
                                "start prefill it once; the end of every answer is cached) or tokens "
                                "(transformers' arithmetic, faster on a lone long prompt) (docs/engine.md)"),
) -> None:
    """Serve MODEL on an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models,
    /health, /metrics)."""
    if log_level.lower() not in LOG_LEVELS:
        fail(f"--log-level {log_level!r}: use one of {', '.join(LOG_LEVELS)}")
    if prefill not in PREFILL_KINDS:
        fail(f"--prefill {prefill!r}: use one of {', '.join(PREFILL_KINDS)}")
    default_max_tokens = renamed(max_tokens, old_max_tokens, "--max-tokens", "--default-max-tokens")
    host = check_host(host)
    body_limit = parse_size(max_body, "--max-body")
    if api_key is not None and not api_key.strip():
        fail(f"--api-key (or {API_KEY_ENV}) is empty; give a key or leave it unset")
    try:
        if api_key is not None:  # before the model loads: a key no client can send is refused at once
            check_api_key(api_key, f"--api-key (or {API_KEY_ENV})")
        set_threads(threads)
        cache_bytes = parse_cache_size(prompt_cache_size)
        disk_bytes = parse_disk_cache(prompt_cache_dir, prompt_cache_disk_size, model_dir)
        origins = tuple(check_origin(o) for o in cors_origins)
        names = tuple(check_alias(a) for a in aliases)
    except QuantkitError as e:
        fail(str(e))
    # lazy: the web stack (uvicorn, fastapi) loads only once the options pass, not for --help or a refusal
    import uvicorn

    from quantkit.server.app import ServerConfig, create_app
    from quantkit.server.serving import Server

    if not Path(model_dir).is_dir():  # before binding: the usual mistake gets its own line
        fail(f"{model_dir}: not a folder; pass a checkpoint folder made by `quantkit quantize`")
    sock = bind_socket(host, port)
    port = sock.getsockname()[1]
    if not is_loopback(host) and not api_key:
        err_console.print(f"warning: binding to {host}, beyond this machine's loopback, with no "
                          f"authentication (no API key): anyone who can reach port {port} can use the model. Pass "
                          f"--api-key KEY (or set {API_KEY_ENV}), or use --host 127.0.0.1 to keep it local.",
                          style="bold yellow", highlight=False, soft_wrap=True)
    try:
        with step_status(err_console, f"loading {model_dir}") as say:  # the load takes minutes on the full model
            backend = load_backend(model_dir, plan=plan, model_id=model_name, max_context=context,
                                   prompt_cache_bytes=cache_bytes, prompt_cache_dir=prompt_cache_dir,
                                   prompt_cache_disk_bytes=disk_bytes, warn=warn_line, slots=parallel or 1,
                                   progress=say, prefill=prefill)
        parallel = choose_parallel(backend.runtime, parallel, backend.max_context)
        config = ServerConfig(max_queue=max_queue, max_body_bytes=body_limit, default_max_tokens=default_max_tokens,
                              bind_host=host, allowed_hosts=tuple(allowed_hosts), api_key=api_key or None,
                              body_timeout_s=body_timeout, aliases=names, cors_origins=origins, max_n=max_n,
                              parallel=parallel)
        shown = f"[{host}]" if ":" in host else host
        console.print(Text.assemble("serving ", (backend.model_id, "bold"), f" on http://{shown}:{port}/v1 ("
                                    f"{context_line(backend.runtime)}; {parallel} decoding at once, up to "
                                    f"{max_queue} waiting, prompt cache "
                                    f"{format_size(backend.cache_summary()['max_bytes'])})"), highlight=False,
                      soft_wrap=True)
        disk = backend.cache_summary().get("disk")
        note = small_cache_note(backend.runtime.model.cfg.text, backend.cache_summary()["max_bytes"], parallel,
                                bool(disk))
        if note:
            err_console.print(note, highlight=False, markup=False, soft_wrap=True)
        if disk:
            console.print(f"prompt cache on disk: {disk['dir']} ({plural(disk['entries'], 'entry', 'entries')} of "
                          f"these weights, up to {format_size(disk['max_bytes'])})", highlight=False)
        note = backend.runtime.set_mtp(mtp)
        if note:
            err_console.print(note, highlight=False, markup=False)
        console.print(backend.runtime.route_line(), highlight=False)  # the instruction set and decode route
        console.print(backend.runtime.mtp_line(), highlight=False)
        web = create_app(backend, config)
        server = Server(uvicorn.Config(web, log_level=log_level.lower(), timeout_graceful_shutdown=5), web)
        try:
            server.run(sockets=[sock])
        except (KeyboardInterrupt, Terminated):
            # uvicorn re-raises the Ctrl-C or SIGTERM it stopped on, once every request has ended (serving.py):
            # this command's normal end
            pass
    finally:
        sock.close()
    console.print("server stopped")


def small_cache_note(text: TextConfig, max_bytes: int, slots: int, disk: bool) -> str | None:
    """A note where the prompt cache in memory holds fewer conversation states than STATES_PER_SLOT per slot, with
    no disk tier to fall back on: agents that resend their history then find where they left off evicted between
    turns and prefill it again."""
    held, per = states_held(text, max_bytes)
    if disk or max_bytes <= 0 or per == 0 or held >= STATES_PER_SLOT * slots:
        return None
    return (f"note: the prompt cache holds about {held} conversation states ({format_size(per)} each), fewer than "
            f"{STATES_PER_SLOT} for each of {slots} slots: histories resent turn after turn may be evicted "
            f"and prefilled again; --prompt-cache-size SIZE or --prompt-cache-dir DIR keeps more")
