"""Reading a GGUF file's header safely: its metadata and tensor table, no weights loaded.

`read_gguf(path)` checks, before trusting anything: the file exists and is a file, starts with the GGUF
magic, its header parses (the `gguf` package's reader, which maps the file and reads only the header and
tensor infos), and every tensor's data lies inside the file (a truncated download is refused by name).
Errors are one line (QuantkitError) naming the file and what to do. Scalar and string metadata are kept;
arrays of up to MAX_ARRAY items as lists, longer ones (the tokenizer's 248k tokens) as their length only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quantkit.errors import QuantkitError

MAGIC = b"GGUF"
MAX_ARRAY = 4096


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
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        tname = t.tensor_type.name
        block, nb = gguf.GGML_QUANT_SIZES[t.tensor_type]
        nbytes = math.prod(shape[:-1]) * (shape[-1] // block) * nb if shape else 0
        tensors.append(GgufTensorInfo(t.name, shape, tname, nbytes, int(t.data_offset)))
        end = max(end, int(t.data_offset) + nbytes)
    if end > size:
        raise QuantkitError(f"{p}: truncated ({size:,} bytes, its tensor table needs {end:,}); "
                            "re-download or re-export it")
    return GgufInfo(p, size, meta, tensors)
