"""What an export reads: a bf16 (or fp16/fp32/FP8) checkpoint, or a quantkit quantized folder.

Both are presented the same way, as canonical tensors (published names, routed experts fused, each a
`StoredTensor`) that can be read dense (fp32, dequantized where stored quantized) or, for a quantized
folder, as the stored parts so an exporter can reuse codes instead of requantizing. A quantized folder is
read through the one reader of quantkit folders (`quantkit.checkpoint.quantized.QuantizedFolder`) after it has
been checked against its manifest and config (`quantkit.quantize.verify.verify_folder`, sizes only); a
source checkpoint through `quantkit.checkpoint.reader.Checkpoint` (validated headers and index paths, never
unpickled).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from quantkit.checkpoint.contract import quant_method
from quantkit.checkpoint.quantized import QuantizedFolder, StoredTensor
from quantkit.checkpoint.reader import Checkpoint
from quantkit.checkpoint.spec import TextConfig, parse_text_config
from quantkit.errors import QuantkitError
from quantkit.formats import get_format
from quantkit.quantize.verify import verify_folder


class ExportSource:
    """A checkpoint opened for export. Use `ExportSource.open(path)`."""

    def __init__(self, path: Path, ckpt: Checkpoint, folder: QuantizedFolder | None):
        self.path = path
        self.ckpt = ckpt
        self.config: dict[str, Any] = ckpt.config
        self.folder = folder  # the quantkit folder reader, None for a source checkpoint
        self.quant = folder.quant if folder else None  # quantization_config of a quantkit folder, else None
        self.text: TextConfig = parse_text_config(self.config, str(path / "config.json"))
        if folder is not None:
            self._tensors = folder.tensors()
        else:
            self._tensors = [StoredTensor(t.name, tuple(t.shape), t.dtype, t.role, None) for t in ckpt.canonical()]
        self._by_name = {t.name: t for t in self._tensors}

    @classmethod
    def open(cls, path: str | Path) -> ExportSource:
        p = Path(path)
        if not p.exists():
            raise QuantkitError(f"{p}: no such checkpoint folder")
        if not p.is_dir():
            raise QuantkitError(f"{p}: not a folder; pass a checkpoint folder (config.json + *.safetensors)")
        ckpt = Checkpoint.open(p)
        folder = QuantizedFolder.from_checkpoint(ckpt)
        if folder is not None:
            res = verify_folder(p, hash_files=False)
            if not res.ok:
                raise QuantkitError(f"{p}: damaged quantkit folder ({res.problems[0]}); run `quantkit verify {p}`")
        elif quant_method(ckpt.config) not in (None, "fp8"):
            raise QuantkitError(f"{p}: quantized with {quant_method(ckpt.config)!r}, which quantkit does not read; "
                                "export from the bf16 checkpoint or a quantkit folder")
        return cls(p, ckpt, folder)

    # ---- listing ----
    def tensors(self) -> list[StoredTensor]:
        return list(self._tensors)

    def get(self, name: str) -> StoredTensor:
        try:
            return self._by_name[name]
        except KeyError:
            raise QuantkitError(f"{self.path}: no tensor named {name}") from None

    def has(self, name: str) -> bool:
        return name in self._by_name

    # ---- reading ----
    def parts(self, name: str, experts: slice | None = None) -> dict[str, torch.Tensor]:
        """The stored parts of a quantized tensor (all experts or a contiguous slab)."""
        if self.folder is None:
            raise QuantkitError(f"{name}: stored dense, it has no quantized parts")
        return self.folder.parts(name, experts)

    def native(self, name: str, experts: slice | None = None) -> torch.Tensor:
        """A tensor stored dense, in its own dtype (a source checkpoint's canonical view: fused experts, FP8
        dequantized)."""
        if self.folder is None:
            return self.ckpt.load(name, experts=experts)
        return self.folder.stored(name, experts)

    def dense(self, name: str, experts: slice | None = None, native: bool = False) -> torch.Tensor:
        """The tensor as fp32 (dequantized from its parts where stored quantized); `native=True` keeps a
        stored float tensor in its own dtype (a caller converting it in chunks saves the fp32 copy)."""
        t = self.get(name)
        if t.spec is None:
            w = self.native(name, experts)
            return w if native and w.is_floating_point() else w.float()
        parts = self.parts(name, experts)
        shape = t.shape if experts is None else (_slab_len(experts, t.shape[0]), *t.shape[1:])
        return get_format(t.spec.format).dequantize(parts, t.spec, shape, torch.float32)

    def close(self) -> None:
        self.ckpt.close()


def _slab_len(sl: slice, n: int) -> int:
    start, stop, _ = sl.indices(n)
    return max(0, stop - start)
