"""bench quantize's file-to-file section: its process timer, the py-spy summary and the markdown it writes."""

from __future__ import annotations

import sys

from benchmarks import file_to_file
from benchmarks.quantize import BEFORE, render_file_to_file


def test_timed_measures_the_child_alone():
    """A child that allocates 200 MB shows it in its peak RSS, whatever the parent holds."""
    r = file_to_file.timed([sys.executable, "-c", "b = bytearray(200 << 20); b[::4096] = b'x' * len(b[::4096])"])
    assert r["peak_rss"] > 200 << 20 and r["wall"] > 0 and r["user"] >= 0
    small = file_to_file.timed([sys.executable, "-c", "pass"])
    assert small["peak_rss"] < r["peak_rss"] - (150 << 20)


def test_summarize_samples_by_innermost_function():
    text = ("main (a/run.py:1);work (q/int4.py:9) 30\n"
            "main (a/run.py:1);write (q/shards.py:5) 10\n"
            "other (x.py:3);work (q/int4.py:12) 10\n"
            "garbage line\n")
    got = dict(file_to_file.summarize_samples(text))
    assert got == {"work (q/int4.py)": 0.8, "write (q/shards.py)": 0.2}


def test_markdown_states_ratios_commands_and_stages():
    best = {"quantkit": {"wall": 4.0, "user": 5.0, "sys": 1.0, "peak_rss": 400e6},
            "llama.cpp": {"wall": 5.0, "user": 3.0, "sys": 1.5, "peak_rss": 500e6}}
    case = {"case": "int4 g32", "llama_type": "Q4_0", "runs": {k: [v] for k, v in best.items()}, "best": best,
            "out_bytes": {"quantkit": 5e8, "llama.cpp": 5e8}, "speed_ratio": 1.25, "rss_ratio": 0.8,
            "quantkit_cmd": "quantkit quantize src --out q", "llama_cmd": "llama_model_quantize(...)",
            "profile": {"wall": 5.0, "run": 3.0, "stages": {"quantize": 2.5, "read": 0.2}, "py_spy": [("f (m.py)", 0.5)]}}
    md = "\n".join(render_file_to_file({"source": "src", "source_bytes": 2e9, "gguf_bytes": 2e9, "threads": 2,
                                        "reps": 3, "cases": [case]}, BEFORE))
    assert "| int4 g32 (Q4_0) | 1.25x | 1.25x |" in md
    assert "`quantkit quantize src --out q`" in md and "| int4 g32 | 2.00 | 3.00 |" in md
    assert "50.0% f (m.py)" in md and "Before (commit 6245de5" in md
    assert "Load average" not in md  # runs recorded before the load was
    case["runs"]["quantkit"][0]["load"], case["runs"]["llama.cpp"][0]["load"] = 2.5, 0.5
    md = "\n".join(render_file_to_file({"source": "src", "source_bytes": 2e9, "gguf_bytes": 2e9, "threads": 2,
                                        "reps": 3, "cases": [case]}, None, "Larger shape"))
    assert md.startswith("## Larger shape") and "before each run: 0.5 to 2.5" in md and "Before (commit" not in md
    assert "### Earlier runs" not in md
    md = "\n".join(render_file_to_file({"source": "src", "source_bytes": 2e9, "gguf_bytes": 2e9, "threads": 2,
                                        "reps": 3, "cases": [case], "history": ["an old run"]}, None))
    assert "### Earlier runs\n\n- an old run" in md
