"""The server as standard clients use it (issue 29): the openai client's completions, logprobs, n, penalties,
structured output and forced tool calls; langchain-openai's chat model and `with_structured_output` in both
modes; litellm's OpenAI-compatible provider; /metrics, CORS, any model name; slow and vanishing request bodies (issue 26). The real server (uvicorn
on a loopback port) on a tiny int4 checkpoint of the real architecture.

Answers are checked against the runtime itself: a greedy request must equal the runtime's own greedy
continuation with the same logits hook (so a penalty the server dropped would show), and structured output
must validate against its schema although a random tiny model has no idea what JSON is.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from quantkit.runtime import SamplingParams
from quantkit.server.app import ServerConfig, create_app
from quantkit.server.logits import LogitsHook, Penalties

from helpers.server import ServerThread, idle, load

NOTHINK = {"chat_template_kwargs": {"enable_thinking": False}}
CHAT = [{"role": "user", "content": "$ cat /etc/hostname"}]
PROMPT = "The agent world model predicts"
BODY_TIMEOUT = 1.5


@pytest.fixture(scope="module")
def backend(q4):
    return load(q4)


@pytest.fixture(scope="module")
def server(backend):
    config = ServerConfig(max_queue=2, max_body_bytes=64_000, body_timeout_s=BODY_TIMEOUT, aliases=("served-alias",),
                          cors_origins=("http://localhost:3000",))
    with ServerThread(create_app(backend, config)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def runtime_text(backend, server, prompt, n: int, hook=None, **kw) -> tuple[str, list[int]]:
    """The runtime's own greedy continuation (thinking and answer in order) and its token ids."""
    idle(server)
    text, ids = "", []
    params = SamplingParams(max_new_tokens=n, temperature=0.0, hook=hook, **kw)
    for e in backend.generate(prompt, params, threading.Event()):
        text += e.text
        if e.token is not None:
            ids.append(e.token)
    return text, ids


# --- /v1/completions ------------------------------------------------------------------------------------

def test_completions_continue_the_raw_prompt(client, backend, server):
    want, _ = runtime_text(backend, server, backend.encode(PROMPT), 8)
    other, _ = runtime_text(backend, server, backend.encode("$ ls"), 8)
    r = client.completions.create(model="text-davinci-003", prompt=PROMPT, max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.model == "text-davinci-003"
    assert r.choices[0].text == want and r.usage.prompt_tokens == len(backend.encode(PROMPT).ids)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="m", prompt=PROMPT, max_tokens=8, temperature=0, stream=True))
    assert streamed == want
    both = client.completions.create(model="m", prompt=[PROMPT, "$ ls"], max_tokens=8, temperature=0)
    assert [(c.index, c.text) for c in both.choices] == [(0, want), (1, other)]
    ids = client.completions.create(model="m", prompt=backend.encode(PROMPT).ids, max_tokens=8, temperature=0)
    assert ids.choices[0].text == want
    echo = client.completions.create(model="m", prompt=PROMPT, max_tokens=8, temperature=0, echo=True)
    assert echo.choices[0].text == PROMPT + want
    if len(want) >= 4:
        stop = want[2:4]
        cut = client.completions.create(model="m", prompt=PROMPT, max_tokens=8, temperature=0, stop=[stop])
        assert cut.choices[0].text == want[: want.index(stop)] and cut.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("body,needle", [
    ({"prompt": "x", "suffix": "y"}, "suffix"), ({"prompt": "x", "echo": True, "logprobs": 1}, "echo"),
    ({"prompt": [], "max_tokens": 2}, "empty"), ({"prompt": [10**9]}, "outside the vocabulary"),
    ({"prompt": ["a", "b", "c"], "n": 3}, "9 choices"), ({"prompt": "x", "logprobs": 30}, "logprobs"),
])
def test_completions_bad_input(server, body, needle):
    r = httpx.post(server.url + "/v1/completions", json={"model": "m", **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"] or needle == r.json()["error"]["param"]


# --- logprobs, n, penalties -----------------------------------------------------------------------------

def test_chat_logprobs_are_the_greedy_tokens_and_their_bytes(client):
    r = client.chat.completions.create(model="m", messages=CHAT, max_tokens=8, temperature=0, logprobs=True,
                                       top_logprobs=3, extra_body=NOTHINK)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert b"".join(bytes(e.bytes) for e in content).decode(errors="replace") == r.choices[0].message.content
    for e in content:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob)  # greedy takes the model's top token
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
    stream = client.chat.completions.create(model="m", messages=CHAT, max_tokens=8, temperature=0, logprobs=True,
                                            top_logprobs=3, extra_body=NOTHINK, stream=True)
    streamed = [e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == [(e.token, round(e.logprob, 5)) for e in content]


def test_completion_logprobs_in_the_legacy_shape(client):
    r = client.completions.create(model="m", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == r.usage.completion_tokens
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert all(len(d) <= 2 and max(d.values()) == pytest.approx(v) for d, v in zip(lp.top_logprobs,
                                                                                   lp.token_logprobs, strict=True))


def test_n_choices_are_the_seeded_samples_one_after_another(client):
    def ask(**kw):
        return client.chat.completions.create(model="m", messages=CHAT, max_tokens=6, temperature=1.0, top_p=1.0,
                                              extra_body={**NOTHINK, "top_k": 0}, **kw)
    many = ask(n=3, seed=5)
    assert [c.index for c in many.choices] == [0, 1, 2]
    singles = [ask(seed=5 + j) for j in range(3)]
    assert [c.message.content for c in many.choices] == [s.choices[0].message.content for s in singles]
    assert many.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert many.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    streamed: dict[int, str] = {}
    for c in ask(n=3, seed=5, stream=True):
        for ch in c.choices:
            streamed[ch.index] = streamed.get(ch.index, "") + (ch.delta.content or "")
    assert [streamed[i] for i in range(3)] == [c.message.content for c in many.choices]


def test_penalties_min_p_and_logit_bias_are_applied(client, backend, server):
    prompt = backend.render(CHAT, None, False)
    plain, _ = runtime_text(backend, server, prompt, 12)
    for pen in (dict(presence_penalty=2.0), dict(frequency_penalty=2.0), dict(repetition_penalty=3.0)):
        p = Penalties(presence=pen.get("presence_penalty", 0.0), frequency=pen.get("frequency_penalty", 0.0),
                      repetition=pen.get("repetition_penalty", 1.0))
        want, _ = runtime_text(backend, server, prompt, 12, hook=LogitsHook(prompt.ids, penalties=p, temperature=0))
        r = client.chat.completions.create(model="m", messages=CHAT, max_tokens=12, temperature=0,
                                           extra_body={**NOTHINK, **{k: v for k, v in pen.items()
                                                                     if k == "repetition_penalty"}},
                                           **{k: v for k, v in pen.items() if k != "repetition_penalty"})
        assert r.choices[0].message.content == want.strip() or (r.choices[0].message.content or "") == want, pen
        assert want != plain, f"{pen} does not change the greedy answer here: the check proves nothing"
    greedy = client.chat.completions.create(model="m", messages=CHAT, max_tokens=8, temperature=0, extra_body=NOTHINK)
    min_p_one = client.chat.completions.create(model="m", messages=CHAT, max_tokens=8, temperature=1.5, seed=3,
                                               extra_body={**NOTHINK, "min_p": 1.0})
    assert min_p_one.choices[0].message.content == greedy.choices[0].message.content
    tok = backend.encode(" the").ids[0]
    biased = client.chat.completions.create(model="m", messages=CHAT, max_tokens=5, temperature=0, logprobs=True,
                                            logit_bias={str(tok): 100}, extra_body={**NOTHINK, "ignore_eos": True})
    assert [e.bytes for e in biased.choices[0].logprobs.content] == [backend.token_piece(tok)[1]] * 5


# --- structured output ----------------------------------------------------------------------------------

class Weather(BaseModel):
    city: str = Field(max_length=10)
    days: int = Field(ge=1, le=9)
    unit: Literal["c", "f"]
    ok: bool


def _valid(w: Weather | None) -> None:
    assert isinstance(w, Weather) and 1 <= w.days <= 9 and len(w.city) <= 10


def test_json_schema_and_json_object_from_a_random_model(client):
    r = client.chat.completions.parse(model="gpt-4o", messages=CHAT, response_format=Weather, max_tokens=120,
                                      temperature=0.8, seed=1, extra_body=NOTHINK)
    _valid(r.choices[0].message.parsed)
    r = client.chat.completions.create(model="m", messages=CHAT, response_format={"type": "json_object"},
                                       max_tokens=120, temperature=0, extra_body=NOTHINK)
    if r.choices[0].finish_reason == "stop":  # an object of any size: the greedy one may need more tokens
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.startswith("{")


TOOL = {"type": "function", "function": {"name": "get_weather", "description": "weather in a city",
                                         "parameters": Weather.model_json_schema()}}
PING = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}


def test_forced_tool_calls_match_the_schema(client):
    r = client.chat.completions.create(model="m", messages=CHAT, tools=[TOOL, PING], max_tokens=150, temperature=0.8,
                                       seed=2, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                       extra_body=NOTHINK)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1 and calls[0].function.name == "get_weather"
    _valid(Weather.model_validate_json(calls[0].function.arguments))
    r = client.chat.completions.create(model="m", messages=CHAT, tools=[TOOL, PING], tool_choice="required",
                                       max_tokens=300, temperature=0.8, seed=3, extra_body=NOTHINK)
    calls = r.choices[0].message.tool_calls or []
    assert calls and {c.function.name for c in calls} <= {"get_weather", "ping"}


def test_langchain_chat_model_and_structured_output(server):
    lc = pytest.importorskip("langchain_openai")
    llm = lc.ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model="gpt-4o-mini", temperature=0.8,
                        max_tokens=150, seed=4, max_retries=0, extra_body=NOTHINK)
    msg = llm.invoke("hello")
    assert isinstance(msg.content, str) and msg.usage_metadata["output_tokens"] >= 1
    text = "".join(c.content for c in llm.stream("hello"))
    assert isinstance(text, str)
    for method in ("json_schema", "function_calling"):
        _valid(llm.with_structured_output(Weather, method=method).invoke("weather in Paris?"))


def test_litellm_completion_stream_structured_output_and_text_completion(client, server, monkeypatch):
    """litellm's OpenAI-compatible provider, as people point it at a local server: a chat completion equal to the
    openai client's (greedy), its stream, a json_schema answer that validates, and a text completion."""
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # offline: no fetch of its price list
    litellm = pytest.importorskip("litellm")
    kw = {"model": "openai/gpt-4o-mini", "api_base": server.url + "/v1", "api_key": "unused", "max_retries": 0}
    want = client.chat.completions.create(model="m", messages=CHAT, max_tokens=8, temperature=0, extra_body=NOTHINK)
    r = litellm.completion(messages=CHAT, max_tokens=8, temperature=0, extra_body=NOTHINK, **kw)
    assert r.choices[0].message.content == want.choices[0].message.content
    assert r.usage.completion_tokens == want.usage.completion_tokens
    stream = litellm.completion(messages=CHAT, max_tokens=8, temperature=0, extra_body=NOTHINK, stream=True, **kw)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == want.choices[0].message.content
    r = litellm.completion(messages=CHAT, response_format=Weather, max_tokens=120, temperature=0.8, seed=1,
                           extra_body=NOTHINK, **kw)
    _valid(Weather.model_validate_json(r.choices[0].message.content))
    direct = client.completions.create(model="m", prompt=PROMPT, max_tokens=8, temperature=0)
    t = litellm.text_completion(prompt=PROMPT, max_tokens=8, temperature=0,
                                **{**kw, "model": "text-completion-openai/davinci-002"})  # its /v1/completions route
    assert t.choices[0].text == direct.choices[0].text


# --- /metrics, CORS, models -----------------------------------------------------------------------------

def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_metrics_count_requests_and_tokens(client, server):
    before = httpx.get(server.url + "/metrics")
    assert before.status_code == 200 and before.headers["content-type"].startswith("text/plain")
    r = client.chat.completions.create(model="m", messages=CHAT, max_tokens=4, extra_body=NOTHINK)
    after = httpx.get(server.url + "/metrics").text
    key = 'quantkit_requests_total{endpoint="/v1/chat/completions",status="200"}'
    assert _metric(after, key) == _metric(before.text, key) + 1
    assert _metric(after, "quantkit_generation_tokens_total") == \
        _metric(before.text, "quantkit_generation_tokens_total") + r.usage.completion_tokens
    assert "quantkit_queue_waiting" in after and "quantkit_time_to_first_token_seconds_bucket" in after


def test_cors_answers_only_the_allowed_origin(server, client, q4):
    pre = {"access-control-request-method": "POST", "access-control-request-headers": "authorization,content-type"}
    ok = httpx.options(server.url + "/v1/chat/completions", headers={"origin": "http://localhost:3000", **pre})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://localhost:3000"
    bad = httpx.options(server.url + "/v1/chat/completions", headers={"origin": "http://evil.example", **pre})
    assert "access-control-allow-origin" not in bad.headers
    assert [m.id for m in client.models.list().data] == [q4.name, "served-alias"]


# --- slow and vanishing bodies --------------------------------------------------------------------------

def _slow_client(server) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", server.port))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              b"Content-Length: 500\r\n\r\n{\"model\": ")
    return s


def test_slow_bodies_are_cut_off_and_do_not_hold_the_line(server):
    idle(server)
    slow = [_slow_client(server) for _ in range(3)]  # --max-queue 2: three readers fill the line
    try:
        time.sleep(0.3)
        body = {"model": "m", "messages": CHAT, "max_tokens": 2}
        assert httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30).status_code == 429
        for s in slow:
            s.settimeout(BODY_TIMEOUT + 10)
            assert s.recv(200).startswith(b"HTTP/1.1 408"), "the trickling body was not cut off"
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
    finally:
        for s in slow:
            s.close()


def test_a_client_leaving_mid_body_logs_no_traceback(server, caplog):
    with caplog.at_level(logging.WARNING):
        s = _slow_client(server)
        time.sleep(0.2)
        s.close()
        time.sleep(0.5)
    assert not [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()], caplog.text
    body = {"model": "m", "messages": CHAT, "max_tokens": 2}
    assert httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
