"""`quantkit chat` driven through a pseudo-terminal (pexpect), plus its context policy and saved files."""

from __future__ import annotations

import json
import os
import signal
import sys

import pexpect
import pytest

from quantkit.errors import QuantkitError
from quantkit.runtime.chat import ChatSession, fit_context

from helpers.runtime import quantized


def _default_sigint() -> None:
    """Ctrl-C as in a user's terminal: a runner started in the background (`cmd &` in a script) ignores
    SIGINT, and the ignore is inherited, so the chat would never see the test's Ctrl-C at its prompt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
def test_chat_session_in_a_terminal(tiny_model, tmp_path):
    q = quantized(tiny_model, "quality")
    saved = tmp_path / "conv.json"
    env = {**os.environ, "NO_COLOR": "1", "TERM": "dumb", "COLUMNS": "200", "OMP_NUM_THREADS": "1"}
    child = pexpect.spawn(sys.executable, ["-m", "quantkit", "chat", str(q), "--max-new-tokens", "40", "--seed", "0",
                                           "--system", "You are terse."], env=env, encoding="utf-8", timeout=240,
                          dimensions=(50, 200), preexec_fn=_default_sigint)
    try:
        child.expect("you> ")
        child.sendline("hello there")
        child.expect(r"thinking:")  # thinking streams first, apart from the answer
        child.expect(r"\[prompt \d+ tok, [\d.]+ tok/s \| generated \d+ tok, [\d.]+ tok/s \| \w+ \| cpu: weights")
        child.expect("you> ")
        child.sendline(f"/save {saved}")
        child.expect("saved 2 messages")
        child.expect("you> ")
        child.sendline("/stats")
        child.expect(r"context: [\d,]+/32,768 tokens used, 2 messages")
        child.expect("you> ")
        child.sendline("/clear")
        child.expect(r"conversation cleared \(system prompt kept\)")
        child.expect("you> ")
        child.sendline("/system")
        child.expect("system prompt: 'You are terse.'")
        child.expect("you> ")
        child.sendline("second turn, stopped early")
        child.expect("thinking:")
        child.sendintr()  # Ctrl-C stops the reply, not the session
        child.expect(r"\(stopped; the partial reply is kept")
        child.expect("you> ")
        child.sendintr()
        child.expect(r"use /exit or Ctrl-D")
        child.expect("you> ")
        child.sendline(f"/load {saved}")
        child.expect("loaded 2 messages")
        child.expect("you> ")
        child.sendline("/nothink")
        child.expect("thinking off")
        child.expect("you> ")
        child.sendline("/help")
        child.expect("/save FILE")
        child.expect("you> ")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0
    d = json.loads(saved.read_text())
    assert d["system"] == "You are terse." and [m["role"] for m in d["messages"]] == ["user", "assistant"]
    assert d["messages"][0]["content"] == "hello there"


def test_context_policy_drops_oldest_exchanges_never_the_system_prompt():
    s = ChatSession(system="SYS", messages=[])
    for i in range(5):
        s.messages += [{"role": "user", "content": f"u{i}"}, {"role": "assistant", "content": f"a{i}"}]
    s.messages.append({"role": "user", "content": "now"})

    def count(msgs):  # 10 tokens per message
        return 10 * len(msgs)

    dropped, n = fit_context(count, s, context=100, reply_room=40)
    assert dropped == 6 and n == 60  # 12 messages -> system + 5 left; 60 + 40 <= 100
    assert s.conversation()[0] == {"role": "system", "content": "SYS"}
    assert s.messages[0]["content"] == "u3" and s.messages[-1]["content"] == "now"
    lonely = ChatSession(system="SYS", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(QuantkitError, match="does not fit"):
        fit_context(lambda m: 90, lonely, context=100, reply_room=40)


def test_saved_conversation_round_trip_and_bad_files(tmp_path):
    s = ChatSession(system=None, messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
                    thinking=False)
    assert ChatSession.from_json(s.to_json(), "x") == s
    with pytest.raises(QuantkitError, match="not valid JSON"):
        ChatSession.from_json("{", "f.json")
    with pytest.raises(QuantkitError, match="not a conversation"):
        ChatSession.from_json('{"messages": []}', "f.json")
    with pytest.raises(QuantkitError, match="user/assistant"):
        ChatSession.from_json('{"quantkit_chat": 1, "messages": [{"role": "tool", "content": 1}]}', "f.json")
