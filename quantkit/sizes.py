"""The one size rule for every option that takes a size (--ram, --gpu-reserve, --working-set, --max-shard-size,
--max-body, ...): `KB`/`MB`/`GB`/`TB` (and `K`/`M`/`G`/`T`) are decimal, powers of 1000; `KiB`/`MiB`/`GiB`/`TiB`
are binary, powers of 1024; `B` is bytes. A bare number means `bare_unit` (bytes, unless the option documents
another, e.g. --ram 64 = 64 GiB). Anything else, zero, negative, nan or absurdly large is one clear error."""

from __future__ import annotations

import re

from quantkit.errors import QuantkitError

KB, MB, GB, TB = 10**3, 10**6, 10**9, 10**12
KIB, MIB, GIB, TIB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
UNITS = {"b": 1, "k": KB, "kb": KB, "m": MB, "mb": MB, "g": GB, "gb": GB, "t": TB, "tb": TB,
         "kib": KIB, "mib": MIB, "gib": GIB, "tib": TIB}
MAX_SIZE = 1 << 60
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.I)


def parse_size(text: str, what: str = "size", bare_unit: int = 1, minimum: int = 1) -> int:
    """`64GB` -> 64e9, `64GiB` -> 64 * 2**30, `512k` -> 512000, `1000` -> 1000 * bare_unit bytes."""
    m = _SIZE.match(str(text or ""))
    unit = m.group(2).lower() if m else ""
    if not m or (unit and unit not in UNITS):
        raise QuantkitError(f"{what} {text!r} is not a size; write it like 2GB (10^9 bytes), 1GiB (2^30) "
                            "or 512MB")
    value = int(float(m.group(1)) * (UNITS[unit] if unit else bare_unit))
    if value < minimum or value > MAX_SIZE:
        raise QuantkitError(f"{what} {text!r} is out of range: give at least {minimum:,} bytes"
                            f" and at most {MAX_SIZE / 1e18:.1f} EB")
    return value


def format_size(n: int) -> str:
    """Bytes in the unit that fits, decimal as the size rule: `512 bytes`, `12.3 KB`, `4.56 MB`, `19.2 GB`."""
    n = int(n)
    sign = "-" if n < 0 else ""
    if abs(n) < KB:
        return f"{n:,} bytes"
    for unit, scale in (("KB", KB), ("MB", MB), ("GB", GB), ("TB", TB)):
        v = abs(n) / scale
        text = f"{v:.2f}" if v < 10 else f"{v:.1f}" if v < 100 else f"{v:,.0f}"
        if float(text.replace(",", "")) < 1000 or unit == "TB":
            return f"{sign}{text} {unit}"
    raise AssertionError("not reached")


def format_sizes(*sizes: int) -> list[str]:
    """Each size by `format_size`, or all in exact bytes where two would read the same but differ."""
    out = [format_size(n) for n in sizes]
    if len(set(out)) < len(set(sizes)):
        return [f"{int(n):,} bytes" for n in sizes]
    return out
