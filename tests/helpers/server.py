"""A quantized tiny model served on a thread (`ServerThread`) or by the real command (`ServeProcess`), for the
server tests."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import httpx
import uvicorn

from quantkit.server.serving import Server

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
        # quantkit's Server (serving.py), as `quantkit serve` runs: a stop ends the requests first
        self.server = Server(uvicorn.Config(app, log_level="warning", lifespan="on"), app)
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


class ServeProcess:
    """`quantkit serve MODEL *args` as users start it: a subprocess on port 0 (the port it prints), its output in
    `log_path`; up once /health says ok. `stop(sig)` sends a signal and returns the exit code."""

    def __init__(self, model: Path, log_path: Path, *args: object):
        import os
        import subprocess
        import sys

        self.log_path = log_path
        self._log = log_path.open("w")
        self.port = 0
        self.proc = subprocess.Popen([sys.executable, "-m", "quantkit", "serve", str(model), "--port", "0",
                                      "--log-level", "warning", *map(str, args)],
                                     stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, "COLUMNS": "200"})

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServeProcess:
        import re

        deadline = time.monotonic() + 300
        while True:
            assert self.proc.poll() is None, self.log()
            if not self.port:
                m = re.search(r"on http://127\.0\.0\.1:(\d+)/v1", self.log())
                self.port = int(m.group(1)) if m else 0
            if self.port:
                try:
                    if httpx.get(self.url + "/health", timeout=2).json()["status"] == "ok":
                        return self
                except httpx.HTTPError:
                    pass
            assert time.monotonic() < deadline, "the server did not come up:\n" + self.log()
            time.sleep(0.1)

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=30).json()

    def wait_for(self, ok, what: str, timeout: float = 120) -> dict:
        """/health's queue once `ok(queue)` holds."""
        deadline = time.monotonic() + timeout
        while True:
            q = self.health()["queue"]
            if ok(q):
                return q
            assert time.monotonic() < deadline, f"{what}: {q}"
            time.sleep(0.02)

    def stop(self, sig: int, timeout: float = 60) -> int:
        import subprocess

        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"the server did not exit within {timeout} s of signal {sig}:\n{self.log()}") from None

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()
