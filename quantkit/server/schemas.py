"""OpenAI-shaped request and response models for /v1/chat/completions, /v1/completions and /v1/models.

Requests are validated strictly (a string is not an integer, as in OpenAI's API; no NaN or Infinity);
unknown fields are accepted, since clients send many optional ones (`user`, `store`, ...). Every field that
changes the answer is declared here and either applied or refused by name (quantkit/server/options.py).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


# --- request ---------------------------------------------------------------------------------------------

class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ContentPart(_Strict):
    """Any content part; only text parts are served (checked in the app for a clear message)."""
    type: str


Content = str | list[TextPart | ContentPart] | None


class FunctionCall(_Strict):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class SystemMessage(_Strict):
    role: Literal["system", "developer"]
    content: Content
    name: str | None = None


class UserMessage(_Strict):
    role: Literal["user"]
    content: Content
    name: str | None = None


class AssistantMessage(_Strict):
    role: Literal["assistant"]
    content: Content = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    name: str | None = None


class ToolMessage(_Strict):
    role: Literal["tool"]
    content: Content
    tool_call_id: str | None = None


Message = Annotated[SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")]


class FunctionDef(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class StreamOptions(_Strict):
    include_usage: bool | None = None


class _Generation(_Strict):
    """The fields /v1/chat/completions and /v1/completions share (sampling, penalties, stops, choices)."""
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: no top-k
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 63)  # int64, as OpenAI's
    stop: str | list[str] | None = None
    n: int | None = Field(None, ge=1)
    response_format: dict[str, Any] | None = None
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens whatever the model says

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        """A streamed answer ends with a usage-only chunk only when asked (OpenAI's stream_options)."""
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Generation):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ToolDef] | None = None
    tool_choice: str | dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(_Generation):
    """/v1/completions: raw text (or token ids) continued without the chat template."""
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)  # the number of top tokens per position (OpenAI: <= 5)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)


# --- responses -------------------------------------------------------------------------------------------

class FunctionOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionOut


class AssistantOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobOut(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprobOut] | None
    refusal: None = None


class Choice(BaseModel):
    index: int = 0
    message: AssistantOut
    finish_reason: str
    logprobs: ChoiceLogprobs | None = None


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: parallel lists, `top_logprobs` as {token: logprob} per position."""
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens restored from the prompt cache, not prefilled


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    completion_tokens_details: CompletionTokensDetails
    prompt_tokens_details: PromptTokensDetails


class Timings(BaseModel):
    """llama-server's `timings` names; times in ms. prompt: start of generation -> first token;
    predicted: first -> last token (so predicted_per_second counts the tokens after the first)."""
    queue_ms: float
    cache_n: int  # prompt tokens taken from the prompt cache (prompt_n counts the ones prefilled)
    prompt_n: int
    prompt_ms: float
    prompt_per_second: float | None
    predicted_n: int
    predicted_ms: float
    predicted_per_second: float | None
    draft_n: int | None = None  # tokens the MTP layer drafted (speculative decoding; None when off)
    draft_n_accepted: int | None = None  # of them, those the model accepted


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    timings: Timings | None = None
    system_fingerprint: str | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    timings: Timings | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "quantkit"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
