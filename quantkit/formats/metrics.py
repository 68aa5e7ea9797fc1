"""Error measures of a dequantized tensor against its original."""

from __future__ import annotations

import math

import torch


def rel_error(w: torch.Tensor, wq: torch.Tensor) -> float:
    """Relative Frobenius error ||w - wq|| / ||w|| (0 for an all-zero w reproduced exactly)."""
    w, wq = w.float(), wq.float()
    num = torch.linalg.vector_norm(w - wq).item()
    den = torch.linalg.vector_norm(w).item()
    return num / den if den else (0.0 if num == 0 else math.inf)


def sqnr_db(w: torch.Tensor, wq: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: 20 log10(||w|| / ||w - wq||)."""
    e = rel_error(w, wq)
    return math.inf if e == 0 else -20.0 * math.log10(e)
