"""`quantkit bench serve --clients 1,2,...` (quantkit/bench/serve_slots.py): the client counts parsed strictly, and
a smoke run on the tiny int4 checkpoint (quantkit alone: no llama-server) whose report names the command, the
machine and the absent peer, with a row per client count and the long-prompt round, its section of
bench-serve.md replaced in place."""

from __future__ import annotations

import json

import pytest

from quantkit.bench import serve_slots
from quantkit.errors import QuantkitError

from helpers.cli import run_cli
from helpers.runtime import quantized


def test_client_counts_are_parsed_strictly():
    assert serve_slots.parse_clients("1, 2,4,8") == [1, 2, 4, 8]
    for bad in ("", "0", "1,,2", "two", "1,1", "65", str(2**40)):
        with pytest.raises(QuantkitError, match="--clients"):
            serve_slots.parse_clients(bad, 64)


def test_a_missing_llama_server_is_one_line_and_nothing_is_made(tmp_path, capsys, monkeypatch):
    code, out, err = run_cli(["bench", "--workdir", str(tmp_path / "w"), "--reports", str(tmp_path / "r"), "serve",
                              "--clients", "1,2", "--llama-server", str(tmp_path / "nope")], capsys, monkeypatch)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--llama-server" in err and "Traceback" not in err
    assert not (tmp_path / "w").exists() and not (tmp_path / "r").exists()


@pytest.mark.slow
def test_the_slots_bench_runs_on_a_tiny_model(tiny_model, tmp_path):
    reports = tmp_path / "reports"
    reports.mkdir()
    (reports / "bench-serve.md").write_text("# load test\n\nkept\n")
    model = quantized(tiny_model, "int4")
    d = serve_slots.run(reports, model, tmp_path / "w", [1, 2], 4, 512, 1, None, long_words=48, log=lambda _m: None)
    saved = json.loads((reports / "bench-serve-slots.json").read_text())
    assert saved["peer"] is None and saved["machine"] and saved["command"] and saved == json.loads(json.dumps(d))
    rows = [r for r in d["rows"] if "long_prompt" not in r]
    assert [(r["engine"], r["clients"]) for r in rows] == [("quantkit", 1), ("quantkit", 2)]
    for r in rows:
        assert r["tokens"] == 4 * r["clients"] and r["tok_s"] > 0 and r["ttft_s"]["p50"] > 0
        assert r["tbt_s"]["p50"] <= r["tbt_s"]["p95"] <= r["tbt_s"]["max"]
    lp = next(r for r in d["rows"] if "long_prompt" in r)["long_prompt"]
    assert lp["long_prompt_tokens"] > 48 and lp["prefill_s"] > 0
    md = (reports / "bench-serve.md").read_text()
    assert md.startswith("# load test") and "kept" in md and "llama-server is absent" in md
    assert "--parallel" in d["engine_commands"]["quantkit"]
    serve_slots.write_report(reports, d)  # again: the section is replaced, not appended
    assert (reports / "bench-serve.md").read_text().count(serve_slots.SECTION[0]) == 1
