"""`quantkit serve MODEL_DIR`: the OpenAI-compatible server (quantkit/server) on the quantized runtime."""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path

import typer

from quantkit.cli import app, console, err_console, fail
from quantkit.cli.options import CONTEXT, COUNT, MAX_TOKENS, PORT
from quantkit.cli.runtime import parse_cache_size
from quantkit.errors import QuantkitError
from quantkit.runtime.threads import set_threads
from quantkit.server.runtime_backend import load_backend
from quantkit.server.security import API_KEY_ENV, is_loopback
from quantkit.sizes import parse_size

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
_HOSTNAME = re.compile(r"^(?=.{1,253}$)([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*$",
                       re.I)


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
def serve(
    model_dir: Path = typer.Argument(..., help="quantized checkpoint folder (from `quantkit quantize`)"),
    plan: Path = typer.Option(None, "--plan",
                              help="placement plan from `quantkit plan --out` (default: plan here)"),
    host: str = typer.Option("127.0.0.1", "--host", help="address to bind (loopback by default)"),
    port: int = typer.Option(8000, "--port", parser=PORT, help="TCP port (0: any free port)"),
    max_queue: int = typer.Option(8, "--max-queue", parser=COUNT,
                                  help="requests that may wait behind the running one; more get 429"),
    max_body: str = typer.Option("8MB", "--max-body", help="largest request body accepted (413 beyond)"),
    model_name: str = typer.Option(None, "--served-model-name",
                                   help="model id clients use (default: folder name)"),
    context: int = typer.Option(None, "--context", parser=CONTEXT,
                                help="context length to plan for (default: the plan's, or 4096)"),
    default_max_tokens: int = typer.Option(None, "--default-max-tokens", parser=MAX_TOKENS,
                                           help="max_tokens when a request gives none (default: rest of context)"),
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
) -> None:
    """Serve MODEL_DIR on an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/models, /health)."""
    if log_level.lower() not in LOG_LEVELS:
        fail(f"--log-level {log_level!r}: use one of {', '.join(LOG_LEVELS)}")
    host = check_host(host)
    body_limit = parse_size(max_body, "--max-body")
    if api_key is not None and not api_key.strip():
        fail(f"--api-key (or {API_KEY_ENV}) is empty; give a key or leave it unset")
    try:
        set_threads(threads)
        cache_bytes = parse_cache_size(prompt_cache_size)
    except QuantkitError as e:
        fail(str(e))
    if not is_loopback(host) and not api_key:
        err_console.print(f"[bold yellow]warning:[/] binding to {host}, beyond this machine's loopback, with no "
                          f"authentication (no API key): anyone who can reach port {port} can use the model. Pass "
                          f"--api-key KEY (or set {API_KEY_ENV}), or use --host 127.0.0.1 to keep it local.",
                          highlight=False, soft_wrap=True)
    import uvicorn

    from quantkit.server.app import ServerConfig, create_app

    backend = load_backend(model_dir, plan=plan, model_id=model_name, max_context=context,
                           prompt_cache_bytes=cache_bytes)
    config = ServerConfig(max_queue=max_queue, max_body_bytes=body_limit, default_max_tokens=default_max_tokens,
                          bind_host=host, allowed_hosts=tuple(allowed_hosts), api_key=api_key or None)
    shown = f"[{host}]" if ":" in host else host
    console.print(f"serving [bold]{backend.model_id}[/] on http://{shown}:{port}/v1 (context {backend.max_context} "
                  f"tokens, up to {max_queue} waiting requests, prompt cache "
                  f"{backend.cache_summary()['max_bytes'] / 2**20:.0f} MiB)", highlight=False)
    try:
        uvicorn.run(create_app(backend, config), host=host, port=port, log_level=log_level.lower(),
                    timeout_graceful_shutdown=5)
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it shut down on; that is a normal stop
        pass
    console.print("server stopped")
