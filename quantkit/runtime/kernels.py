"""Per-format matmul kernels: `y = x @ W^T` for one stored matrix W [out, in], on the device it lives on.

`prepare(parts, spec, shape, device)` turns a tensor's stored parts (quantkit/formats contract) into a
`Kernel` ONCE at load (packing, layout conversion); `kernel(x)` then runs on every forward without
touching the weight again. `reference_matmul` is the plain dequantize-then-matmul every kernel is
tested against.

Routes (the first that applies):
- bf16 (kept tensors): quantkit's kernel at decode batch sizes where it is built (`QBf16Kernel`, the stored
  tensor as it is: AVX512-BF16 dots, or bf16 widened in registers), `F.linear` above them and elsewhere; a decode
  batch of any count (`Kernel.rows`) stays on the kernel.
- int4 and int8 on a CPU: quantkit's own C++ kernel (every instruction set, generic C++ included) (`QKernel`, built at
  set-up: runtime/cpu_kernel.py, csrc/qk_cpu.cpp), int8 activations against the stored codes, repacked
  once at load into 16-row tiles; the torch routes below stay where it is missing or switched off
  (`QUANTKIT_CPU_ISA=none`), or `route="torch"`.
- int8: `torch._weight_int8pack_mm` (CPU; CUDA where torch has it, else dequantize-on-the-fly).
- int4: CPU `_convert_weight_to_int4pack_for_cpu` at load + `_weight_int4pack_mm_for_cpu`; CUDA
  `_convert_weight_to_int4pack` + `_weight_int4pack_mm` (tinygemm). The stored codes/scales already
  follow tinygemm's float-zero convention, so nothing is requantized. Rows are padded to a multiple
  of 16 (the CPU packer's requirement) and the padding sliced off the output.
- nf4/fp4: bitsandbytes. On a CPU with AVX512-BF16 its packed gemv (`_convert_weight_packed_for_cpu`
  once, then `gemv_4bit`: what `Linear4bit.eval()` does); elsewhere on CPU bitsandbytes'
  C dequantizer + `F.linear` (again what `Linear4bit` does there); CUDA `bnb.matmul_4bit`.
  Without bitsandbytes: dequantize-on-the-fly in torch.
- mxfp4: no library has a CPU MXFP4 matmul for torch, so at load each E2M1 code (doubled values
  0,1,2,3,4,6,8,12 and negatives) is split EXACTLY into lo + 4*hi with lo, hi in -3..3, and the two
  halves become one tinygemm int4 matrix over a doubled inner dimension: y = [x, x] @ [W_lo, W_hi]^T
  with group scales 2^(e-128) and 2^(e-126) (powers of two: exact in bf16). One int4 kernel call,
  9 bits per weight resident instead of 4.25 (`prepare(..., mxfp4="dequant")`, QUANTKIT_MXFP4_ROUTE through
  runtime/options.py, keeps the stored 4.25 bits and dequantizes per call instead, slower).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from quantkit.errors import QuantkitError
from quantkit.formats import QuantSpec, get_format
from quantkit.formats.int4 import DEFAULT_GROUP as INT4_GROUP
from quantkit.formats.int4 import codes
from quantkit.formats.int4 import codes as int4_codes
from quantkit.formats.mxfp4 import e8m0_to_fp32_half
from quantkit.kernels import cpu as kernel_cpu
from quantkit.runtime import cpu_kernel, hugepages

COMPUTE_DTYPE = torch.bfloat16


def reference_matmul(x: torch.Tensor, parts: dict[str, torch.Tensor] | torch.Tensor, spec: QuantSpec | None,
                     shape: tuple[int, ...]) -> torch.Tensor:
    """Dequantize (formats' own dequantize) to fp32, then x @ W^T in fp32."""
    if spec is None:
        w = parts.float() if isinstance(parts, torch.Tensor) else parts["weight"].float()
    else:
        cpu_parts = {k: v.cpu() for k, v in parts.items()}
        w = get_format(spec.format).dequantize(cpu_parts, spec, tuple(shape), torch.float32).to(x.device)
    return x.float() @ w.t()


ROW_GROUP = 4  # rows per call where a kernel has no decode form for any count (`Kernel.rows`)


class Kernel:
    """One prepared matrix. Call with x [M, in] (any float dtype) -> [M, out] in x's dtype. `rows(x)`: the rows of
    a decode batch, each row bit for bit its own call `self(x[j:j+1])`."""

    route: str = "?"
    format: str = "bf16"  # the stored format (the loader sets it)
    out_features: int
    in_features: int
    device: torch.device

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """In groups of ROW_GROUP rows: torch's kernels keep a row's sums at these counts, not at a prefill's."""
        parts = [self(x[a:a + ROW_GROUP]) for a in range(0, x.shape[0], ROW_GROUP)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        return []


class DenseKernel(Kernel):
    route = "bf16 F.linear"

    def __init__(self, w: torch.Tensor):
        self.w = w
        self.out_features, self.in_features = w.shape
        self.device = w.device

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.w.dtype), self.w).to(x.dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [self.w]


class QBf16Kernel(DenseKernel):
    """bf16 weights on quantkit's CPU kernel at decode batch sizes: the stored row-major tensor as it is,
    bf16 activations, fp32 accumulation (AVX512-BF16 dots, or bf16 widened to fp32 in registers). Batches above `MAX_ROWS` (prefill) go to
    torch's `F.linear` (a oneDNN GEMM), on the same tensor."""

    MAX_ROWS = 4

    def __init__(self, w: torch.Tensor, shared: bool = False):

        # the kernel's loads are unaligned: no `aligned` copy. A large matrix moves to 2 MiB pages
        # (runtime/hugepages.py: the kernel streams it every token, and a bf16 model decodes faster from the
        # copies than from the shard's mapped pages). The loader drops
        # the source and a mapped shard's pages are unmapped, so the copy does not count twice; a `shared`
        # tensor (the tied embedding) stays where it is
        super().__init__(w if shared else hugepages.copy(w))
        self._mod = kernel_cpu.module()
        self.route = f"quantkit qk bf16 ({kernel_cpu.isa_name()}) at decode, F.linear above 4 rows"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return super().__call__(x) if x.shape[0] > self.MAX_ROWS else self.rows(x)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """Any count of decode rows in one kernel call: the matrix read once for all of them."""
        y = self._mod.linear_bf16(x, self.w)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def descriptor(self) -> list[int]:
        return [self.w.data_ptr(), 0, 0, 16, 0, self.out_features, self.in_features, 0]


class DequantKernel(Kernel):
    """Fallback: dequantize the stored parts on every call (in torch, fp32), then F.linear."""

    route = "dequantize + F.linear"

    def __init__(self, parts: dict[str, torch.Tensor], spec: QuantSpec, shape: tuple[int, int]):
        self.parts, self.spec, self.shape = parts, spec, tuple(shape)
        self.fmt = get_format(spec.format)
        self.out_features, self.in_features = shape
        self.device = next(iter(parts.values())).device

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # fp32: dequantized values such as (q - 8) * scale need more bits than bf16 holds
        w = self.fmt.dequantize(self.parts, self.spec, self.shape, torch.float32)
        return F.linear(x.float(), w).to(x.dtype)

    def tensors(self) -> list[torch.Tensor]:
        return list(self.parts.values())


class Int8Kernel(Kernel):
    route = "torch._weight_int8pack_mm"

    def __init__(self, q: torch.Tensor, scales: torch.Tensor):
        self.q, self.s = aligned(q), aligned(scales.to(COMPUTE_DTYPE))
        self.out_features, self.in_features = q.shape
        self.device = q.device
        if q.device.type != "cpu" and not _int8pack_works(q.device):
            self.route = "int8 dequantize + F.linear"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xb = x.to(COMPUTE_DTYPE)
        if self.route == "torch._weight_int8pack_mm":
            return torch._weight_int8pack_mm(xb, self.q, self.s).to(x.dtype)
        return (F.linear(xb, self.q.to(COMPUTE_DTYPE)) * self.s).to(x.dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [self.q, self.s]


def aligned(t: torch.Tensor) -> torch.Tensor:
    """`t` contiguous and starting on a 64-byte boundary. A tensor read from a safetensors file can be a
    view at any byte offset of its shard's buffer, and torch 2.13's CPU `_weight_int8pack_mm` crashes
    (SIGSEGV, measured) on an int8 weight that starts 8 bytes off; torch's own allocator aligns to 64."""
    t = t.contiguous()
    return t if t.data_ptr() % 64 == 0 else t.clone()


@functools.lru_cache(maxsize=8)
def _int8pack_works(device: torch.device) -> bool:
    try:
        x = torch.randn(1, 64, dtype=COMPUTE_DTYPE, device=device)
        torch._weight_int8pack_mm(x, torch.ones(16, 64, dtype=torch.int8, device=device),
                                  torch.ones(16, dtype=COMPUTE_DTYPE, device=device))
        return True
    except (RuntimeError, NotImplementedError):
        return False


def _pad_rows(t: torch.Tensor, rows: int, value: int | float) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    pad = torch.full((rows - t.shape[0], *t.shape[1:]), value, dtype=t.dtype, device=t.device)
    return torch.cat([t, pad])


class Int4Kernel(Kernel):
    """tinygemm int4 from unsigned codes [out, in] (0..15), bf16 scales/zeros [out, in/g]."""

    route = "torch _weight_int4pack_mm_for_cpu"

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group: int,
                 in_features: int | None = None, dup_input: int = 1):
        n, k = codes.shape
        self.out_features, self.in_features = n, in_features or k
        self.dup = dup_input
        self.group = group
        self.device = codes.device
        npad = -(-n // 16) * 16
        codes = _pad_rows(codes, npad, 8)  # code 8 with scale 0 is an exact zero row
        scales = _pad_rows(scales.to(COMPUTE_DTYPE), npad, 0)
        zeros = _pad_rows(zeros.to(COMPUTE_DTYPE), npad, 0) if zeros is not None else torch.zeros_like(scales)
        self.sz = torch.stack([scales.t(), zeros.t()], dim=-1).contiguous()  # [in/g, out, 2]
        if codes.device.type == "cpu":
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 2)
            self._mm = torch.ops.aten._weight_int4pack_mm_for_cpu
        else:
            self.route = "torch _weight_int4pack_mm (tinygemm CUDA)"
            packed_u8 = ((codes[:, 0::2] << 4) | codes[:, 1::2]).to(torch.uint8).contiguous()
            self.packed = torch.ops.aten._convert_weight_to_int4pack(packed_u8, 8)
            self._mm = torch.ops.aten._weight_int4pack_mm

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xb = x.to(COMPUTE_DTYPE)
        if self.dup > 1:
            xb = xb.repeat(1, self.dup)
        y = self._mm(xb.contiguous(), self.packed, self.group, self.sz)
        return y[:, :self.out_features].to(x.dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [self.packed, self.sz]


class QKernel(Kernel):
    """quantkit's C++ CPU kernel on int4 (any group, symmetric or not) or int8 codes repacked at load
    (runtime/cpu_kernel.py). `mat` is what the fused MoE call (QuantExperts) reads for this matrix."""

    def __init__(self, fmt: str, n: int, k: int, qw: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor | None, group: int):

        self._mod = kernel_cpu.module()
        assert self._mod is not None, "QKernel needs the compiled CPU kernel"
        self.route = f"quantkit qk {fmt} ({kernel_cpu.isa_name()}, int8 activations)"
        self.fmt_bits = 4 if fmt == "int4" else 8
        self.out_features, self.in_features = n, k
        self.group = group
        self.device = torch.device("cpu")
        self.qw, self.scales, self.zeros = qw, scales, zeros

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self._mod.linear(x, self.qw, self.scales, self.zeros, self.fmt_bits, self.group, self.out_features)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        return self(x)  # any count of rows in one call: each tile read once for all of them

    def descriptor(self) -> list[int]:
        """(qw, scales, zeros pointers, bits, group, out, in, 0): one row of qk_moe's table."""
        z = self.zeros.data_ptr() if self.zeros is not None else 0
        return [self.qw.data_ptr(), self.scales.data_ptr(), z, self.fmt_bits, self.group, self.out_features,
                self.in_features, 0]

    def tensors(self) -> list[torch.Tensor]:
        return [self.qw, self.scales] + ([self.zeros] if self.zeros is not None else [])


class Projections:
    """Several matrices applied to the same input (a layer's q/k/v, its linear-attention in_proj_*, the
    shared expert's gate/up/gate): one `linear_many` call of quantkit's CPU kernel, which quantizes the
    input once and runs every matrix's tiles in one parallel region, where every one of them is a
    `QKernel` or `QBf16Kernel`; else each kernel in turn. Either way the outputs equal the kernels' own,
    bit for bit (tests/kernels/test_cpu_kernel.py)."""

    def __init__(self, kernels: list[Any]):
        self.kernels = kernels
        mod = kernel_cpu.module()
        fused = (mod is not None and all(isinstance(k, (QKernel, QBf16Kernel)) for k in kernels)
                 and len({k.in_features for k in kernels}) == 1)
        self._mod = mod if fused else None
        self._table = torch.tensor([k.descriptor() for k in kernels], dtype=torch.int64) if fused else None

    @property
    def fused(self) -> bool:
        return self._mod is not None

    @property
    def table(self) -> torch.Tensor | None:
        """The int64 [P, 8] descriptor table `linear_many` takes, where fused."""
        return self._table

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        if x.shape[0] <= QBf16Kernel.MAX_ROWS and self._takes(x):
            return self._mod.linear_many(x.contiguous(), self._table)
        return [k(x) for k in self.kernels]

    def rows(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The rows of a decode batch, any count, each row bit for bit its own call: one `linear_many` call where
        fused (every matrix read once for all the rows), else each kernel's `rows`."""
        if self._takes(x):
            return self._mod.linear_many(x.contiguous(), self._table)
        return [k.rows(x) for k in self.kernels]

    def _takes(self, x: torch.Tensor) -> bool:
        return self._mod is not None and x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float32)


def qkernel(parts: dict[str, torch.Tensor], spec: QuantSpec, shape: tuple[int, int]) -> QKernel | None:
    """The C++ kernel for an int4/int8 matrix on the CPU, or None where it does not apply."""

    dev = next(iter(parts.values())).device
    if not cpu_kernel.supports(spec.format, shape, dev):
        return None
    n, k = shape
    if spec.format == "int8":
        qw, s = cpu_kernel.repack_int8(parts["qweight"], parts["scales"])
        return QKernel("int8", n, k, qw, s, None, 0)

    g = spec.group_size or 128
    qw, s, z = cpu_kernel.repack_int4(codes(parts), parts["scales"], parts.get("zeros"))
    return QKernel("int4", n, k, qw, s, z, g)


class Bnb4Kernel(Kernel):
    """bitsandbytes nf4/fp4 from our stored bytes (bitsandbytes' own layout)."""

    def __init__(self, parts: dict[str, torch.Tensor], spec: QuantSpec, shape: tuple[int, int]):
        import bitsandbytes.functional as bf

        self.out_features, self.in_features = shape
        self.device = parts["qweight"].device
        block = spec.group_size or 64
        qs = bf.QuantState(absmax=parts["absmax"].float().reshape(-1).contiguous(), shape=torch.Size(shape),
                           code=bf.get_4bit_type(spec.format, device=self.device), blocksize=block,
                           quant_type=spec.format, dtype=COMPUTE_DTYPE)
        q = aligned(parts["qweight"].reshape(-1, 1))
        self._bf = bf
        # the packed layout keeps absmax as [out, in / block]: rows must hold whole blocks (a tiny model's
        # in=32 with block 64 crashed bitsandbytes' packer on an AVX512-BF16 CPU)
        if self.device.type == "cpu" and _bnb_avx512bf16() and shape[0] % 32 == 0 and shape[1] % block == 0:
            q, qs = bf._convert_weight_packed_for_cpu(q, qs)
            self.route = "bitsandbytes gemv_4bit (CPU packed, AVX512-BF16)"
            self.mode = "gemv"
        elif self.device.type == "cpu":
            self.route = "bitsandbytes dequantize_4bit (C) + F.linear"
            self.mode = "dequant"
        else:
            self.route = "bitsandbytes matmul_4bit"
            self.mode = "matmul"
        self.q, self.qs = q, qs

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xb = x.to(COMPUTE_DTYPE)
        if self.mode == "gemv":
            y = self._bf.gemv_4bit(xb, self.q, state=self.qs)
        elif self.mode == "dequant":
            w = self._bf.dequantize_4bit(self.q, self.qs)
            y = F.linear(xb, w.to(COMPUTE_DTYPE))
        else:
            import bitsandbytes as bnb

            y = bnb.matmul_4bit(xb, self.q, quant_state=self.qs)
        return y.to(x.dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [self.q, self.qs.absmax]


@functools.lru_cache(maxsize=1)
def _bnb_available() -> bool:
    import logging

    # On AVX512-BF16 CPUs bitsandbytes tries to fetch a gemm kernel from the Hugging Face Hub through the
    # optional `kernels` package and warns when it cannot. quantkit stays offline and does not install
    # `kernels`; bitsandbytes then uses its built-in gemv, so that warning is noise on every run.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    try:
        import bitsandbytes  # noqa: F401
    except Exception:  # bitsandbytes raises assorted errors on unsupported platforms
        return False
    return True


@functools.lru_cache(maxsize=1)
def _bnb_avx512bf16() -> bool:
    try:
        from bitsandbytes.nn.modules import has_avx512bf16

        return bool(has_avx512bf16())
    except Exception:
        return False


def mxfp4_to_int4x2(parts: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact split of an MXFP4 matrix into tinygemm codes [out, 2*in] and scales [out, 2*in/32].

    Doubled E2M1 magnitude m = lo + 4*hi (m: 0,1,2,3,4,6,8,12 -> lo 0,1,2,3,0,2,0,0 and hi
    0,0,0,0,1,1,2,3); the sign goes on both. w = 2^(e-128) * m, so lo carries scale 2^(e-128) and hi
    2^(e-126), each stored as the code + 8."""

    s = parts["scales"]
    out, nb = s.shape
    p = parts["qweight"].reshape(out, nb, 16)
    q = torch.cat([p & 0x0F, p >> 4], dim=-1).to(torch.int64)  # [out, nb, 32]: element order 0..31
    mag = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12])[q & 7]
    sign = torch.where(q >= 8, -1, 1)
    hi = mag // 4
    hi = torch.where(mag == 6, 1, hi)
    lo = mag - 4 * hi
    codes = torch.cat([(sign * lo + 8).reshape(out, -1), (sign * hi + 8).reshape(out, -1)], dim=1)
    d = e8m0_to_fp32_half(s.cpu()).to(s.device)
    scales = torch.cat([d, d * 4], dim=1).to(COMPUTE_DTYPE)
    return codes.to(torch.uint8), scales


def _int8(parts: dict[str, torch.Tensor], spec: QuantSpec, shape: tuple[int, int], route: str | None) -> Kernel:
    return Int8Kernel(parts["qweight"], parts["scales"])


def _int4(parts: dict[str, torch.Tensor], spec: QuantSpec, shape: tuple[int, int], route: str | None) -> Kernel:
    try:
        return Int4Kernel(int4_codes(parts), parts["scales"], parts.get("zeros"), spec.group_size or INT4_GROUP)
    except RuntimeError:
        return DequantKernel(parts, spec, shape)


def _bnb4(parts: dict[str, torch.Tensor], spec: QuantSpec, shape: tuple[int, int], route: str | None) -> Kernel:
    return Bnb4Kernel(parts, spec, shape) if _bnb_available() else DequantKernel(parts, spec, shape)


def _mxfp4(parts: dict[str, torch.Tensor], spec: QuantSpec, shape: tuple[int, int], route: str | None) -> Kernel:
    if route == "int4x2":
        c, s = mxfp4_to_int4x2(parts)
        try:
            k = Int4Kernel(c, s, None, 32, in_features=shape[1], dup_input=2)
            k.route = "mxfp4 as exact int4 pair, " + k.route
            return k
        except RuntimeError:
            pass
    return DequantKernel(parts, spec, shape)


# The kernel of each stored format (quantkit/formats), keyed by format name: adding a format is its module in
# formats/ plus one entry here. quantkit's own CPU kernel (cpu_kernel.py) takes int4/int8 first where built.
KERNELS: dict[str, Callable[[dict[str, torch.Tensor], QuantSpec, tuple[int, int], str | None], Kernel]] = {
    "int8": _int8, "int4": _int4, "nf4": _bnb4, "fp4": _bnb4, "mxfp4": _mxfp4,
}


def prepare(parts: dict[str, torch.Tensor] | torch.Tensor, spec: QuantSpec | None, shape: tuple[int, ...],
            route: str | None = None, shared: bool = False, mxfp4: str = "int4x2") -> Kernel:
    """The kernel for one matrix whose parts already sit on their device. `route` forces a route
    ("dequant" for the generic fallback, "torch" for torch's packed ops instead of quantkit's CPU
    kernel), for tests and benchmarks. `shared`: a dense tensor the model also uses elsewhere (kept as
    it is, not copied). `mxfp4`: how an MXFP4 matrix runs where `route` leaves it open ("int4x2", the
    exact int4 pair, or "dequant"; RuntimeOptions.mxfp4_route)."""
    if len(shape) != 2:
        raise QuantkitError(f"prepare takes one matrix [out, in]; got shape {list(shape)}")
    if spec is None:
        w = parts if isinstance(parts, torch.Tensor) else parts["weight"]
        if route != "torch" and w.dtype == torch.bfloat16 and w.dim() == 2:

            if w.is_contiguous() and cpu_kernel.supports("bf16", tuple(w.shape), w.device):
                return QBf16Kernel(w, shared)
        return DenseKernel(w)
    assert isinstance(parts, dict)
    if route == "dequant":
        return DequantKernel(parts, spec, shape)
    f = spec.format
    if f in ("int4", "int8") and route != "torch":
        qk = qkernel(parts, spec, (shape[0], shape[1]))
        if qk is not None:
            return qk
    if f in KERNELS:
        # the mxfp4 kernel's only choice is int4x2 or dequant: torch's route leaves it to `mxfp4`
        chosen = mxfp4 if f == "mxfp4" and route in (None, "torch") else route
        return KERNELS[f](parts, spec, (shape[0], shape[1]), chosen)
    raise QuantkitError(f"no kernel for format {f!r}")


@dataclass
class KernelInfo:
    """What `describe` reports for one prepared kernel."""

    route: str
    out_features: int
    in_features: int
    device: str
    nbytes: int


def describe(k: Kernel) -> KernelInfo:
    return KernelInfo(k.route, k.out_features, k.in_features, str(k.device), k.nbytes)


def slice_parts(parts: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
    """Expert i's parts from a stack's parts (every part's dim 0 is the expert)."""
    return {k: v[i] for k, v in parts.items()}


def kernel_routes(kernels: list[Any]) -> dict[str, int]:
    out: dict[str, int] = {}
    for k in kernels:
        out[k.route] = out.get(k.route, 0) + 1
    return out
