"""`quantkit serve` reuses its prompt cache for /v1/completions (a repeated raw prompt, or one with another last
line, restores a checkpoint: usage.prompt_tokens_details.cached_tokens > 0, the answer a cold server gives), and
with --prompt-cache-dir a conversation goes on across a server restart (a new backend on the same folder restores
it from disk, prefills only the new turn, answers as a cold server; /health and /metrics show the disk cache)."""

from __future__ import annotations

import httpx
import openai
import pytest

from quantkit.runtime.generate import PREFILL_CHUNK
from quantkit.server.app import ServerConfig, create_app
from quantkit.server.runtime_backend import load_backend

from helpers.server import MAX_CONTEXT, ServerThread

pytestmark = pytest.mark.usefixtures("one_thread")

LOG = "\n".join(f"[{i:03d}] GET /api/items/{i * 13 % 97} 200 {i * 7 % 50}ms" for i in range(60))
SYSTEM = {"role": "system", "content": "You are a terminal world model.\n" + LOG}


def backend_on(q4, cache_bytes: int = 1 << 28, folder=None):
    return load_backend(q4, max_context=MAX_CONTEXT, prompt_cache_bytes=cache_bytes, prompt_cache_dir=folder,
                        prompt_cache_disk_bytes=(1 << 30) if folder is not None else None)


def client_of(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def complete(client, prompt: str) -> tuple[str, int, int]:
    r = client.completions.create(model="m", prompt=prompt, max_tokens=8, temperature=0)
    return r.choices[0].text, r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens


def chat(client, messages) -> tuple[str, int, int]:
    r = client.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    return r.choices[0].message.content or "", r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens


def serve(backend, fn):
    with ServerThread(create_app(backend, ServerConfig(max_queue=2))) as s:
        return fn(s, client_of(s))


def test_repeated_and_extended_completions_prompts_reuse_the_cache(q4):
    prompts = [LOG + "\n[060] GET", LOG + "\n[060] GET", LOG + "\n[060] POST /api/login"]
    cold = serve(backend_on(q4, 0), lambda s, c: [complete(c, p) for p in prompts])
    got = serve(backend_on(q4), lambda s, c: [complete(c, p) for p in prompts])
    assert [t for t, _n, _c in got] == [t for t, _n, _c in cold]
    assert all(c == 0 for _t, _n, c in cold) and got[0][2] == 0
    n = got[1][1]
    assert n > 2 * PREFILL_CHUNK and got[1][2] == n  # the same prompt again: reused whole
    assert 0 < got[2][2] <= (n - 1) // PREFILL_CHUNK * PREFILL_CHUNK  # another last line: the chunk end before it


def test_a_conversation_resumes_across_a_server_restart(q4, tmp_path):
    d = tmp_path / "prompt-cache"
    turn1 = [SYSTEM, {"role": "user", "content": "$ tail -n 3 access.log"}]

    def first(s, c):
        answer, n, _ = chat(c, turn1)
        return answer, n
    answer, n1 = serve(backend_on(q4, folder=d), first)
    turn2 = turn1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": "$ wc -l access.log"}]
    want = serve(backend_on(q4, 0), lambda s, c: chat(c, turn2))

    def second(s, c):
        got = chat(c, turn2)
        return got, httpx.get(s.url + "/health").json()["prompt_cache"]["disk"], httpx.get(s.url + "/metrics").text
    got, disk, metrics = serve(backend_on(q4, folder=d), second)  # a new process's backend: memory empty
    assert got[0] == want[0] and got[1] == want[1]
    assert got[2] >= n1 - 12 and want[2] == 0  # only the new turn (and the generation prompt) prefilled
    assert disk["hits"] == 1 and disk["restored_tokens"] == got[2] and 0 < disk["bytes"] <= disk["max_bytes"]
    assert "quantkit_prompt_cache_disk_hits 1.0" in metrics and "quantkit_prompt_cache_disk_other_bytes 0.0" in metrics
    assert f"quantkit_prompt_cache_disk_restored_tokens {float(got[2])}" in metrics


def test_a_dir_shared_with_another_model_is_not_restored_nor_evicted(q4, tiny_model, tmp_path):
    """The bf16 checkpoint and its 4-bit folder share a DIR: neither restores the other's entries, and the bf16
    server, bounded below what the folder holds, evicts none of the 4-bit ones: /health says the folder is over
    its bound because of them, and one warning said so."""
    d = tmp_path / "prompt-cache"
    prompt = LOG + "\n[060] GET"
    serve(backend_on(q4, folder=d), lambda s, c: complete(c, prompt))
    theirs = {p.name: p.read_bytes() for p in d.glob("qkpc-*")}
    warnings: list[str] = []
    other = load_backend(tiny_model, max_context=MAX_CONTEXT, prompt_cache_bytes=1 << 28, prompt_cache_dir=d,
                         prompt_cache_disk_bytes=sum(map(len, theirs.values())), warn=warnings.append)
    want = serve(load_backend(tiny_model, max_context=MAX_CONTEXT, prompt_cache_bytes=0), lambda s, c: complete(c, prompt))
    got, health = serve(other, lambda s, c: (complete(c, prompt), httpx.get(s.url + "/health").json()))
    disk = health["prompt_cache"]["disk"]
    assert got == want and got[2] == 0
    assert disk["ignored_other_weights"] == len(theirs) > 0 and disk["hits"] == 0 and disk["writes"] > 0
    assert disk["other_bytes"] == sum(map(len, theirs.values())) and disk["over_bound"]
    assert {p.name: p.read_bytes() for p in d.glob("qkpc-*") if p.name in theirs} == theirs
    assert len(warnings) == 1 and "over --prompt-cache-disk-size" in warnings[0], warnings
