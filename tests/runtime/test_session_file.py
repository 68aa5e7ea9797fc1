"""`quantkit chat --session FILE`: the conversation and its state saved after each turn and resumed after a
restart without a re-prefill; a file for another model or recipe is refused in one line, damaged state is
ignored with a notice (never loaded half-way)."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from quantkit.errors import QuantkitError
from quantkit.runtime import SamplingParams, load_model
from quantkit.runtime.chat import Chat, ChatSession
from quantkit.runtime.session_file import load_session, save_session

from helpers.cli import run_main
from helpers.runtime import quantized

pytestmark = pytest.mark.usefixtures("one_thread")
SP = SamplingParams(temperature=0, max_new_tokens=6)


def fresh(tiny_model):
    rt = load_model(tiny_model, recipe="bf16")
    rt.set_prompt_cache(1 << 28)
    return rt


def chat(rt, session: ChatSession, lines: list[str], path=None) -> tuple[Chat, str]:
    feed, out = iter(lines), io.StringIO()

    def read(_p: str) -> str:
        try:
            return next(feed)
        except StopIteration:
            raise EOFError from None
    c = Chat(rt, session, SP, Console(file=out, width=300), read,
             autosave=(lambda s: save_session(path, rt, s)) if path else None)
    c.run()
    return c, out.getvalue()


@pytest.fixture(scope="module")
def saved(tiny_model, tmp_path_factory):
    """A 3-turn chat saved with its state, and the same chat continued in the same process (the reference)."""
    path = tmp_path_factory.mktemp("session") / "s.qks"
    rt = fresh(tiny_model)
    c, _ = chat(rt, ChatSession(system="You are a shell."), ["ls", "cat notes.txt", "pwd"], path)
    cont, _ = chat(rt, ChatSession(c.s.system, [dict(m) for m in c.s.messages]), ["whoami"])
    return path, cont.last


def test_resume_without_reprefill(tiny_model, saved):
    path, reference = saved
    rt = fresh(tiny_model)  # a restart: a new runtime with an empty cache
    r = load_session(path, rt)
    assert r.notice is None and r.session is not None and len(r.session.messages) == 6
    assert r.restored_tokens > 0 and len(rt.prompt_cache) == 1
    c, _ = chat(rt, r.session, ["whoami"])
    assert c.last.cached_tokens == r.restored_tokens  # only the last answer and the new message are prefilled
    assert c.last.prefilled_tokens < c.last.prompt_tokens // 3
    assert c.last.token_ids == reference.token_ids


def test_foreign_files_are_refused(tiny_model, tiny_model_mtp, saved, tmp_path):
    path, _ = saved
    with pytest.raises(QuantkitError, match="another recipe"):
        load_session(path, load_model(quantized(tiny_model, "int4")))
    with pytest.raises(QuantkitError, match="another model"):
        load_session(path, load_model(tiny_model_mtp, recipe="bf16"))
    other = tmp_path / "x.safetensors"
    import torch
    from safetensors.torch import save_file
    save_file({"a": torch.zeros(2)}, str(other))
    with pytest.raises(QuantkitError, match="not a quantkit chat session"):
        load_session(other, fresh(tiny_model))


def test_damaged_files_are_ignored_never_half_loaded(tiny_model, saved, tmp_path):
    path, _ = saved
    data = path.read_bytes()
    header = 8 + int.from_bytes(data[:8], "little")
    cases = {"truncated-header": data[:header // 2], "truncated-data": data[:header + (len(data) - header) // 2],
             "flipped": data[:-10] + bytes([data[-10] ^ 0xFF]) + data[-9:]}
    for name, blob in cases.items():
        p = tmp_path / f"{name}.qks"
        p.write_bytes(blob)
        rt = fresh(tiny_model)
        if name == "truncated-header":  # not recognisably a session: refused, never "ignored and overwritten"
            with pytest.raises(QuantkitError, match="not a quantkit chat session"):
                load_session(p, rt)
            continue
        r = load_session(p, rt)
        assert r.notice and "damaged" in r.notice and "\n" not in r.notice, name
        assert r.restored_tokens == 0 and len(rt.prompt_cache) == 0, name
        assert r.session is not None and len(r.session.messages) == 6  # the conversation survives
        c, _ = chat(rt, r.session, ["whoami"])
        assert c.last.cached_tokens == 0


def test_chat_cli_session_round_trip(tiny_model, tmp_path):
    path = tmp_path / "s.qks"
    args = ["chat", tiny_model, "--session", path, "--temperature", "0", "--max-new-tokens", "4",
            "--prompt-cache-size", "256MB"]
    import os
    import subprocess
    import sys

    def run(stdin: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "quantkit", *map(str, args)], input=stdin, capture_output=True,
                              text=True, env={**os.environ, "COLUMNS": "200", "OMP_NUM_THREADS": "1"}, timeout=300)
    first = run("hello\nls -la\n")
    assert first.returncode == 0, first.stderr
    second = run("whoami\n")
    assert second.returncode == 0, second.stderr
    assert "resumed 4 messages" in second.stderr
    restored = int(second.stderr.split("messages from")[1].split("(")[1].split()[0])
    assert restored > 0 and f"reused {restored}]" in second.stdout
    meta = json.loads(path.read_bytes()[8:8 + int.from_bytes(path.read_bytes()[:8], "little")])["__metadata__"]
    assert len(json.loads(meta["conversation"])["messages"]) == 6
    path.write_bytes(b"garbage" * 10)
    third = run("")  # not quantkit's: refused in one line and left as it was
    assert third.returncode != 0 and "not a quantkit output" in third.stderr and "Traceback" not in third.stderr
    assert path.read_bytes() == b"garbage" * 10
    bad = run_main("chat", tiny_model, "--session", tmp_path / "none.qks", "--prompt-cache-size", "lots")
    assert bad.returncode != 0 and "--prompt-cache-size 'lots'" in bad.stderr and "Traceback" not in bad.stderr
