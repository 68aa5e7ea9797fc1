"""Reading a GGUF file's header safely: its metadata and tensor table, no weights loaded.

`read_gguf(path)` checks, before trusting anything: the file exists and is a file, starts with the GGUF
magic, its header parses (the `gguf` package's reader, which maps the file and reads only the header and
tensor infos), and every tensor's data lies inside the file (a truncated download is refused by name).
Before the reader runs, `check_header_bounds` walks the header checking every count and length it declares
(tensors, keys, strings, arrays) against bounds and the file's size, so a hostile header cannot hang it;
after, every tensor's dimensions (1..2^40, whole blocks) and offset alignment are checked.
Errors are one line (QuantkitError) naming the file and what to do. Scalar and string metadata are kept;
arrays of up to MAX_ARRAY items as lists, longer ones (the tokenizer's 248k tokens) as their length only.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quantkit.errors import QuantkitError

MAGIC = b"GGUF"
MAX_ARRAY = 4096
# Bounds on what a header may declare, far above any real model's (a 248k-token vocabulary, ~2k tensors, a
# chat template of kilobytes) so that a hostile header is refused before it is walked.
MAX_ENTRIES = 1 << 20
MAX_ITEMS = 1 << 24
MAX_STRING = 1 << 26
MAX_DIM = 1 << 40
# GGUF value types: scalar sizes, string, array
_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GgufTensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (outermost first); GGUF stores the reverse (ggml ne)
    type: str  # ggml type name, "Q4_K"
    nbytes: int
    offset: int  # absolute file offset of the data


@dataclass
class GgufInfo:
    path: Path
    size: int
    metadata: dict[str, Any]
    tensors: list[GgufTensorInfo] = field(default_factory=list)

    @property
    def arch(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def get(self, key: str, default: Any = None) -> Any:
        """Architecture key `key` (e.g. "block_count" -> "qwen35moe.block_count")."""
        return self.metadata.get(f"{self.arch}.{key}", default)

    def by_name(self) -> dict[str, GgufTensorInfo]:
        return {t.name: t for t in self.tensors}


def _value(field_: Any) -> Any:
    from gguf import GGUFValueType

    if not field_.types:
        return None
    if field_.types[0] == GGUFValueType.ARRAY:
        n = len(field_.data)
        if n > MAX_ARRAY:
            return n
        sub = field_.types[-1]
        if sub == GGUFValueType.STRING:
            return [bytes(field_.parts[i]).decode("utf-8", "replace") for i in field_.data]
        return [field_.parts[i].tolist()[0] for i in field_.data]
    if field_.types[0] == GGUFValueType.STRING:
        return bytes(field_.parts[-1]).decode("utf-8", "replace")
    return field_.parts[-1].tolist()[0]


class _Walk:
    """A cursor over a mapped GGUF header: every read is checked to lie inside the file."""

    def __init__(self, buf: mmap.mmap, p: Path):
        self.buf, self.p, self.pos = buf, p, 0

    def take(self, n: int, what: str) -> int:
        """Advance by `n` bytes; returns where they start."""
        if self.pos + n > len(self.buf):
            raise QuantkitError(f"{self.p}: the GGUF header's {what} runs past the end of the file; "
                                "re-download or re-export it")
        self.pos += n
        return self.pos - n

    def read(self, fmt: str, what: str) -> tuple[int, ...]:
        return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt), what))

    def too_many(self, n: int, limit: int, what: str) -> None:
        if n > limit:
            raise QuantkitError(f"{self.p}: the GGUF header declares {what} of {n:,} (at most {limit:,}); not a "
                                "model file quantkit reads")

    def string(self, what: str) -> str:
        (n,) = self.read("<Q", what)
        self.too_many(n, MAX_STRING, f"{what[:80]}: a string")
        at = self.take(n, what)
        return bytes(self.buf[at:at + min(n, 200)]).decode("utf-8", "replace")

    def value(self, vtype: int, key: str, depth: int = 0) -> None:
        """Skip one metadata value of type `vtype`, every declared length checked."""
        if vtype in _SCALAR:
            self.take(_SCALAR[vtype], key)
        elif vtype == _STRING:
            self.string(key)
        elif vtype == _ARRAY and depth < 2:
            sub, n = self.read("<IQ", key)
            self.too_many(n, MAX_ITEMS, f"{key[:80]}: an array")
            if sub in _SCALAR:
                self.take(n * _SCALAR[sub], key)
            else:
                for _ in range(n):
                    self.value(sub, key, depth + 1)
        else:
            raise QuantkitError(f"{self.p}: GGUF key {key[:80]} has value type {vtype}, which GGUF does not "
                                "define; re-export it")


def check_header_bounds(p: Path, size: int) -> None:
    """Walk the GGUF header checking every count and length it declares against bounds and the file's size
    BEFORE the `gguf` reader trusts them (a 2^62-item array or tensor count would hang it)."""
    if size < 24:
        raise QuantkitError(f"{p}: the GGUF header is truncated ({size} bytes); re-download or re-export it")
    with p.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        w = _Walk(buf, p)
        magic, version, n_tensors, n_kv = w.read("<4sIQQ", "start")
        if magic != MAGIC:
            raise QuantkitError(f"{p}: not a GGUF file (it does not start with 'GGUF'); name a .gguf file")
        if version not in (2, 3):
            raise QuantkitError(f"{p}: GGUF version {version}; quantkit reads versions 2 and 3")
        w.too_many(n_tensors, MAX_ENTRIES, "a tensor count")
        w.too_many(n_kv, MAX_ENTRIES, "a metadata key count")
        for _ in range(n_kv):
            key = w.string("key name")
            (vtype,) = w.read("<I", key)
            w.value(vtype, key)
        for _ in range(n_tensors):
            name = w.string("tensor name")
            (n_dims,) = w.read("<I", "tensor table")
            if not 0 < n_dims <= 4:
                raise QuantkitError(f"{p}: tensor {name[:80]} has {n_dims} dimensions in the GGUF tensor table "
                                    "(1 to 4); re-export it")
            dims = w.read(f"<{n_dims}Q", "tensor table")
            if not all(1 <= d <= MAX_DIM for d in dims):
                raise QuantkitError(f"{p}: tensor {name[:80]} has shape {list(dims)} in the GGUF tensor table "
                                    "(dimensions 1..2^40); re-export it")
            w.read("<IQ", "tensor table")  # type, offset: checked once the reader has parsed them


def read_gguf(path: str | Path, what: str = "GGUF file") -> GgufInfo:
    """The header of GGUF file `path` (metadata and tensor table), validated; `what` names it in errors."""
    p = Path(path)
    if not p.is_file():
        raise QuantkitError(f"{p}: no such {what}")
    size = p.stat().st_size
    with p.open("rb") as f:
        head = f.read(4)
    if head != MAGIC:
        raise QuantkitError(f"{p}: not a GGUF file (it does not start with 'GGUF'); name a .gguf {what}")
    check_header_bounds(p, size)
    import gguf

    try:
        reader = gguf.GGUFReader(str(p))
    except (ValueError, IndexError, KeyError, OSError, UnicodeDecodeError, EOFError) as e:
        raise QuantkitError(f"{p}: the GGUF header is damaged or truncated ({type(e).__name__}); "
                            "re-download or re-export it") from None
    meta = {}
    for k, fld in reader.fields.items():
        if k.startswith("GGUF."):
            continue
        meta[k] = _value(fld)
    tensors = []
    end = 0
    align = meta.get("general.alignment", 32)
    if not isinstance(align, int) or isinstance(align, bool) or not 0 < align <= 1 << 16 or align & (align - 1):
        raise QuantkitError(f"{p}: general.alignment {align!r} is not a power of two; re-export it")
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        tname = t.tensor_type.name
        block, nb = gguf.GGML_QUANT_SIZES[t.tensor_type]
        if not shape or min(shape) < 1 or max(shape) > MAX_DIM or shape[-1] % block:
            raise QuantkitError(f"{p}: tensor {t.name[:80]} has shape {list(shape)}, not a {tname} tensor "
                                "(dimensions 1..2^40, rows a whole number of blocks); re-export it")
        if int(t.data_offset) % align:
            raise QuantkitError(f"{p}: tensor {t.name[:80]} data is not aligned to {align} bytes; re-export it")
        nbytes = math.prod(shape[:-1]) * (shape[-1] // block) * nb if shape else 0
        tensors.append(GgufTensorInfo(t.name, shape, tname, nbytes, int(t.data_offset)))
        end = max(end, int(t.data_offset) + nbytes)
    if end > size:
        raise QuantkitError(f"{p}: truncated ({size:,} bytes, its tensor table needs {end:,}); "
                            "re-download or re-export it")
    return GgufInfo(p, size, meta, tensors)
