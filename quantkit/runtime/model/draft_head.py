"""`DraftHead`: the MTP layer's head over part of the vocabulary, as FR-Spec and EAGLE-3 draft.

A draft need not be exact (the verify decides every token), and the head's 248k rows cost the draft about as
much as the rest of a small model's step. So the draft scores only the first `rows` ids (Qwen's byte-level BPE
numbers its tokens roughly in merge order, frequent ones first) and the top `TAIL` ids of the vocabulary, where
Qwen puts its special tokens (`<|im_end|>`, `<think>`, the tool-call tags: 248044 and up), and the ids between
get -inf. A target token among them is never drafted: that draft is rejected and nothing else changes. The
rows are the head's own tiles (the kernel's layout keeps a matrix's rows in order, 16 to a tile), read in one
`linear_many` call; a head not on quantkit's CPU kernel is used whole.
"""

from __future__ import annotations

import torch

from quantkit.runtime import cpu_kernel
from quantkit.runtime.kernels import QBf16Kernel, QKernel

DRAFT_ROWS = 32768  # ids the draft scores from the bottom of the vocabulary (0: the whole head)
TAIL = 288  # ids from the top: 248032 and up on Qwen3.5's 248,320, its special tokens among them
TILE = 16


class DraftHead:
    def __init__(self, head: object, rows: int = DRAFT_ROWS):
        self.head, self.asked = head, rows
        self.vocab = int(getattr(head, "out_features", 0))
        rows -= rows % TILE
        self.tail = (self.vocab - TAIL) // TILE * TILE  # the first id of the top part, on a tile boundary
        mod = cpu_kernel.module()
        kernel = isinstance(head, (QKernel, QBf16Kernel)) and getattr(head, "device", torch.device("cpu")).type == "cpu"
        self.rows = rows if mod is not None and kernel and 0 < rows and rows < self.tail else 0
        self._table = self._descriptors() if self.rows else None

    @property
    def reduced(self) -> bool:
        """Whether the draft reads part of the head (else the whole head)."""
        return self._table is not None

    def _descriptors(self) -> torch.Tensor:
        """The head's rows [0, rows) and [tail, V) as two matrices of one `linear_many` table."""
        d = self.head.descriptor()  # type: ignore[attr-defined]
        fmt, group, k = d[3], d[4], d[6]
        low = [*d[:5], self.rows, k, 0]
        t0 = self.tail // TILE
        if fmt == 16:  # row-major bf16
            high = [d[0] + self.tail * k * 2, 0, 0, 16, 0, self.vocab - self.tail, k, 0]
        else:  # tiles of 16 rows: codes, then per tile its scales (int4: bf16 [K/g, 16]; int8: fp32 [16])
            codes = k * (8 if fmt == 4 else 16)
            scales = (k // group) * TILE * 2 if fmt == 4 else TILE * 4
            high = [d[0] + t0 * codes, d[1] + t0 * scales, d[2] + t0 * scales if d[2] else 0, fmt, group,
                    self.vocab - self.tail, k, 0]
        return torch.tensor([low, high], dtype=torch.int64)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Logits [V] of one row x [1, H]: the scored ids' own, -inf elsewhere."""
        if self._table is None:
            return self.head(x).view(-1)  # type: ignore[operator]
        low, high = cpu_kernel.module().linear_many(x.contiguous(), self._table)
        out = torch.full((self.vocab,), float("-inf"), dtype=low.dtype)
        out[:self.rows] = low.view(-1)
        out[self.tail:] = high.view(-1)
        return out
