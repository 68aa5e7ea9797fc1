"""The quantizer's kernels: formats/int4.py's and int8.py's route through the CPU kernel's op table.

They are ops of the CPU kernel's module (csrc/qk_quant_impl.h, one copy in every ISA unit), so the quantizer
shares its one build, its CPU detection and its QUANTKIT_CPU_ISA switch (`none`: torch's route; kernels/cpu.py).
Each call runs one row chunk on the table in use with the GIL released, so the quantizer's chunks run on its
threads in parallel, and returns (squared error of the stored weights, sum of x^2).
"""

from __future__ import annotations

from types import ModuleType

import torch

from quantkit.kernels import cpu


def ops() -> ModuleType | None:
    """The kernel module that quantizes, or None: torch's route (no kernel, or QUANTKIT_CPU_ISA=none)."""
    return cpu.module()


def int4_sym(mod: ModuleType, x: torch.Tensor, group: int, grid: tuple[float, ...], packed: torch.Tensor,
             scales: torch.Tensor) -> tuple[float, float]:
    """Rows of x [R, K] (bf16 or fp32, contiguous) into packed uint8 [R, K/2] and bf16 scales [R, K/group],
    in place, by symmetric int4 with the clip search over `grid`."""
    return mod.quant_int4(x, group, list(grid), packed, scales)


def int8_row(mod: ModuleType, x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> tuple[float, float]:
    """Rows of bf16 x [R, K] (contiguous) into int8 q [R, K] and bf16 scales [R], in place."""
    return mod.quant_int8(x, q, scales)
