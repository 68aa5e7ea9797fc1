"""The model's multi-token-prediction (MTP) layer, as the drafter of speculative decoding: `MTP`.

Given the main model's final-normed hidden state h_p at position p and the token x_(p+1), the layer predicts
x_(p+2): the embedding of x_(p+1) and h_p, each through its own RMSNorm, are concatenated and projected back to
the hidden size (`fc`), pass through one gated full-attention decoder layer with its own experts and KV cache,
then the MTP's final norm and the shared lm_head, over part of the vocabulary (model/draft_head.py). Drafting k tokens chains it on its own output hidden state.
Its KV holds one entry per (token, hidden) pair it has seen; RoPE is relative, so pair i sits at position i.
Drafts only decide how many tokens a verify accepts, never which tokens come out (runtime/speculative.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from quantkit.runtime import cpu_kernel
from quantkit.runtime.kernels import Kernel
from quantkit.runtime.model.cache import HybridCache
from quantkit.runtime.model.draft_head import DRAFT_ROWS, DraftHead
from quantkit.runtime.model.layers import Layer, rms
from quantkit.runtime.model.spec import ModelConfig


@dataclass
class MTP:
    cfg: ModelConfig  # a one-layer (full attention) config: the MTP cache's shape
    fc: Kernel  # [H, 2H]
    emb_scale: torch.Tensor  # pre_fc_norm_embedding's (1 + w), fp32
    hid_scale: torch.Tensor  # pre_fc_norm_hidden's
    final: torch.Tensor  # mtp.norm's
    layer: Layer  # index 0 of its own cache
    draft_rows: int = DRAFT_ROWS  # ids the draft head scores from the bottom of the vocabulary (0: all)
    _head: DraftHead | None = field(default=None, init=False, repr=False)

    def new_cache(self, capacity: int) -> HybridCache:
        return HybridCache(self.cfg, [self.layer.device], torch.bfloat16, capacity)

    def forward(self, model: Any, tokens: list[int], hidden: torch.Tensor, cache: HybridCache
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [V] of the token after the last pair, the MTP's normed hidden [1, H] to chain on) for the
        pairs (tokens[i], hidden[i]) appended to its cache; `model` lends the embedding, rotary and head."""
        t = len(tokens)
        cache.reserve(cache.n + t)
        eps = self.cfg.rms_eps
        e = rms(model._embed(tokens).to(self.layer.device), self.emb_scale, eps)
        h = rms(hidden.to(self.layer.device, torch.bfloat16), self.hid_scale, eps)
        x = self.fc(torch.cat([e, h], dim=-1))
        cos, sin = model._rope_rows(torch.arange(cache.n, cache.n + t), x.dtype)
        ops = cpu_kernel.module() if model.route.kind in ("stack", "fused") else None
        # a few pairs (the accepted drafts of a verify) row by row on the one-token ops, as a verify runs them: the
        # T-token path's grouped experts cost more than the rows' own fused calls; only the last row's output is
        # drafted from, so the rows before it just write their K/V
        x = self.layer(x, cache, cos, sin, ops, keep=1 < t <= 4, last_only=True)
        cache.n += t
        out = rms(x[-1:].to(model.head_device), self.final, eps)
        return self.head(model)(out), out

    def head(self, model: Any) -> DraftHead:
        """The draft's head on the model's lm_head, `draft_rows` of it (made again when that changes)."""
        if self._head is None or self._head.head is not model.head or self._head.asked != self.draft_rows:
            self._head = DraftHead(model.head, self.draft_rows)
        return self._head

    def nbytes(self) -> int:
        kernels = [self.fc, self.layer.mixer.q, self.layer.mixer.k, self.layer.mixer.v, self.layer.mixer.o]
        m = self.layer.moe
        kernels += [m.shared_gate, m.shared_up, m.shared_down, m.shared_sigmoid]
        return sum(k.nbytes for k in kernels) + m.experts.nbytes + m.router_w.numel() * m.router_w.element_size()
