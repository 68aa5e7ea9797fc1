"""`Runtime`: a loaded model with its tokenizer and chat template, generating token streams."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from quantkit.errors import ArgumentError, QuantkitError
from quantkit.fileio import read_json_bounded
from quantkit.runtime import args
from quantkit.runtime.batch import BatchGenerator
from quantkit.runtime.batch_drafts import DraftPlan
from quantkit.runtime.devices import available_bytes
from quantkit.runtime.generate import (
    GenerationResponse,
    SamplingParams,
    TokenEvent,
    sampling_with,
)
from quantkit.runtime.options import PREFILL_KINDS
from quantkit.runtime.prompt_disk import default_warn, open_store
from quantkit.runtime.safe_prompt import render_ids
from quantkit.runtime.speculative import MAX_DRAFT
from quantkit.runtime.state_cache import PrefixCache

AUTO_CACHE_FRACTION = 4  # the default prompt cache takes 1/4 of the free memory of the states' device

if TYPE_CHECKING:
    from quantkit.planner.placement import Plan
    from quantkit.recipe import Recipe
    from quantkit.runtime.loader import LoadReport, Placement
    from quantkit.runtime.model.qwen3_5_moe import Model


def load_tokenizer(folder: Path) -> Any:
    """The model's own tokenizer, from local files only, never with remote code."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise QuantkitError(f"{folder}: cannot load the tokenizer ({str(e).splitlines()[0]})") from None
    if not getattr(tok, "chat_template", None):
        raise QuantkitError(f"{folder}: the tokenizer has no chat template (tokenizer_config.json chat_template)")
    return tok


def stop_token_ids(folder: Path, config: dict[str, Any], tok: Any) -> set[int]:
    """eos ids from generation_config.json and config.json, plus <|im_end|> and <|endoftext|>."""
    ids: set[int] = set()

    def add(v: Any) -> None:
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, list):
            ids.update(x for x in v if isinstance(x, int))

    gc = folder / "generation_config.json"
    if gc.is_file():
        try:
            add(read_json_bounded(gc, "generation config").get("eos_token_id"))
        except (QuantkitError, AttributeError):
            pass
    add(config.get("text_config", config).get("eos_token_id"))
    for t in ("<|im_end|>", "<|endoftext|>"):
        i = tok.convert_tokens_to_ids(t)
        if isinstance(i, int) and i != tok.unk_token_id:
            ids.add(i)
    return ids


def generation_defaults(folder: Path) -> dict[str, Any]:
    """temperature, top_p and top_k from generation_config.json, each only where SamplingParams can take it (a
    value it refuses is left to SamplingParams' default rather than failing every generation)."""
    gc = folder / "generation_config.json"
    if not gc.is_file():
        return {}
    try:
        d = read_json_bounded(gc, "generation config")
    except QuantkitError:
        return {}
    if not isinstance(d, dict):
        return {}
    out: dict[str, Any] = {}
    for k in ("temperature", "top_p", "top_k"):
        if d.get(k) is not None:
            try:
                out[k] = args.sampling_field(k, d[k])
            except QuantkitError:
                pass
    return out


class Runtime:
    """A model ready to generate. Built by `quantkit.runtime.load_model`."""

    def __init__(self, model: Model, folder: Path, config: dict[str, Any], placement: Placement, report: LoadReport,
                 recipe: Recipe | None = None, plan: Plan | None = None):
        self.model = model
        self.folder = folder
        self.config = config
        self.placement = placement
        self.report = report
        self.recipe = recipe
        self.plan = plan
        self.tokenizer = load_tokenizer(folder)
        self.stop_ids = stop_token_ids(folder, config, self.tokenizer)
        self.defaults = generation_defaults(folder)
        vocab = self.tokenizer.get_vocab()
        self.think_ids = (vocab.get("<think>"), vocab.get("</think>"))
        # message boundaries: prefill is cut and snapshots are taken before each <|im_start|>
        self.boundary_ids = frozenset(i for i in (vocab.get("<|im_start|>"),) if i is not None)
        self.prompt_cache = PrefixCache(0)  # off until set_prompt_cache
        # drafts per step from the model's MTP layer (runtime/batch_drafts.py): by default as many as the measured
        # step costs say pay (`draft_plan`, kept across generations), `set_mtp(N)` fixes N
        self.mtp = 0
        # how prompts compute inside the batch's steps (`set_prefill`, runtime/batch_prompts.py): "tokens", the
        # T-token arithmetic; "rows", as one-token steps compute them
        self.prefill = "tokens"
        self.draft_plan: DraftPlan | None = DraftPlan() if model.mtp is not None else None
        self._cancel = threading.Event()
        self._lock = threading.Lock()  # the model's caches and kernels: one forward (or prefill) at a time
        self._generating = threading.Lock()  # generate calls: one after the other, as `stop` expects
        self.last: GenerationResponse | None = None
        self.last_prompt_ids: list[int] = []

    # ---- facts ----
    @property
    def context(self) -> int:
        return self.placement.context

    @property
    def devices(self) -> list[str]:
        return self.placement.devices()

    def route(self) -> dict[str, Any]:
        """The one-token route chosen at load (runtime/model/route.py): {"name", "isa": generic|avx2|avx512
        (or none), "table", "fused_ops", "one_call"}."""
        return self.model.route.describe()

    def set_mtp(self, draft: int | None) -> str | None:
        """Drafts per verify from the MTP layer (None: the default); the one line to show where the folder has
        no MTP layer to draft with (decoding goes on without it)."""
        if draft is None:
            return None
        if not 0 <= draft <= MAX_DRAFT:
            raise QuantkitError(f"--mtp {draft}: draft 0 to {MAX_DRAFT} tokens per step (0 = off)")
        self.draft_plan = None
        if draft and self.model.mtp is None:
            self.mtp = 0
            return f"--mtp {draft}: {self.folder.name} has no MTP layer; decoding without drafts"
        self.mtp = draft
        return None

    def set_prefill(self, kind: str) -> None:
        """How prompts compute, both packed into the batch's steps beside the decoding rows: "tokens" (the T-token
        arithmetic, transformers' eager path, cut where the prompt's own plan cuts it: snapshots at message
        boundaries and chunk ends) or "rows" (each token as a one-token step computes it: snapshots at any token,
        the end of every answer included, shared starts prefilled once; docs/engine.md). Set it before
        `set_prompt_cache`: the two arithmetics' snapshots are not each other's."""
        if kind not in PREFILL_KINDS:
            raise ArgumentError(f"prefill={kind!r}: give one of {', '.join(PREFILL_KINDS)}")
        if kind == self.prefill:
            return
        if self.prompt_cache.disk is not None:
            raise QuantkitError("set the prefill before the disk prompt cache: its entries are bound to one")
        self.prefill = kind
        self.prompt_cache.clear()

    def mtp_line(self) -> str:
        """Whether decoding drafts with the MTP layer, for the load line and /stats."""
        if self.model.mtp is None:
            return "MTP: none in this model"
        if self.draft_plan is not None:
            return f"MTP: {self.draft_plan.line()}"
        if not self.mtp:
            return "MTP: off (--mtp N drafts N tokens per step with the model's MTP layer)"
        return f"MTP: drafting {self.mtp} token{'s' if self.mtp != 1 else ''} per step"

    def route_line(self) -> str:
        """The route in a few words, for logs and /stats."""
        r = self.route()
        how = "one call per token" if r["one_call"] else "fused ops per layer" if r["fused_ops"] else "torch ops"
        return f"route {r['name']}: {r['table'] or 'no'} CPU kernel ({r['isa']}), {how}"

    def memory(self) -> dict[str, int]:
        """Resident weight bytes per device (what the loader placed)."""
        return dict(self.report.bytes_by_device)

    def set_prompt_cache(self, max_bytes: int | None = None, disk_dir: str | Path | None = None,
                         disk_bytes: int | None = None, warn: Callable[[str], None] | None = None) -> PrefixCache:
        """Keep snapshots of the conversation state, up to `max_bytes` (0: off; None: a quarter of the memory
        free now on the device of the first linear-attention layer, which holds the states), so that a prompt
        that extends an earlier one is prefilled only from where they part (quantkit.runtime.state_cache).
        `disk_dir`: also keep them in files there, found again after a restart (quantkit.runtime.prompt_disk),
        up to `disk_bytes` (None: a quarter of the free space there); `warn` prints its one-line warnings."""
        if max_bytes is None:
            max_bytes = available_bytes(self.state_device) // AUTO_CACHE_FRACTION
        disk = None
        if disk_dir is not None:
            disk = open_store(self, disk_dir, disk_bytes, warn or default_warn)
        self.prompt_cache = PrefixCache(max_bytes, disk=disk)
        return self.prompt_cache

    @property
    def state_device(self) -> str:
        types = self.config.get("text_config", self.config).get("layer_types") or []
        lin = [i for i, t in enumerate(types) if t == "linear_attention"]
        return self.placement.layer_device[lin[0] if lin else 0]

    # ---- prompts ----
    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
               enable_thinking: bool = True) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                                      enable_thinking=enable_thinking, tokenize=False)
        except Exception as e:  # jinja2 raises TemplateError subclasses for malformed messages
            raise QuantkitError(f"the chat template rejects these messages ({e})") from None

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def render_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                   enable_thinking: bool = True) -> tuple[str, list[int]]:
        """The prompt's text and ids, control tokens only from the template (quantkit/runtime/safe_prompt.py).
        Bad `messages` / `tools` / `enable_thinking` raise ArgumentError / ArgumentTypeError naming them."""
        messages = args.messages(messages)
        tools = args.tools(tools)
        args.flag(enable_thinking, "enable_thinking")
        return render_ids(self.tokenizer, lambda m, t: self.render(m, t, enable_thinking), messages, tools)

    def count_tokens(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                     enable_thinking: bool = True) -> int:
        return len(self.render_ids(messages, tools, enable_thinking)[1])

    # ---- generation ----
    def sampling(self, sampling: SamplingParams | None = None, **overrides: Any) -> SamplingParams:
        """The sampling a generation runs with, checked: `sampling` (None: the model's generation_config.json
        over SamplingParams' defaults), then `overrides` (None = keep)."""
        return sampling_with(SamplingParams(**self.defaults) if sampling is None else sampling, overrides)

    def generate_stream(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                        enable_thinking: bool = True, sampling: SamplingParams | None = None,
                        cancel: threading.Event | None = None, **sampling_kw: Any) -> Iterator[TokenEvent]:
        """Token events for the assistant's reply to `messages`; the last event carries the response. The
        arguments are checked here, at the call (not at the first event): see `render_ids`, `sampling`."""
        sp = self.sampling(sampling, **sampling_kw)
        args.event(cancel)
        ids = self.render_ids(messages, tools, enable_thinking)[1]
        self.last_prompt_ids = ids
        return self._generate(ids, sp, enable_thinking, cancel, None)

    def generate_ids(self, ids: list[int], sampling: SamplingParams, thinking: bool = True,
                     cancel: threading.Event | None = None,
                     stop_ids: set[int] | None = None) -> Iterator[TokenEvent]:
        """Token events for prompt `ids` already rendered (each a token id of this model's vocabulary);
        stop_ids: None = the model's end-of-turn tokens; set() = none (the server's ignore_eos). The arguments
        are checked here, at the call."""
        ids = args.token_ids(ids, self.model.vocab)
        sp = sampling_with(sampling, {})
        args.flag(thinking, "thinking")
        args.event(cancel)
        stops = args.stop_token_ids(stop_ids, self.model.vocab)
        return self._generate(ids, sp, thinking, cancel, stops)

    def _generate(self, ids: list[int], sampling: SamplingParams, thinking: bool, cancel: threading.Event | None,
                  stop_ids: set[int] | None) -> Iterator[TokenEvent]:
        """One generation: the one-row case of the batch engine (runtime/batch.py), so a request alone and in a
        server's batch run the same loop, drafts and prompt cache."""
        with self._generating:
            self._cancel.clear()
            batch = BatchGenerator(self)
            try:
                batch.add(ids=ids, sampling=sampling, stop_ids=stop_ids, cancel=_AnyEvent(self._cancel, cancel),
                          enable_thinking=thinking)
                for row, e in batch.run():
                    if e.response is not None:
                        if row in batch.errors:  # the sampling hook raised: the caller gets it, as it gave the hook
                            raise batch.errors[row]
                        self.last = e.response
                    yield e
            finally:  # a consumer that stops reading (the server at max_tokens) still gets the disk writes
                self.prompt_cache.flush()

    def generate(self, messages: list[dict[str, Any]], **kw: Any) -> GenerationResponse:
        resp = None
        for e in self.generate_stream(messages, **kw):
            resp = e.response or resp
        assert resp is not None
        return resp

    def stop(self) -> None:
        """Stop the generation in progress (it ends with finish_reason "cancelled")."""
        self._cancel.set()

    def _io_devices(self) -> list[str]:
        # the embedding's device first: input ids go there
        return [self.placement.embedding, *[d for d in self.devices if d != self.placement.embedding]]

    @torch.inference_mode()
    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """Full-sequence logits [B, T, V] in fp32, each row from a fresh cache, for evaluation."""
        rows = [self.model.forward(row.tolist(), self.model.new_cache(row.numel()), all_logits=True).float()
                for row in ids]
        return torch.stack(rows)


class _AnyEvent:
    """Set when either event is set (the runtime's stop() or the caller's own cancel)."""

    def __init__(self, *events: threading.Event | None):
        self.events = [e for e in events if e is not None]

    def is_set(self) -> bool:
        return any(e.is_set() for e in self.events)
