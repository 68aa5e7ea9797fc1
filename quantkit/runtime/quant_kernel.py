"""The quantizer's own kernels (csrc/qk_quant_impl.h): build, load, choose the instruction set, call.

A small plain-C library of its own (not the decode kernel's torch extension): its three units build in
seconds, with cpu_kernel's compiler, flags and cache rules (a folder keyed by the sources, the compiler and
the flags; a checksum written after the build), and it is called through ctypes, which releases the GIL,
so the quantizer's row chunks run on its threads in parallel. The unit is chosen once at load: the best
this CPU and OS run (the generic unit asks), lowered by QUANTKIT_CPU_ISA like the decode kernel's;
`QUANTKIT_CPU_ISA=none` keeps torch's route. Whatever goes wrong costs one line and torch's route is used.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
from pathlib import Path

import torch

from quantkit.runtime import cpu_kernel as ck

SOURCES = ("qk_quant_impl.h", "qk_quant.h", "qk_bf16.h")
# unit -> its flags (cpu_kernel's per level); the generic unit is required
UNITS: dict[str, tuple[str, ...]] = {"generic": ck.UNITS["generic"], "avx2": ck.UNITS["avx2"],
                                     "avx512": ck.UNITS["avx512"]}
_VOIDP = ctypes.c_void_p
_I64 = ctypes.c_int64


class _Ops(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("level", ctypes.c_int),
                ("int4_sym", ctypes.CFUNCTYPE(None, _VOIDP, _I64, _I64, _I64, _VOIDP, ctypes.c_int, _VOIDP, _VOIDP,
                                              _VOIDP)),
                ("int8_row", ctypes.CFUNCTYPE(None, _VOIDP, _I64, _I64, _VOIDP, _VOIDP, _VOIDP))]


def _units() -> dict[str, tuple[str, ...]]:
    return UNITS if platform.machine().lower() in ("x86_64", "amd64", "i686", "i386") else {"generic": ()}


def cache_dir() -> Path:
    """The build folder for these sources, this compiler and these flags (under cpu_kernel's cache root)."""
    base = os.environ.get("QUANTKIT_KERNEL_CACHE") or str(Path.home() / ".cache" / "quantkit" / "kernels")
    files = [ck.CSRC / s for s in SOURCES] + [ck.CSRC / f"qk_quant_{u}.cpp" for u in _units()]
    key = "\n".join([ck._compiler_id(ck._cxx()), repr(sorted(_units().items())), repr(ck.UNIT_CFLAGS),
                     platform.machine()])
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in files) + key.encode()).hexdigest()[:12]
    return Path(base) / f"qk_quant-{digest}"


def _build(d: Path) -> list[str]:
    """Compile each unit and link the library; the units left out (one line each)."""
    d.mkdir(parents=True, exist_ok=True)
    left_out: list[str] = []
    objs = ck.compile_units(d, _units(), "qk_quant", "quantizer kernel", left_out)
    so = d / "libqk_quant.so"
    tmp = so.with_suffix(".tmp")
    p = subprocess.run([*shlex.split(ck._cxx()), "-shared", *objs, "-o", str(tmp)], capture_output=True, text=True,
                       timeout=600)
    if p.returncode != 0:
        raise RuntimeError(f"error: linking the quantizer kernel failed: {p.stderr.strip()[-200:]}")
    tmp.replace(so)
    ck.write_stamp(so, d / "lib.sha256")
    return left_out


def _load_lib() -> ctypes.CDLL | None:
    d = cache_dir()
    so, stamp = d / "libqk_quant.so", d / "lib.sha256"
    if not ck.cache_root_usable(d.parent):
        return None
    with open(d.parent / f"{d.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not ck.stamp_matches(so, stamp):
            shutil.rmtree(d, ignore_errors=True)
            for line in _build(d):
                ck.notice(line)
        return ctypes.CDLL(str(so))


def tables() -> dict[str, _Ops]:
    """The units in the library this CPU can run, best first."""
    lib = _lib()
    if lib is None:
        return {}
    lib.qk_quant_best_level.restype = ctypes.c_int
    best = lib.qk_quant_best_level()
    out = {}
    for name, level in (("avx512", 2), ("avx2", 1), ("generic", 0)):
        entry = getattr(lib, f"qk_quant_{name}", None)
        if entry is None or level > best:
            continue
        entry.restype = ctypes.POINTER(_Ops)
        out[name] = entry().contents
    return out


@functools.lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL | None:
    if not ck.enabled_by_env():
        return None
    try:
        return _load_lib()
    except Exception as err:  # no compiler, a failed build, an unwritable cache
        ck.notice(f"quantizer kernel unavailable ({type(err).__name__}: {str(err).strip()[-200:]}); using torch's route")
        return None


@functools.lru_cache(maxsize=1)
def ops() -> _Ops | None:
    """The unit to run (QUANTKIT_CPU_ISA may lower it), or None: torch's route."""
    have = tables()
    if not have:
        return None
    best = max(t.level for t in have.values())
    level = ck.chosen_level(best)
    return next(t for t in have.values() if t.level <= level)


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def int4_sym(ops_: _Ops, x: torch.Tensor, group: int, grid: tuple[float, ...], packed: torch.Tensor,
             scales: torch.Tensor) -> tuple[float, float]:
    """Rows of bf16 x [R, K] into packed uint8 [R, K/2] and bf16 scales [R, K/group], in place; (squared
    error of the stored weights, sum of x^2)."""
    _check(x, packed, scales, x.shape[0] * x.shape[1] // 2, x.shape[0] * x.shape[1] // group)
    if group % 16 or group > 128 or x.shape[1] % group or len(grid) > 8:
        raise ValueError(f"int4_sym: group {group} / grid {grid} not supported")
    f = (ctypes.c_float * max(len(grid), 1))(*grid)
    sums = (ctypes.c_double * 2)()
    ops_.int4_sym(_ptr(x), x.shape[0], x.shape[1], group, ctypes.addressof(f), len(grid), _ptr(packed),
                  _ptr(scales), ctypes.addressof(sums))
    return sums[0], sums[1]


def int8_row(ops_: _Ops, x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> tuple[float, float]:
    """Rows of bf16 x [R, K] into int8 q [R, K] and bf16 scales [R], in place; (squared error, sum of x^2)."""
    _check(x, q, scales, x.numel(), x.shape[0])
    sums = (ctypes.c_double * 2)()
    ops_.int8_row(_ptr(x), x.shape[0], x.shape[1], _ptr(q), _ptr(scales), ctypes.addressof(sums))
    return sums[0], sums[1]


def _check(x: torch.Tensor, out: torch.Tensor, scales: torch.Tensor, out_numel: int, scales_numel: int) -> None:
    ok = (x.dim() == 2 and x.dtype == torch.bfloat16 and x.is_contiguous() and x.device.type == "cpu"
          and out.is_contiguous() and out.element_size() == 1 and out.numel() == out_numel
          and scales.dtype == torch.bfloat16 and scales.is_contiguous() and scales.numel() == scales_numel)
    if not ok:
        raise ValueError("quantizer kernel: x must be contiguous bf16 [R, K] on the CPU, outputs contiguous and sized")
