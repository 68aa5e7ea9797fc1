"""A short soak of `quantkit serve` in its own process (issue 14; the long one is `python -m benchmarks.soak`, whose
figures are in reports/bench-serve.md): 8 clients for 10 s with hang-ups, oversized and too-long bodies and
foreign hosts mixed in. /health keeps answering, nothing gets a 500, RSS stays within its bound and returns
to its start."""

from __future__ import annotations

from pathlib import Path

from benchmarks.soak import write_report

from helpers.probe import count


def test_short_soak(tiny_model: Path, tmp_path: Path) -> None:
    from benchmarks.soak import run_soak
    from quantkit.checkpoint.reader import Checkpoint
    from quantkit.quantize.run import QuantizeOptions, run_quantize
    from quantkit.recipe import build_recipe

    q = tmp_path / "q4"
    run_quantize(Checkpoint.open(tiny_model), q, QuantizeOptions(recipe=build_recipe(4, "int", None, False, [], None)))
    d = run_soak(q, tmp_path / "work", clients=8, seconds=10, max_queue=4, log=lambda *_: None)
    count(d["requests"])
    r = d["rss"]
    print(f"soak: {d['clients']} clients x {d['seconds']:.0f} s, {d['requests']} requests; RSS start "
          f"{r['start'] / 1e6:.0f} MB, peak {r['peak'] / 1e6:.0f}, end {r['end'] / 1e6:.0f}; /health "
          f"{d['health']['polls']} polls, max {d['health']['max_s']} s; {d['by_kind_and_status']}")
    assert all(d["checks"].values()), (d["checks"], d["problems"], d["rss"], d["health"])
    kinds = {k.split()[0] for k in d["by_kind_and_status"]}
    assert {"ok", "too_long", "foreign_host"} <= kinds, d["by_kind_and_status"]
    write_report(tmp_path, d)
    md = (tmp_path / "bench-serve.md").read_text()
    write_report(tmp_path, d)  # the section is replaced in place, not appended twice
    assert (tmp_path / "bench-serve.md").read_text() == md and md.count("## Soak") == 1
