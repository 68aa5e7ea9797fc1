"""The `cuda-graph` route: a one-token step captured once in a `torch.cuda.CUDAGraph` and replayed per token.

The step is the model's static step (`Model.static_step`): the token and the position are device tensors the
replay refills, the attention runs over the whole KV buffer with the positions after the current one masked,
experts are gathered by routed id on the device, so every replay has the same shapes and reads nothing on the
host. It needs every layer, expert, the embedding and the head on one CUDA device (`route.possible` checks);
the graph is bound to one cache's buffers and captured again for another cache.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from quantkit.runtime.model.cache import HybridCache
    from quantkit.runtime.model.qwen3_5_moe import Model


class CudaGraphStep:
    def __init__(self, model: Model, cache: HybridCache):
        dev = model.layers[0].device
        self.model, self.cache, self.version = model, cache, cache.version  # a graph holds the buffers' addresses
        self.token = torch.zeros(1, dtype=torch.long, device=dev)
        self.pos = cache.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.graph: Any = None
        self.logits: torch.Tensor | None = None

    def _state(self) -> list[torch.Tensor]:
        c = self.cache
        return [t.clone() for i in c.conv for t in (c.conv[i], c.state[i])]

    def _restore(self, saved: list[torch.Tensor]) -> None:
        c = self.cache
        it = iter(saved)
        for i in c.conv:
            c.conv[i].copy_(next(it))
            c.state[i].copy_(next(it))

    def capture(self) -> None:
        """Warm up on a side stream (the states restored after), then capture one step."""
        saved = self._state()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            self.model.static_step(self.token, self.cache)
        torch.cuda.current_stream().wait_stream(s)
        self._restore(saved)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self.model.static_step(self.token, self.cache)
        self._restore(saved)  # capture runs no kernel, but keep the state exact

    def replay(self, token: int, n: int) -> torch.Tensor:
        """Logits [V] after `token` at position n (the states and KV updated in place)."""
        self.token.fill_(token)
        self.cache.pos = self.pos  # the tensor the graph reads (a prompt's forward in between unset it)
        self.pos.fill_(n)
        if self.graph is None:
            self.capture()
        self.graph.replay()
        assert self.logits is not None
        return self.logits


class GraphExecutor:
    """The cuda-graph route's one-token steps (model/executors.py `executor_for`): replayed from the graph
    captured for the cache in use, captured again for another cache or moved buffers. Verifies run in the
    layers."""

    def __init__(self, model: Model):
        self.model = model
        self.graph: CudaGraphStep | None = None

    def step(self, ids: list[int] | torch.Tensor, cache: HybridCache) -> torch.Tensor | None:
        g = self.graph
        if g is None or g.cache is not cache or g.version != cache.version:
            g = self.graph = CudaGraphStep(self.model, cache)
        logits = g.replay(int(ids[0]), cache.n)
        cache.n += 1
        return logits

    def verify(self, ids: list[int] | torch.Tensor, cache: HybridCache) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None
