"""`quantkit serve MODEL_DIR`: the OpenAI-compatible server (quantkit/server) on the quantized runtime."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import typer

from quantkit.cli import app, console, err_console, fail
from quantkit.sizes import parse_size


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@app.command()
def serve(
    model_dir: Path = typer.Argument(..., help="quantized checkpoint folder (from `quantkit quantize`)"),
    plan: Path = typer.Option(None, "--plan", help="placement plan from `quantkit plan --out` (default: plan here)"),
    host: str = typer.Option("127.0.0.1", "--host", help="address to bind (loopback by default)"),
    port: int = typer.Option(8000, "--port", help="TCP port (0: any free port)"),
    max_queue: int = typer.Option(8, "--max-queue", help="requests that may wait behind the running one; more get 429"),
    max_body: str = typer.Option("8MB", "--max-body", help="largest request body accepted (413 beyond)"),
    model_name: str = typer.Option(None, "--served-model-name", help="model id clients use (default: folder name)"),
    context: int = typer.Option(None, "--context", help="context length to plan for (default: the plan's, or 4096)"),
    default_max_tokens: int = typer.Option(None, "--default-max-tokens",
                                           help="max_tokens when a request gives none (default: rest of context)"),
    log_level: str = typer.Option("info", "--log-level", help="uvicorn log level"),
) -> None:
    """Serve MODEL_DIR on an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/models, /health)."""
    if max_queue < 1:
        fail(f"--max-queue {max_queue}: must be at least 1")
    if not 0 <= port <= 65535:
        fail(f"--port {port}: must be 0..65535")
    body_limit = parse_size(max_body, "--max-body")
    if not is_loopback(host):
        err_console.print(f"[bold yellow]warning:[/] binding to {host}, beyond this machine's loopback: the server "
                          f"has no authentication, so anyone who can reach port {port} can use the model. "
                          f"Use --host 127.0.0.1 to keep it local.", highlight=False, soft_wrap=True)
    import uvicorn

    from quantkit.server.app import ServerConfig, create_app
    from quantkit.server.runtime_backend import load_backend

    backend = load_backend(model_dir, plan=plan, model_id=model_name, max_context=context)
    config = ServerConfig(max_queue=max_queue, max_body_bytes=body_limit, default_max_tokens=default_max_tokens)
    shown = f"[{host}]" if ":" in host else host
    console.print(f"serving [bold]{backend.model_id}[/] on http://{shown}:{port}/v1 (context {backend.max_context} "
                  f"tokens, up to {max_queue} waiting requests)", highlight=False)
    try:
        uvicorn.run(create_app(backend, config), host=host, port=port, log_level=log_level,
                    timeout_graceful_shutdown=5)
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it shut down on; that is a normal stop
        pass
    console.print("server stopped")
