"""`quantkit bench serve --agents` (quantkit/bench/serve_agents.py, agent_texts.py, vllm_server.py): the load's
texts (deterministic, distinct per agent and turn, each turn's prompt the previous one grown), the accounting of
reuse and time to first text from canned streams of each engine's shape, the report's ratios and target, the bad
options refused in one line before anything is made, and one run on the tiny int4 checkpoint, quantkit alone."""

from __future__ import annotations

import json
import sys

import pytest

from quantkit.bench import agent_texts, serve_agents, vllm_server
from quantkit.errors import QuantkitError

from helpers.cli import run_cli
from helpers.runtime import quantized


def test_the_system_prompt_is_one_fixed_text_of_tools():
    s = agent_texts.system_prompt()
    assert s == agent_texts.system_prompt()
    assert 650 <= len(s.split()) <= 750
    assert s.count('"type": "function"') == len(agent_texts._TOOLS) and "<tools>" in s and "</tools>" in s


def test_observations_are_deterministic_distinct_and_of_their_size():
    seen = set()
    for tag in ("r0", "r1"):
        for agent in range(4):
            for turn in range(3):
                text = agent_texts.observation(tag, agent, turn)
                assert text == agent_texts.observation(tag, agent, turn)
                assert 100 <= len(text.split()) <= 200
                seen.add(text)
    assert len(seen) == 2 * 4 * 3
    assert len({agent_texts.task("r0", a) for a in range(8)}) == 8


def test_render_writes_qwen_markup_and_opens_the_assistant_turn():
    text = agent_texts.render([("system", "S"), ("user", "U"), ("assistant", "A"), ("tool", "T")])
    assert text == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\nA"
                    "<|im_end|>\n<|im_start|>user\n<tool_response>\nT\n</tool_response><|im_end|>\n"
                    "<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="role 'robot'"):
        agent_texts.render([("robot", "x")])


def test_each_turn_sends_the_previous_prompt_grown_by_the_answer_and_a_tool_result():
    a, b = agent_texts.Agent("r0", 0), agent_texts.Agent("r0", 1)
    system = agent_texts.render([("system", agent_texts.system_prompt())]).removesuffix("<|im_start|>assistant\n")
    assert a.prompt().startswith(system) and b.prompt().startswith(system) and a.prompt() != b.prompt()
    prompts = [a.prompt()]
    for turn, answer in enumerate(["first answer", "second ü answer"]):
        a.answered(answer)
        prompts.append(a.prompt())
        assert prompts[-1].startswith(prompts[-2]) and len(prompts[-1]) > len(prompts[-2])
        assert answer in prompts[-1] and agent_texts.observation("r0", 0, turn) in prompts[-1]
    assert a.turn == 2 and [r for r, _ in a.messages] == ["system", "user", "assistant", "tool", "assistant", "tool"]


def _sse(*events: dict) -> list[str]:
    return [*(f"data: {json.dumps(e)}" for e in events), "", "data: [DONE]"]


QUANTKIT_STREAM = _sse({"choices": [{"index": 0, "text": ""}]}, {"choices": [{"index": 0, "text": "Hel"}]},
                       {"choices": [{"index": 0, "text": "lo", "finish_reason": "length"}]},
                       {"choices": [], "usage": {"prompt_tokens": 900, "completion_tokens": 2, "total_tokens": 902,
                                                 "prompt_tokens_details": {"cached_tokens": 512}},
                        "timings": {"cache_n": 512, "prompt_n": 388}})
LLAMA_STREAM = _sse({"choices": [{"index": 0, "text": "Hi"}]},
                    {"choices": [{"index": 0, "text": "!", "finish_reason": "length"}],
                     "timings": {"cache_n": 700, "prompt_n": 200, "predicted_n": 2}},
                    {"choices": [], "usage": {"prompt_tokens": 900, "completion_tokens": 2}})
VLLM_STREAM = _sse({"choices": [{"index": 0, "text": "Yo"}]}, {"choices": [{"index": 0, "text": "u"}]},
                   {"choices": [], "usage": {"prompt_tokens": 900, "completion_tokens": 2,
                                             "prompt_tokens_details": None}})


def _read(lines: list[str]) -> dict:
    ticks = iter(range(10, 100))
    return serve_agents.read_stream(lines, clock=lambda: float(next(ticks)))


def test_streams_of_each_engines_shape_give_text_first_token_and_reuse():
    q, ll, v = _read(QUANTKIT_STREAM), _read(LLAMA_STREAM), _read(VLLM_STREAM)
    assert (q["text"], q["first"]) == ("Hello", 10.0)  # the empty first chunk is not the first text
    assert (ll["text"], v["text"]) == ("Hi!", "You")
    assert serve_agents.reused_tokens(q["usage"], q["timings"]) == (512, "usage.prompt_tokens_details.cached_tokens")
    assert serve_agents.reused_tokens(ll["usage"], ll["timings"]) == (700, "timings.cache_n")
    assert serve_agents.reused_tokens(v["usage"], v["timings"]) == (None, None)
    with pytest.raises(QuantkitError, match="error event"):
        _read(_sse({"error": {"message": "boom"}}))


def test_requests_and_rounds_are_accounted_from_their_streams():
    def req(lines, sent, end, agent, turn):
        return serve_agents.record({**_read(lines), "sent": sent, "end": end}, agent, turn, 2)

    q = req(QUANTKIT_STREAM, 9.5, 11.0, 0, 1)
    assert q["ttft_s"] == pytest.approx(0.5) and q["seconds"] == pytest.approx(1.5)
    assert (q["tokens"], q["prompt_tokens"], q["reused_tokens"]) == (2, 900, 512) and q["tokens_counted"]
    no_usage = serve_agents.record({"first": None, "text": "", "usage": None, "sent": 0.0, "end": 1.0,
                                    "timings": {"cache_n": 10, "prompt_n": 5}}, 1, 0, 32)
    assert (no_usage["tokens"], no_usage["tokens_counted"], no_usage["prompt_tokens"]) == (32, False, 15)
    assert no_usage["ttft_s"] is None
    ll = req(LLAMA_STREAM, 9.0, 12.0, 1, 0)
    f = serve_agents.figures([q, ll], wall=2.0)
    assert f["tok_s"] == 2.0 and f["prompt_tokens"] == 1800 and f["reused_tokens"] == 1212
    assert f["reused_pct"] == pytest.approx(100 * 1212 / 1800) and f["ttft_s"]["n"] == 2
    assert f["ttft_s"]["max"] == pytest.approx(1.0) and set(f["ttft_by_turn_s"]) == {"0", "1"}
    assert f["reused_from"] == ["timings.cache_n", "usage.prompt_tokens_details.cached_tokens"]
    assert (q["cache_n"], ll["cache_n"], f["cache_n"]) == (512, 700, 1212)  # llama.cpp's count kept beside
    v = req(VLLM_STREAM, 9.0, 12.0, 2, 0)
    assert serve_agents.figures([q, v], wall=2.0)["reused_pct"] is None  # one request without: not a total
    assert serve_agents.figures([q, v], wall=2.0)["cache_n"] is None


def test_the_report_states_ratios_and_the_target():
    def r(engine, n, tok_s):
        return {"engine": engine, "agents": n, "tok_s": tok_s, "ttft_s": {"p50": 1.0, "p95": 2.0, "max": 3.0},
                "prompt_tokens": 100, "reused_tokens": None, "reused_pct": None, "requests": 3}

    d = {"rows": [r("quantkit", 8, 30.0), r("llama-server", 8, 12.0), r("vLLM", 8, 20.0)]}
    assert serve_agents.ratio(d, "quantkit", "llama-server", 8) == 2.5
    assert serve_agents.ratio(d, "quantkit", "vLLM", 8) == 1.5
    assert serve_agents.ratio(d, "quantkit", "vLLM", 4) is None
    assert serve_agents.cache_n_note(d) == ""
    usage = ["usage.prompt_tokens_details.cached_tokens"]
    d["rows"][1].update(reused_tokens=50, reused_from=usage, cache_n=50)
    assert "llama-server: `timings.cache_n` equals usage's count" in serve_agents.cache_n_note(d)
    d["rows"][1]["cache_n"] = 40
    assert "llama-server 8: 40 against 50" in serve_agents.cache_n_note(d)


def test_agent_counts_are_parsed_strictly():
    assert serve_agents.parse_agents("1, 4,8") == [1, 4, 8]
    for bad in ("", "0", "1,,4", "four", "4,4", "17"):
        with pytest.raises(QuantkitError, match="--agents"):
            serve_agents.parse_agents(bad)


@pytest.mark.parametrize("args, words", [
    (["--agents", "0,4"], "--agents '0,4'"),
    (["--agents", "2", "--vllm", "{tmp}/no-python"], "no such executable"),
    (["--agents", "2", "--vllm", "{python}"], "does not import vllm"),
    (["--clients", "1,2", "--vllm", "{python}"], "give --agents too"),
])
def test_bad_agents_or_vllm_is_one_line_and_nothing_is_made(tmp_path, capsys, monkeypatch, args, words):
    args = [a.format(tmp=tmp_path, python=sys.executable) for a in args]
    code, out, err = run_cli(["bench", "--workdir", str(tmp_path / "w"), "--reports", str(tmp_path / "r"), "serve",
                              *args], capsys, monkeypatch)
    assert code != 0 and len(err.strip().splitlines()) == 1 and words in err and "Traceback" not in err
    assert not (tmp_path / "r").exists() and not (tmp_path / "w").exists()


def test_a_file_that_is_no_python_is_refused(tmp_path):
    script = tmp_path / "python"
    script.write_text("#!/bin/sh\nexit 0\n")
    script.chmod(0o755)
    with pytest.raises(QuantkitError, match="does not import vllm"):
        vllm_server.check_python(script)


def test_the_vllm_line_and_environment():
    cmd = vllm_server.command(vllm_server.Path("/v/bin/python"), vllm_server.Path("/m"), 8000, 8, 4096, True)
    assert cmd[:3] == ["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert "--enable-prefix-caching" in cmd and cmd[cmd.index("--max-num-seqs") + 1] == "8"
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and "--enable-prompt-tokens-details" in cmd
    assert "--no-enable-prefix-caching" in vllm_server.command(vllm_server.Path("p"), vllm_server.Path("m"), 1, 1,
                                                               512, False)


def test_the_vllm_environment_carries_no_checkout_and_the_sitecustomize(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/somewhere/quantkit")
    env = vllm_server.environment(tmp_path, 2)
    assert env["OMP_NUM_THREADS"] == "2" and env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert env["PYTHONPATH"] == str(tmp_path / "vllm-site")
    assert (tmp_path / "vllm-site" / "sitecustomize.py").read_text() == vllm_server.SITECUSTOMIZE.read_text()


@pytest.mark.slow
def test_the_agents_bench_runs_on_a_tiny_model(tiny_model, tmp_path):
    reports = tmp_path / "reports"
    reports.mkdir()
    (reports / "bench-serve.md").write_text("# load test\n\nkept\n")
    model = quantized(tiny_model, "int4")
    d = serve_agents.run(reports, model, tmp_path / "w", [1, 2], 2, 4, 4096, 1, None, None, log=lambda _m: None)
    saved = json.loads((reports / "bench-serve-agents.json").read_text())
    assert saved == json.loads(json.dumps(d)) and saved["machine"] and saved["command"]
    assert [(r["engine"], r["agents"]) for r in d["rows"]] == [("quantkit", 1), ("quantkit", 2)]
    for r in d["rows"]:
        n = r["agents"]
        assert r["requests"] == 2 * n and r["tokens"] == 4 * 2 * n and r["tokens_counted"] and r["tok_s"] > 0
        assert r["ttft_s"]["n"] == 2 * n and r["ttft_s"]["p50"] <= r["ttft_s"]["p95"] <= r["ttft_s"]["max"]
        assert r["prompt_tokens"] == r["prompt_tokens_local"] and r["prompt_tokens_same"] == 2 * n
        assert r["reused_tokens"] is not None and 0 < r["reused_tokens"] < r["prompt_tokens"]
        turns = {t: [q for q in r["per_request"] if q["turn"] == t] for t in (0, 1)}
        # the second turn resends the first's prompt and answer: the prompt cache gives some of it back
        assert all(q["reused_tokens"] > 0 for q in turns[1])
        assert all(b["prompt_tokens"] > a["prompt_tokens"] for a, b in zip(turns[0], turns[1], strict=True))
    md = (reports / "bench-serve.md").read_text()
    assert md.startswith("# load test") and "kept" in md and "### 2 agents" in md and "not measured" in md
    assert "--parallel 2" in d["engine_commands"]["quantkit"] and "--prompt-cache-size" not in \
        d["engine_commands"]["quantkit"]
    serve_agents.write_report(reports, d)  # again: the section is replaced, not appended
    assert (reports / "bench-serve.md").read_text().count(serve_agents.SECTION[0]) == 1
