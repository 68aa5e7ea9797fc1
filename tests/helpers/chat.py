"""A chat driven by scripted input lines."""

from __future__ import annotations

import io

from rich.console import Console

from quantkit.runtime import SamplingParams
from quantkit.runtime.chat import Chat, ChatSession


def run_chat(rt, lines: list[str], sampling: SamplingParams | None = None) -> tuple[Chat, str]:
    feed = iter(lines)

    def read(_prompt: str) -> str:
        try:
            return next(feed)
        except StopIteration:
            raise EOFError from None

    out = io.StringIO()
    chat = Chat(rt, ChatSession(system="You are a terminal."),
                sampling or SamplingParams(temperature=0, max_new_tokens=8), Console(file=out, width=300), read)
    chat.run()
    return chat, out.getvalue()
