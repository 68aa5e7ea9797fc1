"""Build and load quantkit's C++ CPU kernel (csrc/).

Instruction sets: every op has a generic C++ version and AVX2+FMA, AVX2 with AVX-VNNI (Intel Core 12th gen
on), AVX512 (F/BW/VL/VNNI) and AVX512-BF16 versions (csrc/qk_ops_impl.h), each compiled as its own unit with
its own -m flags (`UNITS`) and linked into one module, which picks one table once at load from cpuid and the
OS's XSAVE state (csrc/qk_cpu.cpp; kernels/cpu.py chooses). No CPU runs an instruction it lacks, whatever the
compiler hoists. A unit the compiler cannot build is left out with one line; the others still load.

Build: `build()` compiles into a cache folder keyed by every file in csrc/, the torch version, the compiler
(path and version) and the units' flags (`$QUANTKIT_KERNEL_CACHE`, default `~/.cache/quantkit/kernels`), so an
edited source, a new torch or another compiler never loads a stale module; a checksum written after the build
guards against a truncated or corrupt file. Whatever goes wrong (no compiler, a failed build) costs one line
on stderr and None: the callers keep torch's kernels.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

CSRC = Path(__file__).parent / "csrc"
SOURCES = (CSRC / "qk_cpu.cpp", CSRC / "qk_step.cpp", CSRC / "qk_layers.cpp")  # torch-facing, baseline flags
HEADERS = tuple(sorted(CSRC.glob("*.h")))
_AVX2 = ("-mavx2", "-mfma")
_AVX512 = (*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni")
# the ISA units (csrc/qk_ops_<name>.cpp) and their own flags; generic is required, the others optional
UNITS: dict[str, tuple[str, ...]] = {"generic": (), "avx2": _AVX2, "avx2vnni": (*_AVX2, "-mavxvnni"),
                                     "avx512": _AVX512, "avx512bf16": (*_AVX512, "-mavx512bf16")}
UNIT_CFLAGS = ("-O3", "-std=c++17", "-fPIC", "-ffp-contract=off", "-fno-math-errno")

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


def units() -> dict[str, tuple[str, ...]]:
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
    import torch  # here, not at the top: kernels/cpu.py's switch parsing (RuntimeOptions) needs no torch

    base = os.environ.get("QUANTKIT_KERNEL_CACHE") or str(Path.home() / ".cache" / "quantkit" / "kernels")
    # every source and header, named and read: an edited, added or removed file is a new build
    text = b"".join(p.name.encode() + b"\0" + p.read_bytes() for p in sorted(CSRC.glob("*.[ch]*")))
    key = "\n".join([torch.__version__, _compiler_id(_cxx()), repr(sorted(units().items())), repr(UNIT_CFLAGS),
                     platform.machine()])
    digest = hashlib.sha256(text + key.encode()).hexdigest()[:12]
    return Path(base) / f"qk_cpu-{digest}"


def _compile_units(d: Path, left_out: list[str]) -> list[str]:
    """Compile each ISA unit csrc/qk_ops_NAME.cpp with its own flags into d; the objects that built. A unit
    that fails is left out (its table is then absent), with one line for it in `left_out`; the generic unit
    must build."""
    objs = []
    for name, flags in units().items():
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
            notice(f"building the CPU kernel into {d} (once: later runs load it from there)")
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
