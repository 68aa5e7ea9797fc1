"""The server's `Backend` on quantkit's runtime: the model's own tokenizer and chat template, its generation.

`load_backend(path)` loads the quantized checkpoint once (quantkit.runtime.load_model, onto the plan's
placement) and adapts it; `max_context` is the model's context length unless capped.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from quantkit.errors import QuantkitError
from quantkit.server.backend import Prompt, SamplingParams, TokenEvent


class IncrementalDetokenizer:
    """Text deltas from a growing list of token ids. Decoding each token alone breaks multi-byte characters
    and byte-level merges, so this decodes a short window and holds back a trailing replacement character
    until the bytes that complete it arrive (the approach of vLLM's and TGI's detokenizers)."""

    def __init__(self, tokenizer: Any):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        before = self.tok.decode(self.ids[self.prefix:self.read], skip_special_tokens=True)
        now = self.tok.decode(self.ids[self.prefix:], skip_special_tokens=True)
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return now[len(before):]
        return ""

    def flush(self) -> str:
        """What is still held back (an incomplete character at the very end) when generation stops."""
        before = self.tok.decode(self.ids[self.prefix:self.read], skip_special_tokens=True)
        now = self.tok.decode(self.ids[self.prefix:], skip_special_tokens=True)
        self.prefix = self.read = len(self.ids)
        return now[len(before):]


class RuntimeBackend:
    """A loaded runtime behind the server's Backend protocol."""

    def __init__(self, runtime: Any, model_id: str, max_context: int | None = None):
        self.runtime = runtime
        self.tokenizer = runtime.tokenizer
        self.model_id = model_id
        ctx = int(runtime.max_context)
        self.max_context = min(ctx, max_context) if max_context else ctx

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               enable_thinking: bool) -> Prompt:
        text = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                  tokenize=False, enable_thinking=enable_thinking)
        return Prompt(text, list(self.tokenizer.encode(text, add_special_tokens=False)))

    def generate(self, prompt: Prompt, params: SamplingParams, cancel: threading.Event) -> Iterator[TokenEvent]:
        detok = IncrementalDetokenizer(self.tokenizer)
        for token_id in self.runtime.generate_ids(prompt.ids, params, cancel):
            yield TokenEvent(token_id, detok.add(token_id))
        rest = detok.flush()
        if rest:  # generation ended inside a multi-byte character
            yield TokenEvent(-1, rest)


def load_backend(path: str | Path, plan: str | Path | None = None, model_id: str | None = None,
                 max_context: int | None = None) -> RuntimeBackend:
    """Load the checkpoint at `path` once, for serving."""
    p = Path(path)
    if not p.is_dir():
        raise QuantkitError(f"{p}: not a folder; pass a checkpoint folder made by `quantkit quantize`")
    from quantkit.runtime import load_model

    runtime = load_model(p, plan=plan)
    return RuntimeBackend(runtime, model_id or p.resolve().name, max_context)
