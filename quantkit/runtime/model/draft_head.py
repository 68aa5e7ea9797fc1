"""`DraftHead`: the MTP layer's head over part of the vocabulary, as FR-Spec and EAGLE-3 draft.

A draft need not be exact (the verify decides every token), and the head's 248k rows cost the draft about as
much as the rest of a small model's step. So the draft scores only the ids `model/draft.py` names (on Qwen3.5's
vocabulary its most frequent ones, else the lowest) and the top `TAIL` ids, where Qwen puts its special tokens
(`<|im_end|>`, `<think>`, the tool-call tags: 248044 and up); the ids between get -inf. A target token among
them is never drafted: that draft is rejected and nothing else changes.

The rows are read in one `linear_many` call: from a compact int4 copy of them where the loader made one
(`compact_copy`: an int8 or bf16 head's rows cost the draft 2-4x the bytes of int4 ones, the draft reads them
right after a verify has streamed the whole head out of cache, and ranked ids are scattered over the head's
tiles), else the head's own tiles for the lowest ids (the kernel's layout keeps a matrix's rows in order, 16 to a
tile; a ranked draft without its copy, as `bench mtp --draft-vocab` asks for, scores the lowest ids instead). A
head not on quantkit's CPU kernel is used whole.
"""

from __future__ import annotations

import torch

from quantkit.checkpoint.draft import COPY_SPEC, DRAFT_ROWS, TILE, copy_bytes, draft_ids, draft_span, ranked
from quantkit.formats import QuantSpec, get_format
from quantkit.kernels import cpu as kernel_cpu
from quantkit.runtime import cpu_kernel
from quantkit.runtime.kernels import Projections, QBf16Kernel, QKernel, prepare

COPY_CHUNK = 4096  # rows dequantized and quantized at a time


def requantized(parts: dict[str, torch.Tensor] | torch.Tensor, spec: QuantSpec | None, shape: tuple[int, int],
                to: QuantSpec) -> dict[str, torch.Tensor]:
    """A stored matrix (`spec` None: dense, bare or as {"weight": ...}) quantized again as `to`, through fp32."""
    if spec is None:
        w = (parts["weight"] if isinstance(parts, dict) else parts).to(torch.float32)
    else:
        assert isinstance(parts, dict)
        w = get_format(spec.format).dequantize(parts, spec, shape, torch.float32)
    return get_format(to.format).quantize(w, to)


def compact_copy(parts: dict[str, torch.Tensor] | torch.Tensor, spec: QuantSpec | None, shape: tuple[int, int],
                 rows: int = DRAFT_ROWS) -> QKernel | None:
    """An int4 (`COPY_SPEC`) kernel of the draft's rows of a stored head (`draft_ids`, in their order); None
    where it would not help (an id prefix of a 4-bit head is read in place), the kernel cannot take it, or the
    head's stored parts are not row-major."""
    vocab, k = shape
    if not copy_bytes(vocab, k, spec.format if spec is not None else "bf16", rows):
        return None
    ids = draft_ids(vocab, rows)
    stored = {"weight": parts} if isinstance(parts, torch.Tensor) else parts
    if ids is None or any(p.shape[0] != vocab for p in stored.values()) or not cpu_kernel.supports(
            "int4", (len(ids), k), torch.device("cpu")):
        return None
    index = torch.tensor(ids, dtype=torch.long)
    pieces: list[dict[str, torch.Tensor]] = []
    for c in range(0, len(ids), COPY_CHUNK):  # a chunk at a time: a whole copy's fp32 rows would be ~270 MB
        at = index[c:c + COPY_CHUNK].to(next(iter(stored.values())).device)
        rows_of = {n: p.index_select(0, at).cpu() for n, p in stored.items()}
        pieces.append(requantized(rows_of, spec, (len(at), k), COPY_SPEC))
    kernel = prepare({name: torch.cat([p[name] for p in pieces]) for name in pieces[0]}, COPY_SPEC, (len(ids), k))
    return kernel if isinstance(kernel, QKernel) else None


class DraftHead:
    def __init__(self, head: object, rows: int = DRAFT_ROWS, compact: QKernel | None = None):
        self.head, self.asked = head, rows
        self.vocab = int(getattr(head, "out_features", 0))
        rows, self.tail = draft_span(self.vocab, rows)
        mod = kernel_cpu.module()
        kernel = isinstance(head, (QKernel, QBf16Kernel)) and getattr(head, "device", torch.device("cpu")).type == "cpu"
        ids = draft_ids(self.vocab, rows) if mod is not None and kernel else None
        self.compact = compact if ids is not None and compact is not None and compact.out_features == len(ids) else None
        self.ranked = ids is not None and ranked(self.vocab)
        if self.ranked and self.compact is None:  # ranked rows lie scattered over the tiles: the lowest ids in place
            ids, self.ranked = draft_ids(self.vocab, rows, by_rank=False), False
        self.rows = rows if ids is not None else 0
        self.ids = ids or []
        self._index = torch.tensor(self.ids, dtype=torch.long)
        # the linear_many table of what the draft reads (None: a head off the kernel, called as it is)
        self.table = (self._descriptors() if self.compact is None else Projections([self.compact]).table
                      ) if self.rows else Projections([head]).table if kernel else None

    @property
    def reduced(self) -> bool:
        """Whether the draft reads part of the head (else the whole head)."""
        return self.rows > 0

    def _descriptors(self) -> torch.Tensor:
        """The head's rows [0, rows) and [tail, V) (an id prefix) as two matrices of one `linear_many` table."""
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

    def logits(self, outs: list[torch.Tensor]) -> torch.Tensor:
        """Logits [V] from the outputs of a `linear_many` call on `table`: the scored ids' own, -inf elsewhere."""
        y = outs[0].view(-1) if len(outs) == 1 else torch.cat([o.view(-1) for o in outs])
        if not self.rows:
            return y
        out = torch.full((self.vocab,), float("-inf"), dtype=y.dtype)
        out[self._index] = y
        return out

    def argmax(self, outs: list[torch.Tensor]) -> int:
        """The argmax of `logits(outs)` (its first maximum), read from the outputs themselves."""
        y = outs[0].view(-1) if len(outs) == 1 else torch.cat([o.view(-1) for o in outs])
        return self.vocab_id(cpu_kernel.argmax(y))

    def vocab_id(self, i: int) -> int:
        """The vocabulary id of position i of the outputs on `table`, taken as one row."""
        return self.ids[i] if self.rows else i

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Logits [V] of one row x [1, H]: the scored ids' own, -inf elsewhere."""
        if not self.rows:
            return self.head(x).view(-1)  # type: ignore[operator]
        return self.logits(kernel_cpu.module().linear_many(x.contiguous(), self.table))
