"""The OpenAI-compatible HTTP app (FastAPI): /v1/chat/completions and /v1/completions (plain and SSE),
/v1/models, /health, /metrics.

`create_app(backend, config)` serves one model loaded on quantkit's runtime through a `BatchScheduler` of
`parallel` slots (the one loop: one slot is its one-row case). Every error is an OpenAI
error object (`{"error": {"message", "type", "param", "code"}}`) with its HTTP status: 400 for malformed
JSON, a missing or wrong-typed field, an unknown role, `max_tokens` < 1, `n` over the limit, a tool or
schema of the wrong shape (quantkit/server/schema_check.py), a schema the grammar engine cannot compile or a
prompt that does not fit the context (with the numbers); 404 for an unknown path; 408 for a body not
received within --body-timeout; 413 for a body over the size limit; 429 when the line of waiting requests is
full; 503 while shutting down.

Shutdown (`app.state.shutdown`, which quantkit/server/serving.py calls on SIGTERM/SIGINT before uvicorn waits
for the connections): new requests get 503, a body still being read is cut off with a 503, and every waiting and
running request ends at once (`JobLine.drain`: a 503, or a stream's error event then `[DONE]`); the lifespan's
end then waits for the worker and writes the disk prompt cache's pending entries.

Any model name is answered (as llama-server does: a client configured for `gpt-4o` works); /v1/models lists
the served name and its aliases, and the answer names the model the request asked for.

Before any route, in this order: the Host header, CORS (off unless --cors-origin), the API key and the
content type (quantkit/server/security.py: 403, 400 for a refused preflight, 401, 415). A request is
admitted (429 otherwise) before its body is read, by the queue's one bound (`JobLine.admit`: --parallel
running, --max-queue waiting): the requests being read or rendered count with those waiting, so memory per
request is bounded by the body limit and at most --max-queue + --parallel requests hold any, and a body that
trickles in is cut off after --body-timeout seconds so slow clients cannot hold the line. Its length is
bounded from the text's bytes before the tokenizer runs (no token covers more than `max_token_bytes` bytes),
and rendering/tokenizing runs one request at a time.

Every OpenAI field that changes the answer is applied: sampling, penalties, min_p, logit_bias, logprobs,
`n` (quantkit/server/options.py), `response_format` json_object / json_schema and `tool_choice` "required"
or a named function by constrained decoding (quantkit/server/grammar.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from quantkit.errors import QuantkitError
from quantkit.planner.slots import check_slots
from quantkit.server import answer as ans
from quantkit.server import security
from quantkit.server.backend import Backend, Prompt
from quantkit.server.chat_request import enable_thinking, template_messages, text_bytes, tool_choice
from quantkit.server.errors import ApiError, validation_error
from quantkit.server.grammar import GrammarError
from quantkit.server.metrics import CONTENT_TYPE, CountRequests, Metrics
from quantkit.server.options import MAX_N, GenOptions, response_format_schema, sampling_temperature
from quantkit.server.parsing import OutputParser
from quantkit.server.queue import Job, JobLine, QueueClosed, QueueFull, Ticket
from quantkit.server.scheduler import BatchScheduler
from quantkit.server.schemas import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from quantkit.server.security import allowed_host_names

__all__ = ["ApiError", "ServerConfig", "create_app", "template_messages"]

DEFAULT_MAX_BODY = 8 << 20  # 8 MiB: a full 262k-token context is about 1 MB of text
DEFAULT_BODY_TIMEOUT_S = 30.0
COMPLETIONS_MAX_TOKENS = 16  # OpenAI's (and vLLM's) default for /v1/completions


@dataclass(frozen=True)
class ServerConfig:
    max_queue: int = 8  # requests waiting behind the one being generated
    max_body_bytes: int = DEFAULT_MAX_BODY
    default_max_tokens: int | None = None  # cap when a request gives no max_tokens (None: rest of context)
    retry_after_s: int = 1
    bind_host: str = "127.0.0.1"  # the address bound: its name is an allowed Host
    allowed_hosts: tuple[str, ...] = ()  # more Host names to answer ("*": any)
    api_key: str | None = None  # when set, every endpoint but /health needs it
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S  # a request body must arrive within this
    aliases: tuple[str, ...] = ()  # more model names listed by /v1/models
    cors_origins: tuple[str, ...] = ()  # origins a browser page may call from (none: CORS off)
    max_n: int = MAX_N  # choices per request
    parallel: int = 1  # requests decoded together (quantkit/server/scheduler.py): its slots

    def __post_init__(self) -> None:
        if self.max_queue < 1:
            raise QuantkitError(f"max_queue {self.max_queue}: must be at least 1")
        if self.max_body_bytes < 1:
            raise QuantkitError(f"max_body_bytes {self.max_body_bytes}: must be at least 1")
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise QuantkitError(f"default_max_tokens {self.default_max_tokens}: must be at least 1")
        if not self.body_timeout_s > 0:
            raise QuantkitError(f"body_timeout_s {self.body_timeout_s}: must be more than 0")
        if self.max_n < 1:
            raise QuantkitError(f"max_n {self.max_n}: must be at least 1")
        check_slots(self.parallel)
        if self.api_key is not None:
            security.check_api_key(self.api_key)


@dataclass
class Place:
    """An admitted request's place in `queue` (its `Ticket`), and whether its answer now gives it back."""
    queue: JobLine
    ticket: Ticket
    handed: bool = False


_STATUS_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                 405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
                 429: "rate_limit_error", 503: "service_unavailable"}

# The longest token of a vocabulary, when a backend does not say (every byte-level BPE token of the Qwen
# vocabularies is far shorter): a prompt of more than max_context * this many bytes cannot fit.
DEFAULT_MAX_TOKEN_BYTES = 256


async def read_body(request: Request, limit: int, timeout_s: float, closing: asyncio.Event | None = None) -> bytes:
    """The body, at most `limit` bytes, all of it within `timeout_s` (413 / 408; a client that leaves
    mid-body ends the request quietly: 499, no traceback; 503 once `closing` is set: the server is stopping)."""
    too_big = ApiError(413, f"request body is larger than the server's limit of {limit} bytes "
                            f"(start the server with a larger --max-body to allow it)", code="body_too_large")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_big

    async def read() -> bytes:
        chunks, n = [], 0
        async for chunk in request.stream():
            n += len(chunk)
            if n > limit:
                raise too_big
            chunks.append(chunk)
        return b"".join(chunks)
    reading = asyncio.ensure_future(asyncio.wait_for(read(), timeout_s))
    if closing is not None:
        stop = asyncio.ensure_future(closing.wait())
        try:
            await asyncio.wait({reading, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if not reading.done():  # the server is stopping: a body still on its way is not waited for
            reading.cancel()
            with contextlib.suppress(BaseException):
                await reading
            raise shutting_down()
    try:
        return await reading
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout_s:g} s (--body-timeout)",
                       code="body_timeout") from None
    except ClientDisconnect:
        raise ApiError(499, "the client closed the connection before sending the whole body",
                       code="client_closed") from None


def shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down; retry once it is back", "service_unavailable",
                    code="shutting_down")


def _token_piece_fallback(token: int) -> tuple[str, list[int]]:
    return str(token), list(str(token).encode())


def create_app(backend: Backend, config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()
    created = int(time.time())
    state: dict[str, Any] = {}
    names = tuple(dict.fromkeys((backend.model_id, *config.aliases)))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state["closing"] = asyncio.Event()  # set by `shutdown`: bodies still being read are cut off
        # every slot count decodes on the batch loop (MTP drafts per slot inside it)
        state["queue"] = app.state.queue = BatchScheduler(backend, config.max_queue, config.parallel)
        try:
            yield
        finally:
            shutdown()
            if await asyncio.to_thread(state["queue"].close):
                # the prefills cut short keep their snapshots: written now, as after any answer (the worker is
                # gone, so nothing else writes)
                flush = getattr(backend, "flush_prompt_cache", None)
                if flush is not None:
                    await asyncio.to_thread(flush)

    def shutdown() -> None:
        """Refuse new requests and end every one being read, waiting or running, at once (the module
        docstring); on the event loop's thread."""
        if "closing" in state:
            state["closing"].set()
        q = state.get("queue")
        if q is not None:
            q.drain()

    app = FastAPI(title="quantkit", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.backend = backend
    app.state.shutdown = shutdown
    metrics = Metrics(lambda: state["queue"].stats if "queue" in state else None)
    if callable(getattr(backend, "cache_summary", None)):
        metrics.watch_disk_cache(lambda: (backend.cache_summary() or {}).get("disk"))
    app.state.metrics = metrics
    security.install(app, hosts=allowed_host_names(config.bind_host, config.allowed_hosts), api_key=config.api_key,
                     cors_origins=config.cors_origins)
    app.add_middleware(CountRequests, metrics=metrics,  # outermost: refusals are counted too
                       endpoints=("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics"))
    render_lock = asyncio.Lock()  # one request rendered and tokenized at a time
    max_token_bytes = int(getattr(backend, "max_token_bytes", DEFAULT_MAX_TOKEN_BYTES))
    vocab = int(getattr(backend, "vocab_size", 1 << 31))
    piece = getattr(backend, "token_piece", _token_piece_fallback)

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
        return {"status": status, "model": backend.model_id, "aliases": list(names[1:]),
                "max_context": backend.max_context, "queue": q.stats.as_dict() if q else None,
                "prompt_cache": summary() if summary else None}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.text(), media_type=CONTENT_TYPE)

    def card(name: str) -> ModelCard:
        return ModelCard(id=name, created=created, max_model_len=backend.max_context)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return ModelList(data=[card(n) for n in names]).model_dump()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id not in names:
            raise ApiError(404, f"the model {model_id!r} does not exist: this server lists "
                                f"{', '.join(map(repr, names))} (and answers requests for any name)",
                           "not_found_error", param="model", code="model_not_found")
        return card(model_id).model_dump()

    # --- admission, rendering, submission -------------------------------------------------------------

    @contextlib.contextmanager
    def admission():
        """The request's place (the queue's one bound, `JobLine.admit`: 429 beyond it, 503 while shutting
        down), given back when the request ends here, or handed to its answer (`Place.handed`)."""
        q = state.get("queue")
        if q is None or state["closing"].is_set():
            raise shutting_down()
        try:
            place = Place(q, q.admit())
        except QueueFull as e:
            raise ApiError(429, f"server busy: {e}", "rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(config.retry_after_s)}) from None
        except QueueClosed:
            raise shutting_down() from None
        try:
            yield place
        finally:
            if not place.handed:
                q.release(place.ticket)

    async def parse(request: Request, model: type) -> Any:
        body = await read_body(request, config.max_body_bytes, config.body_timeout_s, state["closing"])
        try:
            return model.model_validate_json(body)
        except ValidationError as e:
            raise validation_error(e) from None

    def too_long(nbytes: int, what: str) -> None:
        ctx = backend.max_context
        if nbytes > ctx * max_token_bytes:
            raise ApiError(400, f"This model's maximum context length is {ctx} tokens. However, your {what} "
                                f"hold {nbytes} bytes of text, more than {ctx} tokens can cover. Please reduce the "
                                f"length of the {what}.", param=what, code="context_length_exceeded")

    async def rendered(fn, *args: Any) -> Any:
        async with render_lock:
            return await asyncio.to_thread(fn, *args)

    async def grammar_for(schema_or_tools: Any, kind: str, name: str | None = None) -> str:
        def build() -> str:
            g = state.get("grammars")
            if g is None:
                make = getattr(backend, "grammars", None)
                if make is None:
                    raise GrammarError("this backend has no tokenizer for constrained decoding")
                g = state["grammars"] = make()
            return g.json(schema_or_tools) if kind == "json" else g.tool_calls(schema_or_tools, name or None)
        try:
            return await rendered(build)
        except GrammarError as e:
            raise ApiError(400, str(e), param="response_format" if kind == "json" else "tools",
                           code="invalid_grammar") from None

    def max_tokens_for(p: int, asked: int | None, default: int | None) -> int:
        ctx = backend.max_context
        max_tokens = asked if asked is not None else max(ctx - p, 0)
        if asked is None and default is not None:
            max_tokens = min(max_tokens, default)
        if p + max(max_tokens, 1) > ctx:
            raise ApiError(400, f"This model's maximum context length is {ctx} tokens. However, you requested "
                                f"{p + max_tokens} tokens ({p} in the messages, {max_tokens} in the completion). "
                                f"Please reduce the length of the messages or completion.",
                           param="messages", code="context_length_exceeded")
        return max_tokens

    def submit_jobs(queue: Any, jobs: list[Job]) -> None:
        try:
            queue.submit_group(jobs)
        except QueueFull as e:
            raise ApiError(429, f"server busy: {e}", "rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(config.retry_after_s)}) from None
        except QueueClosed:
            raise shutting_down() from None

    def on_done(a: ans.Answer) -> None:
        d = a.done
        if d is not None:
            metrics.generation(len(a.spec.prompt.ids), d.cached_tokens, a.tokens, d.queue_s + d.prompt_s, d.decode_s,
                               d.drafts)

    def specs(prompts: list[Prompt], req: Any, opts: GenOptions, max_tokens: list[int], parser_tools: Any,
              grammar: str | None, echo: bool = False) -> list[ans.ChoiceSpec]:
        out = []
        for pi, prompt in enumerate(prompts):
            base = backend.sampling(max_new_tokens=max_tokens[pi], temperature=sampling_temperature(req.temperature),
                                    top_p=req.top_p, top_k=None if req.top_k is None else max(req.top_k, 0),
                                    seed=req.seed, ignore_eos=req.ignore_eos)
            for j in range(opts.n):
                constraint = None
                if grammar is not None:
                    constraint = state["grammars"].constraint(grammar, prompt.opens_reasoning)
                params = dataclasses.replace(
                    base, seed=None if req.seed is None else req.seed + j,
                    hook=opts.hook(prompt.ids, base.temperature, constraint))
                out.append(ans.ChoiceSpec(index=pi * opts.n + j, prompt=prompt, params=params, prompt_index=pi,
                                          parser=OutputParser(stops=req.stop_list, tools=parser_tools),
                                          echo=prompt.text if echo else ""))
        return out

    async def respond(request: Request, req: Any, specs_: list[ans.ChoiceSpec], fmt: ans.Format,
                      prefix: str, want_lp: bool, place: Place):
        ticket = place.ticket
        ticket.jobs = len(specs_)  # the place is the queue's to give back once every choice has ended
        # every choice at once: those of one prompt prefilled once and decoded together
        groups = {pi: object() for pi in dict.fromkeys(sp.prompt_index for sp in specs_)}
        jobs = [Job(prompt=sp.prompt, params=sp.params, loop=asyncio.get_running_loop(), group=groups[sp.prompt_index],
                    ticket=ticket) for sp in specs_]
        queue = place.queue
        submit_jobs(queue, jobs)
        run = ans.Run(specs=specs_, jobs=jobs, fmt=fmt, rid=prefix + uuid.uuid4().hex, created=int(time.time()),
                      model=req.model, logprobs=want_lp, include_usage=req.include_usage, on_done=on_done)
        # from here the answer gives the place back when it ends (or its client leaves), whichever way
        listener = ans.Listener(request, on_end=lambda: queue.release(ticket))
        place.handed = True
        listener.job = jobs[0]
        listener.others = jobs[1:]
        if req.stream:
            return StreamingResponse(ans.stream(run, listener), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await ans.complete(run, listener)

    # --- the endpoints --------------------------------------------------------------------------------

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        with admission() as place:
            req: ChatCompletionRequest = await parse(request, ChatCompletionRequest)
            if req.top_logprobs and not req.logprobs:
                raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
            opts = GenOptions.from_request(req, vocab=vocab, max_n=config.max_n,
                                           top_logprobs=(req.top_logprobs or 0) if req.logprobs else None)
            messages = template_messages(req)
            tools, forced = tool_choice(req)
            constrained, schema = response_format_schema(req.response_format)
            if forced is not None and constrained:
                raise ApiError(400, "tool_choice forces a tool call and response_format asks for JSON: give one "
                                    "of them", param="response_format")
            thinking = enable_thinking(req)
            too_long(text_bytes(messages, tools), "messages")
            grammar = None
            if forced is not None:
                assert tools is not None
                grammar = await grammar_for(tools, "tools", forced)
            elif constrained:
                grammar = await grammar_for(schema, "json")
            try:
                prompt: Prompt = await rendered(backend.render, messages, tools, thinking)
            except QuantkitError as e:  # the template refused these messages (e.g. roles out of order)
                raise ApiError(400, str(e), param="messages") from None
            except Exception as e:  # noqa: BLE001 - jinja's errors are the user's messages, not a server fault
                raise ApiError(400, f"the chat template rejects these messages ({e})", param="messages") from None
            asked = req.max_completion_tokens or req.max_tokens
            mt = max_tokens_for(len(prompt.ids), asked, config.default_max_tokens)
            return await respond(request, req, specs([prompt], req, opts, [mt], tools, grammar),
                                 ans.ChatFormat(piece), "chatcmpl-", req.logprobs is True, place)

    @app.post("/v1/completions")
    async def completions(request: Request):
        with admission() as place:
            req: CompletionRequest = await parse(request, CompletionRequest)
            if req.suffix:
                raise ApiError(400, "suffix (fill-in-the-middle) is not supported by this model's server",
                               param="suffix")
            if req.best_of not in (None, 1, req.n or 1):
                raise ApiError(400, f"best_of {req.best_of}: only best_of equal to n is served (every choice is "
                                    "returned)", param="best_of")
            if req.echo and req.logprobs is not None:
                raise ApiError(400, "echo with logprobs needs the prompt's logprobs, which this server does not "
                                    "compute; drop one of them", param="echo")
            opts = GenOptions.from_request(req, vocab=vocab, max_n=config.max_n, top_logprobs=req.logprobs)
            constrained, schema = response_format_schema(req.response_format)
            grammar = await grammar_for(schema, "json") if constrained else None
            prompts = await completion_prompts(req)
            mts = [max_tokens_for(len(p.ids), req.max_tokens or COMPLETIONS_MAX_TOKENS, None) for p in prompts]
            return await respond(request, req, specs(prompts, req, opts, mts, None, grammar, echo=req.echo),
                                 ans.CompletionFormat(piece), "cmpl-", req.logprobs is not None, place)

    async def completion_prompts(req: CompletionRequest) -> list[Prompt]:
        raw = req.prompt
        if isinstance(raw, str) or (isinstance(raw, list) and raw and isinstance(raw[0], int)):
            raw = [raw]  # one prompt
        if not raw:
            raise ApiError(400, "prompt is empty", param="prompt")
        encode = getattr(backend, "encode", None)
        if encode is None:
            raise ApiError(404, "this backend serves chat only", param="prompt")
        out = []
        for i, p in enumerate(raw):
            where = f"prompt[{i}]" if len(raw) > 1 else "prompt"
            if isinstance(p, str):
                too_long(len(p.encode()), "prompt")
                prompt = await rendered(encode, p)
            else:
                bad = [t for t in p if not 0 <= t < vocab]
                if bad:
                    raise ApiError(400, f"{where}: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})",
                                   param="prompt")
                prompt = await rendered(backend.decode_prompt, list(p))
            if not prompt.ids:
                raise ApiError(400, f"{where} is empty", param="prompt")
            out.append(prompt)
        if len(out) * (req.n or 1) > config.max_n:
            raise ApiError(400, f"{len(out)} prompts x n {req.n or 1} = {len(out) * (req.n or 1)} choices: at most "
                                f"{config.max_n} per request", param="n")
        return out

    return app
