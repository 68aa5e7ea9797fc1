"""The README's first reply is real (issue 54): its "Try it now" block runs as written, line by line, in a fresh
process each (tiny model, quantize, generate, chat, serve), and then its openai snippet, read from README.md
too, prints visible text against that server. Output goes to pipes, as in a script or CI: nothing may be cut."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from quantkit.termtext import printable

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def block_after(marker: str, lang: str) -> str:
    """The first ```lang block after `marker` in the README."""
    text = README.read_text()
    at = text.index(marker)
    m = re.compile(rf"```{lang}\n(.*?)```", re.S).search(text, at)
    assert m is not None, f"no {lang} block after {marker!r}"
    return m.group(1)


def commands(block: str) -> list[list[str]]:
    return [shlex.split(line, comments=True) for line in block.splitlines() if line.split("#")[0].strip()]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}  # a pipe as a script has it: no width given
    env["OMP_NUM_THREADS"] = "1"
    return env


def test_the_readme_shows_both_paths_and_a_snippet_that_turns_thinking_off_explicitly():
    real = commands(block_after("**The real model.**", "bash"))
    assert real[0][:2] == ["hf", "download"] and ["quantkit", "quantize"] == real[2][:2]
    two_step = commands(block_after("Or in two steps", "bash"))
    assert two_step[0][:2] == ["hf", "download"]
    assert two_step[1][:2] == ["quantkit", "chat"] and "--scheme" in two_step[1]
    assert two_step[1][2] == two_step[0][two_step[0].index("--local-dir") + 1]  # the downloaded folder as is
    snippet = block_after("From any OpenAI client", "python")
    assert '"enable_thinking": False' in snippet and "print(" in snippet


@pytest.mark.slow
def test_the_quick_start_runs_as_written(tmp_path: Path):
    cmds = commands(block_after("**Try it now**", "bash"))
    assert [c[:2] for c in cmds] == [["quantkit", c] for c in ("tiny-model", "quantize", "generate", "chat", "serve")]

    def here(args: list[str]) -> list[str]:  # the block's /tmp paths inside this test's folder
        return [sys.executable, "-m", "quantkit"] + [str(tmp_path / a[5:]) if a.startswith("/tmp/") else a
                                                    for a in args[1:]]

    out = {}
    for args in cmds[:4]:
        r = subprocess.run(here(args), input="hello\n" if args[1] == "chat" else None, capture_output=True,
                           text=True, timeout=600, env=_env())
        assert r.returncode == 0, (args, r.stderr)
        assert "Traceback" not in r.stderr
        out[args[1]] = r
    # the two-step path, quantized while it loads: its chat line on the tiny bf16 folder in place of the download
    two_step = commands(block_after("Or in two steps", "bash"))[1]
    r = subprocess.run([*here(["quantkit", "chat", "/tmp/tiny", *two_step[3:]])], input="hello\n",
                       capture_output=True, text=True, timeout=600, env=_env())
    assert r.returncode == 0 and "quantkit chat: tiny," in r.stdout, r.stderr
    assert printable(r.stdout.split("you> ", 1)[1].split("[prompt", 1)[0]).strip()
    assert printable(out["generate"].stdout).strip()  # the answer, visible, on stdout
    assert "<think>" not in out["generate"].stdout
    chat = out["chat"].stdout
    assert "context 32,768 tokens (default:" in chat  # the context said, and where it came from
    assert printable(chat.split("you> ", 1)[1].split("[prompt", 1)[0]).strip()  # the reply
    # a pipe is not a terminal: quantize's table is whole, not cut at 80 columns
    assert "…" not in out["quantize"].stdout and "routed_expert" in out["quantize"].stdout

    server = subprocess.Popen([*here(cmds[4]), "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=_env())
    try:
        banner = server.stdout.readline()
        m = re.search(r"http://127\.0\.0\.1:(\d+)/v1 \(context [\d,]+ tokens \(default: ", banner)
        assert m, (banner, server.stderr.read() if server.poll() is not None else "")
        deadline = time.monotonic() + 120
        import httpx

        while True:  # the banner comes before uvicorn starts listening
            try:
                if httpx.get(f"http://127.0.0.1:{m.group(1)}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and server.poll() is None
            time.sleep(0.1)
        snippet = block_after("From any OpenAI client", "python").replace("127.0.0.1:8000", f"127.0.0.1:{m.group(1)}")
        r = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=300, env=_env())
        assert r.returncode == 0, r.stderr
        assert printable(r.stdout).strip(), "the README's snippet printed an empty reply"
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
