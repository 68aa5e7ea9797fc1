"""Speculative decoding with the model's own MTP layer: the rule that keeps a draft (`picker`), the MTP layer's cache
over a prompt (`mtp_prefill`) and the counts a response reports (`DraftStats`). The loop that drafts and verifies
is the batch engine's (runtime/batch.py, runtime/batch_drafts.py), a generation alone being its one-row case.

The MTP layer (runtime/model/qwen3_5_moe.py) drafts k tokens; the main model verifies the current token and the k
drafts in one forward that computes exactly what k + 1 one-token steps would (bit for bit) and keeps its Gated
DeltaNet states at every position; the longest prefix of drafts the target accepts is kept, plus the target's own
next token, and the cache is rewound to it (`HybridCache.rewind`, no recompute). Acceptance: each row's token is the
target's own, picked as without drafts (its argmax, or drawn from its sampling distribution with the same random
draws, one per token kept), and a draft is kept when it equals that token. The drafts are the MTP's argmax (a
one-hot draft distribution), for which this is the standard speculative-sampling rule (keep draft d with
probability p(d), else a token from p with d removed and renormalised), and the tokens are those of decoding without
drafts, greedy or seeded (llama.cpp's speculative loop accepts the same way). Logits processors
(`SamplingParams.hook`) see every row in order, as without drafts. How many drafts: `--mtp N`, or by default as many
as the measured step costs say pay (`DraftPlan`; none where drafting does not).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from quantkit.runtime.model.cache import HybridCache

MAX_DRAFT = 3


@dataclass
class DraftStats:
    draft: int  # drafts per verify asked for (auto: the count in use at the end)
    drafted: int = 0
    accepted: int = 0
    auto: bool = False  # the count was left to quantkit (`DraftPlan`, runtime/batch_drafts.py)

    def to_dict(self) -> dict[str, int | bool]:
        out: dict[str, int | bool] = {"draft": self.draft, "drafted": self.drafted, "accepted": self.accepted}
        return {**out, "auto": True} if self.auto else out


Pick = Callable[[torch.Tensor, int | None], tuple[int, Any, bool]]  # (logits row, draft) -> (token, info, kept)


def mtp_prefill(model: Any, mtp_cache: HybridCache, tokens: list[int], hidden: torch.Tensor, chunk: int) -> None:
    """The MTP layer's KV over a prompt: pairs (tokens[i + 1], hidden[i]) in chunks."""
    for a in range(0, len(tokens) - 1, chunk):
        b = min(a + chunk, len(tokens) - 1)
        model.mtp.forward(model, tokens[a + 1:b + 1], hidden[a:b], mtp_cache)


def picker(sampling: Any, gen: torch.Generator | None, sample: Callable[..., int]) -> Pick:
    """The token for a row of logits, through the sampling hook, and whether it keeps the row's draft (module
    docstring's rule: the token decoding without drafts would pick there, and the draft kept where they agree)."""
    hook = sampling.hook

    def pick(logits: torch.Tensor, draft: int | None) -> tuple[int, Any, bool]:
        tok = sample(logits if hook is None else hook.process(logits), sampling, gen)
        return tok, (None if hook is None else hook.accept(tok)), draft is not None and tok == draft

    return pick
