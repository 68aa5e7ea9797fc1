"""The one reader of quantkit output folders, shared by the runtime loader, verify's callers and both exporters.

`QuantizedFolder.open(path)` checks the contract (quantkit/checkpoint/contract.py: method and version), reads the
shard headers through `Checkpoint` (index paths validated, never unpickled) and lists every tensor under its
canonical name as a `StoredTensor`: quantized ones with their `QuantSpec` and original shape (their parts
`N.<suffix>` grouped), dense ones as stored. `parts(name, experts)` and `dense(name, experts)` read one
tensor (or a contiguous slab of experts) from disk alone, with plain reads into fresh memory (Checkpoint.read:
no memory map stays behind, so a reader's RSS counts each weight once).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from quantkit.checkpoint.contract import read_quant_config
from quantkit.checkpoint.reader import Checkpoint
from quantkit.checkpoint.spec import Role, dtype_bytes, role_of
from quantkit.errors import QuantkitError
from quantkit.formats import QuantSpec


@dataclass(frozen=True)
class StoredTensor:
    """One canonical tensor of a checkpoint: how it is stored (spec None = dense) and what it was."""

    name: str  # canonical (published) name
    shape: tuple[int, ...]  # the original (dense) shape
    dtype: str  # torch dtype name of the dense tensor
    role: Role
    spec: QuantSpec | None


class QuantizedFolder:
    """A quantkit output folder opened for reading. Use `QuantizedFolder.open(path)` (or `from_checkpoint`)."""

    def __init__(self, ckpt: Checkpoint, qc: dict[str, Any]):
        self.path = ckpt.path
        self.ckpt = ckpt
        self.config: dict[str, Any] = ckpt.config
        self.quant = qc
        self.drop_cache = False  # set by a reader that copies the whole folder (Checkpoint.read)
        self._parts: dict[str, dict[str, str]] = {}  # canonical name -> suffix -> stored name
        self._tensors: dict[str, StoredTensor] = {}
        tq = qc["tensors"]
        for n in ckpt.names():
            base, _, suffix = n.rpartition(".")
            if base in tq and "." not in suffix:
                if base not in self._parts:
                    d = tq[base]
                    try:
                        spec, shape = QuantSpec.from_dict(d), tuple(int(x) for x in d["shape"])
                    except (KeyError, TypeError, ValueError) as e:
                        raise QuantkitError(f"{self.path / 'config.json'}: quantization_config entry {base} is "
                                            f"malformed ({e}); run `quantkit verify {self.path}`") from None
                    self._tensors[base] = StoredTensor(base, shape, d.get("dtype", "bfloat16"), role_of(base), spec)
                self._parts.setdefault(base, {})[suffix] = n
            elif n not in tq:
                shape, dt = ckpt.header(n)
                self._tensors[n] = StoredTensor(n, tuple(shape), dt, role_of(n), None)
        missing = [n for n in tq if n not in self._parts]
        if missing:
            raise QuantkitError(f"{self.path}: config.json lists {missing[0]} as quantized but no part of it is "
                                f"stored; run `quantkit verify {self.path}`")

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint) -> QuantizedFolder | None:
        """The folder read as a quantkit output, or None when `ckpt` is not one."""
        qc = read_quant_config(ckpt.path, ckpt.config)
        return None if qc is None else cls(ckpt, qc)

    @classmethod
    def open(cls, path: str | Path) -> QuantizedFolder:
        ckpt = Checkpoint.open(path)
        q = cls.from_checkpoint(ckpt)
        if q is None:
            ckpt.close()
            raise QuantkitError(f"{path}: not a quantkit output folder (no quantkit quantization_config)")
        return q

    # ---- listing ----
    def tensors(self) -> list[StoredTensor]:
        return list(self._tensors.values())

    def get(self, name: str) -> StoredTensor:
        try:
            return self._tensors[name]
        except KeyError:
            raise QuantkitError(f"{self.path}: no tensor named {name}") from None

    def has(self, name: str) -> bool:
        return name in self._tensors

    def stored_bytes(self, name: str) -> int:
        """Bytes of one tensor on disk: its parts (packed values, scales, zeros) or its dense data."""
        names = list(self._parts[name].values()) if name in self._parts else [self.get(name).name]
        return sum(math.prod(s) * dtype_bytes(d) for s, d in (self.ckpt.header(n) for n in names))

    # ---- reading ----
    def parts(self, name: str, experts: slice | None = None) -> dict[str, torch.Tensor]:
        """The stored parts of a quantized tensor (all experts, or a contiguous slab read from disk alone)."""
        if self.get(name).spec is None:
            raise QuantkitError(f"{name}: stored dense, it has no quantized parts")
        return {suffix: self.ckpt.read(n, experts, self.drop_cache) for suffix, n in self._parts[name].items()}

    def stored(self, name: str, experts: slice | None = None) -> torch.Tensor:
        """A dense tensor as stored (its own dtype)."""
        if self.get(name).spec is not None:
            raise QuantkitError(f"{name}: stored quantized; read its parts")
        return self.ckpt.read(name, experts, self.drop_cache)

    def close(self) -> None:
        self.ckpt.close()
