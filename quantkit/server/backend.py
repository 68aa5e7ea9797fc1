"""What the server needs from a model: a prompt from chat messages, and tokens as they are generated.

`Backend` is the small protocol the HTTP layer and the queue are written against; `RuntimeBackend`
(quantkit/server/runtime_backend.py) implements it on quantkit's quantized runtime. One backend serves
one request at a time (the queue's worker thread is its only caller).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float | None = None  # None: the model's generation_config default
    top_p: float | None = None
    top_k: int | None = None  # 0: off
    seed: int | None = None
    ignore_eos: bool = False  # keep going past end-of-turn tokens (vLLM's extension; for benchmarks and tests)


@dataclass(frozen=True)
class Prompt:
    text: str
    ids: list[int]

    @property
    def opens_reasoning(self) -> bool:
        """The template ended the prompt inside a think block (thinking on): output starts as reasoning."""
        return self.text.rstrip("\n").endswith("<think>")


@dataclass(frozen=True)
class TokenEvent:
    token_id: int  # -1: no new token, only text held back until the end (an incomplete character)
    text: str  # the text this token adds to the output (may be "" while a multi-byte character is split)
    cached_tokens: int = 0  # prompt tokens restored from the backend's prompt cache instead of prefilled


class Backend(Protocol):
    model_id: str
    max_context: int

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               enable_thinking: bool) -> Prompt:
        """The model's chat template applied (with the generation prompt) and tokenized."""
        ...

    def generate(self, prompt: Prompt, params: SamplingParams, cancel: threading.Event) -> Iterator[TokenEvent]:
        """Generated tokens, ending at an end-of-turn token, after `params.max_tokens`, or soon after
        `cancel` is set. End-of-turn tokens are not yielded."""
        ...

    def cache_summary(self) -> dict[str, Any] | None:
        """The prompt cache's size, entries and hit rate for /health (None: the backend has none)."""
        ...
