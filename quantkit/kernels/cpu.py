"""The CPU kernel loaded with its instruction set chosen, and the QUANTKIT_CPU_ISA switch.

`module()` loads the module kernels/build.py builds and sets its op table once: the best this CPU and build
run, lowered by QUANTKIT_CPU_ISA=generic|avx2|avx512 (LEVEL-plain: that level without its extension,
AVX-VNNI or AVX512-BF16; a level the CPU or the build lacks gets one line and the best there is), or None
with `none`/`off`: torch's kernels. A load given options sets the level through `configure` instead of the
environment. `python -m quantkit.kernels.cpu build` (scripts/setup.sh) builds or checks the cached module.
"""

from __future__ import annotations

import functools
import os
import sys
from types import ModuleType

from quantkit.kernels.build import build, cache_dir, notice

CPU_ISA_ENV = "QUANTKIT_CPU_ISA"
ISA_LEVELS = {"generic": 0, "avx2": 1, "avx512": 2}
ISA_NAMES = {v: k for k, v in ISA_LEVELS.items()}


def torch_only(cpu_isa: str) -> bool:
    """QUANTKIT_CPU_ISA=none (or off): the kernel is not loaded, torch's kernels run."""
    return cpu_isa in ("none", "off")


def plain(cpu_isa: str) -> bool:
    """LEVEL-plain: the level without its extension (AVX-VNNI, AVX512-BF16)."""
    return cpu_isa.endswith("-plain")


def isa_level(cpu_isa: str) -> str:
    """The level asked for without the -plain suffix ("" for the best)."""
    return "" if torch_only(cpu_isa) else cpu_isa.removesuffix("-plain")


_asked: str | None = None  # set by `configure` (a load given options); None: the environment's


def asked() -> str:
    """The QUANTKIT_CPU_ISA value the kernel's level follows: that of `configure`, else the environment's."""
    return _asked if _asked is not None else os.environ.get(CPU_ISA_ENV, "").strip().lower()


def enabled_by_env() -> bool:
    """False where QUANTKIT_CPU_ISA=none (or the load's cpu_isa): torch's kernels only."""
    return not torch_only(asked())


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


def _set_level(mod: ModuleType, cpu_isa: str) -> None:
    mod.set_isa(chosen_level(mod.detect_isa(), isa_level(cpu_isa)))
    if plain(cpu_isa) and mod.table() != mod.isa_plain_name():
        mod.set_table(mod.isa_plain_name())
    global loaded_table
    loaded_table = mod.table()


def configure(cpu_isa: str) -> None:
    """Follow `cpu_isa`, spelled as QUANTKIT_CPU_ISA (a load given options calls it; "" leaves the level to the
    environment). Before the kernel loads it records the level the load will choose; once loaded, the level is
    set (the table is process-wide: every model loaded runs on it); "none" cannot unload it (one line; torch's
    kernels run where the kernel never loaded)."""
    global _asked
    if not cpu_isa:
        return
    if module.cache_info().currsize == 0:
        _asked = cpu_isa
        return
    mod = module()
    if mod is None:
        return
    if torch_only(cpu_isa):
        notice(f"cpu_isa={cpu_isa}: the CPU kernel is already loaded in this process; it stays on")
        return
    _set_level(mod, cpu_isa)


loaded_table = "none"  # the table module() chose at load (tests and benches may switch it for a while)


def chosen_level(best: int, want: str | None = None) -> int:
    """The level to run: the best this CPU and build have, lowered by `want` (generic, avx2, avx512; None:
    the level `asked()` names, QUANTKIT_CPU_ISA without a load's options; LEVEL-plain there is that level
    without its extension; one line when the value is unknown or above what there is)."""
    if want is None:
        want = isa_level(asked())
    if not want:
        return best
    if want not in ISA_LEVELS:
        notice(f"QUANTKIT_CPU_ISA={want!r} is not one of {', '.join(ISA_LEVELS)}; using {ISA_NAMES[best]}")
        return best
    if ISA_LEVELS[want] > best:
        notice(f"QUANTKIT_CPU_ISA={want}: this CPU (or this build) cannot run it; using {ISA_NAMES[best]}")
        return best
    return ISA_LEVELS[want]


def available() -> bool:
    return module() is not None


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


def main(argv: list[str] | None = None) -> int:
    """Build (or check) the cached module; one line out. scripts/setup.sh calls `main(["build"])`.
    Exits 0 even when the build fails: set-up must go on, and the runtime then keeps torch's kernels."""
    args = sys.argv[1:] if argv is None else argv
    if args not in ([], ["build"], ["lower-isas"]):
        print("usage: python -m quantkit.kernels.cpu [build | lower-isas]", file=sys.stderr)
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
