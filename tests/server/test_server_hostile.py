"""Hostile requests that used to reach generation or slip past the Host check (issue 43), against the real app
serving the tiny int4 model: its tokenizer's chat template renders the prompt, the grammar engine builds on its
token table, and each token comes through the server's batch loop, the request's logits hook and the runtime's
`sample`. So a bad tool schema meets the real grammar builder and parser, and an extreme penalty or temperature
meets the real sampling arithmetic.

The test client re-raises any exception inside the app: a request that only avoided a 500 by a traceback in
the log fails here too. After every refused request the server must still answer /health."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quantkit.errors import QuantkitError
from quantkit.runtime.generate import SamplingParams, sample
from quantkit.server.app import ServerConfig, create_app
from quantkit.server.logits import MAX_LOGIT, LogitsHook, Penalties

from helpers.cli import run_cli
from helpers.probe import count, expect_one_line

ORIGIN = "http://localhost:3000"


@pytest.fixture(scope="module")
def backend(q4: Path) -> Any:
    """The tiny int4 model's backend, served as `quantkit serve` serves it."""
    from quantkit.server.runtime_backend import load_backend

    return load_backend(q4, model_id="m", max_context=2048)


def _client(backend: Any, **cfg: Any) -> TestClient:
    return TestClient(create_app(backend, ServerConfig(max_body_bytes=256_000, **cfg)),
                      base_url="http://127.0.0.1:8000")


@pytest.fixture(scope="module")
def client(backend: Any) -> Iterator[TestClient]:
    with _client(backend) as c:
        yield c


NOTHINK = {"chat_template_kwargs": {"enable_thinking": False}}
OK = {"model": "m", "messages": [{"role": "user", "content": "weather in Paris?"}], "max_tokens": 4,
      "temperature": 1, **NOTHINK}
GOOD_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                "days": {"type": "integer", "minimum": 1}},
               "required": ["city"]}


def _tools(params: Any, name: str = "get_weather") -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": name, "parameters": params}}]


def _alive(c: TestClient) -> None:
    r = c.get("/health")
    assert r.status_code == 200 and r.json()["status"] == "ok", r.text


def _refused(c: TestClient, r: Any, status: int, param: str | None = None) -> dict[str, Any]:
    """An OpenAI error object with `status` (and `param`), one line; the server still answers /health."""
    count()
    assert r.status_code == status, (r.status_code, r.text[:500])
    err = r.json()["error"]
    assert err["message"] and "\n" not in err["message"] and err["type"], err
    if param is not None:
        assert err["param"] == param and param in err["message"], err
    _alive(c)
    return err


def _ok(c: TestClient, r: Any) -> dict[str, Any]:
    count()
    assert r.status_code == 200, (r.status_code, r.text[:500])
    _alive(c)
    return r.json()


# --- tool and response_format schemas ---------------------------------------------------------------------

P = "tools[0].function.parameters"
BAD_TOOLS = [
    ({"type": "object", "properties": ["a"]}, f"{P}.properties"),
    ({"type": "object", "properties": "city"}, f"{P}.properties"),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "required": 5}, f"{P}.required"),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "required": [5]}, f"{P}.required"),
    ({"type": "object", "properties": {"a": 5}}, f"{P}.properties.a"),
    ({"type": "object", "properties": {"a": {"type": "object", "properties": ["x"]}}}, f"{P}.properties.a.properties"),
    ({"type": "object", "properties": {"a": {"type": "array", "items": {"required": "x"}}}},
     f"{P}.properties.a.items.required"),
    ({"type": "object", "properties": {"a": {"anyOf": []}}}, f"{P}.properties.a.anyOf"),
    ({"type": "object", "properties": {"a": {"anyOf": [{"type": "string"}, "int"]}}}, f"{P}.properties.a.anyOf[1]"),
    ({"type": "object", "properties": {"a": {"type": "string", "enum": "x"}}}, f"{P}.properties.a.enum"),
    ({"type": "object", "properties": {"a": {"type": "string", "enum": []}}}, f"{P}.properties.a.enum"),
    ({"type": "object", "properties": {"a": {"type": "string", "minLength": -3}}}, f"{P}.properties.a.minLength"),
    ({"type": "object", "properties": {"a": {"type": "string", "minLength": True}}}, f"{P}.properties.a.minLength"),
    ({"type": "object", "properties": {"a": {"type": "string", "maxLength": 10**11}}}, f"{P}.properties.a.maxLength"),
    ({"type": "object", "properties": {"a": {"type": "string", "minLength": 5, "maxLength": 2}}},
     f"{P}.properties.a.minLength"),
    ({"type": "object", "properties": {"a": {"type": 7}}}, f"{P}.properties.a.type"),
    ({"type": "object", "properties": {"a": {"type": ["string", "text"]}}}, f"{P}.properties.a.type"),
    ({"type": "object", "properties": {"a": {"type": "number", "minimum": "0"}}}, f"{P}.properties.a.minimum"),
    ({"type": "object", "properties": {"a": {"type": "number", "multipleOf": 0}}}, f"{P}.properties.a.multipleOf"),
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": 5}}}, f"{P}.properties.a.pattern"),
    ({"type": "object", "$defs": [1]}, f"{P}.$defs"),
    ({"type": "array"}, f"{P}.type"),
    ({"type": "object", "properties": {"a\n>b": {"type": "string"}}}, f'{P}.properties["a\\n>b"]'),
    ({"type": "object", "properties": {"<x": {"type": "string"}}}, f'{P}.properties["<x"]'),
]
CHOICES = {"required": "required", "named": {"type": "function", "function": {"name": "get_weather"}},
           "auto": "auto", "none": "none"}


@pytest.mark.parametrize("choice", CHOICES)
@pytest.mark.parametrize("params,param", BAD_TOOLS, ids=[f"bad{i}" for i in range(len(BAD_TOOLS))])
def test_a_tool_schema_of_the_wrong_shape_is_400_naming_the_field(client, params, param, choice):
    """Each tool_choice: a forced call builds a grammar from the schema, "auto" renders it and parses calls by
    it. The grammar builder used to meet a list where it iterated an object: 500 and a traceback."""
    r = client.post("/v1/chat/completions", json={**OK, "tools": _tools(params), "tool_choice": CHOICES[choice]})
    assert _refused(client, r, 400, param)["code"] == "invalid_schema"


@pytest.mark.parametrize("name", ["", " ", "a>b", "get<weather", "f\n", " f", "f\x00"])
def test_a_function_name_a_call_cannot_carry_is_400(client, name):
    r = client.post("/v1/chat/completions", json={**OK, "tools": _tools(GOOD_PARAMS, name), "tool_choice": "required"})
    _refused(client, r, 400, "tools[0].function.name")


RICH = {"type": "object", "$defs": {"unit": {"type": "string", "enum": ["c", "f"]}},
        "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 20},
                       "unit": {"$ref": "#/$defs/unit"}, "days": {"type": ["integer", "null"], "exclusiveMinimum": 0},
                       "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
                       "pair": {"type": "array", "prefixItems": [{"type": "number"}, True]},
                       "extra": {"anyOf": [{"type": "boolean"}, {"type": "object", "additionalProperties": False}]}},
        "required": ["city"], "additionalProperties": False}


@pytest.mark.parametrize("choice", CHOICES)
def test_well_formed_tool_schemas_are_still_served(client, choice):
    """The checks refuse shapes, not features: $defs and $ref, type lists, prefixItems, boolean schemas."""
    params = GOOD_PARAMS if choice in ("required", "named") else RICH
    body = _ok(client, client.post("/v1/chat/completions",
                                   json={**OK, "tools": _tools(params), "tool_choice": CHOICES[choice]}))
    assert body["choices"][0]["finish_reason"] in ("length", "stop", "tool_calls")
    if choice in ("required", "named"):  # the grammar holds from the first token
        assert body["choices"][0]["message"]["content"].startswith("<tool_call>")


S = "response_format.json_schema.schema"
BAD_SCHEMAS = [
    ({"type": "object", "properties": ["a"]}, f"{S}.properties"),
    ({"type": "object", "required": 5}, f"{S}.required"),
    ({"type": "object", "properties": {"a": {"enum": "x"}}}, f"{S}.properties.a.enum"),
    ({"type": "array", "items": [{"type": "string"}, 3]}, f"{S}.items[1]"),
    ({"type": "string", "maxLength": 1e30}, f"{S}.maxLength"),
    ({"type": "object", "properties": {"a b": {"type": "string", "minLength": 5, "maxLength": 2}}},
     f'{S}.properties["a b"].minLength'),
]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("schema,param", BAD_SCHEMAS, ids=[f"bad{i}" for i in range(len(BAD_SCHEMAS))])
def test_a_response_format_schema_of_the_wrong_shape_is_400_naming_the_field(client, schema, param, path):
    body = {**OK, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    if path == "/v1/completions":
        body = {k: v for k, v in body.items() if k not in ("messages", "chat_template_kwargs")} | {"prompt": "x"}
    _refused(client, client.post(path, json=body), 400, param)


_keywords = st.sampled_from(["type", "properties", "required", "enum", "items", "anyOf", "minLength", "maxLength",
                             "minimum", "additionalProperties", "const", "prefixItems", "maxItems", "$defs"])
_json = st.recursive(st.none() | st.booleans() | st.integers(-3, 2**33) | st.floats(allow_nan=False,
                                                                                    allow_infinity=False)
                     | st.sampled_from(["string", "integer", "object", "array", "x"]),
                     lambda c: st.lists(c, max_size=3) | st.dictionaries(st.sampled_from(["a", "b", "type"]), c,
                                                                         max_size=3), max_leaves=6)
_schemas = st.recursive(st.dictionaries(_keywords, _json, max_size=3),
                        lambda c: st.dictionaries(_keywords, c | _json, max_size=3), max_leaves=8)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.sampled_from(["a", "b"]), _schemas, max_size=2), st.sampled_from(sorted(CHOICES)))
def test_generated_tool_schemas_never_get_a_500(client, props, choice):
    """Any schema: served, or a 400 naming a field of the tool (the shape check's or the grammar engine's)."""
    r = client.post("/v1/chat/completions", json={**OK, "max_tokens": 2, "tool_choice": CHOICES[choice],
                                                  "tools": _tools({"type": "object", "properties": props})})
    count()
    assert r.status_code in (200, 400), (r.status_code, r.text[:500])
    if r.status_code == 400:
        err = r.json()["error"]
        assert err["param"].startswith("tools") and "\n" not in err["message"], err


# --- sampling values at their extremes --------------------------------------------------------------------

EXTREME = [{"repetition_penalty": 1e-300}, {"repetition_penalty": 5e-324}, {"repetition_penalty": 1e-45},
           {"repetition_penalty": 10}, {"repetition_penalty": 1e-300, "presence_penalty": 2, "frequency_penalty": 2},
           {"repetition_penalty": 1e-300, "frequency_penalty": -2, "logit_bias": {"5": 100, "6": -100}},
           {"repetition_penalty": 1e-300, "min_p": 0.99}, {"repetition_penalty": 1e-300, "top_p": 1e-300},
           {"temperature": 1e-300}, {"temperature": 5e-324, "top_k": 0, "top_p": 0.5}, {"temperature": 1e-5},
           {"temperature": 2, "repetition_penalty": 1e-300, "top_k": 0}, {"presence_penalty": -2, "top_k": 0}]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("extra", EXTREME, ids=[json.dumps(e) for e in EXTREME])
def test_extreme_sampling_values_are_served(client, extra, stream):
    """A repetition penalty of 1e-300 divided float32 logits by 0 (inf, then NaN probabilities: 500); so did a
    temperature of 1e-300 in the runtime's sampler. Sampled with three choices, on both endpoints."""
    for path, body in (("/v1/chat/completions", {**OK, **extra, "n": 3, "max_tokens": 6, "stream": stream}),
                       ("/v1/completions", {"model": "m", "prompt": "abc abc abc", **extra, "n": 3, "max_tokens": 6,
                                            "stream": stream})):
        r = client.post(path, json=body)
        if stream:
            count()
            assert r.status_code == 200 and '"error"' not in r.text and r.text.rstrip().endswith("[DONE]"), r.text
            _alive(client)
        else:
            assert len(_ok(client, r)["choices"]) == 3


def test_a_temperature_below_the_floor_samples_greedily(client):
    """Below 1e-5 the answer is the greedy one (as vLLM does), with or without a penalty."""
    count(2)
    greedy = client.post("/v1/chat/completions", json={**OK, "temperature": 0, "max_tokens": 8}).json()
    for extra in ({"temperature": 1e-300}, {"temperature": 1e-6, "seed": 7}):
        got = client.post("/v1/chat/completions", json={**OK, "max_tokens": 8, **extra}).json()
        assert got["choices"][0]["message"]["content"] == greedy["choices"][0]["message"]["content"]


@pytest.mark.parametrize("repetition", [1e-300, 5e-324, 1e-20, 1e-5])
def test_a_tiny_repetition_penalty_keeps_logits_finite_and_ordered(repetition):
    """Seen tokens with a positive logit outrank every other, in their own order; all stay finite."""
    count()
    logits = torch.tensor([3.0, 1.0, 2.5, -1.0, 0.5, 4.0])
    hook = LogitsHook([0, 1, 3], penalties=Penalties(repetition=repetition))
    out = hook.process(logits)
    assert torch.isfinite(out).all() and float(out.max()) <= MAX_LOGIT
    assert out.argsort(descending=True)[:2].tolist() == [0, 1]  # seen, positive: 3.0 then 1.0
    assert float(out[3]) > -1.0 and float(out[3]) <= 0  # seen, negative: multiplied towards 0
    for temperature in (1e-5, 1.0):
        p = SamplingParams(temperature=temperature, top_k=0, top_p=1.0)
        assert sample(out, p, torch.Generator().manual_seed(0)) == 0


@pytest.mark.parametrize("extra,param", [({"repetition_penalty": 1e300}, "repetition_penalty"),
                                         ({"presence_penalty": 1e300}, "presence_penalty"),
                                         ({"frequency_penalty": -1e300}, "frequency_penalty"),
                                         ({"repetition_penalty": -0.0}, "repetition_penalty")])
def test_penalties_out_of_range_are_400(client, extra, param):
    _refused(client, client.post("/v1/chat/completions", json={**OK, **extra}), 400, param)


@pytest.mark.parametrize("key", ["\u0661", " 5 ", "1_0", "+5", "", "5.0", "0x5", "1" * 30])
def test_a_logit_bias_key_must_be_a_decimal_token_id(client, key):
    """int() reads other scripts' digits, spaces and underscores: such a key named a token the client never wrote."""
    _refused(client, client.post("/v1/chat/completions", json={**OK, "logit_bias": {key: 5}}), 400, "logit_bias")


# --- Host before CORS; every refusal a JSON error ---------------------------------------------------------

def _preflight(c: TestClient, host: str = "127.0.0.1:8000", origin: str = ORIGIN, method: str = "POST",
               headers: str | None = "content-type") -> Any:
    h = {"host": host, "origin": origin, "access-control-request-method": method}
    if headers is not None:
        h["access-control-request-headers"] = headers
    return c.options("/v1/chat/completions", headers=h)


@pytest.mark.parametrize("key", [None, "s3cret"])
def test_a_preflight_for_a_foreign_host_is_refused_before_cors(backend, key):
    """DNS rebinding: the page's own name as Host, a listed origin. The preflight used to get 200 with
    access-control-allow-origin before the Host check ran."""
    with _client(backend, cors_origins=(ORIGIN,), api_key=key) as c:
        for host in ("evil.example", "evil.example:8000", "localhost.evil.example"):
            r = _preflight(c, host=host)
            assert _refused(c, r, 403)["code"] == "host_not_allowed"
            assert "access-control-allow-origin" not in r.headers
        count()
        r = _preflight(c)  # the same preflight on the server's own name: allowed, without the key
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN


@pytest.mark.parametrize("origin,method,headers,needle", [
    ("http://evil.example", "POST", "content-type", "origin 'http://evil.example'"),
    (ORIGIN, "DELETE", "content-type", "method 'DELETE'"),
    (ORIGIN, "POST", "x-evil", "headers 'x-evil'"),
    ("null", "PUT", None, "origin 'null'"),
])
def test_a_refused_preflight_is_a_json_error_naming_what(backend, origin, method, headers, needle):
    with _client(backend, cors_origins=(ORIGIN,)) as c:
        err = _refused(c, _preflight(c, origin=origin, method=method, headers=headers), 400)
        assert err["code"] == "cors_refused" and needle in err["message"], err


def test_a_refusal_behind_cors_carries_the_cors_headers(backend):
    """A listed page gets its 401 as JSON it can read (the key check runs inside CORS)."""
    with _client(backend, cors_origins=(ORIGIN,), api_key="s3cret") as c:
        r = c.get("/v1/models", headers={"origin": ORIGIN})
        _refused(c, r, 401)
        assert r.headers["access-control-allow-origin"] == ORIGIN
        count()
        assert c.get("/v1/models", headers={"origin": ORIGIN, "authorization": "Bearer s3cret"}).status_code == 200


# --- API keys an HTTP header can carry --------------------------------------------------------------------

@pytest.mark.parametrize("key", ["clé", "ключ", "key\u00a0x", "tab\tkey", "line\nkey", " padded", "padded "])
def test_an_api_key_no_client_can_send_is_refused_at_start(key, tmp_path, capsys, monkeypatch):
    """httpx (so the openai SDK) and browsers refuse non-ASCII header values: every request would get 401."""
    code, out, err = run_cli(["serve", tmp_path, "--api-key", key], capsys, monkeypatch)
    line = expect_one_line(code, out, err, "--api-key", exit_code=2)
    assert key.strip() not in line or not key.strip()  # the key itself is never printed
    monkeypatch.setenv("QUANTKIT_API_KEY", key)
    code, out, err = run_cli(["serve", tmp_path], capsys, monkeypatch)
    expect_one_line(code, out, err, "QUANTKIT_API_KEY", exit_code=2)
    count()
    with pytest.raises(QuantkitError):
        ServerConfig(api_key=key)


def test_an_ascii_key_with_punctuation_works(backend):
    key = "k!#$%&'*+-.^_`|~:;=?@[]{}()<>,/\\\"0 9"
    with _client(backend, api_key=key) as c:
        count(3)
        assert c.get("/v1/models", headers={"authorization": f"Bearer {key}"}).status_code == 200
        assert c.get("/v1/models", headers={"x-api-key": key}).status_code == 200
        assert c.get("/v1/models", headers={"authorization": f"Bearer {key[:-1]}"}).status_code == 401
