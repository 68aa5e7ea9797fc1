"""The part of the vocabulary an MTP draft scores (runtime/model/draft_head.py) and the bytes of its int4 copy,
which the runtime keeps beside the lm_head and the planner budgets with the MTP layer; and the int4 form the
runtime holds the MTP layer's own dense matrices in (`layer_copy_spec`).

A draft scores `rows` ids and the top `TAIL` ones (Qwen's special tokens). On Qwen3.5's vocabulary the `rows`
are the most frequent ids of a shipped ranking (`IDS_FILE`, built and measured by scripts/draft_vocab.py:
Qwen's ids are not in frequency order, its Chinese tokens sit above id 64k); on any other vocabulary they are
the lowest ids."""

from __future__ import annotations

import functools
import zlib
from pathlib import Path

from quantkit.checkpoint.spec import Role, mtp_subrole
from quantkit.errors import QuantkitError
from quantkit.fileio import read_bytes_bounded
from quantkit.formats import QuantSpec, stored_bytes

DRAFT_ROWS = 32768  # ids the draft scores below the top ones (0: the whole head)
TAIL = 288  # ids from the top: 248032 and up on Qwen3.5's 248,320, its special tokens among them
TILE = 16
COPY_SPEC = QuantSpec("int4", 128)  # the copy's format (what the quality recipe gives routed experts)
COPIED = ("int8", "bf16")  # lm_head formats whose id-prefix rows the draft reads from a copy (4-bit: in place)
LAYER_COPIED = (Role.ATTENTION, Role.SHARED_EXPERT)  # the MTP layer's dense roles (mtp.fc plays attention)
RANKED_VOCAB = 248320  # Qwen3.5 / 3.6's vocabulary, the one the ranking was counted with
IDS_FILE = "draft_ids_qwen3_5.bin"  # zlib of the ranked ids, uint32 little-endian, most frequent first
IDS_LIMIT = 1 << 20  # bytes the file may hold, compressed and not


def draft_span(vocab: int, rows: int = DRAFT_ROWS) -> tuple[int, int]:
    """(rows, tail): the draft scores `rows` ids below `tail` and [tail, vocab), rows and tail on tile
    boundaries; rows 0 where the reduction does not apply (asked for 0, or the two parts would meet)."""
    rows -= rows % TILE
    tail = (vocab - TAIL) // TILE * TILE
    return (rows if 0 < rows < tail else 0), tail


def load_ranking(path: Path) -> tuple[int, ...]:
    """Ranked ids from an `IDS_FILE`-format file, most frequent first (read with a size bound and checked)."""
    fix = "reinstall quantkit, or rebuild it with scripts/draft_vocab.py"
    d = zlib.decompressobj()
    try:
        raw = d.decompress(read_bytes_bounded(path, "draft vocabulary", IDS_LIMIT), IDS_LIMIT + 1)
    except zlib.error:
        raise QuantkitError(f"{path}: not a zlib stream; {fix}") from None
    _, tail = draft_span(RANKED_VOCAB)
    ids = tuple(int.from_bytes(raw[i:i + 4], "little") for i in range(0, len(raw), 4))
    if len(raw) > IDS_LIMIT or d.unconsumed_tail or len(raw) % 4 or len(set(ids)) != len(ids) or (
            ids and max(ids) >= tail):
        raise QuantkitError(f"{path}: not a ranking of distinct ids below {tail}; {fix}")
    return ids


@functools.lru_cache(maxsize=1)
def ranked_ids() -> tuple[int, ...]:
    """The shipped ranking of Qwen3.5's ids below the tail, most frequent first."""
    return load_ranking(Path(__file__).with_name(IDS_FILE))


def ranked(vocab: int) -> bool:
    """Whether a draft on this vocabulary takes its rows from the shipped ranking."""
    return vocab == RANKED_VOCAB


def draft_ids(vocab: int, rows: int = DRAFT_ROWS, by_rank: bool = True) -> list[int] | None:
    """The ids a draft of `rows` scores, ascending (its head's outputs in this order): the ranked ones where
    `by_rank` and the vocabulary is the ranking's, else the lowest; None: the whole head."""
    rows, tail = draft_span(vocab, rows)
    if not rows:
        return None
    if not (by_rank and ranked(vocab)):
        return [*range(rows), *range(tail, vocab)]
    low = set(ranked_ids()[:rows])
    for i in range(tail):  # past the ranking's length: the lowest ids it does not hold
        if len(low) >= rows:
            break
        low.add(i)
    return [*sorted(low), *range(tail, vocab)]


def copy_bytes(vocab: int, hidden: int, head_format: str, rows: int = DRAFT_ROWS) -> int:
    """Bytes of the int4 copy of the draft's rows of an lm_head stored as `head_format` ("bf16" for kept); 0
    where there is none (no reduction, an id prefix of a 4-bit head, read in place, a width the copy's groups
    do not divide)."""
    rows, tail = draft_span(vocab, rows)
    if not rows or (head_format not in COPIED and not ranked(vocab)) or hidden % COPY_SPEC.group_size:  # type: ignore[operator]
        return 0
    return stored_bytes(COPY_SPEC, (rows + vocab - tail, hidden))


def layer_copy_spec(name: str, stored_format: str, shape: tuple[int, ...]) -> QuantSpec | None:
    """The int4 spec the runtime holds an MTP-layer matrix in, or None to hold it as stored.

    The layer only drafts, and a verify decides every token, so its attention (`mtp.fc` with it) and shared
    expert stored int8 or bf16 are held as int4 (the stored form is let go): they are most of what a draft reads
    besides its head. COPY_SPEC's group, or the largest smaller one that divides the row (as the recipe does on
    small models). bench mtp's trained part measures what this costs in acceptance."""
    if (not name.startswith("mtp.") or stored_format not in COPIED or len(shape) != 2
            or mtp_subrole(name) not in LAYER_COPIED):
        return None
    group = next((g for g in (COPY_SPEC.group_size, 64, 32) if shape[1] % g == 0), None)  # type: ignore[operator]
    return QuantSpec(COPY_SPEC.format, group, COPY_SPEC.symmetric) if group else None
