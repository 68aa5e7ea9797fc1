"""A quantized tiny model served on a thread, for the server tests."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import httpx
import uvicorn

MAX_CONTEXT = 2048


MAX_BODY = 64_000


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]


class ServerThread:
    """uvicorn serving `app` from a thread, on a loopback socket bound to a free port."""

    def __init__(self, app):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def load(q4: Path):
    from quantkit.server.runtime_backend import load_backend

    return load_backend(q4, max_context=MAX_CONTEXT)


def idle(server, timeout: float = 120) -> dict:
    """Wait until the server has no running or waiting job (a cancelled one ends at its next token)."""
    deadline = time.monotonic() + timeout
    while True:
        h = httpx.get(server.url + "/health").json()
        if h["queue"]["running"] == 0 and h["queue"]["waiting"] == 0:
            return h
        assert time.monotonic() < deadline, h
        time.sleep(0.05)
