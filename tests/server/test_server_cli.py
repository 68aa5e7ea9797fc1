"""`quantkit serve` as users start it: the real command in a subprocess answering the openai client
(plain, streaming, tools, an alias, /metrics), and its bad input through the real entry point (one line,
exit 2), an address not on this machine included (refused before the model loads)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from quantkit.bench.serve import free_port, stop_server
from quantkit.cli.serve import is_loopback

from helpers.cli import run_cli, run_main


@pytest.fixture(scope="module")
def q4(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("serve-cli") / "q4"
    r = run_main("quantize", tiny_model, "--bits", "4", "--out", out, timeout=600)
    assert r.returncode == 0, r.stderr
    return out


TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file",
                                           "parameters": {"type": "object",
                                                          "properties": {"path": {"type": "string"}}}}}]


@pytest.mark.slow
def test_quantkit_serve_answers_the_openai_client(q4: Path, tmp_path: Path):
    port = free_port()
    log = (tmp_path / "serve.log").open("w+")
    proc = subprocess.Popen([sys.executable, "-m", "quantkit", "serve", str(q4), "--port", str(port),
                             "--max-queue", "2", "--log-level", "warning", "--alias", "gpt-4o"],
                            stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "COLUMNS": "200"})
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, Path(log.name).read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).json()["status"] == "ok":
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.5)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=300)
        assert [m.id for m in client.models.list().data] == ["q4", "gpt-4o"]
        msgs = [{"role": "user", "content": "hello"}]
        r = client.chat.completions.create(model="q4", messages=msgs, max_tokens=5)
        assert r.choices[0].message.role == "assistant" and 1 <= r.usage.completion_tokens <= 5
        chunks = list(client.chat.completions.create(model="gpt-4o", messages=msgs, max_tokens=5, stream=True,
                                                     stream_options={"include_usage": True}))
        assert chunks[-1].usage is not None and any(c.choices and c.choices[0].finish_reason for c in chunks)
        r = client.chat.completions.create(model="q4", messages=msgs, tools=TOOLS, max_tokens=5,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert r.usage.prompt_tokens > 100  # the tool schema and instructions went into the prompt
        assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert 'quantkit_requests_total{endpoint="/v1/chat/completions",status="200"} 3.0' in text
    finally:
        stop_server(proc)
    out = Path(log.name).read_text()
    assert f"serving q4 on http://127.0.0.1:{port}/v1" in out and "server stopped" in out
    # the start lines name the one-token route (with the kernel's instruction set) and whether MTP drafts
    assert re.search(r"^route \S+: .*(CPU kernel|torch ops)", out, re.M) and "\nMTP: " in out
    assert proc.returncode == 0, out


def test_serve_bad_input_is_one_line(tmp_path: Path, capsys, monkeypatch):
    cases = [
        (["serve", str(tmp_path / "missing")], "not a folder"),
        (["serve", str(tmp_path), "--max-queue", "0"], "'--max-queue': '0' is out of range"),
        (["serve", str(tmp_path), "--max-body", "lots"], "--max-body 'lots'"),
        (["serve", str(tmp_path), "--port", "70000"], "'--port': '70000' is out of range"),
        (["serve", str(tmp_path), "--host", "8.8.8.8"], "it is not an address of this machine"),
        (["serve", str(tmp_path), "--cors-origin", "localhost:3000"], "is not an origin"),
        (["serve", str(tmp_path), "--cors-origin", "http://a.example/path"], "is not an origin"),
        (["serve", str(tmp_path), "--alias", "my model"], "--alias 'my model'"),
        (["serve", str(tmp_path), "--body-timeout", "0"], "'--body-timeout': '0' is out of range"),
        (["serve", str(tmp_path), "--max-n", "0"], "'--max-n': '0' is out of range"),
    ]
    for args, needle in cases:
        code, out, err = run_cli(args, capsys, monkeypatch)
        assert code == 2, (args, out, err)
        assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, (args, err)


def test_binding_beyond_loopback_warns(tmp_path: Path, capsys, monkeypatch):
    # the folder holds no checkpoint: the socket is bound (and warned about), then loading fails in one line
    code, _, err = run_cli(["serve", str(tmp_path), "--host", "0.0.0.0", "--port", "0"], capsys, monkeypatch)
    assert code == 2 and err.count("error:") == 1
    assert "warning" in err and "0.0.0.0" in err and "no authentication" in err
    code, _, err = run_cli(["serve", str(tmp_path), "--port", "0"], capsys, monkeypatch)
    assert code == 2 and "warning" not in err


def test_loopback_addresses():
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "192.168.1.5", "10.0.0.1", "example.org"))
