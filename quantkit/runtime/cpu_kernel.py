"""The runtime's side of quantkit's C++ CPU kernel: repack the stored codes into its tiles, call it.

Why: torch's CPU int4 op is compute-bound at batch 1 and a MoE layer ran as 16 of its calls plus dozens of
small ops from Python (reports/bench-kernel.md). The C++ kernel quantizes activations to int8 per block of 32
and dots them against the stored 4-bit / 8-bit codes, runs the k routed experts of a layer in one call, and
fuses the rest of a decode step (norms, routing, the Gated DeltaNet and attention cores, the whole stack of
layers in one call). Its build, load and instruction-set choice live below the formats in quantkit/kernels/
(the quantizer runs on the same module); this module holds the runtime's side: repacking, argmax, denormals.

Error of the int8 activations: each block of 32 is rounded to 127 levels of its largest magnitude, a
relative error of about 2^-8 per element, the same order as the bf16 activations torch's route takes;
tests/kernels/test_cpu_kernel.py holds the fused route within 2e-2 relative of the fp32 reference on every ISA.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from quantkit.kernels import cpu
from quantkit.runtime import hugepages
from quantkit.runtime.options import RuntimeOptions

TILE = 16
BLOCK = 32


def configure(opts: RuntimeOptions) -> None:
    """Follow `opts.cpu_isa` (kernels/cpu.py's `configure`: a load given options calls it)."""
    cpu.configure(opts.cpu_isa)


def argmax(x: torch.Tensor) -> int:
    """int(torch.argmax(x)) (the first maximum), by the kernel's `argmax` on a contiguous bf16 / fp32 CPU tensor:
    torch's reads bf16 logits element by element, a cost a greedy step over a 248k vocabulary notices."""
    mod = cpu.module()
    if mod is not None and x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float32) and x.is_contiguous():
        return int(mod.argmax(x))
    return int(torch.argmax(x))


def logsumexp(x: torch.Tensor) -> torch.Tensor:
    """torch.logsumexp(x.float(), -1) of [V] logits (a 0-d fp32 tensor), by the kernel's `logsumexp` on a contiguous
    bf16 CPU tensor: torch's exp takes a scalar route for each element far below the max, and a vocabulary's
    logits spread that far. The table's exp and sum order: within a few fp32 ulps of torch's."""
    mod = cpu.module()
    if mod is not None and x.device.type == "cpu" and x.dtype == torch.bfloat16 and x.is_contiguous():
        return mod.logsumexp(x.reshape(1, -1))[0]
    return torch.logsumexp(x.float(), dim=-1)


@contextlib.contextmanager
def denormals_flushed() -> Iterator[None]:
    """Within the block fp32 denormals are flushed to zero on every thread torch computes on (the kernel's
    `flush_denormals`; without the kernel, torch's own switch, which covers the calling thread only); after it
    the threads are as they were. Why: a fast-forgetting Gated DeltaNet head makes denormals in a prefill, each
    a slow microcode assist; flushing them left every bit-for-bit forward test unchanged."""
    mod = cpu.module()
    if mod is not None:
        was = mod.flush_denormals(True)
    else:
        was = not torch.set_flush_denormal(True)  # a CPU without the switch: nothing to clear after
    try:
        yield
    finally:
        if not was:
            if mod is not None:
                mod.flush_denormals(False)
            else:
                torch.set_flush_denormal(False)


# ---------------------------------------------------------------- repacking (once, at load)

def _pad_rows(t: torch.Tensor, rows: int, value: int | float) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    pad = torch.full((rows - t.shape[0], *t.shape[1:]), value, dtype=t.dtype)
    return torch.cat([t, pad])


# rows repacked per step: the temporaries stay a few MB even for a 248k-row lm_head
_REPACK_ROWS = 4096


def repack_int4(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """codes uint8 [N, K] (0..15), scales/zeros [N, K/g] -> the kernel's tiles (see qk_cpu.cpp), on
    2 MiB pages where large (runtime/hugepages.py)."""
    n, k = codes.shape
    nt = -(-n // TILE)
    ng = scales.shape[1]
    qw = hugepages.empty((nt, k // BLOCK, 4, TILE, 4), torch.uint8)
    for r0 in range(0, nt * TILE, _REPACK_ROWS):
        r1 = min(nt * TILE, r0 + _REPACK_ROWS)
        q = codes[r0:min(r1, n)].to(torch.uint8)
        q = _pad_rows(q, r1 - r0, 8).view(-1, TILE, k // BLOCK, 4, 2, 4)
        qw[r0 // TILE:r1 // TILE] = (q[..., 0, :] | (q[..., 1, :] << 4)).permute(0, 2, 3, 1, 4)

    def tiles(s: torch.Tensor) -> torch.Tensor:
        return hugepages.copy(_pad_rows(s.to(torch.bfloat16), nt * TILE, 0).view(nt, TILE, ng).transpose(1, 2).contiguous())

    return qw.view(-1), tiles(scales), tiles(zeros) if zeros is not None else None


def repack_int8(q: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q int8 [N, K], per-row scales [N] -> (codes + 128 as uint8 tiles, fp32 scales [NT*16]). A code of -128
    (quantkit's quantizer writes -127..127; a foreign file might hold one) is stored as -127: the AVX2 one-row
    tile takes |x| against sign(w, x), which has no int8 for -(-128), and every table must give the same bits."""
    n, k = q.shape
    nt = -(-n // TILE)
    qw = hugepages.empty((nt, k // BLOCK, 8, TILE, 4), torch.uint8)
    for r0 in range(0, nt * TILE, _REPACK_ROWS):
        r1 = min(nt * TILE, r0 + _REPACK_ROWS)
        u = q[r0:min(r1, n)].clamp(min=-127).view(torch.uint8) ^ 0x80  # two's complement + 128
        u = _pad_rows(u, r1 - r0, 128).view(-1, TILE, k // BLOCK, 8, 4)
        qw[r0 // TILE:r1 // TILE] = u.permute(0, 2, 3, 1, 4)
    return qw.view(-1), _pad_rows(scales.float().reshape(-1), nt * TILE, 0.0).contiguous()


def supports(fmt: str, shape: tuple[int, ...], device: torch.device) -> bool:
    """Whether a matrix of this format ("bf16" for kept weights) and shape can run on the kernel."""
    if device.type != "cpu" or len(shape) != 2 or shape[1] % BLOCK or shape[0] <= 0:
        return False
    return fmt in ("bf16", "int4", "int8") and cpu.available()
