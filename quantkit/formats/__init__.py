"""Quantization formats: one module per format, registered here by name.

Contract every format follows (pure functions over torch tensors, no I/O):

- `quantize(w, spec) -> dict[str, Tensor]`: `w` is [..., out, in] (a 2D matrix or a stack of expert
  matrices [E, out, in]; leading dims are independent matrices). The result maps a part suffix
  (`"qweight"`, `"scales"`, `"zeros"`, ...) to a tensor whose leading dims match `w`'s, so a slab of
  experts quantized alone and concatenated along dim 0 equals the whole stack quantized at once.
- `dequantize(parts, spec, shape, dtype) -> Tensor` inverts it to a dense [..., out, in] tensor.
- `parts(spec, shape) -> dict[str, Part]`: the shape, dtype and kind of every part `quantize` returns for a
  tensor of `shape`, without quantizing anything. It is the one source of a format's bytes: the planner's
  budget, the quantizer's shard layout and verify all read it (`stored_parts`, `stored_bytes`,
  `bits_per_weight` below), and a test holds it equal to what `quantize` returns.
- `default_group`: the group (block) size a spec without one gets.

In a quantized checkpoint a tensor named `N` (e.g. `...self_attn.q_proj.weight`, or the suffix-less
fused `...mlp.experts.gate_up_proj`) is stored as `N.<suffix>` for each part, and its `QuantSpec`
(plus original shape and dtype) is recorded under `quantization_config.tensors[N]` in config.json.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Protocol

import torch

from quantkit.errors import QuantkitError


@dataclass(frozen=True)
class QuantSpec:
    """One tensor's quantization choice."""

    format: str  # "int8", "int4", "nf4", "fp4", "mxfp4"; "bf16" means kept as is
    group_size: int | None = None  # int4: 32/64/128; nf4/fp4: blocksize (64); mxfp4: 32; int8: None = per channel
    symmetric: bool = True
    clip_search: bool = True  # int4 only: per-group search over clipped scales (see formats/int4.py)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> QuantSpec:
        try:
            return cls(
                format=d["format"],
                group_size=d.get("group_size"),
                symmetric=d.get("symmetric", True),
                clip_search=d.get("clip_search", True),
            )
        except (KeyError, TypeError):
            raise QuantkitError(f"malformed quantization spec {d!r}") from None


# bytes per element of the dtypes parts are stored in
_PART_DTYPE_BYTES = {"uint8": 1, "int8": 1, "bfloat16": 2, "float32": 4}


@dataclass(frozen=True)
class Part:
    """One stored part of a quantized tensor: its shape, torch dtype name and what it holds."""

    shape: tuple[int, ...]
    dtype: str  # "uint8", "int8", "bfloat16", "float32"
    kind: str  # "weight" (codes), "scales" or "zeros"

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _PART_DTYPE_BYTES[self.dtype]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class Format(Protocol):
    name: str
    default_group: int | None

    def parts(self, spec: QuantSpec, shape: tuple[int, ...]) -> dict[str, Part]: ...

    def quantize(self, w: torch.Tensor, spec: QuantSpec) -> dict[str, torch.Tensor]: ...

    def dequantize(
        self, parts: dict[str, torch.Tensor], spec: QuantSpec, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor: ...


_REGISTRY: dict[str, Format] = {}


def register(fmt: Format) -> Format:
    _REGISTRY[fmt.name] = fmt
    return fmt


def get_format(name: str) -> Format:
    _load_builtin()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise QuantkitError(
            f"unknown quantization format {name!r}; known: {', '.join(sorted(_REGISTRY))}"
        ) from None


def stored_parts(spec: QuantSpec, shape: tuple[int, ...]) -> dict[str, Part]:
    """The parts `N.<suffix>` a tensor of `shape` [..., out, in] is stored as under `spec`."""
    return get_format(spec.format).parts(spec, tuple(shape))


def stored_bytes(spec: QuantSpec, shape: tuple[int, ...]) -> int:
    return sum(p.nbytes for p in stored_parts(spec, shape).values())


def bits_per_weight(spec: QuantSpec, shape: tuple[int, ...]) -> float:
    """Storage bits per weight, scales and zeros included."""
    return stored_bytes(spec, shape) * 8 / math.prod(shape)


def default_group(fmt: str) -> int | None:
    return get_format(fmt).default_group


def available_formats() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def _load_builtin() -> None:
    import importlib

    for mod in ("int8", "int4", "bnb4", "mxfp4"):  # each registers itself on import
        importlib.import_module(f"quantkit.formats.{mod}")
