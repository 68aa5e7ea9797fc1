"""`quantkit serve` end to end: the real server (uvicorn, on a free loopback port) on a tiny int4 checkpoint
of the real architecture, driven by the official `openai` client and by plain HTTP (httpx).

What is proven where:
- the answer is the model's own: a greedy request returns exactly the runtime's greedy continuation of
  the prompt the chat template renders (thinking on and off), streamed or not;
- tools reach the prompt (prompt token counts equal the template's rendering with the tools, an
  assistant tool call + tool result in history render as Qwen's XML and <tool_response>) and responses
  keep the OpenAI shape; a random tiny model never writes a well-formed <tool_call> by itself, so turning
  the model's XML into `tool_calls` is proven on real-format text in test_server_parsing.py;
- each bad input gets an OpenAI error object with its status, and the server keeps serving;
- a full queue answers 429, and a client that hangs up mid-stream stops its generation.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import openai
import pytest

from quantkit.runtime import SamplingParams
from quantkit.server.app import ServerConfig, create_app

from helpers.server import MAX_BODY, MAX_CONTEXT, TOOLS, ServerThread, idle, load


@pytest.fixture(scope="module")
def backend(q4: Path):
    return load(q4)


@pytest.fixture(scope="module")
def server(backend):
    app = create_app(backend, ServerConfig(max_queue=1, max_body_bytes=MAX_BODY))
    with ServerThread(app) as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def reference(backend, server, messages, tools=None, thinking=True, max_tokens=12):
    """The runtime's own greedy continuation, called directly (no HTTP) while the server is idle: the prompt
    and the (thinking, answer) texts of the runtime's channels."""
    idle(server)
    prompt = backend.render(messages, tools, thinking)
    texts = {"thinking": "", "answer": ""}
    for e in backend.generate(prompt, SamplingParams(max_new_tokens=max_tokens, temperature=0.0), threading.Event()):
        texts[e.channel] += e.text
    return prompt, (texts["thinking"], texts["answer"])


CHAT = [{"role": "system", "content": "You are a terminal world model."},
        {"role": "user", "content": "$ ls -la /home/user/project"}]


# --- the openai client -----------------------------------------------------------------------------------

def test_models_and_health(client, server, q4):
    ids = [m.id for m in client.models.list().data]
    assert ids == [q4.name]
    assert client.models.retrieve(q4.name).id == q4.name
    h = httpx.get(server.url + "/health").json()
    assert h["status"] == "ok" and h["max_context"] == MAX_CONTEXT


def test_plain_completion_is_the_models_greedy_answer(client, backend, server, q4):
    prompt, text = reference(backend, server, CHAT)
    assert prompt.opens_reasoning  # thinking is on by default
    r = client.chat.completions.create(model=q4.name, messages=CHAT, max_tokens=12, temperature=0)
    msg, ch = r.choices[0].message, r.choices[0]
    want_reasoning, want_content = text
    assert (getattr(msg, "reasoning_content", None) or "") == want_reasoning
    assert (msg.content or "") == want_content
    assert r.usage.prompt_tokens == len(prompt.ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert 1 <= r.usage.completion_tokens <= 12
    assert ch.finish_reason == ("length" if r.usage.completion_tokens == 12 else "stop")
    t = r.model_extra["timings"]
    assert t["prompt_n"] + t["cache_n"] == len(prompt.ids) and t["predicted_n"] == r.usage.completion_tokens
    assert t["prompt_ms"] > 0 and t["queue_ms"] >= 0


def test_streaming_gives_the_same_answer_in_pieces(client, backend, server, q4):
    _, text = reference(backend, server, CHAT)
    stream = client.chat.completions.create(model=q4.name, messages=CHAT, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert (reasoning, content) == text
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason in ("stop", "length")
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens >= 1
    assert usage.model_extra["timings"]["predicted_n"] == usage.usage.completion_tokens
    assert len([c for c in chunks if c.choices]) >= 3  # role, at least one text piece, finish


def test_the_plain_streaming_loop_of_every_tutorial_works(client, q4):
    """Without stream_options.include_usage no chunk has empty choices (OpenAI sends the usage chunk only when
    asked), so `chunk.choices[0]` never raises."""
    text = ""
    for chunk in client.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=6, stream=True,
                                                extra_body={"chat_template_kwargs": {"enable_thinking": False}}):
        assert chunk.usage is None and chunk.model == "gpt-4o"
        text += chunk.choices[0].delta.content or ""
    off = client.chat.completions.create(model=q4.name, messages=CHAT, max_tokens=3, stream=True,
                                         stream_options={"include_usage": False})
    assert all(c.choices for c in off)


def test_thinking_off(client, backend, server, q4):
    prompt, text = reference(backend, server, CHAT, thinking=False)
    assert not prompt.opens_reasoning and prompt.text.endswith("<think>\n\n</think>\n\n")
    r = client.chat.completions.create(model=q4.name, messages=CHAT, max_tokens=12, temperature=0,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.usage.prompt_tokens == len(prompt.ids)
    want_reasoning, want_content = text
    assert (r.choices[0].message.content or "") == want_content
    assert (getattr(r.choices[0].message, "reasoning_content", None) or "") == want_reasoning


def test_seed_makes_sampling_reproducible(client, q4):
    def ask(seed):
        r = client.chat.completions.create(model=q4.name, messages=CHAT, max_tokens=8, temperature=1.0, top_p=1.0,
                                           seed=seed, extra_body={"top_k": 0,
                                                                  "chat_template_kwargs": {"enable_thinking": False}})
        return r.choices[0].message.content
    a = ask(11)
    assert ask(11) == a
    assert len({a, ask(12), ask(13), ask(14)}) > 1


def test_stop_string_ends_the_answer(client, backend, server, q4):
    _, text = reference(backend, server, CHAT, thinking=False, max_tokens=16)
    _, content = text
    if len(content) < 4:
        pytest.skip(f"the greedy answer {content!r} is too short to cut")
    stop = content[len(content) // 2: len(content) // 2 + 2]
    r = client.chat.completions.create(model=q4.name, messages=CHAT, max_tokens=16, temperature=0, stop=[stop],
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.content == content[: content.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_tools_go_into_the_prompt_and_history_renders_calls_and_results(client, backend, server, q4):
    with_tools = backend.render(CHAT, TOOLS, True)
    assert "<tools>" in with_tools.text and '"name": "get_weather"' in with_tools.text
    r = client.chat.completions.create(model=q4.name, messages=CHAT, tools=TOOLS, max_tokens=6, temperature=0)
    assert r.usage.prompt_tokens == len(with_tools.ids) > len(backend.render(CHAT, None, True).ids)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.choices[0].message.tool_calls is None or all(c.type == "function" for c in r.choices[0].message.tool_calls)

    history = [*CHAT,
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 2})}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'}]
    from quantkit.server.app import template_messages
    from quantkit.server.schemas import ChatCompletionRequest

    rendered = backend.render(template_messages(ChatCompletionRequest.model_validate(
        {"model": q4.name, "messages": history})), TOOLS, True)
    assert ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>") in rendered.text
    assert "<tool_response>\n{\"temp_c\": 21}\n</tool_response>" in rendered.text
    r = client.chat.completions.create(model=q4.name, messages=history, tools=TOOLS, max_tokens=4, temperature=0)
    assert r.usage.prompt_tokens == len(rendered.ids)


def test_content_parts_and_developer_role(client, q4):
    msgs = [{"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]}]
    r = client.chat.completions.create(model=q4.name, messages=msgs, max_tokens=3)
    assert r.choices[0].message.role == "assistant"


# --- bad input over plain HTTP ---------------------------------------------------------------------------

def _post(server, body: bytes | dict, **kw) -> httpx.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + "/v1/chat/completions", content=data,
                      headers={"content-type": "application/json"}, timeout=120, **kw)


def _ok_body(q4, **extra) -> dict:
    return {"model": q4.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}


def _bad_cases(q4) -> list[tuple[str, bytes | dict, int, str, str | None]]:
    msgs = [{"role": "user", "content": "hi"}]
    return [
        ("malformed JSON", b'{"model": "x", "messages": [', 400, "malformed JSON", None),
        ("not an object", b"[1, 2]", 400, "object", None),
        ("missing messages", {"model": q4.name}, 400, "messages", "messages"),
        ("missing model", {"messages": msgs}, 400, "model", "model"),
        ("wrong type max_tokens", {"model": q4.name, "messages": msgs, "max_tokens": "ten"}, 400, "max_tokens",
         "max_tokens"),
        ("wrong type content", {"model": q4.name, "messages": [{"role": "user", "content": 5}]}, 400,
         "messages[0].content", "messages[0].content"),
        ("wrong type temperature", {"model": q4.name, "messages": msgs, "temperature": "hot"}, 400, "temperature",
         "temperature"),
        ("n over the limit", {"model": q4.name, "messages": msgs, "n": 99}, 400, "n 99", "n"),
        ("max_tokens 0", {"model": q4.name, "messages": msgs, "max_tokens": 0}, 400, "max_tokens", "max_tokens"),
        ("max_tokens -5", {"model": q4.name, "messages": msgs, "max_tokens": -5}, 400, "max_tokens", "max_tokens"),
        ("unknown role", {"model": q4.name, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "wizard",
         "messages[0].role"),
        ("empty messages", {"model": q4.name, "messages": []}, 400, "messages", "messages"),
        ("image part", {"model": q4.name, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:,"}}]}]}, 400, "image_url", "messages[0].content"),
        ("bad tool arguments", {"model": q4.name, "messages": [*msgs, {"role": "assistant", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]}, 400,
         "not valid JSON", "messages[1].tool_calls"),
        ("bad schema", {"model": q4.name, "messages": msgs, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "string", "pattern": "(?<=a)b"}}}}, 400, "look-around", "response_format"),
        ("huge body", b'{"model": "' + b"x" * (MAX_BODY + 1) + b'"}', 413, str(MAX_BODY), None),
    ]


@pytest.mark.parametrize("case", range(16))
def test_bad_input_gets_an_openai_error_and_the_server_keeps_serving(server, q4, case):
    cases = _bad_cases(q4)
    assert len(cases) == 16
    name, body, status, needle, param = cases[case]
    r = _post(server, body)
    assert r.status_code == status, (name, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert needle in err["message"], (name, err)
    assert err["param"] == param, (name, err)
    ok = _post(server, _ok_body(q4))
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["role"] == "assistant"


def test_prompt_longer_than_the_context_is_refused_with_the_numbers(server, backend, q4):
    long = [{"role": "user", "content": "the agent world model predicts " * 500}]
    n = len(backend.render(long, None, True).ids)
    assert n > MAX_CONTEXT
    r = _post(server, {"model": q4.name, "messages": long})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded"
    assert f"maximum context length is {MAX_CONTEXT} tokens" in err["message"] and f"{n} in the messages" in err["message"]
    # fits alone, but not with the completion asked for
    short = [{"role": "user", "content": "hi"}]
    p = len(backend.render(short, None, True).ids)
    r = _post(server, {"model": q4.name, "messages": short, "max_tokens": MAX_CONTEXT})
    assert r.status_code == 400 and f"{p + MAX_CONTEXT} tokens ({p} in the messages, {MAX_CONTEXT} in the completion)" \
        in r.json()["error"]["message"]
    assert _post(server, _ok_body(q4)).status_code == 200


def test_unknown_paths_and_methods_are_openai_errors(server):
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(server.url + "/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()
    r = httpx.get(server.url + "/v1/models/not-this-one")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


# --- queue and disconnects -------------------------------------------------------------------------------

def _open_stream(http: httpx.Client, server, q4, max_tokens: int):
    body = _ok_body(q4, max_tokens=max_tokens, stream=True, temperature=1.0, ignore_eos=True)
    return http.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120)


def test_disconnect_mid_stream_stops_the_generation(server, q4):
    before = idle(server)["queue"]
    long = MAX_CONTEXT - 40
    with httpx.Client() as http, _open_stream(http, server, q4, long) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = 0
        for line in lines:
            got += line.startswith("data: ")
            if got >= 4:  # the role chunk and three pieces of text
                break
    after = idle(server)["queue"]  # returns once the worker has let the job go
    assert after["cancelled"] == before["cancelled"] + 1
    assert after["last_cancelled_tokens"] < long
    assert _post(server, _ok_body(q4)).status_code == 200


def test_a_full_queue_answers_429_and_the_others_finish(server, q4):
    idle(server)
    with httpx.Client() as a, httpx.Client() as b, _open_stream(a, server, q4, MAX_CONTEXT - 40) as running:
        assert running.status_code == 200
        lines = running.iter_lines()  # (keep it: a dropped iterator closes the response)
        next(lines)  # its job is running now
        with _open_stream(b, server, q4, 2) as waiting:  # takes the one waiting place (--max-queue 1)
            assert waiting.status_code == 200
            r = _post(server, _ok_body(q4))
            assert r.status_code == 429, r.text
            assert r.json()["error"]["type"] == "rate_limit_error" and r.headers["retry-after"] == "1"
            running.close()  # hang up the long one: the waiting one runs and completes
            text = "".join(line for line in waiting.iter_lines())
            assert text.rstrip().endswith("data: [DONE]")
    assert httpx.get(server.url + "/health").json()["queue"]["rejected"] >= 1
    assert _post(server, _ok_body(q4)).status_code == 200


def test_a_plain_request_whose_client_gives_up_is_cancelled(server, q4):
    before = idle(server)["queue"]
    long = MAX_CONTEXT - 40
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", json=_ok_body(q4, max_tokens=long, ignore_eos=True),
                   timeout=httpx.Timeout(120, read=0.5))
    after = idle(server)["queue"]
    assert after["cancelled"] == before["cancelled"] + 1
    assert after["last_cancelled_tokens"] < long
    assert _post(server, _ok_body(q4)).status_code == 200


def test_concurrent_clients_each_get_a_complete_answer_or_a_clean_429(server, q4):
    from quantkit.bench.serve import run_faults, run_load

    idle(server)
    res = run_load(server.url + "/v1/chat/completions", q4.name, clients=4, requests=2, max_tokens=4, retries=0,
                   timeout=120)
    kinds = [o.kind for o in res.outcomes]
    assert len(kinds) == 8 and set(kinds) <= {"ok", "429"}, [o.detail for o in res.outcomes if o.kind == "bad"]
    assert "ok" in kinds and {o.stream for o in res.outcomes if o.kind == "ok"} == {True, False}
    faults = run_faults(server.url, q4.name, n_disconnects=1, max_body=MAX_BODY)
    assert faults["wrong_answers"] == [] and faults["hang_ups"] == [("hang-up", 200)]
    idle(server)
    assert _post(server, _ok_body(q4)).status_code == 200


def test_the_direct_peer_generates_the_asked_tokens_with_the_servers_defaults(q4):
    """`bench serve`'s peer: the same prompt through the runtime alone, every token asked for counted."""
    from quantkit.bench.serve import direct_peer

    got = direct_peer(q4, "hello", max_tokens=5, reps=1, context=256)
    assert got["reps"] == 1 and got["median_s"] > 0 and got["tok_s"] == pytest.approx(5 / got["median_s"])


def test_the_load_checkers_catch_incomplete_answers():
    from quantkit.bench.serve import check_plain, check_stream

    role = json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
    text = json.dumps({"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None}]})
    fin = json.dumps({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
    usage = json.dumps({"choices": [], "usage": {"completion_tokens": 4}})
    assert check_stream([role, text, fin, usage, "[DONE]"], 4) == ""
    assert "DONE" in check_stream([role, text, fin, usage], 4)  # cut off
    assert check_stream([role, text, usage, "[DONE]"], 4)  # no finish chunk
    assert check_stream([role, text, fin, usage, "[DONE]"], 5)  # short
    assert check_stream([role, '{"error": {"message": "boom"}}', "[DONE]"], 4)
    good = {"object": "chat.completion", "choices": [{"message": {"role": "assistant", "content": "x"},
                                                      "finish_reason": "length"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}, "timings": {"predicted_n": 4}}
    assert check_plain(good, 4) == ""
    assert check_plain({**good, "usage": {**good["usage"], "total_tokens": 8}}, 4)
    assert check_plain({"choices": []}, 4)


def test_a_closed_queue_answers_503(backend, q4):
    app = create_app(backend, ServerConfig(max_queue=1))
    with ServerThread(app) as s:
        app.state.queue.close()  # what shutdown does: refuse new work, cancel what is left
        r = httpx.post(s.url + "/v1/chat/completions", json=_ok_body(q4), timeout=60)
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        assert httpx.get(s.url + "/health").json()["status"] == "shutting_down"
