"""`quantkit serve` keeps a prompt cache for clients that resend the whole history: usage reports the reused
tokens (usage.prompt_tokens_details.cached_tokens, timings.cache_n), /health shows the cache, and answers equal
those without reuse across turns, an edited history, concurrent clients with a shared prefix and a client that
hangs up mid-request."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest

from quantkit.server.app import ServerConfig, create_app

from helpers.server import ServerThread, idle, load

SYSTEM = {"role": "system", "content": "You are a terminal world model. Print what each command prints."}


@pytest.fixture(scope="module")
def backend(q4):
    b = load(q4)
    b.runtime.set_prompt_cache(1 << 28)
    return b


@pytest.fixture(scope="module")
def server(backend):
    with ServerThread(create_app(backend, ServerConfig(max_queue=4))) as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def ask(client, backend, messages, thinking=True):
    r = client.chat.completions.create(model=backend.model_id, messages=messages, max_tokens=8, temperature=0,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": thinking}})
    m = r.choices[0].message
    return (m.content, m.model_extra.get("reasoning_content")), r.usage, r.model_extra["timings"]


def session(client, backend, turns=10, edit_at=None):
    msgs, out = [SYSTEM], []
    for t in range(turns):
        if t == edit_at:
            msgs[1] = {"role": "user", "content": "$ cat /etc/hostname  # edited"}
        msgs.append({"role": "user", "content": f"$ ls /srv/data/run{t} --sort=time"})
        answer, usage, timings = ask(client, backend, msgs, thinking=t % 3 != 2)
        out.append((answer, usage, timings))
        msgs.append({"role": "assistant", "content": answer[0] or "", "reasoning_content": answer[1] or ""})
    return out


def without_cache(server, backend, fn):
    idle(server)
    backend.runtime.set_prompt_cache(0)
    try:
        return fn()
    finally:
        backend.runtime.set_prompt_cache(1 << 28)


def test_turns_report_cached_tokens_and_match_no_reuse(client, server, backend):
    ref = without_cache(server, backend, lambda: session(client, backend))
    got = session(client, backend)
    assert [a for a, _u, _t in got] == [a for a, _u, _t in ref]
    assert all(u.prompt_tokens_details.cached_tokens == 0 for _a, u, _t in ref)
    cached = [u.prompt_tokens_details.cached_tokens for _a, u, _t in got]
    assert cached[0] == 0 and all(c > 0 for c in cached[1:])
    for (_a, u, t), (_a0, u0, _t0) in zip(got[1:], got, strict=False):
        assert u.prompt_tokens_details.cached_tokens >= u0.prompt_tokens - 12  # all but the generation prompt
        assert t["cache_n"] == u.prompt_tokens_details.cached_tokens
        assert t["prompt_n"] + t["cache_n"] == u.prompt_tokens
    h = httpx.get(server.url + "/health").json()["prompt_cache"]
    assert h["enabled"] and h["entries"] > 0 and 0 < h["bytes"] <= h["max_bytes"] and h["hit_rate"] > 0.5


def test_edited_history_is_a_miss_answered_correctly(client, server, backend):
    ref = without_cache(server, backend, lambda: session(client, backend, 6, edit_at=4))
    got = session(client, backend, 6, edit_at=4)
    assert [a for a, _u, _t in got] == [a for a, _u, _t in ref]
    edited, after = got[4][1], got[5][1]
    assert edited.prompt_tokens_details.cached_tokens < edited.prompt_tokens // 3
    assert after.prompt_tokens_details.cached_tokens > after.prompt_tokens // 2


def test_concurrent_clients_with_a_shared_prefix(client, server, backend):
    base = [SYSTEM, {"role": "user", "content": "$ uname -a"}, {"role": "assistant", "content": "Linux box"}]
    convs = [base + [{"role": "user", "content": f"$ echo client {i}"}] for i in range(4)]
    ref = without_cache(server, backend, lambda: [ask(client, backend, c)[0] for c in convs])
    ask(client, backend, base[:2])  # warm the shared prefix
    got: dict[int, tuple] = {}

    def run(i: int) -> None:
        got[i] = ask(client, backend, convs[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert [got[i][0] for i in range(4)] == ref
    assert all(got[i][1].prompt_tokens_details.cached_tokens > 0 for i in range(4))


def test_client_gone_mid_request_corrupts_nothing(client, server, backend):
    long = [SYSTEM] + [m for t in range(30) for m in ({"role": "user", "content": f"$ cat log{t}.txt | head"},
                                                      {"role": "assistant", "content": f"line {t} ok"})]
    long.append({"role": "user", "content": "$ wc -l *.txt"})
    ref = without_cache(server, backend, lambda: ask(client, backend, long)[0])
    for _ in range(3):  # hang up right after sending: the job is cancelled during prefill or at its first token
        with httpx.Client(timeout=30) as h, h.stream("POST", server.url + "/v1/chat/completions", json={
                "model": backend.model_id, "messages": long, "max_tokens": 8, "stream": True}) as r:
            assert r.status_code == 200
    idle(server)
    assert ask(client, backend, long)[0] == ref


def test_prompt_cache_size_option(q4, capsys, monkeypatch):
    from quantkit.cli.runtime import parse_cache_size

    from helpers.cli import run_cli

    assert parse_cache_size("auto") is None and parse_cache_size("0") == 0 and parse_cache_size("0MB") == 0
    assert parse_cache_size("512MB") == 512 * 10**6 and parse_cache_size("1GiB") == 1 << 30
    code, _out, err = run_cli(["serve", q4, "--prompt-cache-size", "-3GB"], capsys, monkeypatch)
    assert code != 0 and "--prompt-cache-size '-3GB'" in err and "Traceback" not in err
