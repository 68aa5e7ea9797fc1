"""`BatchScheduler` (quantkit/server/scheduler.py), the server's queue with several slots decoded together, on the
tiny decisive int4 checkpoint: every request's tokens are the ones it gets served alone, whatever else shares
its steps, with requests joining as slots free up, with and without MTP drafts; a cancelled request or one whose
sampling hook fails ends alone; bad slot counts are refused; `quantkit serve --parallel N` answers concurrent
requests as it answers them one at a time, and `--parallel 1` runs on the same loop (drafts and their counts)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import httpx
import pytest

from quantkit.errors import QuantkitError
from quantkit.planner.slots import MAX_SLOTS
from quantkit.runtime import load_model
from quantkit.runtime.generate import SamplingParams
from quantkit.server.app import ServerConfig, create_app
from quantkit.server.backend import Prompt
from quantkit.server.queue import Done, Failed, Job, QueueFull
from quantkit.server.runtime_backend import RuntimeBackend
from quantkit.server.scheduler import BatchScheduler

from helpers.cli import run_cli
from helpers.runtime import quantized
from helpers.server import ServerThread

TEXTS = ["list the files in this folder", "write a haiku about rivers", "what is 17 times 23?",
         "name three colours", "translate 'good morning' to French"]
WAIT_S = 120


@pytest.fixture(scope="module", params=["tokens", "rows"])
def backend(tiny_model, request):
    """The tiny int4 model served, its prompts prefilled in the T-token (tokens) or the row arithmetic (rows)."""
    rt = load_model(quantized(tiny_model, "int4"))
    rt.set_prefill(request.param)
    return RuntimeBackend(rt, "tiny")


def _prompt(backend, text: str) -> Prompt:
    return backend.render([{"role": "user", "content": text}], None, True)


def _params() -> list[SamplingParams]:
    greedy = dict(temperature=0, ignore_eos=True)
    seeded = dict(temperature=0.8, top_p=0.9, top_k=20, ignore_eos=True)
    return [SamplingParams(max_new_tokens=10, **greedy), SamplingParams(max_new_tokens=4, seed=1, **seeded),
            SamplingParams(max_new_tokens=7, seed=2, **seeded), SamplingParams(max_new_tokens=6, **greedy),
            SamplingParams(max_new_tokens=9, seed=3, **seeded)]


def _alone(backend, prompt: Prompt, sp: SamplingParams) -> list[int]:
    return [e.token for e in backend.generate(prompt, replace(sp), threading.Event()) if e.token is not None]


async def _collect(job: Job, on_token=None) -> tuple[list[int], object]:
    toks = []
    while True:
        item = await asyncio.wait_for(job.events.get(), WAIT_S)
        if isinstance(item, (Done, Failed)):
            return toks, item
        toks.append(item.token)
        if on_token is not None:
            on_token(job, len(toks))


def _serve(queue, prompts, params, on_token=None):
    async def main():
        loop = asyncio.get_running_loop()
        jobs = [Job(p, replace(sp), loop) for p, sp in zip(prompts, params, strict=True)]
        for j in jobs:
            queue.submit(j)
        return jobs, await asyncio.gather(*(_collect(j, on_token) for j in jobs))
    try:
        return asyncio.run(main())
    finally:
        queue.close()


def test_every_request_gets_the_tokens_it_gets_alone(backend, one_thread):
    prompts, params = [_prompt(backend, t) for t in TEXTS], _params()
    want = [_alone(backend, p, sp) for p, sp in zip(prompts, params, strict=True)]
    sched = BatchScheduler(backend, max_waiting=8, slots=3)
    sizes = []
    _jobs, got = _serve(sched, prompts, params, lambda job, n: sizes.append(sched.stats.batch_size))
    for (toks, done), w, sp in zip(got, want, params, strict=True):
        assert isinstance(done, Done) and toks == w
        assert done.finish_reason == "length" and done.completion_tokens == sp.max_new_tokens
    assert max(sizes) == 3  # three slots decoded together, and the last two requests joined as slots freed
    assert sched.stats.completed == 5 and sched.stats.running == 0 and sched.stats.generated_tokens == sum(map(len, want))


def test_one_slot_serves_the_requests_one_after_another_as_alone(backend, one_thread):
    """`--parallel 1`: the one queue with one slot; each request waits for the one before it, and gets the
    tokens it gets alone."""
    prompts, params = [_prompt(backend, t) for t in TEXTS[:3]], _params()[:3]
    want = [_alone(backend, p, sp) for p, sp in zip(prompts, params, strict=True)]
    sched = BatchScheduler(backend, 8, slots=1)
    sizes = []
    _j, got = _serve(sched, prompts, params, lambda job, n: sizes.append(sched.stats.batch_size))
    assert [t for t, _d in got] == want
    assert [(d.finish_reason, d.completion_tokens) for _t, d in got] == [("length", sp.max_new_tokens) for sp in params]
    assert max(sizes) == 1


def test_a_cancelled_request_ends_alone(backend, one_thread):
    prompts, params = [_prompt(backend, t) for t in TEXTS[:3]], _params()[:3]
    params[1] = replace(params[1], max_new_tokens=20)
    want = [_alone(backend, p, sp) for p, sp in zip(prompts, params, strict=True)]

    def cancel_second(job, n):
        if job.prompt is prompts[1] and n == 2:
            job.stop()

    _jobs, got = _serve(BatchScheduler(backend, 8, slots=3), prompts, params, cancel_second)
    toks, done = got[1]
    assert done.finish_reason == "cancelled" and toks == want[1][:len(toks)] and len(toks) < 20
    assert [got[0][0], got[2][0]] == [want[0], want[2]]


class _Breaks:
    """A sampling hook that fails at its third token (a grammar that cannot go on)."""

    def __init__(self):
        self.n = 0

    def process(self, logits):
        self.n += 1
        if self.n == 3:
            raise ValueError("the grammar has no way on")
        return logits

    def accept(self, token):
        return None


def test_a_request_whose_hook_fails_ends_alone(backend, one_thread):
    prompts, params = [_prompt(backend, t) for t in TEXTS[:3]], _params()[:3]
    want = [_alone(backend, p, sp) for p, sp in zip(prompts, params, strict=True)]
    params[2] = replace(params[2], hook=_Breaks())
    sched = BatchScheduler(backend, 8, slots=3)
    _jobs, got = _serve(sched, prompts, params)
    toks, failed = got[2]
    assert isinstance(failed, Failed) and "no way on" in failed.message and toks == want[2][:2]
    assert [got[0][0], got[1][0]] == [want[0], want[1]]
    assert sched.stats.failed == 1 and sched.stats.completed == 2


def test_a_full_line_is_refused(backend, one_thread):
    sched = BatchScheduler(backend, max_waiting=1, slots=2)

    async def main():
        loop = asyncio.get_running_loop()
        long = replace(_params()[0], max_new_tokens=200)
        jobs = [Job(_prompt(backend, TEXTS[0]), replace(long), loop) for _ in range(6)]
        refused = 0
        for j in jobs:
            try:
                sched.submit(j)
            except QueueFull:
                refused += 1
                j.stop()
        for j in jobs:
            j.stop()
        return refused
    try:
        assert asyncio.run(main()) >= 3 and sched.stats.rejected >= 3  # two slots and one waiting at most
    finally:
        sched.close()


@pytest.mark.parametrize("slots", [0, -1, MAX_SLOTS + 1])
def test_bad_slot_counts_are_refused(backend, slots):
    with pytest.raises(ValueError, match=f"parallel {slots}: give 1 to {MAX_SLOTS} slots"):
        BatchScheduler(backend, 8, slots=slots)


def test_a_backend_off_the_runtime_is_refused():
    with pytest.raises(ValueError, match="RuntimeBackend"):
        BatchScheduler(object(), 8, slots=2)


# ---- `quantkit serve --parallel N` ----

def _chat(url: str, text: str, max_tokens: int, seed: int | None, extra: dict | None = None) -> dict:
    body = {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0 if seed is None else 0.8, "top_p": 0.9, **(extra or {})}
    if seed is not None:
        body["seed"] = seed
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=WAIT_S)
    assert r.status_code == 200, r.text
    return r.json()


def _answers(backend, parallel: int) -> tuple[list[tuple[str, int]], dict]:
    app = create_app(backend, ServerConfig(max_queue=6, parallel=parallel))
    reqs = [(t, 6 + j, None if j % 2 == 0 else j) for j, t in enumerate(TEXTS[:4])]
    reqs += [(TEXTS[4], 12, None, {"response_format": {"type": "json_object"}}),  # structured output
             (TEXTS[0], 5, 9, {"logprobs": True, "top_logprobs": 2, "presence_penalty": 1.5})]
    with ServerThread(app) as s, ThreadPoolExecutor(len(reqs)) as pool:
        got = list(pool.map(lambda r: _chat(s.url, *r), reqs))
        health = httpx.get(s.url + "/health").json()
        metrics = httpx.get(s.url + "/metrics").text
    assert f"quantkit_slots {float(parallel)}" in metrics
    return [(g["choices"][0]["message"]["content"] or "", g["usage"]["completion_tokens"],
             json.dumps(g["choices"][0].get("logprobs"))) for g in got], health


def test_serve_parallel_answers_each_request_as_alone(backend, one_thread):
    """Concurrent requests on two slots (greedy, seeded, one with a JSON grammar, one with logprobs and a
    penalty) answer what one slot answers; /health shows the slots."""
    one, _h = _answers(backend, 1)
    two, health = _answers(backend, 2)
    assert two == one and one[5][2] != "null"  # the logprobs came back, and the same
    q = health["queue"]
    assert q["slots"] == 2 and q["peak_batch"] == 2 and q["running"] == 0 and q["completed"] == 6


def test_a_schema_that_cannot_compile_is_refused_alone_while_others_decode(backend, monkeypatch, one_thread):
    """While a request decodes on one slot, a request whose json_schema the grammar engine cannot compile gets
    its own 400 naming the schema; the running request goes on and answers what it answers alone. (Each step is
    slowed so that the tiny model is still decoding when the second request arrives.)"""
    model = backend.runtime.model
    step = model.forward_batch

    def slow_step(*a, **kw):
        time.sleep(0.01)
        return step(*a, **kw)

    monkeypatch.setattr(model, "forward_batch", slow_step)
    body = {"model": "tiny", "messages": [{"role": "user", "content": TEXTS[1]}], "max_tokens": 300,
            "temperature": 0, "ignore_eos": True}
    bad = {"model": "tiny", "messages": [{"role": "user", "content": TEXTS[2]}], "max_tokens": 4,
           "response_format": {"type": "json_schema", "json_schema": {
               "name": "s", "schema": {"type": "string", "pattern": "(?<=a)b"}}}}
    app = create_app(backend, ServerConfig(max_queue=4, parallel=2))
    with ServerThread(app) as s, httpx.Client(timeout=WAIT_S) as http:
        alone = http.post(s.url + "/v1/chat/completions", json=body).json()["choices"][0]["message"]
        text, running = [], None
        with http.stream("POST", s.url + "/v1/chat/completions", json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                for c in json.loads(line[6:])["choices"]:
                    text.append((c["delta"].get("reasoning_content") or "") + (c["delta"].get("content") or ""))
                if running is None:  # the first request is decoding: send the bad one now
                    refused = http.post(s.url + "/v1/chat/completions", json=bad)
                    running = http.get(s.url + "/health").json()["queue"]["running"]
        health = http.get(s.url + "/health").json()["queue"]
    assert refused.status_code == 400, refused.text
    err = refused.json()["error"]
    assert err["type"] == "invalid_request_error" and "look-around" in err["message"]
    assert running == 1  # refused while the other request was still decoding
    assert "".join(text) == (alone.get("reasoning_content") or "") + (alone["content"] or "")
    assert health["completed"] == 2 and health["running"] == 0


@pytest.mark.parametrize("value, needle", [("0", "'0' is out of range"), ("-2", "'-2' is out of range"),
                                           (str(MAX_SLOTS + 1), "is out of range"), ("lots", "'lots'")])
def test_serve_refuses_a_bad_parallel_in_one_line(tmp_path, capsys, monkeypatch, value, needle):
    code, out, err = run_cli(["serve", str(tmp_path), "--parallel", value], capsys, monkeypatch)
    assert code == 2, (out, err)
    assert "--parallel" in err and needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_serve_refuses_a_bad_prefill_in_one_line(tmp_path, capsys, monkeypatch):
    code, out, err = run_cli(["serve", str(tmp_path), "--prefill", "chunks"], capsys, monkeypatch)
    assert code != 0, (out, err)
    assert "--prefill 'chunks'" in err and "tokens, rows" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_a_bad_parallel_in_the_config_is_one_line():
    with pytest.raises(QuantkitError, match=f"parallel 0: give 1 to {MAX_SLOTS} slots"):
        ServerConfig(parallel=0)


# ---- `n` choices ----

def test_the_choices_of_one_prompt_share_one_prefill(backend, monkeypatch, one_thread):
    """`submit_group`: the prompt prefilled once, each choice decoded from a copy of its state, beside the
    other request's; each choice's tokens (seeded per choice, as the server derives them) are its tokens alone."""

    prompt, other = _prompt(backend, TEXTS[1]), _prompt(backend, TEXTS[2])
    seeded = _params()[1]
    params = [replace(seeded, seed=7 + j, max_new_tokens=5 + j) for j in range(3)]
    want = [_alone(backend, prompt, sp) for sp in params]
    want_other = _alone(backend, other, _params()[0])
    prefills: list[int] = []  # prompt tokens prefilled, per chunk (either arithmetic)
    model = backend.runtime.model
    step = model.forward_batch
    monkeypatch.setattr(model, "forward_batch", lambda b, hidden=False: prefills.extend(
        len(s.ids) for s in b if s.kind in ("prefill", "prompt")) or step(b, hidden=hidden))
    sched = BatchScheduler(backend, max_waiting=2, slots=4)

    async def main():
        loop = asyncio.get_running_loop()
        group = object()
        jobs = [Job(prompt, replace(sp), loop, group=group) for sp in params]
        sched.submit_group(jobs)  # three choices: one request of the two the line holds
        lone = Job(other, replace(_params()[0]), loop)
        sched.submit(lone)
        return await asyncio.gather(*(_collect(j) for j in [*jobs, lone]))
    try:
        got = asyncio.run(main())
    finally:
        sched.close()
    assert [t for t, _d in got] == [*want, want_other]
    assert all(isinstance(d, Done) and d.finish_reason == "length" for _t, d in got)
    assert sum(prefills) == len(prompt.ids) + len(other.ids)  # one prefill for the three choices
    assert sched.stats.peak_batch == 4


def test_n_choices_over_http_answer_as_one_at_a_time(backend, one_thread):
    from helpers.server import ServerThread

    body = {"model": "tiny", "messages": [{"role": "user", "content": TEXTS[3]}], "max_tokens": 6, "n": 3,
            "temperature": 0.8, "top_p": 0.9, "seed": 11, "logprobs": True,
            "chat_template_kwargs": {"enable_thinking": False}}
    got = []
    for parallel in (1, 3):
        with ServerThread(create_app(backend, ServerConfig(max_queue=2, parallel=parallel))) as s:
            r = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=WAIT_S)
            assert r.status_code == 200, r.text
            got.append([(c["index"], c["message"]["content"], json.dumps(c["logprobs"])) for c in r.json()["choices"]])
    assert got[0] == got[1] and [i for i, _c, _l in got[0]] == [0, 1, 2]
    assert len({c for _i, c, _l in got[0]}) > 1  # the seeds differ per choice, so do the choices


# ---- MTP drafts per slot ----

@pytest.fixture(scope="module")
def mtp_backend(tiny_model_mtp):
    return RuntimeBackend(load_model(quantized(tiny_model_mtp, "int4")), "tiny")


def test_slots_that_draft_give_each_request_its_tokens_alone(mtp_backend, one_thread):
    """Three slots on the MTP model, every slot drafting two tokens a step (the tiny model's own MTP layer:
    drafts mostly rejected and rolled back inside the batch), requests joining as slots free: each request's
    tokens are its tokens alone without drafts, and its Done carries its draft counts."""
    rt = mtp_backend.runtime
    prompts, params = [_prompt(mtp_backend, t) for t in TEXTS], _params()
    rt.set_mtp(0)
    want = [_alone(mtp_backend, p, sp) for p, sp in zip(prompts, params, strict=True)]
    rt.set_mtp(2)
    try:
        _jobs, got = _serve(BatchScheduler(mtp_backend, max_waiting=8, slots=3), prompts, params)
    finally:
        rt.set_mtp(0)
    for (toks, done), w in zip(got, want, strict=True):
        assert isinstance(done, Done) and toks == w
        assert done.drafts["draft"] == 2 and 0 <= done.drafts["accepted"] <= done.drafts["drafted"]
    assert sum(d.drafts["drafted"] for _t, d in got) > 0


def test_one_slot_on_the_runtime_is_the_batch_loop_and_drafts(mtp_backend, one_thread):
    """`--parallel 1` (the config's default) serves quantkit's runtime on a one-slot `BatchScheduler`, so MTP
    drafts there as elsewhere: the counts in the response's timings (llama-server's draft_n / draft_n_accepted)
    and in /metrics, the answer the one without drafts."""
    rt = mtp_backend.runtime
    app = create_app(mtp_backend, ServerConfig(max_queue=2))
    extra = {"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}}
    with ServerThread(app) as s:
        queue = app.state.queue
        rt.set_mtp(0)
        plain = _chat(s.url, TEXTS[0], 12, None, extra)
        rt.set_mtp(2)
        try:
            drafted = _chat(s.url, TEXTS[0], 12, None, extra)
        finally:
            rt.set_mtp(0)
        metrics = httpx.get(s.url + "/metrics").text
    assert isinstance(queue, BatchScheduler) and queue.stats.slots == 1
    assert drafted["choices"][0]["message"] == plain["choices"][0]["message"]
    assert plain["timings"].get("draft_n") is None
    t = drafted["timings"]
    assert t["draft_n"] >= 2 and 0 <= t["draft_n_accepted"] <= t["draft_n"]
    assert f"quantkit_spec_decode_draft_tokens_total {float(t['draft_n'])}" in metrics
    assert f"quantkit_spec_decode_accepted_tokens_total {float(t['draft_n_accepted'])}" in metrics
