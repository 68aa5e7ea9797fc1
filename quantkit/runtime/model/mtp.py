"""The model's multi-token-prediction (MTP) layer, as the drafter of speculative decoding: `MTP`.

Given the main model's final-normed hidden state h_p at position p and the token x_(p+1), the layer predicts
x_(p+2): the embedding of x_(p+1) and h_p, each through its own RMSNorm, are concatenated and projected back to
the hidden size (`fc`), pass through one gated full-attention decoder layer with its own experts and KV cache,
then the MTP's final norm and the shared lm_head, over part of the vocabulary (model/draft_head.py). Drafting k
tokens chains it on its own output hidden state. Its KV holds one entry per (token, hidden) pair it has seen;
RoPE is relative, so pair i sits at position i. Where the model decodes on the kernel's stack route, a draft of
up to 4 pairs is one call of the kernel (`Layers.draft`, csrc/qk_layers.cpp), the same calls the Python path below
makes with the kernel's ops, so the same logits bit for bit.
Drafts only decide how many tokens a verify accepts, never which tokens come out (runtime/speculative.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from quantkit.checkpoint.draft import DRAFT_ROWS
from quantkit.runtime import cpu_kernel
from quantkit.runtime.kernels import Kernel, Projections, QKernel
from quantkit.runtime.model.cache import HybridCache
from quantkit.runtime.model.config import ModelConfig
from quantkit.runtime.model.draft_head import DraftHead
from quantkit.runtime.model.executors import layer_stackable, stack_of
from quantkit.runtime.model.layers import Layer, rms

STACK_PAIRS = 4  # a draft of up to this many pairs runs in the kernel's one call (the row-by-row path's bound)


@dataclass
class MTP:
    cfg: ModelConfig  # a one-layer (full attention) config: the MTP cache's shape
    fc: Kernel  # [H, 2H]
    emb_scale: torch.Tensor  # pre_fc_norm_embedding's (1 + w), fp32
    hid_scale: torch.Tensor  # pre_fc_norm_hidden's
    final: torch.Tensor  # mtp.norm's
    layer: Layer  # index 0 of its own cache
    draft_rows: int = DRAFT_ROWS  # ids the draft head scores from the bottom of the vocabulary (0: all)
    compact: QKernel | None = None  # an int4 copy of the head's DRAFT_ROWS rows (draft_head.compact_copy)
    use_stack: bool = True  # the kernel's one-call draft where it applies (False: the Python path, for tests)
    _head: DraftHead | None = field(default=None, init=False, repr=False)
    _stack: Any = field(default=None, init=False, repr=False)
    _stack_key: tuple[int, int, int] | None = field(default=None, init=False, repr=False)
    _layer_stacks: bool | None = field(default=None, init=False, repr=False)

    def new_cache(self, capacity: int) -> HybridCache:
        return HybridCache(self.cfg, [self.layer.device], torch.bfloat16, capacity)

    def forward(self, model: Any, tokens: list[int], hidden: torch.Tensor, cache: HybridCache
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [V] of the token after the last pair, the MTP's normed hidden [1, H] to chain on) for the
        pairs (tokens[i], hidden[i]) appended to its cache (hidden [>= T, H]: its first T rows pair with the T
        tokens); `model` lends the embedding, rotary and head."""
        outs, h, head = self._run(model, tokens, hidden, cache)
        return (head.logits(outs) if isinstance(outs, list) else outs), h

    def draft(self, model: Any, tokens: list[int], hidden: torch.Tensor, cache: HybridCache
              ) -> tuple[int, torch.Tensor]:
        """`forward`'s greedy draft: (the argmax of its logits, the hidden to chain on), without spreading the
        draft head's outputs over the whole vocabulary first (on the stack route, with no torch op at all)."""
        t, head = len(tokens), self.head(model)
        if (t <= STACK_PAIRS and model.route.kind == "stack" and self._stackable(model, head)
                and model.stack_embedding() is not None and hidden.dtype == torch.bfloat16 and hidden.is_contiguous()):
            cache.reserve(cache.n + t)
            cos, sin, row = model._rope_span(cache.n, t)
            i, h = self._bound_stack(cache, model).draft_argmax(tokens, hidden, cos, sin, row, cache.n, head.table)
            cache.n += t
            return head.vocab_id(i), h
        outs, h, head = self._run(model, tokens, hidden, cache)
        return (head.argmax(outs) if isinstance(outs, list) else cpu_kernel.argmax(outs)), h

    def _run(self, model: Any, tokens: list[int], hidden: torch.Tensor, cache: HybridCache
             ) -> tuple[list[torch.Tensor] | torch.Tensor, torch.Tensor, DraftHead]:
        """`forward` up to the head: (the kernel's head outputs on `head.table` as a list, or the logits [V]), the
        hidden, the head."""
        t = len(tokens)
        hidden = hidden[:t] if hidden.shape[0] > t else hidden
        cache.reserve(cache.n + t)
        eps = self.cfg.rms_eps
        ops = model.ops
        e = model._embed(tokens).to(self.layer.device)
        head = self.head(model)
        if ops is not None and t <= STACK_PAIRS and self._stackable(model, head):
            cos, sin, row = model._rope_span(cache.n, t)
            out = self._bound_stack(cache, model).draft(e.contiguous(), hidden.to(torch.bfloat16).contiguous(), cos,
                                                        sin, row, cache.n, head.table)
            cache.n += t
            return list(out[1:]), out[0], head
        norm = (lambda x, w: ops.rms(x.contiguous(), w, eps)) if ops is not None else (lambda x, w: rms(x, w, eps))
        h = hidden.to(self.layer.device, torch.bfloat16)
        x = self.fc(torch.cat([norm(e, self.emb_scale), norm(h, self.hid_scale)], dim=-1))
        cos, sin = model._rope_rows(torch.arange(cache.n, cache.n + t), x.dtype)
        # a few pairs (the accepted drafts of a verify) row by row on the one-token ops, as a verify runs them: the
        # T-token path's grouped experts cost more than the rows' own fused calls; only the last row's output is
        # drafted from, so the rows before it just write their K/V
        x = self.layer(x, cache, cos, sin, ops, keep=1 < t <= STACK_PAIRS, last_only=True)
        cache.n += t
        out = norm(x[-1:].to(model.head_device), self.final)
        return head(out), out, head

    def _stackable(self, model: Any, head: DraftHead) -> bool:
        """Whether the kernel's one-call draft applies: the stack route, this layer and fc on the kernel, the
        draft's head a kernel table."""
        if self._layer_stacks is None:
            self._layer_stacks = Projections([self.fc]).fused and layer_stackable(self.layer)
        return self.use_stack and model.route.kind == "stack" and head.table is not None and self._layer_stacks

    def _bound_stack(self, cache: HybridCache, model: Any) -> Any:
        """The kernel's one-layer `Layers` on this cache's K/V and `model`'s embedding (made again when the cache
        or its buffers change)."""
        key = (cache.serial, cache.version, id(model.embed))
        if self._stack_key != key:
            self._fc_table = Projections([self.fc]).table  # kept alive beside the stack that reads it
            self._stack = stack_of([self.layer], cache)
            self._stack.set_draft(self.emb_scale, self.hid_scale, self.final, self.cfg.rms_eps, self._fc_table)
            if model.stack_embedding() is not None:
                self._stack.set_embed(model.embed)
            self._stack_key = key
        return self._stack

    def head(self, model: Any) -> DraftHead:
        """The draft's head on the model's lm_head, `draft_rows` of it (made again when that changes)."""
        if self._head is None or self._head.head is not model.head or self._head.asked != self.draft_rows:
            self._head = DraftHead(model.head, self.draft_rows, self.compact if self.draft_rows == DRAFT_ROWS else None)
        return self._head

    def nbytes(self) -> int:
        kernels = [self.fc, self.layer.mixer.q, self.layer.mixer.k, self.layer.mixer.v, self.layer.mixer.o]
        m = self.layer.moe
        kernels += [m.shared_gate, m.shared_up, m.shared_down, m.shared_sigmoid]
        copy = self.compact.nbytes if self.compact is not None else 0
        return (sum(k.nbytes for k in kernels) + m.experts.nbytes + m.router_w.numel() * m.router_w.element_size()
                + copy)
