"""Running a request's choices through the queue and writing them as OpenAI objects or SSE chunks.

One request asks for `n` choices of one or more prompts; each choice is one `Job`, all submitted at once to
the scheduler (quantkit/server/scheduler.py), which prefills each prompt once for its choices and decodes them
in its slots. `ChatFormat` and `CompletionFormat` write the two endpoints' shapes; the flow
(collect or stream, disconnects, failures, usage) is shared:
- a streamed answer sends a role chunk per choice (chat), its text as it comes, one finish chunk per choice,
  then a usage-only chunk (`choices: []`) only when `stream_options.include_usage` is true, then `[DONE]`;
- logprobs ride on the chunk that carries their tokens' text (a token whose text is held back, as the
  possible start of a stop string or a tag, is reported with the next text or at the finish chunk);
- a failed generation, or one ended by the server's shutdown (`Closed`), ends a stream with one OpenAI error
  event then `[DONE]`, and a plain answer with its error object (500, or 503 `shutting_down`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from quantkit.runtime.channels import ANSWER, THINKING
from quantkit.runtime.generate import SamplingParams, TokenEvent
from quantkit.server.backend import Prompt
from quantkit.server.errors import ApiError
from quantkit.server.logits import TokenLogprob
from quantkit.server.parsing import OutputDelta, OutputParser
from quantkit.server.queue import Closed, Done, Failed, Job
from quantkit.server.schemas import (
    CompletionTokensDetails,
    ErrorInfo,
    PromptTokensDetails,
    Timings,
    Usage,
)


@dataclass
class ChoiceSpec:
    index: int
    prompt: Prompt
    params: SamplingParams
    parser: OutputParser
    prompt_index: int = 0  # which prompt of the request (prompt tokens are counted once per prompt)
    echo: str = ""  # /v1/completions echo: the prompt's text before the completion


class Answer:
    """One choice's output as it arrives: parsed deltas, token counts, logprobs, the finish reason."""

    def __init__(self, spec: ChoiceSpec, job: Job):
        self.spec, self.job, self.parser = spec, job, spec.parser
        self.tokens = 0
        self.reasoning_tokens = 0
        self.finish: str | None = None
        self.done: Done | None = None
        self.logprobs: list[TokenLogprob] = []  # every answer-channel token's
        self.pending: list[TokenLogprob] = []  # not yet sent with a chunk

    def token(self, ev: TokenEvent) -> OutputDelta:
        if ev.token is not None:
            self.tokens += 1
            self.reasoning_tokens += ev.channel == THINKING
            if isinstance(ev.info, TokenLogprob) and ev.channel == ANSWER:
                self.logprobs.append(ev.info)
                self.pending.append(ev.info)
        d = self.parser.feed(ev.text, ev.channel)
        if self.parser.stopped:
            self.job.stop("stop")
        return d

    def end(self, done: Done) -> OutputDelta:
        self.done = done
        if not self.parser.stopped:
            self.tokens = done.completion_tokens if done.finish_reason != "cancelled" else self.tokens
        self.finish = "stop" if self.parser.stopped else done.finish_reason
        d = self.parser.finish()
        if self.finish == "stop" and self.parser.tools is not None and self.parser.tools.calls:
            self.finish = "tool_calls"
        return d

    def take_pending(self) -> list[TokenLogprob]:
        out, self.pending = self.pending, []
        return out


def usage(answers: list[Answer]) -> Usage:
    prompts = {a.spec.prompt_index: len(a.spec.prompt.ids) for a in answers}
    p = sum(prompts.values())
    c = sum(a.tokens for a in answers)
    cached = sum(a.done.cached_tokens for a in answers if a.done) if answers else 0
    return Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c,
                 completion_tokens_details=CompletionTokensDetails(
                     reasoning_tokens=sum(a.reasoning_tokens for a in answers)),
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=min(cached, p)))


def timings(done: Done | None, completion_tokens: int) -> Timings | None:
    """llama-server's timings of one generation."""
    if done is None:
        return None

    def rate(n: int, s: float) -> float | None:
        return round(n / s, 2) if s > 0 and n > 0 else None
    prefilled = done.prompt_tokens - done.cached_tokens
    return Timings(queue_ms=round(done.queue_s * 1e3, 2), cache_n=done.cached_tokens, prompt_n=prefilled,
                   prompt_ms=round(done.prompt_s * 1e3, 2), prompt_per_second=rate(prefilled, done.prompt_s),
                   predicted_n=completion_tokens, predicted_ms=round(done.decode_s * 1e3, 2),
                   predicted_per_second=rate(completion_tokens - 1, done.decode_s),
                   draft_n=done.drafts["drafted"] if done.drafts else None,
                   draft_n_accepted=done.drafts["accepted"] if done.drafts else None)


class Listener:
    """Watches for the client going away (the body is read, so the next message is the disconnect) and
    cancels the job being generated for it. `on_end` runs once, when the answer ends or the client leaves
    (the request's place in the queue given back: even an answer whose body is never sent ends this way)."""

    def __init__(self, request: Request, on_end: Callable[[], None] | None = None):
        self.request = request
        self.job: Job | None = None
        self.others: list[Job] = []  # the request's other choices running beside `job` (stopped with it)
        self.gone = False
        self.on_end = on_end
        self.task = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        try:
            while True:
                msg = await self.request.receive()
                if msg["type"] == "http.disconnect":
                    self.gone = True
                    for other in self.others:
                        other.stop("cancelled")
                    if self.job is not None:
                        self.job.stop("cancelled")
                        self.job.events.put_nowait(None)  # wake the consumer
                    return
        finally:
            self._end()

    def _end(self) -> None:
        end, self.on_end = self.on_end, None
        if end is not None:
            end()

    def close(self) -> None:
        for job in [*self.others, *([self.job] if self.job is not None else [])]:
            job.stop()
        self.task.cancel()
        self._end()


# --- the two shapes -------------------------------------------------------------------------------------

PieceFn = Callable[[int], tuple[str, list[int]]]  # token id -> (text, UTF-8 bytes)


@dataclass
class ChatFormat:
    piece: PieceFn
    object: str = "chat.completion"
    chunk_object: str = "chat.completion.chunk"

    def _lp(self, lps: list[TokenLogprob]) -> dict[str, Any]:
        def one(t: int, lp: float) -> dict[str, Any]:
            text, b = self.piece(t)
            return {"token": text, "logprob": lp, "bytes": b}
        return {"content": [{**one(x.token, x.logprob), "top_logprobs": [one(t, v) for t, v in x.top]}
                            for x in lps], "refusal": None}

    def start(self, a: Answer) -> list[dict[str, Any]]:
        return [{"index": a.spec.index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                 "logprobs": None}]

    def deltas(self, a: Answer, d: OutputDelta, want_lp: bool, n_calls: list[int]) -> list[dict[str, Any]]:
        i, out = a.spec.index, []
        if d.reasoning:
            out.append({"index": i, "delta": {"reasoning_content": d.reasoning}, "finish_reason": None,
                        "logprobs": None})
        if d.content:
            lp = self._lp(a.take_pending()) if want_lp else None
            out.append({"index": i, "delta": {"content": d.content}, "finish_reason": None, "logprobs": lp})
        for c in d.tool_calls:
            out.append({"index": i, "delta": {"tool_calls": [c.to_openai(index=n_calls[0])]},
                        "finish_reason": None, "logprobs": None})
            n_calls[0] += 1
        return out

    def finish(self, a: Answer, want_lp: bool) -> dict[str, Any]:
        lp = self._lp(a.take_pending()) if want_lp and a.pending else None
        return {"index": a.spec.index, "delta": {}, "finish_reason": a.finish, "logprobs": lp}

    def choice(self, a: Answer, parts: list[OutputDelta], want_lp: bool) -> dict[str, Any]:
        reasoning = "".join(p.reasoning for p in parts)
        text = "".join(p.content for p in parts)
        calls = [c for p in parts for c in p.tool_calls]
        msg: dict[str, Any] = {"role": "assistant", "content": text if text.strip() or not calls else None,
                               "reasoning_content": reasoning or None}
        if calls:
            msg["tool_calls"] = [c.to_openai() for c in calls]
        return {"index": a.spec.index, "message": msg, "finish_reason": a.finish or "stop",
                "logprobs": self._lp(a.logprobs) if want_lp else None}


@dataclass
class CompletionFormat:
    piece: PieceFn
    object: str = "text_completion"
    chunk_object: str = "text_completion"
    _offsets: dict[int, int] = field(default_factory=dict)

    def _lp(self, a: Answer, lps: list[TokenLogprob]) -> dict[str, Any]:
        off = self._offsets.get(a.spec.index, len(a.spec.echo))
        tokens, offsets = [], []
        for x in lps:
            text = self.piece(x.token)[0]
            tokens.append(text)
            offsets.append(off)
            off += len(text)
        self._offsets[a.spec.index] = off
        top = [{self.piece(t)[0]: v for t, v in x.top} for x in lps]
        return {"tokens": tokens, "token_logprobs": [x.logprob for x in lps],
                "top_logprobs": top if any(x.top for x in lps) else None, "text_offset": offsets}

    def start(self, a: Answer) -> list[dict[str, Any]]:
        if not a.spec.echo:
            return []
        return [{"index": a.spec.index, "text": a.spec.echo, "logprobs": None, "finish_reason": None}]

    def deltas(self, a: Answer, d: OutputDelta, want_lp: bool, n_calls: list[int]) -> list[dict[str, Any]]:
        text = d.reasoning + d.content
        if not text:
            return []
        lp = self._lp(a, a.take_pending()) if want_lp else None
        return [{"index": a.spec.index, "text": text, "logprobs": lp, "finish_reason": None}]

    def finish(self, a: Answer, want_lp: bool) -> dict[str, Any]:
        lp = self._lp(a, a.take_pending()) if want_lp and a.pending else None
        return {"index": a.spec.index, "text": "", "logprobs": lp, "finish_reason": a.finish}

    def choice(self, a: Answer, parts: list[OutputDelta], want_lp: bool) -> dict[str, Any]:
        text = a.spec.echo + "".join(p.reasoning + p.content for p in parts)
        self._offsets.pop(a.spec.index, None)
        return {"index": a.spec.index, "text": text, "finish_reason": a.finish or "stop",
                "logprobs": self._lp(a, a.logprobs) if want_lp else None}


Format = ChatFormat | CompletionFormat
OnDone = Callable[[Answer], None]


@dataclass
class Run:
    """One request's choices, ready to run."""
    specs: list[ChoiceSpec]
    jobs: list[Job]  # choice i's job, all submitted before the response starts (429 there)
    fmt: Format
    rid: str
    created: int
    model: str
    logprobs: bool
    include_usage: bool
    on_done: OnDone


def _error_event(message: str, type_: str = "server_error", code: str | None = None) -> str:
    return sse({"error": ErrorInfo(message=message, type=type_, code=code).model_dump()})


CLOSED = "the server is shutting down: this request was ended before its answer was complete"


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _failure(ev: Any) -> str | None:
    """The error event that ends a stream on `ev` (None: `ev` is not an end by failure)."""
    if isinstance(ev, Failed):
        return _error_event(ev.message)
    # a job cancelled while its client still listens: only the server's shutdown does that
    if isinstance(ev, Closed) or (isinstance(ev, Done) and ev.finish_reason == "cancelled"):
        return _error_event(CLOSED, "service_unavailable", "shutting_down")
    return None


async def complete(run: Run, listener: Listener) -> JSONResponse:
    """Every choice, collected: one OpenAI object (499 when the client left)."""
    answers, choices = [], []
    try:
        for i, spec in enumerate(run.specs):
            job = run.jobs[i]
            listener.job = job
            a = Answer(spec, job)
            parts: list[OutputDelta] = []
            while True:
                ev = await job.events.get()
                if ev is None:  # the client went away
                    return JSONResponse({}, status_code=499)
                if isinstance(ev, Closed):
                    raise ApiError(503, CLOSED, "service_unavailable", code="shutting_down")
                if isinstance(ev, Failed):
                    raise ApiError(500, ev.message, "server_error")
                if isinstance(ev, Done) and ev.finish_reason == "cancelled":
                    raise ApiError(503, CLOSED, "service_unavailable", code="shutting_down")
                parts.append(a.end(ev) if isinstance(ev, Done) else a.token(ev))
                if isinstance(ev, Done):
                    break
            run.on_done(a)
            answers.append(a)
            choices.append(run.fmt.choice(a, parts, run.logprobs))
    finally:
        listener.close()
    last = answers[-1]
    body = {"id": run.rid, "object": run.fmt.object, "created": run.created, "model": run.model,
            "choices": choices, "usage": usage(answers).model_dump(), "system_fingerprint": None}
    t = timings(last.done, last.tokens)
    if t is not None:
        body["timings"] = t.model_dump()
    return JSONResponse(body)


async def stream(run: Run, listener: Listener) -> AsyncIterator[str]:
    """Every choice as SSE chunks (see the module docstring)."""
    def chunk(choices: list[dict[str, Any]]) -> str:
        return sse({"id": run.rid, "object": run.fmt.chunk_object, "created": run.created, "model": run.model,
                    "choices": choices})

    answers: list[Answer] = []
    try:
        for i, spec in enumerate(run.specs):
            job = run.jobs[i]
            listener.job = job
            a = Answer(spec, job)
            n_calls = [0]
            for c in run.fmt.start(a):
                yield chunk([c])
            while True:
                ev = await job.events.get()
                if ev is None:
                    return
                failed = _failure(ev)
                if failed is not None:
                    yield failed
                    yield "data: [DONE]\n\n"
                    return
                if isinstance(ev, Done):
                    for c in run.fmt.deltas(a, a.end(ev), run.logprobs, n_calls):
                        yield chunk([c])
                    yield chunk([run.fmt.finish(a, run.logprobs)])
                    break
                for c in run.fmt.deltas(a, a.token(ev), run.logprobs, n_calls):
                    yield chunk([c])
            run.on_done(a)
            answers.append(a)
        if run.include_usage:
            last = answers[-1]
            t = timings(last.done, last.tokens)
            yield sse({"id": run.rid, "object": run.fmt.chunk_object, "created": run.created, "model": run.model,
                       "choices": [], "usage": usage(answers).model_dump(),
                       **({"timings": t.model_dump()} if t is not None else {})})
        yield "data: [DONE]\n\n"
    finally:
        listener.close()
