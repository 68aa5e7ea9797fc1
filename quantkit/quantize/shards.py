"""Streaming safetensors shard writer with a header laid out before any data is produced.

`safetensors.torch.save_file` needs every tensor of a shard in memory at once (and copies each into a
bytes buffer), so a 2 GB shard costs 4 GB of RAM and a fused expert stack cannot be written slab by
slab. The file format is simple (8-byte little-endian header length, a JSON header with dtype, shape
and data offsets, then the raw bytes), and the quantizer knows every part's shape and dtype before it
quantizes, so this writer lays the header out first and then writes each tensor, or each slab of a
tensor along dim 0, straight to its offset. The result is byte-for-byte what safetensors reads (and
validates: contiguous offsets, header padded to 8 bytes, tensors ordered by alignment then name, as
the Rust writer orders them).
"""

from __future__ import annotations

import errno
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from quantkit.errors import QuantkitError
from quantkit.fileio import fsync_dir, temp_name
from quantkit.sizes import format_size

ST_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
}
TORCH_DTYPES = {v: k for k, v in ST_DTYPES.items()}
# The order the safetensors writer puts tensors in (its Dtype enum, descending), then by name.
_ST_ORDER = ["U64", "I64", "F64", "F32", "U32", "I32", "BF16", "F16", "U16", "I16", "F8_E4M3", "F8_E5M2",
             "I8", "U8", "BOOL"]


def dtype_name(d: torch.dtype) -> str:
    """`torch.bfloat16` -> `"bfloat16"` (the spelling config.json uses)."""
    return str(d).removeprefix("torch.")


@dataclass(frozen=True)
class TensorLayout:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


class ShardLayout:
    """Header and byte offsets of one shard, fixed before any data is written."""

    def __init__(self, tensors: list[TensorLayout], metadata: dict[str, str] | None = None):
        names = [t.name for t in tensors]
        if len(set(names)) != len(names):
            raise QuantkitError("internal: duplicate tensor names in one shard")
        self.tensors = sorted(tensors, key=lambda t: (_ST_ORDER.index(ST_DTYPES[t.dtype]), t.name))
        header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
        self.offsets: dict[str, int] = {}
        pos = 0
        for t in self.tensors:
            header[t.name] = {"dtype": ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [pos, pos + t.nbytes]}
            self.offsets[t.name] = pos
            pos += t.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.header = struct.pack("<Q", len(raw)) + raw
        self.data_bytes = pos
        self.by_name = {t.name: t for t in self.tensors}

    @property
    def size(self) -> int:
        return len(self.header) + self.data_bytes


def _reserve(fd: int, size: int) -> None:
    """Allocate the file's blocks up front: a full disk fails here, before any work, and writes into
    allocated blocks run much faster than into a sparse file on ext4 (no block allocation on the write path).
    Filesystems without fallocate get a sparse file of the same size."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise QuantkitError(f"not enough free disk for a {format_size(size)} shard ({e.strerror})") from None
        os.ftruncate(fd, size)
    except AttributeError:  # no posix_fallocate on this platform
        os.ftruncate(fd, size)


class ShardWriter:
    """Writes one shard under a hidden temporary name; `commit()` checks every byte was written, fsyncs
    and renames it into place. Leaving without commit deletes the temporary file."""

    def __init__(self, path: Path, layout: ShardLayout):
        self.path = path
        self.layout = layout
        self.tmp = temp_name(path)
        self._written: dict[str, int] = {t.name: 0 for t in layout.tensors}
        self._f = open(self.tmp, "wb", buffering=0)
        try:
            self._f.write(layout.header)
            _reserve(self._f.fileno(), layout.size)
        except BaseException:
            self.abort()
            raise

    def write(self, name: str, t: torch.Tensor, start: int = 0) -> None:
        """Write `t` (the whole tensor, or rows `start:start+len(t)` along dim 0) into place."""
        lay = self.layout.by_name.get(name)
        if lay is None:
            raise QuantkitError(f"internal: {name} is not in the layout of {self.path.name}")
        if t.dtype != lay.dtype or tuple(t.shape[1:]) != lay.shape[1:] or (
            len(lay.shape) == 0 and tuple(t.shape) != ()
        ):
            raise QuantkitError(
                f"internal: {name} part is {tuple(t.shape)} {t.dtype}, layout says {lay.shape} {lay.dtype}"
            )
        row_bytes = lay.nbytes // lay.shape[0] if lay.shape and lay.shape[0] else lay.nbytes
        off = len(self.layout.header) + self.layout.offsets[name] + start * row_bytes
        data = t.detach().contiguous().view(torch.uint8).numpy() if t.numel() else b""
        n = len(data) if isinstance(data, bytes) else data.nbytes
        if start * row_bytes + n > lay.nbytes:
            raise QuantkitError(f"internal: write past the end of {name}")
        view = memoryview(data) if n else b""
        done = 0
        while done < n:  # pwrite: no shared file position, so writes to other offsets may interleave
            done += os.pwrite(self._f.fileno(), view[done:], off + done)
        self._written[name] += n

    def commit(self) -> None:
        self.finish()
        self.publish()

    def finish(self) -> None:
        """Check every byte was written, fsync and close the temporary (still under its hidden name)."""
        for t in self.layout.tensors:
            if self._written[t.name] != t.nbytes:
                raise QuantkitError(
                    f"internal: {t.name} got {self._written[t.name]} of {t.nbytes} bytes in {self.path.name}"
                )
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()

    def publish(self) -> None:
        """Rename the finished temporary into place (a journal can record it first: see quantize/run.py)."""
        os.replace(self.tmp, self.path)
        fsync_dir(self.path.parent)

    def abort(self) -> None:
        if not self._f.closed:
            self._f.close()
        self.tmp.unlink(missing_ok=True)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None or not self._f.closed:
            self.abort()


def read_header(path: Path) -> dict[str, dict]:
    """The JSON header of a safetensors file (without __metadata__), checked for sanity."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise QuantkitError(f"{path.name}: truncated safetensors file (no header)")
            (n,) = struct.unpack("<Q", head)
            size = path.stat().st_size
            if n > min(size - 8, 100 << 20):
                raise QuantkitError(f"{path.name}: corrupt safetensors header (length {n})")
            raw = f.read(n)
    except OSError as e:
        raise QuantkitError(f"{path}: cannot read ({e.strerror})") from None
    try:
        hdr = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise QuantkitError(f"{path.name}: corrupt safetensors header (not JSON)") from None
    if not isinstance(hdr, dict):
        raise QuantkitError(f"{path.name}: corrupt safetensors header")
    hdr.pop("__metadata__", None)
    end = 0
    for k, v in hdr.items():
        try:
            a, b = v["data_offsets"]
            end = max(end, int(b))
            v["dtype"], v["shape"]  # noqa: B018
        except (KeyError, TypeError, ValueError):
            raise QuantkitError(f"{path.name}: corrupt safetensors header entry {k!r}") from None
    if 8 + n + end > size:
        raise QuantkitError(f"{path.name}: truncated ({size} bytes, header needs {8 + n + end})")
    return hdr
