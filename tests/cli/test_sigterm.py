"""SIGTERM (how systemd, Docker and Kubernetes stop a process) to `quantkit chat` and `quantkit generate`: the
command unwinds (quantkit/cli/signals.py) and exits 143 with the one line `terminated`, no traceback, and nothing
half-written: no temporary left beside the session file, which holds the last whole turn (the next start resumes
it). A SIGTERM to `quantkit serve`: tests/server/test_server_process.py."""

from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from quantkit.cli.signals import EXIT_CODE

from helpers.probe import count

SEED = int(os.environ.get("QK_FAULT_SEED", "1414"))
ENV = {**os.environ, "COLUMNS": "200"}


def _quantkit(*args: object) -> list[str]:
    return [sys.executable, "-m", "quantkit", *map(str, args)]


def _terminated(proc: subprocess.Popen, where: str) -> None:
    """SIGTERM to `proc`, then its end as a user sees it."""
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=120)
    err = err.decode()
    count()
    assert proc.returncode == EXIT_CODE, (where, proc.returncode, err)
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "terminated", (where, err)


def _no_leftovers(folder: Path, where: str) -> None:
    assert [p.name for p in folder.iterdir() if p.name.startswith(".")] == [], where


def _read_until(proc: subprocess.Popen, needle: bytes, after: int, timeout: float = 120, stream: str = "stdout"
                ) -> None:
    """Read `proc`'s `stream` until `needle` has appeared and `after` more bytes followed it."""
    pipe = getattr(proc, stream)
    assert pipe is not None
    buf, deadline = b"", time.monotonic() + timeout
    while not (needle in buf and len(buf) - buf.index(needle) - len(needle) >= after):
        assert proc.poll() is None and time.monotonic() < deadline, buf[-500:]
        if select.select([pipe], [], [], 1.0)[0]:  # the deadline holds even when nothing comes on this stream
            buf += os.read(pipe.fileno(), 4096)


@pytest.mark.slow
@pytest.mark.parametrize("command", ["generate", "chat"])
def test_sigterm_while_generating(command, tiny_model, tmp_path):
    """Mid-answer: the command ends at once, and a chat session that has not finished a turn writes nothing."""
    sess = tmp_path / "talk.qks"
    long = ["--max-tokens", 60000, "--context", 65536, "--temperature", 0]
    args = (["generate", tiny_model, "--prompt", "hello", *long] if command == "generate"
            else ["chat", tiny_model, "--session", sess, *long])
    proc = subprocess.Popen(_quantkit(*args), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=ENV)
    assert proc.stdin is not None
    if command == "chat":
        proc.stdin.write(b"hello there\n")
        proc.stdin.flush()
    # the answer is streaming (generate's thinking streams to stderr, apart from the answer on stdout)
    _read_until(proc, b"you> " if command == "chat" else b"thinking:", 64,
                stream="stdout" if command == "chat" else "stderr")
    _terminated(proc, command)
    assert not sess.exists()
    _no_leftovers(tmp_path, command)


@pytest.mark.slow
def test_sigterm_during_a_chat_session_leaves_whole_turns(tiny_model, tmp_path):
    """chat --session rewrites its file after every turn; a SIGTERM at a random point of a scripted session (in a
    turn, in a save, at the prompt) leaves the file of the last whole turn and no temporary: the next start
    resumes it."""
    rng = random.Random(f"{SEED}-sigterm")
    sess = tmp_path / "talk.qks"
    cmd = _quantkit("chat", tiny_model, "--session", sess, "--no-think", "--max-tokens", 4, "--temperature", 0)
    for attempt in range(2):
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV)
        assert proc.stdin is not None
        proc.stdin.write("".join(f"turn {attempt}.{i}\n" for i in range(8)).encode())
        proc.stdin.flush()  # (stdin stays open: the chat waits at its prompt after the last turn)
        _read_until(proc, b"you> ", 0)  # the chat runs (a SIGTERM while Python imports is Python's own)
        delay = rng.uniform(0.0, 1.0)
        time.sleep(delay)
        where = f"(seed {SEED}, SIGTERM {attempt} after {delay:.2f} s)"
        _terminated(proc, where)
        _no_leftovers(tmp_path, where)
        saved = sess.exists()  # (not when the signal came before the first turn ended)
        r = subprocess.run(cmd, input=b"/exit\n", capture_output=True, env=ENV, timeout=300)
        err = r.stderr.decode()
        assert r.returncode == 0 and "Traceback" not in err and ("resumed" in err) == saved, (where, err)
        assert "damaged" not in err, (where, err)
