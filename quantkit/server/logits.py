"""Per-request logits processing: OpenAI's penalties, `min_p`, `logit_bias`, a grammar mask, and logprobs.

`LogitsHook` is the runtime's `SamplingParams.hook` (quantkit.runtime.generate): `process(logits)` runs
before each sampling step and returns the logits to sample from; `accept(token)` runs after it and returns
the token's `TokenLogprob` (None when logprobs were not asked for), which rides on the token's event.

The arithmetic is vLLM's (and OpenAI's documented one):
- presence / frequency penalty over the tokens generated so far: `l -= presence * (count > 0) + frequency * count`;
- repetition penalty (HF / vLLM / llama.cpp) over the prompt and the generated tokens: a positive logit is
  divided by it, a negative one multiplied (a factor below `MIN_REPETITION` acts as that one: float32 would
  round it to 0 and divide by zero, and at that factor every seen token with a positive logit already
  outranks every other);
- the penalised logits stay finite (at most `MAX_LOGIT`, so that the runtime's division by a temperature of
  at least MIN_TEMPERATURE (quantkit/server/options.py) stays within float32): whatever the values, sampling
  never meets inf or NaN;
- logit_bias added to the named token ids;
- a grammar (quantkit/server/grammar.py) sets the logits of tokens it does not allow to -inf;
- min_p drops tokens whose probability at the request's temperature is below `min_p` times the largest;
- logprobs are those of the model's own distribution (log-softmax of the raw logits, vLLM's default), so a
  penalty or a grammar changes which token is drawn, not what the model thought of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from quantkit.runtime import cpu_kernel

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat top_logprobs
MIN_REPETITION = 1e-20  # a smaller repetition penalty acts as this one (see the module docstring)
MAX_LOGIT = 1e33  # float32's largest is 3.4e38: a logit this large divided by a temperature of 1e-5 still fits


class Constraint(Protocol):
    def mask(self, logits: torch.Tensor) -> None:
        """Set the logits of tokens the grammar does not allow next to -inf (in place)."""

    def accept(self, token: int) -> None:
        """Advance the grammar past `token`."""


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]]  # the `top_logprobs` most likely tokens of the model's distribution


@dataclass
class Penalties:
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    min_p: float = 0.0
    logit_bias: dict[int, float] | None = None

    @property
    def neutral(self) -> bool:
        return (self.presence == 0 and self.frequency == 0 and self.repetition == 1 and self.min_p == 0
                and not self.logit_bias)


class LogitsHook:
    """One generation's processing (stateful: it counts what was generated). See the module docstring."""

    def __init__(self, prompt_ids: list[int], *, penalties: Penalties | None = None, temperature: float = 1.0,
                 top_logprobs: int | None = None, constraint: Constraint | None = None):
        self.prompt_ids = prompt_ids
        self.p = penalties or Penalties()
        self.temperature = temperature
        self.top_logprobs = top_logprobs  # None: no logprobs
        self.constraint = constraint
        self._counts: torch.Tensor | None = None  # [V] tokens generated so far
        self._seen: torch.Tensor | None = None  # [V] in the prompt or generated (repetition penalty)
        self._raw: torch.Tensor | None = None  # the last logits processed, for their logprobs
        self._lse = torch.zeros(())  # their logsumexp

    def _state(self, v: int, device: torch.device) -> None:
        if self._counts is None:  # kept on the logits' device: no per-token copies
            self._counts = torch.zeros(v, dtype=torch.float32, device=device)
            self._seen = torch.zeros(v, dtype=torch.bool, device=device)
            ids = torch.tensor([t for t in self.prompt_ids if 0 <= t < v], dtype=torch.long, device=device)
            self._seen[ids] = True

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        raw = logits.flatten()
        if self.top_logprobs is not None:  # the raw distribution: raw - logsumexp(raw), taken at `accept` where asked
            self._raw, self._lse = raw, cpu_kernel.logsumexp(raw)
        p = self.p
        if p.neutral and self.constraint is None:
            return raw  # nothing to change: sampling reads the logits as they are (it never writes them)
        x = raw.to(torch.float32, copy=True)
        if p.presence or p.frequency or p.repetition != 1:
            self._state(x.numel(), x.device)
            assert self._counts is not None and self._seen is not None
            if p.repetition != 1:
                r = max(p.repetition, MIN_REPETITION)
                s = x[self._seen]
                x[self._seen] = torch.where(s > 0, s / r, s * r)
            if p.presence or p.frequency:
                x -= p.presence * (self._counts > 0).float() + p.frequency * self._counts
            # +inf (an overflow) is the largest logit allowed, NaN (-inf times 0) a token never drawn
            torch.nan_to_num_(x, nan=float("-inf"), posinf=MAX_LOGIT).clamp_(max=MAX_LOGIT)
        if p.logit_bias:
            for t, b in p.logit_bias.items():
                if 0 <= t < x.numel():
                    x[t] += b
        if self.constraint is not None:
            self.constraint.mask(x)
        if p.min_p > 0 and self.temperature > 0:
            top = float(x.max())
            if math.isfinite(top):
                x[x < top + self.temperature * math.log(p.min_p)] = float("-inf")
        return x

    def accept(self, token: int) -> TokenLogprob | None:
        if self._counts is not None and self._seen is not None and 0 <= token < self._counts.numel():
            self._counts[token] += 1
            self._seen[token] = True
        if self.constraint is not None:
            self.constraint.accept(token)
        if self.top_logprobs is None or self._raw is None:
            return None
        raw, lse = self._raw, float(self._lse)
        top: list[tuple[int, float]] = []
        if self.top_logprobs > 0:
            v, i = torch.topk(raw, min(self.top_logprobs, raw.numel()))
            top = [(int(a), float(b) - lse) for a, b in zip(i.tolist(), v.tolist(), strict=True)]
        return TokenLogprob(token, float(raw[token]) - lse, top)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, reversed: the character a token string uses -> the byte it stands for."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


class TokenPieces:
    """A token's text and bytes as OpenAI's logprobs report them: the bytes the token stands for (byte-level
    BPE: part of a UTF-8 character for some), the text decoded from them (U+FFFD for a partial character)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.decoder = _byte_decoder()
        self.cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token: int) -> tuple[str, list[int]]:
        hit = self.cache.get(token)
        if hit is None:
            s = self.tokenizer.convert_ids_to_tokens(token)
            if s is None:
                s = ""
            if all(c in self.decoder for c in s):
                b = bytes(self.decoder[c] for c in s)
            else:  # an added token (<|im_end|>, <tool_call>): its text
                b = s.encode()
            hit = self.cache[token] = (b.decode("utf-8", errors="replace"), list(b))
        return hit
