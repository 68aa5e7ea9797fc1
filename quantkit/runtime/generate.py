"""A generation's parts: prefill (restoring a cached prefix, quantkit.runtime.state_cache), sampling, and what a
generation yields: a `TokenEvent` per generated token and a last event carrying the `GenerationResponse` (text,
thinking, token counts, prompt and generation tok/s, peak memory per device, finish reason). Prompt tok/s = prompt
tokens / prefill seconds; generation tok/s = tokens after the first / seconds of the decode steps that produced
them (the first token comes from the prefill's logits, as mlx-lm and llama.cpp count it).

The loop is the batch engine's (runtime/batch.py, `BatchGenerator`); `Runtime.generate_ids` is its one-row case.
Prefill and decode are one forward (quantkit.runtime.model): the prompt in chunks, then one token (or a verify of
drafts) per step, over one `HybridCache` sized for the prompt and the tokens the generation may reach.

Channels ("thinking" and "answer") are decided by token id in quantkit.runtime.channels, the one place
a generation is split; the tags themselves are not part of either text.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import torch

from quantkit.errors import ArgumentTypeError
from quantkit.planner.budget import DEFAULT_PREFILL_CHUNK
from quantkit.runtime import args, batch_prompts, cpu_kernel
from quantkit.runtime.model.cache import HybridCache
from quantkit.runtime.model.qwen3_5_moe import Model, Segment
from quantkit.runtime.speculative import DraftStats
from quantkit.runtime.state_cache import PrefixCache

PREFILL_CHUNK = DEFAULT_PREFILL_CHUNK  # the chunk the planner sizes the activation buffers for

# prefilled tokens after which the heap's freed temporaries are returned (a trim costs milliseconds)
TRIM_AFTER_PREFILL = 256
TOPK_CHUNK = 1024  # elements per chunk whose max bounds top_values' search
EXP_RANGE = 87.0  # e^-87 is about fp32's smallest normal (1.2e-38)


@dataclass
class SamplingParams:
    """temperature 0 means greedy. Defaults are the model card's evaluation settings."""

    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int = 20
    seed: int | None = None
    max_new_tokens: int = 512
    ignore_eos: bool = False  # keep going past end-of-turn tokens (vLLM's extension; for benchmarks and tests)
    # per-request logits processing (the server's penalties, grammar mask, logprobs: quantkit/server/logits.py):
    # `hook.process(logits) -> logits` before each sampling, `hook.accept(token) -> info` after it; the info
    # rides on that token's TokenEvent
    hook: Any = None

    def validate(self) -> None:
        """Every field's type and range, in one line naming it (quantkit/runtime/args.py)."""
        args.sampling_fields(self, (f.name for f in fields(self)))


def sampling_with(base: SamplingParams, overrides: Mapping[str, Any], name: str = "sampling") -> SamplingParams:
    """`base` (a SamplingParams) with `overrides` (field -> value; None keeps the field), checked: the one way
    the Python API's `sampling=` and `**sampling_kw` become the sampling a generation runs with."""
    args.instance(base, name, SamplingParams, "a SamplingParams", optional=False)
    known = [f.name for f in fields(SamplingParams)]
    for k in overrides:
        if k not in known:
            raise ArgumentTypeError(f"unknown sampling option {k!r}: give {', '.join(known)}")
    changes = {k: v for k, v in overrides.items() if v is not None}
    sp = replace(base, **changes) if changes else base
    sp.validate()
    return sp


@dataclass
class GenerationResponse:
    text: str  # the answer (thinking excluded)
    thinking: str
    token: int | None  # the last token generated
    prompt_tokens: int
    generation_tokens: int
    prompt_tps: float
    generation_tps: float
    peak_memory: dict[str, int] = field(default_factory=dict)  # device -> bytes
    finish_reason: str = "stop"  # stop | length | context | cancelled
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    token_ids: list[int] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens restored from a snapshot instead of prefilled
    mtp: dict[str, int] | None = None  # speculative decoding: {"draft", "drafted", "accepted"} (None: off)

    @property
    def prefilled_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("token_ids")
        d["prompt_tps"] = round(self.prompt_tps, 2)
        d["generation_tps"] = round(self.generation_tps, 2)
        return d


@dataclass
class TokenEvent:
    """One streamed token. `text` is the new printable text (may be empty while a multi-byte character
    is incomplete). The final event has `token` None and `response` set."""

    text: str
    token: int | None
    channel: str  # "thinking" | "answer"
    index: int
    response: GenerationResponse | None = None
    cached_tokens: int = 0  # prompt tokens this generation restored from the prompt cache
    info: Any = None  # what SamplingParams.hook.accept returned for this token (e.g. its logprobs)
    drafts: DraftStats | None = None  # speculative decoding's counts so far (the generation's live object)


def candidates(logits: torch.Tensor, p: SamplingParams) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The tokens `sample` may draw and their probabilities: (ids or None for all of [V], probs).
    Top-p never sorts the vocabulary: after top-k only those k tokens (and ties with the k-th) remain;
    without top-k, the largest probabilities are taken 64, 512, ... at a time until they hold more than
    top_p (then no token outside them can be in the nucleus): a sort of a 248k vocabulary per token would
    cost more than the rest of sampling. Without top-k, a token more than EXP_RANGE below the largest scaled
    logit has probability 0: e^-EXP_RANGE is below fp32's smallest normal, so nothing it adds moves a sum of at
    least 1, and torch's softmax takes a scalar route for each such element (reports/one-engine/sampling.md)."""
    logits = logits.float()
    ids = None
    if p.top_k and p.top_k < logits.numel():
        kth = top_values(logits, p.top_k)[-1]
        ids = (logits >= kth).nonzero().squeeze(1)  # ties with the k-th stay, as a mask would keep them
        logits = logits[ids]
    logits = logits / p.temperature
    if ids is None:
        low, high = torch.aminmax(logits)
        if bool(low < high - EXP_RANGE):
            logits = logits.masked_fill(logits < high - EXP_RANGE, float("-inf"))
    if p.top_p < 1.0:
        probs = torch.softmax(logits, dim=-1)  # the mass top-p is measured in
        k = 64
        while ids is None and k < probs.numel():
            top = top_values(probs, k)
            if float(top.sum()) > p.top_p:  # (a probability of 0 is never in the nucleus)
                ids = (probs >= top[-1] if top[-1] > 0 else probs > 0).nonzero().squeeze(1)
                logits, probs = logits[ids], probs[ids]
            k *= 8
        sorted_l, order = torch.sort(logits, descending=True, stable=True)  # ties: lower id first
        sp = probs[order]
        drop = sp.cumsum(-1) - sp > p.top_p  # keep the smallest prefix whose mass reaches top_p
        logits = torch.full_like(logits, float("-inf")).scatter(0, order, sorted_l.masked_fill(drop, float("-inf")))
    return ids, torch.softmax(logits, dim=-1)


def top_values(x: torch.Tensor, k: int) -> torch.Tensor:
    """torch.topk(x, k).values of a 1-D x (the k largest, largest first), by topk on fewer elements: each of the k
    largest is at least the k-th largest of the maxima of TOPK_CHUNK-element chunks. Why: torch.topk reads a 248k
    vocabulary several times over (reports/one-engine/sampling.md). torch.topk over all of x where there are fewer
    than k chunks, or a NaN."""
    n, c = x.numel(), TOPK_CHUNK
    if k > n // c:
        return torch.topk(x, k).values
    m = x[: n - n % c].view(-1, c).amax(1)
    if n % c:
        m = torch.cat([m, x[n - n % c:].amax().view(1)])
    if bool(m.isnan().any()):  # torch.topk ranks a NaN first; no bound by comparison keeps it
        return torch.topk(x, k).values
    return torch.topk(x[x >= torch.topk(m, k).values[-1]], k).values


def sample(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    """One token from [V] logits: greedy at temperature 0, else top-k, then top-p, then temperature."""
    if p.temperature == 0:
        return cpu_kernel.argmax(logits)
    ids, probs = candidates(logits, p)
    j = draw(probs, gen)
    return int(ids[j]) if ids is not None else j


def draw(probs: torch.Tensor, gen: torch.Generator | None) -> int:
    """An index i of [N] probabilities, drawn with chance probs[i] / probs.sum() (torch.multinomial(probs, 1)'s
    distribution), by the inverse CDF: one uniform draw below the float64 running sum's total, and the first index
    whose running sum passes it, so an index of probability 0 is never drawn. Why not torch.multinomial: it reads
    a 248k vocabulary many times over (reports/one-engine/sampling.md). A total that is not finite and positive
    (NaN or inf probabilities, all zero) raises ValueError, as torch.multinomial refuses such a tensor."""
    c = probs.detach().to("cpu", torch.float64).cumsum(-1)
    total = float(c[-1])
    if not 0 < total < float("inf"):
        raise ValueError(f"sampling: the probabilities sum to {total}")
    u = torch.rand(1, generator=gen, dtype=torch.float64) * total
    i = min(int(torch.searchsorted(c, u, right=True)), c.numel() - 1)
    return i if c[i] > (c[i - 1] if i else 0) else int(torch.nonzero(probs).max())  # u rounded up to the total


def peak_memory(devices: list[str]) -> dict[str, int]:
    """Peak bytes per device: CPU = the process's peak RSS; CUDA = torch's peak allocation."""
    out: dict[str, int] = {}
    for d in dict.fromkeys(devices):
        dev = torch.device(d)
        if dev.type == "cuda":
            out[str(dev)] = int(torch.cuda.max_memory_allocated(dev))
        elif dev.type == "cpu":
            import resource
            import sys

            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            out["cpu"] = int(rss if sys.platform == "darwin" else rss * 1024)
    return out


@dataclass
class Prefill:
    cache: HybridCache
    logits: torch.Tensor | None  # None when cancelled before the last chunk
    cached_tokens: int
    hidden: torch.Tensor | None = None  # with `hidden`: the final norm's output at every prefilled position


def prefill(model: Model, prompt_ids: list[int], *, capacity: int = 0, prefix_cache: PrefixCache | None = None,
            boundary_ids: frozenset[int] = frozenset(), cancel: Any = None, hidden: bool = False) -> Prefill:
    """One prompt alone in the T-token arithmetic, as the batch prefills it (runtime/batch_prompts.py): the
    longest cached prefix of `prompt_ids` restored (the same prompt prefilled before: whole, with its last logits
    and, with `hidden`, its last hidden row), the rest chunk by chunk on the boundary-aligned plan, snapshots at the
    last boundaries passed. `capacity`: the positions the cache is made for (at least the prompt). A set `cancel`
    stops between chunks; the snapshots already passed are kept. `hidden`: keep the final norm's output of every
    prefilled token (what the MTP layer drafts from)."""
    store = prefix_cache if prefix_cache is not None else PrefixCache(0)
    cache, feed, same = batch_prompts.start(model, list(prompt_ids), capacity, store, boundary_ids, hidden,
                                            PREFILL_CHUNK)
    if feed is None:
        assert same is not None and same.logits is not None
        return Prefill(cache, same.logits.clone(), len(prompt_ids), same.hidden.clone() if hidden else None)
    logits = None
    while feed.left and not (cancel is not None and cancel.is_set()):
        ids = feed.chunk(PREFILL_CHUNK)
        out = model.forward_batch([Segment(cache, ids, "prompt")], hidden=hidden)[0]
        feed.fed(len(ids), cache, out.hidden)
        logits = out.logits[-1]
    if feed.left or logits is None:
        batch_prompts.abandon(feed, cache, store)
        return Prefill(cache, None, feed.cached, torch.cat(feed.rows) if feed.rows else None)
    return Prefill(cache, logits, feed.cached, batch_prompts.finish(feed, cache, store, logits))
