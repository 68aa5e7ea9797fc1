"""`QuantLinear`: a drop-in for a bias-free `nn.Linear` whose weight is a prepared `Kernel`."""

from __future__ import annotations

import torch
from torch import nn

from quantkit.runtime.kernels import Kernel


class QuantLinear(nn.Module):
    """y = x @ W^T through the kernel of W's format; the weight never leaves its device."""

    def __init__(self, kernel: Kernel, fmt: str = "bf16"):
        super().__init__()
        self.kernel = kernel
        self.in_features = kernel.in_features
        self.out_features = kernel.out_features
        self.format = fmt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = self.kernel(x.reshape(-1, self.in_features))
        return y.reshape(*lead, self.out_features)

    @property
    def nbytes(self) -> int:
        return self.kernel.nbytes

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, format={self.format}, route={self.kernel.route}"
