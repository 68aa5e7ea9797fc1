"""Text for a terminal: generated text (and anything else quantkit echoes from a model or a file) goes
through `printable` before chat and generate write it, so escape sequences in the output cannot move the
cursor, rewrite the screen, set the window title or hide text. Newlines and tabs stay; other C0 controls,
DEL, C1 controls and whole ESC sequences (CSI, OSC, ...) are removed. The server returns text as generated.
Error lines, which name paths and values a user gave, show those bytes instead: `escaped`."""

from __future__ import annotations

import re

_CONTROL = re.compile(
    r"\x1b\[[0-?]*[ -/]*[@-~]"          # CSI: colours, cursor moves, erase
    r"|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?"  # OSC: window title, hyperlinks (to BEL or ST)
    r"|\x1b[P^_X][^\x1b]*(?:\x1b\\)?"     # DCS, PM, APC, SOS strings
    r"|\x1b.?"                           # any other escape and the byte after it
    r"|[\x00-\x08\x0b-\x1f\x7f-\x9f]"    # other C0 (keeps \t, \n), DEL, C1
)


def printable(text: str) -> str:
    """`text` without terminal control bytes (see the module docstring)."""
    return _CONTROL.sub("", text)


_CONTROL_CHAR = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def escaped(text: str) -> str:
    """`text` with every control character but newline and tab written out as `\\xNN` (an ESC as `\\x1b`):
    for error lines, which name paths and values as given: a name stays recognisable, a terminal runs none
    of its escape sequences."""
    return _CONTROL_CHAR.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def plural(n: int, word: str, many: str | None = None) -> str:
    """`1 shard`, `2 shards`, `1 entry`/`3 entries` (`many` where adding an s is not the plural): every count
    quantkit writes for a person goes through this, so none reads `1 shards`."""
    return f"{n} {word if n == 1 else many or word + 's'}"
