"""A chat driven by scripted input lines."""

from __future__ import annotations

import io
from collections.abc import Callable

from rich.console import Console

from quantkit.runtime import SamplingParams
from quantkit.runtime.chat import Chat, ChatSession


def scripted_input(lines: list[str]) -> Callable[[str], str]:
    """A chat's input function that gives `lines` in turn, then EOF (as a user's Ctrl-D)."""
    feed = iter(lines)

    def read(_prompt: str) -> str:
        try:
            return next(feed)
        except StopIteration:
            raise EOFError from None

    return read


def run_chat(rt, lines: list[str], sampling: SamplingParams | None = None) -> tuple[Chat, str]:
    out = io.StringIO()
    chat = Chat(rt, ChatSession(system="You are a terminal."),
                sampling or SamplingParams(temperature=0, max_new_tokens=8), Console(file=out, width=300),
                scripted_input(lines))
    chat.run()
    return chat, out.getvalue()
