"""`Model`: quantkit's Qwen3.5-MoE language model, one forward for T tokens over a `HybridCache`.

`forward(ids, cache)` embeds the T tokens, runs every layer (model/layers.py) at positions cache.n ..
cache.n + T - 1, advances cache.n and returns the logits of the last token (or of every token, for a
multi-token verify). T = 1 is a decode step, through the `Route` chosen at load (model/route.py): on a CPU with
quantkit's kernel, normally the whole stack in one call; a verify of 2-4 tokens on that route is one call too. The loader (runtime/loader.py) builds the model
from a checkpoint onto the plan's devices; the weights are the loader's `Kernel`s and `QuantExperts`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from quantkit.runtime import cpu_kernel
from quantkit.runtime.devices import HeapGuard
from quantkit.runtime.kernels import Kernel
from quantkit.runtime.model import batch_step
from quantkit.runtime.model import route as routes
from quantkit.runtime.model.cache import HybridCache
from quantkit.runtime.model.config import ModelConfig
from quantkit.runtime.model.executors import GraphExecutor, StackExecutor, executor_for, stackable
from quantkit.runtime.model.layers import Layer, rms

ROPE_BLOCK = 256  # positions per table of rotary cos / sin for one-token steps
EMBED_ROWS = 4096  # dequantized embedding rows kept (16 MiB at hidden 2048 in bf16)
STACK_VERIFY_ROWS = 4  # a verify of up to this many tokens runs in the kernel's stack (its tiles take 4 rows)


@dataclass
class Model:
    cfg: ModelConfig
    embed: Any  # a bf16 [V, H] tensor, or a QuantEmbedding (rows dequantized on demand)
    layers: list[Layer]
    final: torch.Tensor  # the final norm's (1 + w), fp32
    head: Kernel
    dtype: torch.dtype = torch.bfloat16
    route: routes.Route = field(init=False)
    _rows: dict[int, torch.Tensor] = field(default_factory=dict, init=False)  # kept embedding rows, oldest first
    _rope: dict[Any, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, init=False)
    # the route's executor for one-token steps and short verifies (model/executors.py; None: the layers)
    executor: StackExecutor | GraphExecutor | None = field(default=None, init=False)
    mtp: Any = field(default=None, init=False)  # the checkpoint's MTP layer (model/mtp.py), where it has one
    # the CPU kernel's fused one-token ops the layers call, bound with the route (None: torch ops)
    ops: Any = field(default=None, init=False)

    def __post_init__(self) -> None:
        t = self.cfg.text
        rot = self.cfg.rotary_dims
        self.inv_freq = 1.0 / (self.cfg.rope_theta ** (torch.arange(0, rot, 2, dtype=torch.float) / rot))
        self.head_device = self.head.device
        self.eps = self.cfg.rms_eps
        self.heap = HeapGuard()  # a prefill's temporaries given back between its layers
        self.route = routes.choose(self, "torch")
        self.vocab = t.vocab_size
        # a quantized embedding on the CPU: its one-token rows are kept (`_embed`)
        self.keep_rows = not isinstance(self.embed, torch.Tensor) and all(
            p.device.type == "cpu" for p in self.embed.parts.values())

    # ---- facts ----
    @property
    def dtype_is_bf16(self) -> bool:
        return self.dtype == torch.bfloat16

    @property
    def layer_devices(self) -> list[torch.device]:
        return [L.device for L in self.layers]

    def set_route(self, forced: str | None = None, notes: list[str] | None = None,
                  source: str = "route") -> routes.Route:
        """Choose the one-token route (see model/route.py): `forced` (RuntimeOptions.route, named by
        `source` in a refusal's note) or the best."""
        self.route = routes.choose(self, forced, notes, source)
        self.ops = cpu_kernel.module() if self.route.kind in ("stack", "fused") else None
        self.executor = executor_for(self)
        if self.route.kind == "cuda-graph":
            self.inv_freq = self.inv_freq.to(self.layers[0].device)  # the rotary rows are made inside the graph
        return self.route

    def new_cache(self, capacity: int = 0) -> HybridCache:
        return HybridCache(self.cfg, self.layer_devices, self.dtype, capacity)

    # ---- the forward ----
    def forward(self, ids: list[int] | torch.Tensor, cache: HybridCache, *, all_logits: bool = False,
                keep_positions: bool = False, hidden: bool = False) -> Any:
        """Logits [V] of the last of the T tokens `ids` (all_logits: [T, V]), cache advanced by T.
        keep_positions: a speculative verify (T one-token steps' logits bit for bit, the Gated DeltaNet states
        after every position kept for `cache.rewind`). hidden: (logits, the final norm's output [T, H] of every
        token), what the MTP layer drafts from. CPU work runs with denormals flushed (`denormals_flushed`)."""
        with cpu_kernel.denormals_flushed():
            return self._forward(ids, cache, all_logits, keep_positions, hidden)

    def _forward(self, ids: list[int] | torch.Tensor, cache: HybridCache, all_logits: bool, keep_positions: bool,
                 hidden: bool) -> Any:
        t = len(ids) if isinstance(ids, list) else int(ids.numel())
        if t == 0:
            raise ValueError("forward of no tokens")
        cache.reserve(cache.n + t)
        cache.drop_trail()
        ex = self.executor
        if ex is not None and t == 1 and not keep_positions and not hidden:
            logits = ex.step(ids, cache)
            if logits is not None:
                return logits
        if ex is not None and keep_positions and 1 < t <= STACK_VERIFY_ROWS:
            out = ex.verify(ids, cache)
            if out is not None:
                logits = out[0] if all_logits else out[0][-1]
                return (logits, out[1]) if hidden else logits
        cache.pos = None
        x = self._embed(ids)
        ops = self.ops
        cos, sin = self._rope_rows(torch.arange(cache.n, cache.n + t), x.dtype)
        for L in self.layers:
            x = L(x, cache, cos, sin, ops, keep_positions)
            if t > STACK_VERIFY_ROWS:
                self.heap.check()
        cache.n += t
        x = x.to(self.head_device)
        if not all_logits and not hidden:
            x = x[-1:]
        f = ops if ops is not None and x.device.type == "cpu" and x.dtype == torch.bfloat16 else None
        if f is not None and (x.shape[0] == 1 or keep_positions):  # row by row, as one-token steps
            x = torch.cat([f.rms(x[j:j + 1], self.final, self.eps) for j in range(x.shape[0])])
        else:
            x = rms(x, self.final, self.eps)
        logits = self.head(x if all_logits else x[-1:])
        logits = logits if all_logits else logits.view(-1)
        return (logits, x) if hidden else logits

    def step_batch(self, ids: list[int], caches: list[HybridCache]) -> torch.Tensor:
        """Logits [B, V]: token ids[j] stepped on caches[j] for every row j, each at its own position; row j
        bit for bit `forward([ids[j]], caches[j])`, the dense matrices and the chosen experts read once for the
        rows (model/batch_step.py says which ops run per row and why)."""
        return batch_step.step_batch(self, ids, caches)

    def static_step(self, token: torch.Tensor, cache: HybridCache) -> torch.Tensor:
        """Logits [V] of one token given as a device tensor [1] at the device-side position cache.pos: the same
        shapes at every position and no host read (what `CudaGraphStep` captures). cache.n is the caller's."""
        assert cache.pos is not None
        x = self._embed(token)
        cos, sin = self._rope_rows(cache.pos, x.dtype)
        for L in self.layers:
            x = L(x, cache, cos, sin, None)
        return self.head(rms(x.to(self.head_device), self.final, self.eps)).view(-1)

    def _embed(self, ids: list[int] | torch.Tensor) -> torch.Tensor:
        """[T, H] rows. A quantized table on the CPU dequantizes a row in a dozen small ops, so the rows of steps
        and verifies are kept once made (up to EMBED_ROWS, least recently used out)."""
        if isinstance(self.embed, torch.Tensor):
            idx = torch.as_tensor(ids, dtype=torch.long, device=self.embed.device).view(-1)
            return F.embedding(idx, self.embed)
        if isinstance(ids, list) and len(ids) <= STACK_VERIFY_ROWS and self.keep_rows:  # a step, a verify
            return torch.cat([self._embed_row(tok) for tok in ids]) if len(ids) > 1 else self._embed_row(ids[0])
        return self.embed(torch.as_tensor(ids, dtype=torch.long).view(-1))

    def _embed_row(self, tok: int) -> torch.Tensor:
        row = self._rows.pop(tok, None)
        if row is None:
            row = self.embed(torch.tensor([tok], dtype=torch.long))
            if len(self._rows) >= EMBED_ROWS:
                self._rows.pop(next(iter(self._rows)))
        self._rows[tok] = row
        return row

    def _rope_rows(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [len(pos), rot]: the text rotary (its three position axes are equal for text, so the
        interleaved recomposition is the identity)."""
        freqs = pos.to(self.inv_freq.device).float().view(-1, 1) * self.inv_freq
        cos, sin = freqs.cos(), freqs.sin()
        return torch.cat([cos, cos], dim=-1).to(dtype), torch.cat([sin, sin], dim=-1).to(dtype)

    def _rope_table(self, n: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """cos, sin [ROPE_BLOCK, rot] for the block of positions holding n, and n's row in them."""
        block, row = divmod(n, ROPE_BLOCK)
        if block not in self._rope:
            pos = torch.arange(block * ROPE_BLOCK, (block + 1) * ROPE_BLOCK)
            self._rope = {block: self._rope_rows(pos, self.dtype)}  # one block at a time: positions only grow
        cos, sin = self._rope[block]
        return cos, sin, row

    def _rope_span(self, n: int, t: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(cos, sin, row): tables whose rows row .. row + t - 1 are the rotary of positions n .. n + t - 1, as
        one-token steps read them (`_rope_table`'s block where the span fits in it, else `_rope_steps`)."""
        cos, sin, row = self._rope_table(n)
        if row + t <= cos.shape[0]:
            return cos, sin, row
        return (*self._rope_steps(n, t), 0)

    def _rope_steps(self, n: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [t, rot] for positions n .. n + t - 1, the rows of `_rope_table` one-token steps read (so
        the same rotary as t steps)."""
        rows = [self._rope_table(p) for p in range(n, n + t)]
        return torch.stack([c[r] for c, _s, r in rows]), torch.stack([s[r] for _c, s, r in rows])

    # ---- the one-call stack ----
    def stackable(self) -> bool:
        """Whether every layer, the final norm and the head can run in the kernel's one-call stack."""
        return stackable(self)

    def stack_embedding(self) -> torch.Tensor | None:
        """The embedding table the kernel's stack reads token rows from itself (a contiguous bf16 table on the
        CPU), or None (the rows are made here, `_embed`)."""
        e = self.embed
        ok = isinstance(e, torch.Tensor) and e.dtype == torch.bfloat16 and e.device.type == "cpu" and e.is_contiguous()
        return e if ok else None

