"""`quantkit bench serve --clients 1,2,...` (quantkit/bench/serve_slots.py): the client counts parsed strictly, and
the pure parts (chunk accounting, percentiles of gaps, the gaps that overlap a prefill, the long prompt's size and
the schedule of its round), and a smoke run on the tiny int4 checkpoint (quantkit alone: no llama-server) whose
report names the command, the machine and the absent peer, with a row per client count, the long-prompt round and
the single-client check, its section of bench-serve.md replaced in place."""

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


def test_a_chunk_counts_its_logprobs_entries_else_its_text():
    lp = {"content": [{"token": "a", "logprob": -1.0}, {"token": "b", "logprob": -2.0}]}
    assert serve_slots.chunk_tokens({"delta": {"content": "ab"}, "logprobs": lp}) == 2
    assert serve_slots.chunk_tokens({"delta": {"content": ""}, "logprobs": {"content": [{"token": ""}]}}) == 1
    assert serve_slots.chunk_tokens({"delta": {"content": "x"}}) == 1
    assert serve_slots.chunk_tokens({"delta": {"tool_calls": [{"index": 0}]}}) == 1
    assert serve_slots.chunk_tokens({"delta": {"role": "assistant"}}) == 0
    assert serve_slots.chunk_tokens({"delta": {}, "finish_reason": "length", "logprobs": None}) == 0


def test_chunks_are_accounted_against_tokens():
    one = {"chunks": [(1.0, 1), (2.0, 1), (3.0, 1)], "tokens": 3, "times": [1.0, 2.0, 3.0]}
    held = {"chunks": [(1.0, 1), (4.0, 3)], "tokens": 4, "times": [1.0, 4.0]}
    assert serve_slots.chunk_account([one]) == {"chunks": 3, "tokens": 3, "tokens_in_chunks": 3, "multi": 0, "most": 1}
    assert serve_slots.chunk_account([one, held]) == {"chunks": 5, "tokens": 7, "tokens_in_chunks": 7, "multi": 1,
                                                      "most": 3}
    assert serve_slots.chunk_account([]) == {"chunks": 0, "tokens": 0, "tokens_in_chunks": 0, "multi": 0, "most": 0}


def test_gaps_and_their_summary():
    assert serve_slots.gaps([1.0, 1.5, 3.5]) == [0.5, 2.0]
    assert serve_slots.gaps([2.0]) == []
    s = serve_slots.summary([0.1 * i for i in range(1, 101)])
    assert s["n"] == 100 and abs(s["p50"] - 5.05) < 1e-9 and abs(s["p95"] - 9.505) < 1e-9 and s["max"] == 10.0
    assert serve_slots.summary([]) == {"p50": None, "p95": None, "max": None, "n": 0}


def test_only_the_gaps_overlapping_the_prefill_count():
    a = {"times": [0.0, 1.0, 2.0, 6.0, 7.0]}  # (2, 6) spans the window; (0, 1) ends before it; (7, ...) none
    b = {"times": [2.5, 3.5, 4.5]}
    got = serve_slots.window_gaps([a, b], start=3.0, end=5.0)
    assert sorted(got) == [1.0, 1.0, 4.0]
    assert serve_slots.window_gaps([a], start=8.0, end=9.0) == []


def test_the_long_prompt_is_the_fewest_words_that_reach_its_tokens():
    def count(text: str) -> int:
        return 2 * len(text.split())  # a stand-in tokenizer: two tokens a word

    text = serve_slots.long_prompt_text(count, 101)
    assert count(text) >= 101 and count(" ".join(text.split()[:-1])) < 101
    assert serve_slots.long_prompt_text(count, 101) == text  # seeded: the same prompt each run
    assert serve_slots.long_prompt_text(count, 101, seed=1) != text


def test_the_long_prompt_waits_for_every_running_slot_then_they_hang_up_after_its_first_token():
    plan = serve_slots.LongPromptSchedule(running=2, before=3, after=2)
    for _ in range(2):
        assert plan.running_chunk(0, 1) is False
    assert not plan.ready(timeout=0)
    assert plan.running_chunk(0, 1) is False and plan.running_chunk(1, 3) is False
    assert plan.ready(timeout=0)
    assert plan.running_chunk(0, 1) is False  # the long prompt is still prefilled: keep decoding
    assert plan.long_chunk(0) is False and not plan.long_first.is_set()
    assert plan.long_chunk(1) is False and plan.long_first.is_set()
    assert plan.running_chunk(0, 1) is False and plan.running_chunk(0, 1) is True
    assert plan.running_chunk(1, 2) is True
    ended = serve_slots.LongPromptSchedule(running=2, before=3, after=2)
    ended.running_ended(0)
    ended.running_ended(1)  # streams that ended early do not hold the long prompt back
    assert ended.ready(timeout=0)


def test_a_chunks_time_is_the_prefill_less_its_steps_per_chunk_of_tokens():
    # 2048 tokens: 4 chunks of 512 with 3 steps of 0.1 s between them, each chunk 1.5 s
    assert serve_slots.chunk_time(4 * 1.5 + 3 * 0.1, 0.1, 2048) == pytest.approx(1.5)
    # 2072 tokens: a short fifth chunk (24 tokens) after a fourth step; the time per 512 tokens stays the chunk's
    assert serve_slots.chunk_time(4 * 1.5 + 1.5 * 24 / 512 + 4 * 0.1, 0.1, 2072) == pytest.approx(1.5)
    assert serve_slots.chunk_time(1.0, None, 2048) is None and serve_slots.chunk_time(1.0, 0.1, None) is None


def test_the_best_round_is_kept_with_every_rounds_figure():
    rounds = [{"tok_s": 10.0, "tag": "a"}, {"tok_s": 30.0, "tag": "b"}, {"tok_s": 20.0, "tag": "c"}]
    best = serve_slots.best_round(rounds)
    assert best["tag"] == "b" and best["tok_s_rounds"] == [10.0, 30.0, 20.0]


def test_the_targets_are_ratios_of_total_tokens_per_second():
    rows = [{"engine": e, "clients": n, "tok_s": t} for e, n, t in
            [("quantkit", 1, 10.0), ("quantkit", 4, 25.0), ("quantkit", 8, 30.0), ("llama-server", 4, 20.0),
             ("llama-server", 8, 15.0)]]
    got = {what: (v, want) for what, v, want in serve_slots.targets({"rows": rows, "peer": "llama-server"})}
    assert got["quantkit 4 clients / its 1 client"] == (2.5, 2.0)
    assert got["quantkit 4 clients / llama-server -np 4"] == (1.25, 1.5)
    assert got["quantkit 8 clients / llama-server -np 8"] == (2.0, 1.5)
    alone = serve_slots.targets({"rows": rows[:2], "peer": None})
    assert [w for w, _, _ in alone] == ["quantkit 4 clients / its 1 client"]


def test_the_single_client_ratio_pairs_each_round_with_the_one_beside_it():
    # a load that comes and goes between rounds: the ratio of the medians says 1.5, each pair says 1.0
    assert serve_slots.pair_ratio([30.0, 28.0, 19.0], [30.0, 19.0, 19.0]) == 1.0
    assert serve_slots.pair_ratio([20.0, 10.0], [10.0, 10.0]) == 1.5
    assert serve_slots.pair_ratio([], []) is None
    with pytest.raises(ValueError):
        serve_slots.pair_ratio([1.0], [1.0, 2.0])


def test_a_missing_llama_server_is_one_line_and_nothing_is_made(tmp_path, capsys, monkeypatch):
    code, out, err = run_cli(["bench", "--workdir", str(tmp_path / "w"), "--reports", str(tmp_path / "r"), "serve",
                              "--clients", "1,2", "--llama-server", str(tmp_path / "nope")], capsys, monkeypatch)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--llama-server" in err and "Traceback" not in err
    assert not (tmp_path / "w").exists() and not (tmp_path / "r").exists()


def test_a_long_prompt_past_the_context_is_one_line_and_nothing_is_made(tmp_path, capsys, monkeypatch):
    code, out, err = run_cli(["bench", "--workdir", str(tmp_path / "w"), "--reports", str(tmp_path / "r"), "serve",
                              "--clients", "1,2", "--context", "2048", "--long-prompt", "2048"], capsys, monkeypatch)
    assert code != 0 and len(err.strip().splitlines()) == 1 and "--long-prompt 2048" in err and "Traceback" not in err
    assert not (tmp_path / "w").exists() and not (tmp_path / "r").exists()


@pytest.mark.slow
def test_the_slots_bench_runs_on_a_tiny_model(tiny_model, tmp_path):
    reports = tmp_path / "reports"
    reports.mkdir()
    (reports / "bench-serve.md").write_text("# load test\n\nkept\n")
    model = quantized(tiny_model, "int4")
    d = serve_slots.run(reports, model, tmp_path / "w", [1, 2], 4, 512, 1, None, long_tokens=48, single_rounds=1,
                        log=lambda _m: None)
    saved = json.loads((reports / "bench-serve-slots.json").read_text())
    assert saved["peer"] is None and saved["machine"] and saved["command"] and saved == json.loads(json.dumps(d))
    rows = [r for r in d["rows"] if "long_prompt" not in r]
    assert [(r["engine"], r["clients"]) for r in rows] == [("quantkit", 1), ("quantkit", 2)]
    for r in rows:
        assert r["tokens"] == 4 * r["clients"] and r["tok_s"] > 0 and r["ttft_s"]["p50"] > 0
        assert r["tbt_s"]["p50"] <= r["tbt_s"]["p95"] <= r["tbt_s"]["max"]
        assert r["chunks"]["tokens_in_chunks"] == r["tokens"]  # logprobs count every token, text or not
        assert len(r["tok_s_rounds"]) == serve_slots.REPEATS and r["tok_s"] == max(r["tok_s_rounds"])
    lp = next(r for r in d["rows"] if "long_prompt" in r)["long_prompt"]
    assert lp["long_prompt_tokens"] > 48 and lp["prefill_s"] > 0 and lp["step_s"] > 0
    # a running client hangs up once the long prompt has its first token (LongPromptSchedule, tested above), or
    # ends at its budget where this tiny model outruns the clients: either way its tokens are all counted
    assert lp["chunks"]["tokens_in_chunks"] == lp["chunks"]["tokens"] >= serve_slots.RUNNING * serve_slots.BEFORE
    sc = d["single_client"]
    assert sc["rounds"] == 1 and sc["ratio"] > 0 and sc["pair_ratio"] == sc["ratio"] and "--parallel 1" in sc["commands"]["parallel 1"]
    assert "--parallel" not in sc["commands"]["default"] and sc["default_slots"] >= 1
    md = (reports / "bench-serve.md").read_text()
    assert md.startswith("# load test") and "kept" in md and "llama-server is absent" in md
    assert "--parallel" in d["engine_commands"]["quantkit"]
    serve_slots.write_report(reports, d)  # again: the section is replaced, not appended
    assert (reports / "bench-serve.md").read_text().count(serve_slots.SECTION[0]) == 1
