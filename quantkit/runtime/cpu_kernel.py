"""quantkit's own CPU kernel: build, load, choose the instruction set, repack, call.

Why: torch's CPU int4 op is compute-bound at batch 1 and a MoE layer ran as 16 of its calls plus ~50 small
ops from Python (reports/bench-kernel.md). The C++ kernel quantizes activations to int8 per block of 32 and
dots them against the stored 4-bit / 8-bit codes, runs the k routed experts of a layer in one call, and
fuses the rest of a decode step (norms, routing, the Gated DeltaNet and attention cores, the whole stack of
layers in one call). The same op table holds the quantizer's int4 and int8 (csrc/qk_quant_impl.h, called
through runtime/quant_kernel.py): one build, one CPU detector, one forced switch for both.

Instruction sets: every op has a generic C++ version and AVX2+FMA, AVX2 with AVX-VNNI (Intel Core 12th gen
on), AVX512 (F/BW/VL/VNNI) and AVX512-BF16 versions (csrc/qk_ops_impl.h), each compiled as its own unit with its own -m flags (`UNITS`) and linked
into one module, which picks one table once at load from cpuid and the OS's XSAVE state
(csrc/qk_cpu.cpp). No CPU runs an instruction it lacks, whatever the compiler hoists. A unit the compiler
cannot build is left out with one line; the others still load. `QUANTKIT_CPU_ISA=generic|avx2|avx512`
forces a lower one (a level the CPU or the build lacks gets one line and the best there is).

Build: `main(["build"])` (scripts/setup.sh calls it) compiles into a cache folder keyed by every file in
csrc/, the torch version, the compiler (path and version) and the units' flags (`$QUANTKIT_KERNEL_CACHE`, default
`~/.cache/quantkit/kernels`), so an edited source, a new torch or another compiler never loads a stale
module; a checksum written after the build guards against a truncated or corrupt file. Whatever goes wrong
(no compiler, a failed build) costs one line on stderr and the runtime keeps torch's kernels.
`QUANTKIT_CPU_ISA=none` keeps torch's kernels.

Error of the int8 activations: each block of 32 is rounded to 127 levels of its largest magnitude, a
relative error of about 2^-8 per element, the same order as the bf16 activations torch's route takes;
tests/kernels/test_cpu_kernel.py holds the fused route within 2e-2 relative of the fp32 reference on every ISA.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from quantkit.runtime import hugepages
from quantkit.runtime.options import RuntimeOptions

CSRC = Path(__file__).parent / "csrc"
SOURCES = (CSRC / "qk_cpu.cpp", CSRC / "qk_step.cpp", CSRC / "qk_layers.cpp")  # torch-facing, baseline flags
HEADERS = tuple(sorted(CSRC.glob("*.h")))
_AVX2 = ("-mavx2", "-mfma")
_AVX512 = (*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni")
# the ISA units (csrc/qk_ops_<name>.cpp) and their own flags; generic is required, the others optional
UNITS: dict[str, tuple[str, ...]] = {"generic": (), "avx2": _AVX2, "avx2vnni": (*_AVX2, "-mavxvnni"),
                                     "avx512": _AVX512, "avx512bf16": (*_AVX512, "-mavx512bf16")}
UNIT_CFLAGS = ("-O3", "-std=c++17", "-fPIC", "-ffp-contract=off", "-fno-math-errno")
ISA_LEVELS = {"generic": 0, "avx2": 1, "avx512": 2}
ISA_NAMES = {v: k for k, v in ISA_LEVELS.items()}
TILE = 16
BLOCK = 32

_notice_given: set[str] = set()


def notice(msg: str) -> None:
    """One line on stderr, once per process per message."""
    if msg not in _notice_given:
        _notice_given.add(msg)
        print(f"quantkit: {msg}", file=sys.stderr)


def cache_root_usable(root: Path) -> bool:
    """Whether the kernel's cache root can be created; if not, one line and False: torch's route is kept."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        return True
    except OSError as err:
        notice(f"kernel cache {root} unusable ({type(err).__name__}: {err.strerror or err}); quantkit's CPU "
               "kernels are off, torch's route is used (QUANTKIT_KERNEL_CACHE chooses another folder)")
        return False


_asked: RuntimeOptions | None = None  # set by `configure` (a load given options); None: the environment's


def asked() -> RuntimeOptions:
    """The options the kernel's level follows: those of `configure`, else `RuntimeOptions.from_env()`."""
    return _asked if _asked is not None else RuntimeOptions.from_env()


def enabled_by_env() -> bool:
    """False where QUANTKIT_CPU_ISA=none (or the options' cpu_isa): torch's kernels only."""
    return not asked().torch_only


def _units() -> dict[str, tuple[str, ...]]:
    """The units to build here: all on x86-64, the generic one elsewhere."""
    if platform.machine().lower() in ("x86_64", "amd64", "i686", "i386"):
        return UNITS
    return {"generic": ()}


def _cxx() -> str:
    return os.environ.get("CXX") or "c++"


@functools.lru_cache(maxsize=8)
def _compiler_id(cxx: str) -> str:
    """The compiler's resolved path and version line ("?" when it cannot run: the build then fails)."""
    exe = shutil.which(cxx.split()[0]) if cxx.strip() else None
    if exe is None:
        return f"{cxx}: not found"
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return f"{exe}: ?"
    return f"{os.path.realpath(exe)}: {(out.splitlines() or ['?'])[0]}"


def cache_dir() -> Path:
    """The cache folder for these sources, this torch, this compiler and these units' flags."""
    base = os.environ.get("QUANTKIT_KERNEL_CACHE") or str(Path.home() / ".cache" / "quantkit" / "kernels")
    # every source and header, named and read: an edited, added or removed file is a new build
    text = b"".join(p.name.encode() + b"\0" + p.read_bytes() for p in sorted(CSRC.glob("*.[ch]*")))
    key = "\n".join([torch.__version__, _compiler_id(_cxx()), repr(sorted(_units().items())), repr(UNIT_CFLAGS),
                     platform.machine()])
    digest = hashlib.sha256(text + key.encode()).hexdigest()[:12]
    return Path(base) / f"qk_cpu-{digest}"


def _compile_units(d: Path, left_out: list[str]) -> list[str]:
    """Compile each ISA unit csrc/qk_ops_NAME.cpp with its own flags into d; the objects that built. A unit
    that fails is left out (its table is then absent), with one line for it in `left_out`; the generic unit
    must build."""
    objs = []
    for name, flags in _units().items():
        obj = d / f"qk_ops_{name}.o"
        cmd = [*shlex.split(_cxx()), *UNIT_CFLAGS, *flags, "-c", str(CSRC / f"qk_ops_{name}.cpp"), "-o", str(obj)]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            ok, why = p.returncode == 0, next((ln for ln in p.stderr.splitlines() if "error" in ln), p.stderr[-200:])
        except (OSError, subprocess.SubprocessError) as err:
            ok, why = False, str(err)
        if ok:
            objs.append(str(obj))
        elif name == "generic":
            raise RuntimeError(f"error: the generic unit did not build: {why.strip()[:200]}")
        else:
            left_out.append(f"CPU kernel: the {name} unit did not build ({why.strip()[:160]}); left out, the others load")
    return objs


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


def _build(d: Path, left_out: list[str]) -> ModuleType:
    from torch.utils import cpp_extension

    # the ninja that `pip install ninja` puts next to this Python, when the venv is not activated
    bindir = str(Path(sys.executable).parent)
    if bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    d.mkdir(parents=True, exist_ok=True)
    objs = _compile_units(d, left_out)
    mod = cpp_extension.load(name=_module_name(d), sources=[str(p) for p in SOURCES], build_directory=str(d),
                             extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp", *objs], verbose=False)
    so, stamp = _paths(d)
    stamp.with_suffix(".tmp").write_text(_sha256(so))  # written whole, then renamed: the proof build() checks
    stamp.with_suffix(".tmp").replace(stamp)
    return mod


def build(quiet: bool = False) -> ModuleType | None:
    """The compiled module: imported from the cache when its checksum matches the one written after its
    build, else (missing, stale, truncated: dlopen of a truncated module can kill the process with
    SIGBUS, so it is never tried) built afresh there. None, with one line on stderr, when it cannot be had."""
    import fcntl

    try:
        d = cache_dir()  # reads the source: a missing file is a failed build too
        so, stamp = _paths(d)
        if not cache_root_usable(d.parent):
            return None
        # one process checks or builds at a time (two `quantkit` processes starting on a fresh cache)
        with open(d.parent / f"{d.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            # a truncated module loaded with dlopen can kill the process with SIGBUS: one whose sha256 does not
            # match the one written after its build is never loaded
            if so.exists() and stamp.exists() and stamp.read_text().strip() == _sha256(so):
                try:
                    return _import(d)
                except ImportError:
                    pass
            if d.exists():
                shutil.rmtree(d, ignore_errors=True)  # our own cache folder (named for the source's hash)
            notice(f"building the CPU kernel once into {d} (about a minute)")
            left_out: list[str] = []
            try:
                with _quiet_fds(quiet):
                    return _build(d, left_out)
            finally:
                for line in left_out:  # after the compiler's output is let through again
                    notice(line)
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
    _set_level(mod, asked())
    return mod


def _set_level(mod: ModuleType, opts: RuntimeOptions) -> None:
    mod.set_isa(chosen_level(mod.detect_isa(), opts.isa_level))
    if opts.plain and mod.table() != mod.isa_plain_name():
        mod.set_table(mod.isa_plain_name())
    global loaded_table
    loaded_table = mod.table()


def configure(opts: RuntimeOptions) -> None:
    """Follow `opts.cpu_isa` (a load given options calls it; an empty one leaves the level to the environment).
    Before the kernel loads it records the level the load will choose; once loaded, the level is set (the table
    is process-wide: every model loaded runs on it); "none" cannot unload it (one line; torch's kernels run
    where the kernel never loaded)."""
    global _asked
    if not opts.cpu_isa:
        return
    if module.cache_info().currsize == 0:
        _asked = opts
        return
    mod = module()
    if mod is None:
        return
    if opts.torch_only:
        notice(f"cpu_isa={opts.cpu_isa}: the CPU kernel is already loaded in this process; it stays on")
        return
    _set_level(mod, opts)


loaded_table = "none"  # the table module() chose at load (tests and benches may switch it for a while)


def argmax(x: torch.Tensor) -> int:
    """int(torch.argmax(x)) (the first maximum), by the kernel's `argmax` on a contiguous bf16 / fp32 CPU tensor:
    torch's reads bf16 logits element by element, a few percent of a greedy step over a 248k vocabulary."""
    mod = module()
    if mod is not None and x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float32) and x.is_contiguous():
        return int(mod.argmax(x))
    return int(torch.argmax(x))


@contextlib.contextmanager
def denormals_flushed() -> Iterator[None]:
    """Within the block fp32 denormals are flushed to zero on every thread torch computes on (the kernel's
    `flush_denormals`; without the kernel, torch's own switch, which covers the calling thread only); after it
    the threads are as they were. Why: a fast-forgetting Gated DeltaNet head makes denormals in a prefill, each
    a slow microcode assist; flushing them left every bit-for-bit forward test unchanged."""
    mod = module()
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


def chosen_level(best: int, want: str | None = None) -> int:
    """The level to run: the best this CPU and build have, lowered by `want` (generic, avx2, avx512; None:
    the level `asked()` names, QUANTKIT_CPU_ISA without a load's options; LEVEL-plain there is that level
    without its extension; one line when the value is unknown or above what there is)."""
    if want is None:
        want = asked().isa_level
    if not want:
        return best
    if want not in ISA_LEVELS:
        notice(f"QUANTKIT_CPU_ISA={want!r} is not one of {', '.join(ISA_LEVELS)}; using {ISA_NAMES[best]}")
        return best
    if ISA_LEVELS[want] > best:
        notice(f"QUANTKIT_CPU_ISA={want}: this CPU (or this build) cannot run it; using {ISA_NAMES[best]}")
        return best
    return ISA_LEVELS[want]


def bf16_available() -> bool:
    """Whether bf16 matrices run on the kernel (wherever it loads: AVX512-BF16 dots them natively, the
    other units widen bf16 to fp32 in registers)."""
    return available()


def isa() -> str:
    """The instruction set in use: "generic", "avx2" or "avx512" ("none" without the kernel)."""
    mod = module()
    return ISA_NAMES[mod.isa()] if mod else "none"


def isa_name() -> str:
    """The op table in use, as routes name it: generic, avx2, avx2vnni, avx512 or avx512bf16 ("none")."""
    mod = module()
    return mod.table() if mod else "none"


def table_level(table: str) -> str:
    """The level a table belongs to: avx2vnni -> avx2, avx512bf16 -> avx512."""
    return table.removesuffix("bf16").removesuffix("vnni")


def best_table(level: str) -> str | None:
    """The table QUANTKIT_CPU_ISA=level runs on this CPU (its best at that level), or None."""
    mod = module()
    return next((t for t in mod.tables() if table_level(t) == level), None) if mod else None


def lower_isas() -> list[str]:
    """The QUANTKIT_CPU_ISA values below the table in use that this CPU can run, each a table of its own
    (what CI proves a second time): the lower levels, and LEVEL-plain where a level has an extension."""
    mod = module()
    if mod is None:
        return []
    out = []
    for t in mod.tables()[mod.tables().index(mod.table()) + 1:]:
        level = table_level(t)
        out.append(level if t == best_table(level) else f"{level}-plain")
    return out


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
    return fmt in ("bf16", "int4", "int8") and available()


def main(argv: list[str] | None = None) -> int:
    """Build (or check) the cached module; one line out. scripts/setup.sh calls `main(["build"])`.
    Exits 0 even when the build fails: set-up must go on, and the runtime then keeps torch's kernels."""
    args = sys.argv[1:] if argv is None else argv
    if args not in ([], ["build"], ["lower-isas"]):
        print("usage: python -m quantkit.runtime.cpu_kernel [build | lower-isas]", file=sys.stderr)
        return 2
    mod = module()
    if args == ["lower-isas"]:  # scripts/test.sh: the levels to prove a second time, one a line
        print("\n".join(lower_isas()))
        return 0
    if mod is not None:
        print(f"quantkit: CPU kernel ready ({isa_name()}; units {', '.join(mod.units())}) in {cache_dir()}")
    elif not enabled_by_env():
        print("quantkit: CPU kernel switched off (QUANTKIT_CPU_ISA=none)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
