"""The CPU kernel's op tables and the QUANTKIT_CPU_ISA values the forced-switch tests run."""

from __future__ import annotations

import pytest

KERNEL_TABLES = ("avx512bf16", "avx512", "avx2vnni", "avx2", "generic")


# every QUANTKIT_CPU_ISA value that names a table: the forced-switch tests run each in a fresh process (the
# fast tier keeps the plain levels below AVX512; the full run takes them all)
_slow = pytest.mark.slow


ISA_VALUES = (pytest.param("avx512", marks=_slow), pytest.param("avx512-plain", marks=_slow), "avx2",
              pytest.param("avx2-plain", marks=_slow), "generic")


def forced_isa_table(value: str) -> str:
    """The op table QUANTKIT_CPU_ISA=`value` runs on this machine. Skips the calling test where the CPU or the
    build cannot run that level, or where LEVEL-plain is the level's own table (no extension to leave out)."""
    from quantkit.kernels import cpu as cpu_kernel

    mod = cpu_kernel.module()
    level = value.removesuffix("-plain")
    if mod is None or cpu_kernel.ISA_LEVELS[level] > mod.detect_isa() or cpu_kernel.best_table(level) is None:
        pytest.skip(f"QUANTKIT_CPU_ISA={value}: this CPU or build cannot run it")
    if value == level:
        return cpu_kernel.best_table(level)
    if level not in mod.tables() or cpu_kernel.best_table(level) == level:
        pytest.skip(f"QUANTKIT_CPU_ISA={value}: {level} has no extension here, the same table as {level}")
    return level


def forced_table(name: str):
    from quantkit.kernels import cpu as cpu_kernel

    mod = cpu_kernel.module()
    level = cpu_kernel.ISA_LEVELS[cpu_kernel.table_level(name)]
    if name not in mod.units():
        pytest.skip(f"{name}: this build has no such unit (the compiler could not build it)")
    if name not in mod.tables():
        pytest.skip(f"{name}: this CPU lacks it")
    order = mod.tables()
    if order.index(name) < order.index(cpu_kernel.loaded_table):
        pytest.skip(f"{name}: above the table this run uses ({cpu_kernel.loaded_table}; QUANTKIT_CPU_ISA)")
    before = mod.table()
    mod.set_table(name)
    assert mod.table() == name and mod.isa() == level
    yield name
    mod.set_table(before)
