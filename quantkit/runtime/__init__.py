"""The quantized runtime: load a checkpoint onto a placement (experts resident), generate, chat.

Python API (what `quantkit generate`, `quantkit chat` and the server use):

    from quantkit.runtime import load_model, SamplingParams

    rt = load_model("/tmp/q4")                       # plans for the detected hardware
    rt = load_model("/tmp/q4", plan="plan.json")     # or a plan from `quantkit plan --out`
    rt = load_model("/tmp/bf16", recipe="int4")      # an unquantized checkpoint, quantized while loading

    for ev in rt.generate_stream(messages, tools=None, enable_thinking=True,
                                 temperature=0.6, top_p=0.95, top_k=20, seed=0, max_new_tokens=256):
        if ev.response is None:
            print(ev.text, end="")                   # ev.channel is "thinking" or "answer"
        else:
            resp = ev.response                       # GenerationResponse: text, thinking, token counts,
                                                     # prompt_tps, generation_tps, peak_memory, finish_reason
    rt.stop()                                        # from another thread: ends the stream ("cancelled")
    # or pass cancel=threading.Event() to generate_stream and set it

`messages` are chat-template messages ({"role": "system"|"user"|"assistant"|"tool", "content": ...},
assistant turns may carry `reasoning_content` and `tool_calls`); `tools` are OpenAI-style function
schemas, rendered by the model's own template. One generation runs at a time per Runtime (a lock);
`rt.context` is the context length the placement was planned for, `rt.memory()` the resident weight
bytes per device, `rt.report.routes` the kernel each matrix uses. Without `context=` (or a plan), the context is the
longest at which `slots=` conversations (default 1) fit here, capped at 32k (planner/fit.py default_context).

Prompt cache: `rt.set_prompt_cache(max_bytes)` (None: a quarter of the free memory where the states live; 0:
off) keeps snapshots of the hybrid cache at message boundaries, so a prompt that extends an earlier one is
prefilled only past the longest cached prefix, bit-exact with a full prefill; `resp.cached_tokens` counts the
reused tokens, `rt.prompt_cache.summary()` the cache. Raw prompts get checkpoints every prefill chunk;
`rt.set_prompt_cache(max_bytes, disk_dir, disk_bytes)` also keeps the snapshots in files bound to these weights,
restored after a restart (quantkit/runtime/prompt_disk.py, docs/prompt-cache.md).

Several conversations at once: `BatchGenerator(rt)` (quantkit/runtime/batch.py) decodes them together, one
batched forward per token for all of them (`batch.add(messages, **sampling)` prefills one and returns its row id;
`batch.step()` gives one (row id, TokenEvent) per row and each ended row's last event; a row leaves when it ends
and a new one joins between steps), every row's tokens the ones `generate_stream` gives it alone;
`batch.fork(row)` is another choice of a row's prompt, inheriting its sampling (seed + k, no hook).

Bad arguments (`options="torch"`, `context=0`, `temperature=nan`, `ids=[-1]`, a string as messages) are refused
where they enter, in one line naming them: ArgumentTypeError (a TypeError) or ArgumentError (a ValueError), both
QuantkitErrors (runtime/args.py, docs/python.md).

Modules: args (the API's argument checks), model (quantkit's own Qwen3.5-MoE: spec, hybrid cache, layers, the
forward, its one-token route), kernels (per-format matmuls and their dequantize-then-matmul reference), qexperts (QuantExperts), loader
(load_model, Placement), generate (prefill and sampling loop,
GenerationResponse, TokenEvent), state_cache (snapshots of the hybrid cache, the prefix LRU), engine
(Runtime), chat (the interactive loop), session_file (chat --session files), worlds (AgentWorld domain
system prompts).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from quantkit.runtime.batch import BatchGenerator
    from quantkit.runtime.engine import Runtime
    from quantkit.runtime.generate import GenerationResponse, SamplingParams, TokenEvent
    from quantkit.runtime.loader import Placement, load_model

__all__ = ["BatchGenerator", "GenerationResponse", "Placement", "Runtime", "SamplingParams", "TokenEvent", "load_model"]

# Imported on first use (PEP 562): commands that only need a submodule (quantize's threads, the kernels)
# do not pay for the engine, the model and the loader.
_LAZY = {"BatchGenerator": "batch", "Runtime": "engine", "GenerationResponse": "generate", "SamplingParams": "generate",
         "TokenEvent": "generate", "Placement": "loader", "load_model": "loader"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value
    return value
