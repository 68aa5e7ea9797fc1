"""quantkit's own CPU kernel for int4/int8 weights (csrc/qk_cpu.cpp) and the decode step's other pieces
(csrc/qk_step.cpp): build, load, repack, call.

Why: torch 2.13's CPU int4 op (`_weight_int4pack_mm_for_cpu`) is compute-bound at batch 1 (25-37
GMAC/s on 2 threads) and a MoE layer runs as 16 of its calls plus ~50 small ops from Python: 1.03 ms per
layer-token where reading the weights takes 0.42 ms (measured on the 2-core build machine; kt-kernel
measured no gain here). The C++ kernel quantizes activations to int8 per block of 32 and dots them against the stored
4-bit / 8-bit codes with AVX512-VNNI (or AVX2), on torch's own OpenMP pool, and runs the k routed
experts of a layer (gate_up, SiLU x up, down, weighted sum) in one call. Figures: reports/bench-kernel.md.

Build: `main(["build"])` (scripts/setup.sh calls it) compiles the sources with
torch.utils.cpp_extension (gcc, ninja) into a cache folder keyed by the sources' hash and the torch
version (`$QUANTKIT_KERNEL_CACHE`, default `~/.cache/quantkit/kernels`), so an edited source or a new
torch never loads a stale module; a checksum written after the build guards against a truncated or
corrupt file. At run time the first use imports it (building it if missing, about a minute). Whatever
goes wrong (no compiler, a failed build, a CPU without AVX2) costs one line on stderr and the runtime
keeps torch's kernels.

bf16 weights (kept tensors, bf16 experts): on CPUs with AVX512-BF16 the same module dots them as they
are stored (row-major, no repack) with bf16 activations at decode batch sizes (`vdpbf16ps`, fp32
accumulation), and bf16 experts join the fused MoE call; prefill keeps torch's `F.linear` (oneDNN GEMM).

Switches: `QUANTKIT_CPU_KERNEL=off` keeps torch's kernels; `QUANTKIT_NO_AVX512=1` uses the AVX2 path
(what a CPU without AVX512-VNNI runs; bf16 weights then stay on torch).

Error of the int8 activations: each block of 32 is rounded to 127 levels of its largest magnitude, a
relative error of about 2^-8 per element, the same order as the bf16 activations torch's route takes;
tests/test_cpu_kernel.py holds the fused route within 2e-2 relative of the fp32 reference.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from quantkit.runtime import hugepages

CSRC = Path(__file__).parent / "csrc"
SOURCES = (CSRC / "qk_cpu.cpp", CSRC / "qk_step.cpp", CSRC / "qk_layers.cpp")  # compiled
HEADERS = (CSRC / "qk_common.h", CSRC / "qk_cpu.h", CSRC / "qk_layers.h", CSRC / "qk_step.h")
TILE = 16
BLOCK = 32

_notice_given: set[str] = set()


def notice(msg: str) -> None:
    """One line on stderr, once per process per message."""
    if msg not in _notice_given:
        _notice_given.add(msg)
        print(f"quantkit: {msg}", file=sys.stderr)


def enabled_by_env() -> bool:
    return os.environ.get("QUANTKIT_CPU_KERNEL", "on").strip().lower() not in ("off", "0", "no", "false")


def cache_dir() -> Path:
    base = os.environ.get("QUANTKIT_KERNEL_CACHE") or str(Path.home() / ".cache" / "quantkit" / "kernels")
    text = b"".join(p.read_bytes() for p in SOURCES + HEADERS)
    digest = hashlib.sha256(text + torch.__version__.encode()).hexdigest()[:12]
    return Path(base) / f"qk_cpu-{digest}"


def _module_name(d: Path) -> str:
    return "quantkit_" + d.name.replace("-", "_")


def _paths(d: Path) -> tuple[Path, Path]:
    """(the compiled module, the sha256 of it written after a build that loaded)."""
    return d / f"{_module_name(d)}.so", d / "module.sha256"


def _sha256(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _import(d: Path) -> ModuleType:
    import importlib.util

    so, _ = _paths(d)
    spec = importlib.util.spec_from_file_location(_module_name(d), so)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {so}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _build(d: Path) -> ModuleType:
    from torch.utils import cpp_extension

    # the ninja that `pip install ninja` puts next to this Python, when the venv is not activated
    bindir = str(Path(sys.executable).parent)
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    d.mkdir(parents=True, exist_ok=True)
    mod = cpp_extension.load(name=_module_name(d), sources=[str(p) for p in SOURCES], build_directory=str(d),
                             extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)
    so, stamp = _paths(d)
    tmp = stamp.with_suffix(".tmp")
    tmp.write_text(_sha256(so))
    tmp.replace(stamp)
    return mod


def build(quiet: bool = False) -> ModuleType | None:
    """The compiled module: imported from the cache when its checksum matches the one written after its
    build, else (missing, stale, truncated: dlopen of a truncated module can kill the process with
    SIGBUS, so it is never tried) built afresh there. None, with one line on stderr, when it cannot be had."""
    import fcntl

    try:
        d = cache_dir()  # reads the source: a missing file is a failed build too
        so, stamp = _paths(d)
        d.parent.mkdir(parents=True, exist_ok=True)
        # one process checks or builds at a time (two `quantkit` processes starting on a fresh cache)
        with open(d.parent / f"{d.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if so.exists() and stamp.exists() and stamp.read_text().strip() == _sha256(so):
                try:
                    return _import(d)
                except ImportError:
                    pass
            if d.exists():
                shutil.rmtree(d, ignore_errors=True)  # our own cache folder (named for the source's hash)
            notice(f"building the CPU kernel once into {d} (about a minute)")
            with _quiet_fds(quiet):
                return _build(d)
    except Exception as err:  # a compiler error, a missing ninja, an unwritable cache
        lines = str(err).strip().splitlines() or ["?"]
        reason = next((ln.strip() for ln in lines if "error:" in ln), lines[-1].strip())  # the compiler's first
        notice(f"CPU kernel unavailable ({type(err).__name__}: {reason[:200]}); using torch's kernels")
        return None


class _quiet_fds:
    """Silence the compiler's and ninja's output (written to fds 1 and 2 by subprocesses) when asked."""

    def __init__(self, quiet: bool):
        self.quiet = quiet

    def __enter__(self) -> None:
        if not self.quiet:
            return
        sys.stdout.flush()
        sys.stderr.flush()
        self.saved = [os.dup(1), os.dup(2)]
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(null, 2)
        os.close(null)

    def __exit__(self, *exc: Any) -> None:
        if not self.quiet:
            return
        for fd, saved in zip((1, 2), self.saved, strict=True):
            os.dup2(saved, fd)
            os.close(saved)


@functools.lru_cache(maxsize=1)
def module() -> ModuleType | None:
    """The loaded kernel module with its instruction set chosen, or None (torch's kernels are used)."""
    if not enabled_by_env():
        return None
    mod = build(quiet=True)
    if mod is None:
        return None
    best = mod.detect_isa()
    if best == 0:
        notice("CPU kernel needs AVX2+FMA or AVX512-VNNI, which this CPU lacks; using torch's kernels")
        return None
    if os.environ.get("QUANTKIT_NO_AVX512", "").strip() not in ("", "0"):
        best = min(best, 1)
    mod.set_isa(best)
    mod.set_bf16(best == 2 and mod.has_bf16())
    return mod


def bf16_available() -> bool:
    """Whether bf16 matrices can use the kernel (AVX512-BF16 CPUs; not under QUANTKIT_NO_AVX512)."""
    mod = module()
    return bool(mod is not None and mod.has_bf16())


def isa_name() -> str:
    mod = module()
    return {2: "AVX512-VNNI", 1: "AVX2"}.get(mod.isa(), "none") if mod else "none"


def available() -> bool:
    return module() is not None


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
    """q int8 [N, K], per-row scales [N] -> (codes + 128 as uint8 tiles, fp32 scales [NT*16])."""
    n, k = q.shape
    nt = -(-n // TILE)
    qw = hugepages.empty((nt, k // BLOCK, 8, TILE, 4), torch.uint8)
    for r0 in range(0, nt * TILE, _REPACK_ROWS):
        r1 = min(nt * TILE, r0 + _REPACK_ROWS)
        u = q[r0:min(r1, n)].contiguous().view(torch.uint8) ^ 0x80  # two's complement + 128
        u = _pad_rows(u, r1 - r0, 128).view(-1, TILE, k // BLOCK, 8, 4)
        qw[r0 // TILE:r1 // TILE] = u.permute(0, 2, 3, 1, 4)
    return qw.view(-1), _pad_rows(scales.float().reshape(-1), nt * TILE, 0.0).contiguous()


def supports(fmt: str, shape: tuple[int, ...], device: torch.device) -> bool:
    """Whether a matrix of this format ("bf16" for kept weights) and shape can run on the kernel."""
    if device.type != "cpu" or len(shape) != 2 or shape[1] % BLOCK or shape[0] <= 0:
        return False
    if fmt == "bf16":
        return bf16_available()
    return fmt in ("int4", "int8") and available()


def main(argv: list[str] | None = None) -> int:
    """Build (or check) the cached module; one line out. scripts/setup.sh calls `main(["build"])`.
    Exits 0 even when the build fails: set-up must go on, and the runtime then keeps torch's kernels."""
    args = sys.argv[1:] if argv is None else argv
    if args not in ([], ["build"]):
        print("usage: python -m quantkit.runtime.cpu_kernel [build]", file=sys.stderr)
        return 2
    mod = module()
    if mod is not None:
        print(f"quantkit: CPU kernel ready ({isa_name()}) in {cache_dir()}")
    elif not enabled_by_env():
        print("quantkit: CPU kernel switched off (QUANTKIT_CPU_KERNEL=off)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
