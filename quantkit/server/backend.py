"""What the server needs from a model: a prompt from chat messages, and tokens as they are generated.

The generation vocabulary is the runtime's (quantkit.runtime.generate): `SamplingParams` (max_new_tokens,
temperature, top_p, top_k, seed, ignore_eos) and `TokenEvent` (text, token, channel, cached_tokens, and the
closing event's response), so there is one definition of each.

`Backend` is the small protocol the HTTP layer and the scheduler are written against; `RuntimeBackend`
(quantkit/server/runtime_backend.py) implements it on quantkit's quantized runtime, whose batch loop the
scheduler's worker thread runs (its only caller).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from quantkit.runtime.generate import SamplingParams, TokenEvent


@dataclass(frozen=True)
class Prompt:
    text: str
    ids: list[int]

    @property
    def opens_reasoning(self) -> bool:
        """The template ended the prompt inside a think block (thinking on): output starts as reasoning."""
        return self.text.rstrip("\n").endswith("<think>")


class Backend(Protocol):
    model_id: str
    max_context: int
    runtime: Any  # quantkit.runtime.Runtime: the scheduler's batch loop runs on it

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               enable_thinking: bool) -> Prompt:
        """The model's chat template applied (with the generation prompt) and tokenized."""
        ...

    def sampling(self, **overrides: Any) -> SamplingParams:
        """The model's sampling defaults (generation_config.json), then `overrides` (None = keep the default)."""
        ...

    def generate(self, prompt: Prompt, params: SamplingParams, cancel: threading.Event) -> Iterator[TokenEvent]:
        """One request alone, outside the scheduler (a bench's count, the tests' reference): the runtime's token
        events, one per generated token, ending at an end-of-turn token (not yielded unless `params.ignore_eos`),
        after `params.max_new_tokens`, or soon after `cancel` is set; a last event with `token` None carries the
        runtime's GenerationResponse."""
        ...

    def cache_summary(self) -> dict[str, Any] | None:
        """The prompt cache's size, entries and hit rate for /health (None: the backend has none)."""
        ...

    # Optional (the app checks with getattr; RuntimeBackend has them all):
    # vocab_size: int; encode(text) -> Prompt and decode_prompt(ids) -> Prompt for /v1/completions;
    # token_piece(id) -> (text, bytes) for logprobs; grammars() -> quantkit.server.grammar.Grammars;
    # flush_prompt_cache() at shutdown (the disk prompt cache's pending entries).
