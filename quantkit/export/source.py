"""What an export reads: a bf16 (or fp16/fp32/FP8) checkpoint, or a quantkit quantized folder.

Both are presented the same way, as canonical tensors (published names, routed experts fused) that can
be read dense (fp32, dequantized where stored quantized) or, for a quantized folder, as the stored parts
so an exporter can reuse codes instead of requantizing. Reads go through `quantkit.model.checkpoint.Checkpoint`
(validated headers and index paths, never unpickles); a quantized folder is also checked against its
manifest and config (`quantkit.quantize.verify.verify_folder`, sizes only) before anything is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from quantkit.errors import QuantkitError
from quantkit.formats import QuantSpec, get_format
from quantkit.model.checkpoint import Checkpoint
from quantkit.model.spec import Role, TextConfig, parse_text_config, role_of

KNOWN_VERSIONS = (1,)


@dataclass(frozen=True)
class SourceTensor:
    name: str  # canonical (published) name
    shape: tuple[int, ...]
    dtype: str  # torch dtype name of the dense tensor
    role: Role
    spec: QuantSpec | None  # how it is stored in a quantkit folder; None = dense


class ExportSource:
    """A checkpoint opened for export. Use `ExportSource.open(path)`."""

    def __init__(self, path: Path, ckpt: Checkpoint, quant: dict[str, Any] | None):
        self.path = path
        self.ckpt = ckpt
        self.config: dict[str, Any] = ckpt.config
        self.quant = quant  # quantization_config of a quantkit folder, else None
        self.text: TextConfig = parse_text_config(self.config, str(path / "config.json"))
        self._parts: dict[str, dict[str, str]] | None = None
        self._tensors = self._list()
        self._by_name = {t.name: t for t in self._tensors}

    @classmethod
    def open(cls, path: str | Path) -> ExportSource:
        p = Path(path)
        if not p.exists():
            raise QuantkitError(f"{p}: no such checkpoint folder")
        if not p.is_dir():
            raise QuantkitError(f"{p}: not a folder; pass a checkpoint folder (config.json + *.safetensors)")
        ckpt = Checkpoint.open(p)
        qc = ckpt.config.get("quantization_config") if isinstance(ckpt.config, dict) else None
        quant = None
        if isinstance(qc, dict) and qc.get("quant_method") == "quantkit":
            if qc.get("version") not in KNOWN_VERSIONS:
                raise QuantkitError(f"{p / 'config.json'}: quantkit checkpoint version {qc.get('version')!r} is "
                                    f"not one this quantkit reads ({KNOWN_VERSIONS}); upgrade quantkit")
            from quantkit.quantize.verify import verify_folder

            res = verify_folder(p, hash_files=False)
            if not res.ok:
                raise QuantkitError(f"{p}: damaged quantkit folder ({res.problems[0]}); run `quantkit verify {p}`")
            quant = qc
        elif isinstance(qc, dict) and qc.get("quant_method") not in (None, "fp8"):
            raise QuantkitError(f"{p}: quantized with {qc.get('quant_method')!r}, which quantkit does not read; "
                                "export from the bf16 checkpoint or a quantkit folder")
        return cls(p, ckpt, quant)

    # ---- listing ----
    def _list(self) -> list[SourceTensor]:
        if self.quant is None:
            return [SourceTensor(t.name, tuple(t.shape), t.dtype, t.role, None) for t in self.ckpt.canonical()]
        tq = self.quant.get("tensors") or {}
        names = self.ckpt.names()
        out: list[SourceTensor] = []
        seen: set[str] = set()
        for n in names:
            base, _, suffix = n.rpartition(".")
            if base in tq and "." not in suffix:
                if base in seen:
                    continue
                seen.add(base)
                d = tq[base]
                out.append(SourceTensor(base, tuple(d["shape"]), d.get("dtype", "bfloat16"), role_of(base),
                                        QuantSpec.from_dict(d)))
            elif n not in tq:
                shape, dt = self.ckpt.header(n)
                out.append(SourceTensor(n, tuple(shape), dt, role_of(n), None))
        missing = [n for n in tq if n not in seen]
        if missing:
            raise QuantkitError(f"{self.path}: config.json lists {missing[0]} as quantized but no part of it is "
                                f"stored; run `quantkit verify {self.path}`")
        return out

    def tensors(self) -> list[SourceTensor]:
        return list(self._tensors)

    def get(self, name: str) -> SourceTensor:
        try:
            return self._by_name[name]
        except KeyError:
            raise QuantkitError(f"{self.path}: no tensor named {name}") from None

    def has(self, name: str) -> bool:
        return name in self._by_name

    # ---- reading ----
    def parts(self, name: str, experts: slice | None = None) -> dict[str, torch.Tensor]:
        """The stored parts of a quantized tensor (all experts or a contiguous slab)."""
        t = self.get(name)
        if t.spec is None:
            raise QuantkitError(f"{name}: stored dense, it has no quantized parts")
        out = {}
        for suffix, n in self._part_names(name).items():
            # a slab of the stored part, read from disk alone (Checkpoint.load slices canonical tensors only)
            out[suffix] = self.ckpt.get(n, experts)
        return out

    def _part_names(self, name: str) -> dict[str, str]:
        if self._parts is None:
            tq = (self.quant or {}).get("tensors") or {}
            self._parts = {}
            for n in self.ckpt.names():
                base, _, suffix = n.rpartition(".")
                if base in tq:
                    self._parts.setdefault(base, {})[suffix] = n
        return self._parts.get(name, {})

    def dense(self, name: str, experts: slice | None = None, native: bool = False) -> torch.Tensor:
        """The tensor as fp32 (dequantized from its parts where stored quantized); `native=True` keeps a
        stored float tensor in its own dtype (a caller converting it in chunks saves the fp32 copy)."""
        t = self.get(name)
        if t.spec is None:
            if self.quant is None:
                w = self.ckpt.load(name, experts=experts)
            else:
                w = self.ckpt.get(name, experts)
            return w if native and w.is_floating_point() else w.float()
        parts = self.parts(name, experts)
        shape = t.shape if experts is None else (_slab_len(experts, t.shape[0]), *t.shape[1:])
        return get_format(t.spec.format).dequantize(parts, t.spec, shape, torch.float32)

    def close(self) -> None:
        self.ckpt.close()


def _slab_len(sl: slice, n: int) -> int:
    start, stop, _ = sl.indices(n)
    return max(0, stop - start)
