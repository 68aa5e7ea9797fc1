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
from quantkit.runtime import load_model
from quantkit.runtime.generate import SamplingParams, TokenEvent
from quantkit.server.backend import Prompt
from quantkit.server.grammar import Grammars
from quantkit.server.logits import TokenPieces


class RuntimeBackend:
    """A loaded `quantkit.runtime.Runtime` behind the server's Backend protocol: its token events, whose
    channels (thinking / answer, split by token id in quantkit.runtime.channels) the server passes on."""

    def __init__(self, runtime: Any, model_id: str, max_context: int | None = None):
        self.runtime = runtime
        self.tokenizer = runtime.tokenizer
        self.model_id = model_id
        ctx = int(runtime.context)
        self.max_context = min(ctx, max_context) if max_context else ctx
        # the most bytes one token covers (byte-level BPE: one character per byte): bounds a prompt's length
        # from its text before tokenizing it
        self.max_token_bytes = max((len(t) for t in self.tokenizer.get_vocab()), default=1)
        self._pieces: Any = None

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               enable_thinking: bool) -> Prompt:
        text, ids = self.runtime.render_ids(messages, tools, enable_thinking)
        return Prompt(text, ids)

    def sampling(self, **overrides: Any) -> SamplingParams:
        return self.runtime.sampling(**overrides)

    def generate(self, prompt: Prompt, params: SamplingParams, cancel: threading.Event) -> Iterator[TokenEvent]:
        yield from self.runtime.generate_ids(prompt.ids, params, thinking=prompt.opens_reasoning, cancel=cancel)

    def cache_summary(self) -> dict[str, Any] | None:
        return self.runtime.prompt_cache.summary()

    def flush_prompt_cache(self) -> None:
        """Write the snapshots the disk prompt cache still holds back (the server's shutdown, once its worker
        is gone: prefills cut short keep what they computed)."""
        self.runtime.prompt_cache.flush()

    # --- /v1/completions, logprobs, constrained decoding -------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def encode(self, text: str) -> Prompt:
        """A raw prompt (no chat template), its control tokens' text read as those tokens, as vLLM and
        llama-server do for /v1/completions (the caller writes the whole prompt)."""
        return Prompt(text, list(self.tokenizer.encode(text, add_special_tokens=False)))

    def decode_prompt(self, ids: list[int]) -> Prompt:
        return Prompt(self.tokenizer.decode(ids, skip_special_tokens=False), ids)

    def token_piece(self, token: int) -> tuple[str, list[int]]:
        if self._pieces is None:
            self._pieces = TokenPieces(self.tokenizer)
        return self._pieces(token)

    def grammars(self) -> Any:
        """The grammar engine on this tokenizer (quantkit/server/grammar.py; built on first use: it walks
        the whole vocabulary)."""
        return Grammars(self.tokenizer, sorted(self.runtime.stop_ids), self.runtime.think_ids[1])


def load_backend(path: str | Path, plan: str | Path | None = None, model_id: str | None = None,
                 max_context: int | None = None, prompt_cache_bytes: int | None = None,
                 prompt_cache_dir: Path | None = None, prompt_cache_disk_bytes: int | None = None,
                 warn: Any = None, slots: int = 1, progress: Any = None, prefill: str = "tokens") -> RuntimeBackend:
    """Load the checkpoint at `path` once, for serving, with a prompt cache of `prompt_cache_bytes` (0: off,
    None: the runtime's default from free memory), kept on disk in `prompt_cache_dir` too (None: memory only;
    quantkit.runtime.prompt_disk) up to `prompt_cache_disk_bytes`. Without `max_context`, the context is the
    longest at which `slots` conversations fit (load_model's default); `progress(text)` hears the load's steps;
    `prefill`: how prompts are prefilled (`Runtime.set_prefill`)."""
    p = Path(path)
    if not p.is_dir():
        raise QuantkitError(f"{p}: not a folder; pass a checkpoint folder made by `quantkit quantize`")

    runtime = load_model(p, plan=plan, context=max_context, slots=slots, progress=progress)
    runtime.set_prefill(prefill)
    runtime.set_prompt_cache(prompt_cache_bytes, prompt_cache_dir, prompt_cache_disk_bytes, warn)
    return RuntimeBackend(runtime, model_id or p.resolve().name, max_context)
