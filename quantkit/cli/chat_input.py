"""Reading a chat message that spans lines, as Ollama does: a line starting with `\"\"\"` opens the message,
a line ending with `\"\"\"` closes it (`\"\"\"one line\"\"\"` works too). A terminal that supports bracketed
paste delivers a pasted block as one message without the quotes (readline's `enable-bracketed-paste`)."""

from __future__ import annotations

from collections.abc import Callable

FENCE = '"""'


def multiline(read: Callable[[str], str], more: str = "... ") -> Callable[[str], str]:
    """`read` (input-like) wrapped so a fenced block comes back as one message with its newlines."""
    def reader(prompt: str) -> str:
        line = read(prompt)
        head = line.lstrip()
        if not head.startswith(FENCE):
            return line
        body = head[len(FENCE):]
        if body.rstrip().endswith(FENCE):  # """one line"""
            return body.rstrip()[: -len(FENCE)]
        parts = [body]
        while True:
            try:
                nxt = read(more)
            except EOFError:  # Ctrl-D inside the block: send what was typed
                break
            if nxt.rstrip().endswith(FENCE):
                parts.append(nxt.rstrip()[: -len(FENCE)])
                break
            parts.append(nxt)
        return "\n".join(parts).strip("\n")
    return reader


def enable_bracketed_paste() -> None:
    """Ask readline (when present) to take a pasted block as one input, newlines included."""
    try:
        import readline
    except ImportError:  # pragma: no cover - no readline (Windows)
        return
    try:
        readline.parse_and_bind("set enable-bracketed-paste on")
    except Exception:  # noqa: BLE001 - an old readline without the setting: lines as before
        pass
