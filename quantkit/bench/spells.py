"""Decode speed against the read bandwidth of the same moment, for `quantkit bench decode --spells S`.

Why: on a shared machine the streaming read can hold near one of two rates for seconds at a time, every
buffer together (reports/bench-decode.md shows such spells), so a decode timed in one spell and a bound
read in the other say little about each other. Here one
configuration's process decodes again and again for S seconds, each time between two streaming reads,
and `summarize` groups the samples by the bandwidth beside them: per spell, the decode and its share
of that bandwidth (bytes per step x tok/s over the mean of the two reads).

The samples come from quantkit.bench.spell_poll, run in the configuration's own process; `summarize` and
`render` here are pure.
"""

from __future__ import annotations

import statistics
from typing import Any

READ_GIB = 0.25  # each read: 256 MiB, well above a last-level cache, so it streams from DRAM
SPLIT = 1.3  # reads spread wider than this ratio split into a slow and a fast spell at their midpoint


def summarize(poll_result: dict[str, Any]) -> dict[str, Any]:
    """Per spell (`slow` and `fast`, or `steady` when the reads stay within SPLIT of each other): samples,
    median read GB/s, median decode tok/s and median share of the reads beside each decode. A sample whose
    two reads fall in different spells is left out (the spell changed during it)."""
    nbytes = poll_result["step_bytes"]
    samples = poll_result["samples"]
    reads = [r for s in samples for r in (s["read_before_gbs"], s["read_after_gbs"])]
    if not reads:
        return {"step_bytes": nbytes, "spells": {}, "samples": 0}
    lo, hi = min(reads), max(reads)
    split = hi / lo > SPLIT
    mid = (lo + hi) / 2
    groups: dict[str, list[dict[str, Any]]] = {}
    for s in samples:
        b, a = s["read_before_gbs"], s["read_after_gbs"]
        if split and (b > mid) != (a > mid):
            continue
        name = ("fast" if b > mid else "slow") if split else "steady"
        groups.setdefault(name, []).append(s)
    spells = {}
    for name, grp in groups.items():
        shares = [s["decode_tok_s"] * nbytes / ((s["read_before_gbs"] + s["read_after_gbs"]) / 2 * 1e9) for s in grp]
        spells[name] = {"samples": len(grp),
                        "read_gbs": round(statistics.median((s["read_before_gbs"] + s["read_after_gbs"]) / 2
                                                            for s in grp), 2),
                        "decode_tok_s": round(statistics.median(s["decode_tok_s"] for s in grp), 2),
                        "share_of_read": round(statistics.median(shares), 4)}
    return {"step_bytes": nbytes, "spells": spells, "samples": len(samples)}


def render(name: str, summary: dict[str, Any], seconds: float) -> list[str]:
    """The report's section on the spells of one configuration."""
    out = ["", f"## {name} decode in the machine's bandwidth spells", "",
           f"`--spells {seconds:g}`: {name}'s process decoded for {seconds:g} s, each decode between two streaming "
           f"reads of {READ_GIB * 1024:.0f} MiB ({summary['samples']} samples; one whose reads fall in different spells "
           "is left out). The share is the bytes a step reads x tok/s over the mean of the two reads beside it; "
           "medians per spell.", "",
           "| spell | samples | read GB/s | decode tok/s | share of the read |", "|---|---:|---:|---:|---:|"]
    for spell in ("slow", "fast", "steady"):
        s = summary["spells"].get(spell)
        if s:
            out.append(f"| {spell} | {s['samples']} | {s['read_gbs']:.1f} | {s['decode_tok_s']:.1f} | "
                       f"{s['share_of_read']:.0%} |")
    return out

