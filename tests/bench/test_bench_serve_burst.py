"""`quantkit bench serve --burst` (quantkit/bench/serve_burst.py): the prompts (distinct from their first word,
each the fewest words that reach its tokens), the barrier (every client connected before any sends; a failed
client breaks it instead of hanging the rest), the figures of a burst from canned streams, the report's ratio and
target, --quantkit-args, the bad options refused in one line before anything is made, and one run on the tiny
int4 checkpoint, quantkit alone, its extra serve arguments passed through."""

from __future__ import annotations

import json
import threading
import time

import pytest

from quantkit.bench import serve_agents, serve_burst
from quantkit.errors import QuantkitError

from helpers.cli import run_cli
from helpers.probe import expect_one_line
from helpers.runtime import quantized


def _words(text: str) -> list[str]:  # a stand-in tokenizer: the markup's tags and each word a token
    return text.replace("<|im_start|>", " <|im_start|> ").replace("<|im_end|>", " <|im_end|> ").split()


def test_burst_prompts_are_distinct_from_their_first_word_and_reach_their_tokens():
    def count(text: str) -> int:
        return len(_words(text))

    prompts = serve_burst.burst_prompts(count, 8, 300)
    assert len(set(prompts)) == 8 and prompts == serve_burst.burst_prompts(count, 8, 300)  # seeded
    opening = len(_words(serve_burst.render([("user", "")]).split("<|im_end|>")[0]))
    for i, p in enumerate(prompts):
        assert count(p) >= 300 and f"user\n{i + 1}. " in p
        shorter = p.replace(" " + p.split("<|im_end|>")[0].split()[-1] + "<|im_end|>", "<|im_end|>", 1)
        assert count(shorter) < 300  # the fewest words: one fewer falls short
    ids = [_words(p) for p in prompts]
    assert max(serve_burst.shared_prefix(a, b) for a in ids for b in ids if a is not b) == opening
    assert serve_burst.burst_prompts(count, 8, 300, seed=1) != prompts  # a second round has texts of its own


def test_shared_prefix():
    assert serve_burst.shared_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert serve_burst.shared_prefix([1, 2], [1, 2, 3]) == 2
    assert serve_burst.shared_prefix([], [1]) == 0 and serve_burst.shared_prefix([5], [6]) == 0


def test_no_client_sends_before_every_client_is_connected():
    events: list[str] = []
    lock = threading.Lock()

    def prepare(i: int):
        def go() -> int:
            if i == 3:
                time.sleep(0.05)  # a slow connection: without the barrier the others would send first
            with lock:
                events.append(f"prepared {i}")
            return i * 10
        return go

    def send(got: int) -> int:
        with lock:
            events.append(f"sent {got}")
        return got + 1

    out = serve_burst.at_once([prepare(i) for i in range(4)], [send] * 4)
    assert out == [1, 11, 21, 31]
    assert all(e.startswith("prepared") for e in events[:4]) and all(e.startswith("sent") for e in events[4:])


def test_a_client_that_fails_to_connect_breaks_the_barrier_and_its_error_is_raised():
    def bad() -> None:
        raise QuantkitError("no connection")

    sent: list[int] = []
    with pytest.raises(QuantkitError, match="no connection"):
        serve_burst.at_once([lambda: 0, bad, lambda: 0], [sent.append] * 3, timeout=30)
    assert sent == []  # nobody sent, nobody waited out the timeout


def _raw(sent: float, first: float | None, end: float, prompt_tokens: int) -> dict:
    lines = [f"data: {json.dumps(e)}" for e in (
        {"choices": [{"index": 0, "text": "x" if first is not None else ""}]},
        {"choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": serve_burst.ANSWER}})]
    return {"sent": sent, **serve_agents.read_stream(lines, clock=lambda: first), "end": end}


def test_a_bursts_figures():
    raws = [_raw(10.0, 10.5, 11.0, 2050), _raw(10.01, 12.0, 12.5, 2051), _raw(10.02, 11.0, 13.0, 2049),
            _raw(10.005, None, 12.0, 2049)]
    f = serve_burst.figures(raws, [2050, 2051, 2050, 2049])
    assert f["requests"] == 4 and f["no_text"] == 1 and f["tokens"] == 4 * serve_burst.ANSWER
    ft = f["ttft_s"]
    assert ft["n"] == 3 and ft["p50"] == pytest.approx(0.98) and ft["max"] == pytest.approx(1.99)
    assert ft["p95"] == pytest.approx(0.98 + 0.9 * (1.99 - 0.98))
    assert f["wall_s"] == pytest.approx(3.0) and f["sent_spread_s"] == pytest.approx(0.02)
    assert f["prompt_tokens"] == [2050, 2051, 2049, 2049] and f["prompt_tokens_same"] == 3
    assert "prompt_tokens_same" not in serve_burst.figures(raws)


def test_extra_serve_arguments_are_split_and_the_benchs_own_refused():
    assert serve_burst.parse_extra(None) == [] and serve_burst.parse_extra("") == []
    assert serve_burst.parse_extra("--prompt-cache-size 0 --mtp 2") == ["--prompt-cache-size", "0", "--mtp", "2"]
    for bad, words in (("--port 9", "--port is set by the bench"), ("--parallel=2", "--parallel is set"),
                       ("-c 8k", "-c is set"), ("--mtp '2", "quote it")):
        with pytest.raises(QuantkitError, match=words):
            serve_burst.parse_extra(bad)


def _report(p95: dict[tuple[int, str], float]) -> dict:
    rows = [{"engine": e, "round": k, "clients": 8, "load_avg_before": [0.5, 0.5, 0.5], "requests": 8,
             "ttft_s": {"p50": v / 2, "p95": v, "max": v * 1.1, "n": 8}, "wall_s": 9.0, "sent_spread_s": 0.002,
             "prompt_tokens": [2050] * 7 + [2052], "prompt_tokens_same": 8,
             "per_request": [{"ttft_s": None if x is None else v * x} for x in (0.5, None, 0.25, 1.1)]} for (k, e), v in p95.items()]
    d = {"command": "quantkit bench serve --burst 8", "machine": {"cpu": "cpu", "logical_cores": 2,
                                                                  "load_avg_at_start": [0.4, 0.4, 0.4]},
         "load_avg_at_end": [0.6, 0.6, 0.6], "model": "/m", "tokenizer": {"vocab": 10, "tokens": 10},
         "settings": {"clients": 8, "burst_tokens": 2048, "answer_tokens": 8, "context": 4096, "threads": 2,
                      "rounds": 2, "quantkit_args": [], "most_shared_prefix_tokens": 3},
         "engine_commands": {"quantkit": "quantkit serve", "llama-server": "llama-server -np 8"}, "rows": rows}
    d["ratios"] = [serve_burst.ratio(d, k) for k in range(2)]
    return d


def test_the_report_gives_each_rounds_ratio_and_the_target(tmp_path):
    (tmp_path / "bench-serve.md").write_text("# load test\n\nkept\n")
    d = _report({(0, "quantkit"): 4.0, (0, "llama-server"): 5.0, (1, "quantkit"): 6.0, (1, "llama-server"): 5.0})
    assert d["ratios"] == [pytest.approx(0.8), pytest.approx(1.2)]
    serve_burst.write_report(tmp_path, d)
    md = (tmp_path / "bench-serve.md").read_text()
    assert md.startswith("# load test") and "kept" in md and "## Burst of new prompts" in md
    assert "round 1 0.80x, round 2 1.20x" in md and "at most 1.0x: not met." in md
    assert "| 1 | quantkit | [0.5, 0.5, 0.5] | 2,050-2,052 | 8/8 | 2000 | 4000 | 4400 | 9.0 | 2 | 1.0 2.0 4.4 |" in md
    assert json.loads((tmp_path / "bench-serve-burst.json").read_text()) == json.loads(json.dumps(d))
    met = _report({(0, "quantkit"): 4.0, (0, "llama-server"): 5.0, (1, "quantkit"): 4.5, (1, "llama-server"): 5.0})
    serve_burst.write_report(tmp_path, met)
    md = (tmp_path / "bench-serve.md").read_text()
    assert md.count(serve_burst.SECTION[0]) == 1 and "met in every round." in md and "not met" not in md
    alone = _report({(0, "quantkit"): 4.0})
    alone["rows"].append({"engine": "llama-server", "round": 0, "clients": 8, "error": "exited (log: x)"})
    serve_burst.write_report(tmp_path, alone)
    md = (tmp_path / "bench-serve.md").read_text()
    assert "| 1 | llama-server | failed: exited (log: x) |" in md and "not measured" in md


@pytest.mark.parametrize("args, words", [
    (["--burst", "0"], "--burst"),
    (["--burst", "65"], "--burst 65"),
    (["--burst", "8", "--burst-tokens", "4090"], "--burst-tokens 4090"),
    (["--burst", "8", "--context", "1k", "--burst-tokens", "2048"], "--context 1024"),
    (["--burst", "8", "--quantkit-args", "--port 1"], "--port is set by the bench"),
    (["--burst", "8", "--llama-server", "{tmp}/nope"], "--llama-server"),
    (["--burst", "8", "--agents", "1,4"], "give one of them"),
    (["--clients", "1,2", "--quantkit-args", "--mtp 2"], "only --burst and --agents take it"),
])
def test_bad_burst_options_are_one_line_and_nothing_is_made(tmp_path, capsys, monkeypatch, args, words):
    args = [a.format(tmp=tmp_path) for a in args]
    code, out, err = run_cli(["bench", "--workdir", str(tmp_path / "w"), "--reports", str(tmp_path / "r"), "serve",
                              *args], capsys, monkeypatch)
    expect_one_line(code, out, err, words)
    assert not (tmp_path / "r").exists() and not (tmp_path / "w").exists()


@pytest.mark.slow
def test_the_burst_bench_runs_on_a_tiny_model(tiny_model, tmp_path):
    reports = tmp_path / "reports"
    reports.mkdir()
    (reports / "bench-serve.md").write_text("# load test\n\nkept\n")
    model = quantized(tiny_model, "int4")
    d = serve_burst.run(reports, model, tmp_path / "w", 3, 48, 512, 1, None, "--prompt-cache-size 0", rounds=2,
                        log=lambda _m: None)
    saved = json.loads((reports / "bench-serve-burst.json").read_text())
    assert saved == json.loads(json.dumps(d)) and saved["machine"] and saved["command"]
    assert [(r["engine"], r["round"]) for r in d["rows"]] == [("quantkit", 0), ("quantkit", 1)]
    for r in d["rows"]:
        assert r["requests"] == 3 and r["tokens"] == 3 * serve_burst.ANSWER and r["no_text"] == 0
        assert r["ttft_s"]["n"] == 3 and 0 < r["ttft_s"]["p50"] <= r["ttft_s"]["p95"] <= r["ttft_s"]["max"]
        assert r["ttft_s"]["max"] <= r["wall_s"] and 0 <= r["sent_spread_s"] < r["wall_s"]
        assert r["prompt_tokens_same"] == 3 and min(r["prompt_tokens"]) >= 48
    assert d["settings"]["most_shared_prefix_tokens"] < 48 and d["ratios"] == [None, None]
    cmd = d["engine_commands"]["quantkit"]
    assert "--parallel 3" in cmd and cmd.endswith("--prompt-cache-size 0")
    md = (reports / "bench-serve.md").read_text()
    assert md.startswith("# load test") and "kept" in md and "not measured" in md
    serve_burst.write_report(reports, d)  # again: the section is replaced, not appended
    assert (reports / "bench-serve.md").read_text().count(serve_burst.SECTION[0]) == 1
