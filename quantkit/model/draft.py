"""The part of the vocabulary an MTP draft scores (runtime/model/draft_head.py) and the bytes of its int4 copy,
which the runtime keeps beside an int8 or bf16 lm_head and the planner budgets with the MTP layer."""

from __future__ import annotations

from quantkit.formats import QuantSpec, stored_bytes

DRAFT_ROWS = 32768  # ids the draft scores from the bottom of the vocabulary (0: the whole head)
TAIL = 288  # ids from the top: 248032 and up on Qwen3.5's 248,320, its special tokens among them
TILE = 16
COPY_SPEC = QuantSpec("int4", 128)  # the copy's format (what the quality recipe gives routed experts)
COPIED = ("int8", "bf16")  # lm_head formats the draft reads from a copy (4-bit ones are read in place)


def draft_span(vocab: int, rows: int = DRAFT_ROWS) -> tuple[int, int]:
    """(rows, tail): the draft scores ids [0, rows) and [tail, vocab), both on tile boundaries; rows 0 where
    the reduction does not apply (asked for 0, or the two parts would meet)."""
    rows -= rows % TILE
    tail = (vocab - TAIL) // TILE * TILE
    return (rows if 0 < rows < tail else 0), tail


def copy_bytes(vocab: int, hidden: int, head_format: str, rows: int = DRAFT_ROWS) -> int:
    """Bytes of the int4 copy of the draft's rows of an lm_head stored as `head_format` ("bf16" for kept); 0
    where there is none (no reduction, a head read in place, a width the copy's groups do not divide)."""
    rows, tail = draft_span(vocab, rows)
    if not rows or head_format not in COPIED or hidden % COPY_SPEC.group_size:  # type: ignore[operator]
        return 0
    return stored_bytes(COPY_SPEC, (rows + vocab - tail, hidden))
