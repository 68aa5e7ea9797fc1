"""A chat message of several lines (issue 29): Ollama's \"\"\" fence, unit by unit and through the real chat
in a pseudo-terminal (one user message with its newlines, not one turn per line)."""

from __future__ import annotations

import json
import os
import sys

import pexpect
import pytest

from quantkit.cli.chat_input import multiline

from helpers.runtime import quantized


def _reader(lines: list[str]):
    it = iter(lines)
    prompts: list[str] = []

    def read(prompt: str) -> str:
        prompts.append(prompt)
        try:
            return next(it)
        except StopIteration:
            raise EOFError from None
    return multiline(read), prompts


@pytest.mark.parametrize("lines,want", [
    (["hello"], "hello"),
    (['"""', "line one", "  line two", '"""'], "line one\n  line two"),
    (['"""first', "second", 'third"""'], "first\nsecond\nthird"),
    (['"""just one"""'], "just one"),
    (['"""', "typed then Ctrl-D"], "typed then Ctrl-D"),
    (['/save x.json'], "/save x.json"),
])
def test_fenced_blocks_are_one_message(lines, want):
    read, prompts = _reader(lines)
    assert read("you> ") == want
    assert prompts[0] == "you> " and all(p == "... " for p in prompts[1:])


@pytest.mark.slow
def test_chat_takes_a_fenced_message_as_one_turn(tiny_model, tmp_path):
    q = quantized(tiny_model, "quality")
    saved = tmp_path / "conv.json"
    env = {**os.environ, "NO_COLOR": "1", "TERM": "dumb", "COLUMNS": "200", "OMP_NUM_THREADS": "1"}
    child = pexpect.spawn(sys.executable, ["-m", "quantkit", "chat", str(q), "-n", "4", "--no-think"], env=env,
                          encoding="utf-8", timeout=240, dimensions=(50, 200))
    try:
        child.expect("you> ")
        child.sendline('"""')
        child.expect(r"\.\.\. ")
        child.sendline("$ ls")
        child.expect(r"\.\.\. ")
        child.sendline('$ pwd"""')
        child.expect("you> ")
        child.sendline(f"/save {saved}")
        child.expect("saved 2 messages")
        child.expect("you> ")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    msgs = json.loads(saved.read_text())["messages"]
    assert [m["role"] for m in msgs] == ["user", "assistant"] and msgs[0]["content"] == "$ ls\n$ pwd"
