"""The OpenAI-compatible HTTP app (FastAPI): /v1/models, /v1/chat/completions (plain and SSE), /health.

`create_app(backend, config)` serves one loaded model through a `GenerationQueue`. Every error is an
OpenAI error object (`{"error": {"message", "type", "param", "code"}}`) with its HTTP status: 400 for
malformed JSON, a missing or wrong-typed field, an unknown role, `max_tokens` < 1 or a prompt that does
not fit the context (with the numbers); 404 for an unknown model or path; 413 for a body over the size
limit; 429 when the line of waiting requests is full; 503 while shutting down.

Before any route: the Host header, the API key and the JSON content type (quantkit/server/security.py: 403,
401, 415). A request is admitted (429 otherwise) before its body is read: the requests being read or
rendered count against --max-queue with those waiting, so memory per request is bounded by the body limit
and at most --max-queue + 1 requests hold any. Its length is bounded from the text's bytes before the
tokenizer runs (no token covers more than `max_token_bytes` bytes), and rendering/tokenizing runs one request
at a time. OpenAI fields that would change the answer and are not implemented (logprobs, response_format
other than text, penalties, logit_bias) are answered 400 naming the field, never ignored.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from quantkit.errors import QuantkitError
from quantkit.runtime.channels import THINKING
from quantkit.runtime.generate import TokenEvent
from quantkit.server.backend import Backend, Prompt
from quantkit.server.parsing import OutputDelta, OutputParser
from quantkit.server.queue import Done, Failed, GenerationQueue, Job, QueueClosed, QueueFull
from quantkit.server.schemas import (
    AssistantOut,
    ChatCompletion,
    ChatCompletionRequest,
    Choice,
    CompletionTokensDetails,
    ErrorInfo,
    ErrorResponse,
    FunctionOut,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    Timings,
    ToolCallOut,
    Usage,
)
from quantkit.server.security import Guard, allowed_host_names

DEFAULT_MAX_BODY = 8 << 20  # 8 MiB: a full 262k-token context is about 1 MB of text


@dataclass(frozen=True)
class ServerConfig:
    max_queue: int = 8  # requests waiting behind the one being generated
    max_body_bytes: int = DEFAULT_MAX_BODY
    default_max_tokens: int | None = None  # cap when a request gives no max_tokens (None: rest of context)
    retry_after_s: int = 1
    bind_host: str = "127.0.0.1"  # the address bound: its name is an allowed Host
    allowed_hosts: tuple[str, ...] = ()  # more Host names to answer ("*": any)
    api_key: str | None = None  # when set, every endpoint but /health needs it

    def __post_init__(self) -> None:
        if self.max_queue < 1:
            raise QuantkitError(f"max_queue {self.max_queue}: must be at least 1")
        if self.max_body_bytes < 1:
            raise QuantkitError(f"max_body_bytes {self.max_body_bytes}: must be at least 1")
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise QuantkitError(f"default_max_tokens {self.default_max_tokens}: must be at least 1")


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        body = ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.code))
        return JSONResponse(body.model_dump(), status_code=self.status, headers=self.headers)


_STATUS_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                 405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
                 503: "service_unavailable"}


# The longest token of a vocabulary, when a backend does not say (every byte-level BPE token of the Qwen
# vocabularies is far shorter): a prompt of more than max_context * this many bytes cannot fit.
DEFAULT_MAX_TOKEN_BYTES = 256
UNSUPPORTED = {
    "logprobs": "logprobs are not returned by this server",
    "top_logprobs": "logprobs are not returned by this server",
    "logit_bias": "logit_bias is not supported",
    "presence_penalty": "presence_penalty is not supported (use 0)",
    "frequency_penalty": "frequency_penalty is not supported (use 0)",
}


def _unsupported(req: ChatCompletionRequest) -> None:
    """400 for fields that would change the answer and are not implemented; their neutral values pass."""
    extra = req.model_extra or {}
    for name, why in UNSUPPORTED.items():
        v = getattr(req, name, None) if name in type(req).model_fields else extra.get(name)
        if v not in (None, False, 0, 0.0, {}, []):
            raise ApiError(400, f"{name}: {why}; remove the field", param=name, code="unsupported_field")
    rf = req.response_format
    if rf is not None and rf.get("type") != "text":
        raise ApiError(400, f"response_format {rf.get('type')!r} is not supported: only \"text\" (this server has "
                            "no constrained decoding); remove the field", param="response_format",
                       code="unsupported_field")


def _text_bytes(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> int:
    n = sum(len(json.dumps(m, ensure_ascii=False).encode()) for m in messages)
    return n + (len(json.dumps(tools, ensure_ascii=False).encode()) if tools else 0)


_ROLE_TAGS = {"system", "developer", "user", "assistant", "tool"}
_TYPE_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}


def _param(loc: tuple[Any, ...]) -> str | None:
    """pydantic's error location as the request path a user wrote (`messages[0].content`), without the
    union-branch and discriminator labels pydantic inserts."""
    out = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _TYPE_TAGS or "[" in part or part[:1].isupper() or (
                part in _ROLE_TAGS and i > 0 and isinstance(loc[i - 1], int)):
            continue
        else:
            out += f".{part}" if out else part
    return out or None


def _validation_error(e: ValidationError) -> ApiError:
    errs = e.errors(include_url=False)
    for err in errs:
        if err["type"] == "json_invalid":
            return ApiError(400, f"malformed JSON body: {err.get('ctx', {}).get('error', err['msg'])}",
                            code="invalid_json")
    err = errs[0]
    param = _param(err["loc"])
    if err["type"] == "union_tag_invalid":
        param = f"{param}.role" if param else "role"
        got = err.get("ctx", {}).get("tag")
        msg = f"unknown role {got!r} in {param}: expected one of system, developer, user, assistant, tool"
    elif err["type"] == "missing":
        msg = f"missing required field {param}"
    else:
        msg = f"{param}: {err['msg']}" if param else err["msg"]
    others = {_param(x["loc"]) for x in errs} - {_param(err["loc"])}
    if others:
        msg += f" (and {len(others)} more problem{'s' if len(others) > 1 else ''}: {', '.join(sorted(map(str, others)))})"
    return ApiError(400, msg, param=param, code="missing_field" if err["type"] == "missing" else err["type"])


async def _read_body(request: Request, limit: int) -> bytes:
    too_big = ApiError(413, f"request body is larger than the server's limit of {limit} bytes "
                            f"(start the server with a larger --max-body to allow it)", code="body_too_large")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    out = []
    for i, part in enumerate(content):
        if part.type != "text":
            raise ApiError(400, f"{where}.content[{i}]: content parts of type {part.type!r} are not supported "
                                f"(this model takes text only)", param=f"{where}.content")
        out.append(part.text)
    return "".join(out)


def template_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The request's messages as the chat template expects them (text content, tool-call arguments as dicts)."""
    out = []
    for i, m in enumerate(req.messages):
        where = f"messages[{i}]"
        role = "system" if m.role == "developer" else m.role
        d: dict[str, Any] = {"role": role, "content": _text(m.content, where)}
        if m.role == "assistant":
            if m.reasoning_content:
                d["reasoning_content"] = m.reasoning_content
            if m.tool_calls:
                calls = []
                for j, tc in enumerate(m.tool_calls):
                    args = tc.function.arguments
                    if isinstance(args, str):
                        try:
                            args = json.loads(args) if args.strip() else {}
                        except ValueError as e:
                            raise ApiError(400, f"{where}.tool_calls[{j}].function.arguments is not valid JSON: {e}",
                                           param=f"{where}.tool_calls") from None
                    if not isinstance(args, dict):
                        raise ApiError(400, f"{where}.tool_calls[{j}].function.arguments must be a JSON object",
                                       param=f"{where}.tool_calls")
                    calls.append({"id": tc.id, "type": "function",
                                  "function": {"name": tc.function.name, "arguments": args}})
                d["tool_calls"] = calls
        if m.role == "tool" and m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


def _enable_thinking(req: ChatCompletionRequest) -> bool:
    kw = req.chat_template_kwargs or {}
    v = kw.get("enable_thinking", True)
    if not isinstance(v, bool):
        raise ApiError(400, "chat_template_kwargs.enable_thinking must be true or false",
                       param="chat_template_kwargs.enable_thinking")
    return v


def _tools(req: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    tc = req.tool_choice
    if tc is not None and tc not in ("auto", "none"):
        raise ApiError(400, f"tool_choice {tc!r} is not supported: use \"auto\" or \"none\" (the model decides "
                            f"whether to call a tool; forcing a call needs constrained decoding)",
                       param="tool_choice")
    if not req.tools or tc == "none":
        return None
    return [t.model_dump(exclude_none=True) for t in req.tools]


def _timings(done: Done, completion_tokens: int) -> Timings:
    def rate(n: int, s: float) -> float | None:
        return round(n / s, 2) if s > 0 and n > 0 else None
    prefilled = done.prompt_tokens - done.cached_tokens
    return Timings(queue_ms=round(done.queue_s * 1e3, 2), cache_n=done.cached_tokens, prompt_n=prefilled,
                   prompt_ms=round(done.prompt_s * 1e3, 2), prompt_per_second=rate(prefilled, done.prompt_s),
                   predicted_n=completion_tokens, predicted_ms=round(done.decode_s * 1e3, 2),
                   predicted_per_second=rate(completion_tokens - 1, done.decode_s))


class _Answer:
    """Accumulates one request's output: parsed deltas, token counts, the finish reason."""

    def __init__(self, job: Job, parser: OutputParser):
        self.job, self.parser = job, parser
        self.tokens = 0
        self.reasoning_tokens = 0
        self.finish: str | None = None
        self.done: Done | None = None
        self.error: str | None = None

    def token(self, ev: TokenEvent) -> OutputDelta:
        if ev.token is not None:
            self.tokens += 1
            self.reasoning_tokens += ev.channel == THINKING
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

    def usage(self) -> Usage:
        p = len(self.job.prompt.ids)
        cached = self.done.cached_tokens if self.done else 0
        return Usage(prompt_tokens=p, completion_tokens=self.tokens, total_tokens=p + self.tokens,
                     completion_tokens_details=CompletionTokensDetails(reasoning_tokens=self.reasoning_tokens),
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def create_app(backend: Backend, config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()
    created = int(time.time())
    state: dict[str, GenerationQueue] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state["queue"] = app.state.queue = GenerationQueue(backend, config.max_queue)
        try:
            yield
        finally:
            await asyncio.to_thread(state["queue"].close)

    app = FastAPI(title="quantkit", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.backend = backend
    app.add_middleware(Guard, hosts=allowed_host_names(config.bind_host, config.allowed_hosts),
                       api_key=config.api_key)
    admitted = {"n": 0}  # requests being read or rendered (not yet in the queue)
    render_lock = asyncio.Lock()  # one request rendered and tokenized at a time
    max_token_bytes = int(getattr(backend, "max_token_bytes", DEFAULT_MAX_TOKEN_BYTES))

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> JSONResponse:
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        msg = {404: f"no such endpoint: {request.method} {request.url.path}",
               405: f"method {request.method} is not allowed on {request.url.path}"}.get(e.status_code, str(e.detail))
        return ApiError(e.status_code, msg, _STATUS_TYPES.get(e.status_code, "server_error")).response()

    @app.exception_handler(Exception)
    async def _server_error(request: Request, e: Exception) -> JSONResponse:
        return ApiError(500, f"internal error: {type(e).__name__}: {e}", "server_error").response()

    @app.get("/health")
    async def health() -> dict[str, Any]:
        q = state.get("queue")
        status = "starting" if q is None else "ok" if q.accepting else "shutting_down"
        summary = getattr(backend, "cache_summary", None)
        return {"status": status, "model": backend.model_id,
                "max_context": backend.max_context, "queue": q.stats.as_dict() if q else None,
                "prompt_cache": summary() if summary else None}

    def card() -> ModelCard:
        return ModelCard(id=backend.model_id, created=created, max_model_len=backend.max_context)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return ModelList(data=[card()]).model_dump()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != backend.model_id:
            raise _unknown_model(model_id)
        return card().model_dump()

    def _unknown_model(name: str) -> ApiError:
        return ApiError(404, f"the model {name!r} does not exist: this server serves {backend.model_id!r}",
                        "not_found_error", param="model", code="model_not_found")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        q = state.get("queue")
        # the one running plus --max-queue waiting, counting those still being read or rendered
        if q is not None and admitted["n"] + q.stats.waiting + q.stats.running > config.max_queue:
            q.stats.rejected += 1
            raise ApiError(429, f"server busy: {admitted['n'] + q.stats.waiting} requests are already waiting "
                                f"(--max-queue {config.max_queue}); retry later", "rate_limit_error",
                           code="queue_full", headers={"Retry-After": str(config.retry_after_s)})
        admitted["n"] += 1
        try:
            prompt, req, tools = await _prepare(request)
        finally:
            admitted["n"] -= 1
        return await _start(request, prompt, req, tools)

    async def _prepare(request: Request) -> tuple[Prompt, ChatCompletionRequest, list[dict[str, Any]] | None]:
        body = await _read_body(request, config.max_body_bytes)
        try:
            req = ChatCompletionRequest.model_validate_json(body)
        except ValidationError as e:
            raise _validation_error(e) from None
        del body
        if req.model != backend.model_id:
            raise _unknown_model(req.model)
        if req.n not in (None, 1):
            raise ApiError(400, "n > 1 is not supported: ask for one choice per request", param="n")
        _unsupported(req)
        messages = template_messages(req)
        tools = _tools(req)
        thinking = _enable_thinking(req)
        ctx = backend.max_context
        nbytes = _text_bytes(messages, tools)
        if nbytes > ctx * max_token_bytes:
            raise ApiError(400, f"This model's maximum context length is {ctx} tokens. However, your messages "
                                f"hold {nbytes} bytes of text, more than {ctx} tokens can cover. Please reduce the "
                                f"length of the messages.", param="messages", code="context_length_exceeded")
        async with render_lock:
            try:
                prompt: Prompt = await asyncio.to_thread(backend.render, messages, tools, thinking)
            except QuantkitError as e:  # the template refused these messages (e.g. roles out of order)
                raise ApiError(400, str(e), param="messages") from None
            except Exception as e:  # noqa: BLE001 - jinja's errors are the user's messages, not a server fault
                raise ApiError(400, f"the chat template rejects these messages ({e})", param="messages") from None
        return prompt, req, tools

    async def _start(request: Request, prompt: Prompt, req: ChatCompletionRequest,
                     tools: list[dict[str, Any]] | None):
        ctx, p = backend.max_context, len(prompt.ids)
        asked = req.max_completion_tokens or req.max_tokens
        max_tokens = asked if asked is not None else max(ctx - p, 0)
        if asked is None and config.default_max_tokens is not None:
            max_tokens = min(max_tokens, config.default_max_tokens)
        if p + max(max_tokens, 1) > ctx:
            raise ApiError(400, f"This model's maximum context length is {ctx} tokens. However, you requested "
                                f"{p + max_tokens} tokens ({p} in the messages, {max_tokens} in the completion). "
                                f"Please reduce the length of the messages or completion.",
                           param="messages", code="context_length_exceeded")
        params = backend.sampling(max_new_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                                  top_k=None if req.top_k is None else max(req.top_k, 0), seed=req.seed,
                                  ignore_eos=req.ignore_eos)
        job = Job(prompt=prompt, params=params, loop=asyncio.get_running_loop())
        try:
            state["queue"].submit(job)
        except QueueFull as e:
            raise ApiError(429, f"server busy: {e}", "rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(config.retry_after_s)}) from None
        except QueueClosed as e:
            raise ApiError(503, str(e), "service_unavailable", code="shutting_down") from None
        answer = _Answer(job, OutputParser(stops=req.stop_list, tools=tools))
        rid, now = "chatcmpl-" + uuid.uuid4().hex, int(time.time())
        watcher = asyncio.create_task(_watch_disconnect(request, job))
        if req.stream:
            return StreamingResponse(_stream(answer, watcher, rid, now, backend.model_id),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            return await _complete(answer, rid, now, backend.model_id)
        finally:
            job.stop()
            watcher.cancel()

    return app


async def _watch_disconnect(request: Request, job: Job) -> None:
    """Cancel the job when the client goes away (the body is read, so the next message is the disconnect)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            job.stop("cancelled")
            job.events.put_nowait(None)  # wake the consumer
            return


async def _complete(answer: _Answer, rid: str, created: int, model: str) -> JSONResponse:
    reasoning, content, calls = [], [], []
    while True:
        ev = await answer.job.events.get()
        if ev is None:  # the client went away
            return JSONResponse({}, status_code=499)
        if isinstance(ev, Failed):
            raise ApiError(500, ev.message, "server_error")
        if isinstance(ev, Done) and ev.finish_reason == "cancelled":
            raise ApiError(503, "generation was cancelled: the server is shutting down", "service_unavailable")
        d = answer.end(ev) if isinstance(ev, Done) else answer.token(ev)
        reasoning.append(d.reasoning)
        content.append(d.content)
        calls.extend(d.tool_calls)
        if isinstance(ev, Done):
            break
    text = "".join(content)
    msg = AssistantOut(content=(text if text.strip() or not calls else None),
                       reasoning_content="".join(reasoning) or None,
                       tool_calls=[ToolCallOut(id=c.id, function=FunctionOut(name=c.name, arguments=c.arguments))
                                   for c in calls] or None)
    out = ChatCompletion(id=rid, created=created, model=model,
                         choices=[Choice(message=msg, finish_reason=answer.finish or "stop")],
                         usage=answer.usage(), timings=_timings(answer.done, answer.tokens))
    body = out.model_dump()
    if not calls:
        del body["choices"][0]["message"]["tool_calls"]
    return JSONResponse(body)


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _stream(answer: _Answer, watcher: asyncio.Task, rid: str, created: int, model: str) -> AsyncIterator[str]:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
        return _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                     "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]})

    n_calls = 0

    def deltas(d: OutputDelta) -> list[str]:
        nonlocal n_calls
        out = []
        if d.reasoning:
            out.append(chunk({"reasoning_content": d.reasoning}))
        if d.content:
            out.append(chunk({"content": d.content}))
        for c in d.tool_calls:
            out.append(chunk({"tool_calls": [c.to_openai(index=n_calls)]}))
            n_calls += 1
        return out

    job = answer.job
    try:
        yield chunk({"role": "assistant", "content": ""})
        while True:
            ev = await job.events.get()
            if ev is None:
                return
            if isinstance(ev, Done) and ev.finish_reason == "cancelled":
                ev = Failed("generation was cancelled: the server is shutting down")
            if isinstance(ev, Failed):
                yield _sse({"error": ErrorInfo(message=ev.message, type="server_error").model_dump()})
                yield "data: [DONE]\n\n"
                return
            if isinstance(ev, Done):
                for s in deltas(answer.end(ev)):
                    yield s
                yield chunk({}, answer.finish)
                yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                            "choices": [], "usage": answer.usage().model_dump(),
                            "timings": _timings(ev, answer.tokens).model_dump()})
                yield "data: [DONE]\n\n"
                return
            for s in deltas(answer.token(ev)):
                yield s
    finally:
        job.stop()
        watcher.cancel()
