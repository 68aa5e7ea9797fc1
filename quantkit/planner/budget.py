"""Exact memory budgets: bytes per component for a spec, a recipe and run settings. Pure arithmetic.

A kept tensor takes numel x dtype bytes; a quantized one the bytes of its format's stored parts, which each
format declares once (quantkit/formats, `Format.parts`): the quantizer writes exactly those parts, so the
budget equals the bytes on disk.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from quantkit.checkpoint.draft import copy_bytes, layer_copy_spec
from quantkit.checkpoint.spec import ModelSpec, Role, TensorSpec, TextConfig, dtype_bytes
from quantkit.errors import QuantkitError
from quantkit.formats import QuantSpec, ceil_div, stored_parts
from quantkit.recipe import Recipe

# KV cache element types: (bytes per block, elements per block). q8_0/q4_0 are llama.cpp's blocks
# (32 values + one fp16 scale); fp8 is e4m3 without scales (vLLM's fp8 KV cache).
CACHE_DTYPES: dict[str, tuple[int, int]] = {
    "fp16": (2, 1), "bf16": (2, 1), "fp8": (1, 1), "q8_0": (34, 32), "q4_0": (18, 32),
}
CACHE_ALIASES = {"f16": "fp16", "float16": "fp16", "bfloat16": "bf16", "fp8_e4m3": "fp8", "q8": "q8_0",
                 "q4": "q4_0", "int8": "q8_0", "int4": "q4_0"}

DEFAULT_PREFILL_CHUNK = 512
GB = 1e9
GIB = 1 << 30


def cache_dtype(name: str) -> str:
    n = CACHE_ALIASES.get(name.lower(), name.lower())
    if n not in CACHE_DTYPES:
        raise QuantkitError(f"unknown cache dtype {name!r}; use one of fp16, bf16, fp8, q8_0, q4_0")
    return n


@dataclass(frozen=True)
class TensorBytes:
    weight: int = 0
    scales: int = 0
    zeros: int = 0

    @property
    def total(self) -> int:
        return self.weight + self.scales + self.zeros

    def __add__(self, o: TensorBytes) -> TensorBytes:
        return TensorBytes(self.weight + o.weight, self.scales + o.scales, self.zeros + o.zeros)

    def scaled(self, num: int, den: int) -> TensorBytes:
        """A fraction num/den of this (exact when den divides every part, as for one expert of E)."""
        return TensorBytes(self.weight * num // den, self.scales * num // den, self.zeros * num // den)


def tensor_bytes(t: TensorSpec, q: QuantSpec | None, keep_dtype: str | None = None) -> TensorBytes:
    """Exact stored bytes of one tensor under a QuantSpec (None or "bf16" = kept in keep_dtype), from the
    format's own part layout (quantkit/formats: `parts`)."""
    if q is None or q.format in ("bf16", "fp16", "keep"):
        return TensorBytes(weight=t.numel * dtype_bytes(keep_dtype or t.dtype))
    if not t.is_matrix:
        raise QuantkitError(f"{t.name}: shape {t.shape} is not a matrix and cannot be quantized")
    try:
        parts = stored_parts(q, tuple(t.shape))
    except QuantkitError as e:
        raise QuantkitError(f"{t.name}: {e}") from None
    by_kind = {"weight": 0, "scales": 0, "zeros": 0}
    for p in parts.values():
        by_kind[p.kind] += p.nbytes
    return TensorBytes(**by_kind)


def bits_per_weight(t: TensorSpec, q: QuantSpec | None, keep_dtype: str | None = None) -> float:
    return tensor_bytes(t, q, keep_dtype).total * 8 / t.numel


# prompt-cache snapshots the runtime takes per prompt (quantkit.runtime.state_cache): the last two message
# boundaries and the whole prompt, which also keeps its last logits (and hidden row, with MTP) in bf16
SNAPSHOTS_PER_PROMPT = 3


@dataclass(frozen=True)
class RunSettings:
    """How the model will be run: what the caches and buffers are sized for."""

    context: int = 4096
    batch: int = 1
    cache_dtype: str = "fp16"
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    include_mtp: bool = False
    # prompt-cache snapshots kept (quantkit.runtime.state_cache): the runtime takes two per prompt (at the
    # start of the generation prompt and of the last message), so 2 = one conversation kept across turns;
    # `quantkit plan` budgets 2 by default (--prompt-snapshots), the library 0 (the live cache alone)
    prompt_cache_snapshots: int = 0

    def validate(self, c: TextConfig) -> None:
        if self.context <= 0:
            raise QuantkitError(f"context {self.context} must be a positive number of tokens")
        if self.context > c.max_position_embeddings:
            raise QuantkitError(
                f"context {self.context} exceeds the model's maximum of {c.max_position_embeddings} tokens"
            )
        if self.batch <= 0:
            raise QuantkitError(f"batch {self.batch} must be a positive integer")
        if self.prefill_chunk <= 0:
            raise QuantkitError(f"prefill chunk {self.prefill_chunk} must be a positive number of tokens")
        if self.prompt_cache_snapshots < 0:
            raise QuantkitError(f"prompt cache snapshots {self.prompt_cache_snapshots} must be >= 0 (0: off)")
        cache_dtype(self.cache_dtype)


def kv_bytes_per_token(c: TextConfig, dtype: str, layers: int = 1) -> int:
    """K and V of one token in `layers` full-attention layers (blocks run along head_dim)."""
    bb, be = CACHE_DTYPES[cache_dtype(dtype)]
    return layers * 2 * c.num_key_value_heads * ceil_div(c.head_dim, be) * bb


def linear_state_bytes(c: TextConfig) -> tuple[int, int]:
    """(recurrent, conv) state bytes of one Gated DeltaNet layer for one sequence: the recurrent state is
    fp32 [v_heads, k_dim, v_dim]; the conv state keeps `kernel` positions of the qkv channels in bf16
    (transformers' LinearAttentionLayer allocates [batch, conv_dim, kernel])."""
    rec = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
    conv_dim = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
    return rec, conv_dim * c.linear_conv_kernel_dim * 2


def snapshot_bytes(c: TextConfig, tokens: int, dtype: str = "bf16") -> int:
    """One prompt-cache snapshot (quantkit.runtime.state_cache) after `tokens` tokens: a copy of every Gated
    DeltaNet layer's recurrent + conv state (~63 MB at full size, whatever the length) plus the attention KV
    of those tokens (shared by the snapshots of one prefill, so count it once per conversation)."""
    rec, conv = linear_state_bytes(c)
    n_lin = sum(t == "linear_attention" for t in c.layer_types)
    n_full = len(c.layer_types) - n_lin
    return n_lin * (rec + conv) + kv_bytes_per_token(c, dtype, n_full) * tokens


def states_held(c: TextConfig, max_bytes: int) -> tuple[int, int]:
    """(conversation states a prompt cache of `max_bytes` holds, the bytes of one): each snapshot's own copy of
    the Gated DeltaNet states, their attention KV shared (`snapshot_bytes` at no token). (0, 0) for a model
    without recurrent layers: its snapshots are KV alone."""
    per = snapshot_bytes(c, 0)
    return (max_bytes // per, per) if per else (0, 0)


def activation_bytes_per_token(c: TextConfig) -> int:
    """Peak live bf16 activations per token inside one decoder layer: residual + normed hidden, plus the
    largest of the linear-attention projections (qkv, conv output, z, core output, gated norm), the
    attention projections (gated q, k, v, output) and the MoE (router logits in fp32, each routed
    expert's gate/up, activation and down outputs, the shared expert)."""
    h = c.hidden_size
    kd = c.linear_num_key_heads * c.linear_key_head_dim
    vd = c.linear_num_value_heads * c.linear_value_head_dim
    lin = 2 * (2 * kd + vd) + 3 * vd + 2 * c.linear_num_value_heads
    q = c.num_attention_heads * c.head_dim
    attn = q * (2 if c.attn_output_gate else 1) + 2 * c.num_key_value_heads * c.head_dim + q
    i, si = c.moe_intermediate_size, c.shared_expert_intermediate_size
    moe = 2 * c.num_experts + c.num_experts_per_tok * (3 * i + h) + 3 * si + h
    return (2 * h + max(lin, attn, moe)) * 2


@dataclass
class Budget:
    """Bytes of every component. Per-layer lists are what the placement solver moves around."""

    scheme: str
    settings: RunSettings
    weights_by_role: dict[Role, TensorBytes]
    layer_dense: list[int]  # non-expert weights of each decoder layer
    expert_bytes: list[int]  # one routed expert (gate, up, down with their scales) of each layer
    layer_cache: list[int]  # KV cache (full attention) or recurrent + conv state (linear attention)
    num_experts: int
    embedding: int
    lm_head: int
    final_norm: int
    mtp: int
    kv_cache: int
    recurrent_state: int
    conv_state: int
    activations: int
    logits: int
    kept_high_precision: int  # bytes of tensors the recipe keeps unquantized (router, norms, ...)
    layer_dense_params: list[int] = field(default_factory=list)
    expert_params: list[int] = field(default_factory=list)  # one routed expert of each layer
    lm_head_params: int = 0
    mtp_weights: int = 0
    mtp_draft_copy: int = 0  # the runtime's int4 copy of the draft's lm_head rows (quantkit/checkpoint/draft.py)
    mtp_copy_saving: int = 0  # what holding the MTP layer's dense matrices as int4 (`layer_copy_spec`) saves
    prompt_cache: int = 0  # snapshots of the conversation state (in layer_cache too, with their layers)

    @property
    def weights(self) -> int:
        return sum(tb.total for tb in self.weights_by_role.values())

    @property
    def caches(self) -> int:
        return self.kv_cache + self.recurrent_state + self.conv_state + self.prompt_cache

    @property
    def buffers(self) -> int:
        return self.activations + self.logits

    @property
    def model_total(self) -> int:
        """Weights + caches + buffers (no runtime reserve: that depends on the devices)."""
        return self.weights + self.caches + self.buffers

    def components(self) -> dict[str, int]:
        out = {f"weights.{r.value}": tb.total for r, tb in self.weights_by_role.items()}
        out.update({
            "scales_and_zeros": sum(tb.scales + tb.zeros for tb in self.weights_by_role.values()),
            "kept_high_precision": self.kept_high_precision,
            "kv_cache": self.kv_cache, "recurrent_state": self.recurrent_state, "conv_state": self.conv_state,
            "prompt_cache": self.prompt_cache,
            "activations": self.activations, "logits": self.logits,
        })
        return out


def compute_budget(spec: ModelSpec, recipe: Recipe, settings: RunSettings) -> Budget:
    c = spec.config
    settings.validate(c)
    n = c.num_hidden_layers
    by_role: dict[Role, TensorBytes] = {}
    layer_dense = [0] * n
    layer_experts = [0] * n
    dense_params = [0] * n
    expert_params = [0] * n
    head_params = 0
    embedding = lm_head = final_norm = mtp = mtp_copied = kept = 0
    for t in spec.tensors:
        if t.role == Role.VISION or (t.role == Role.MTP and not settings.include_mtp):
            continue
        q = recipe.spec_for(t)
        tb = tensor_bytes(t, q, recipe.keep_dtype)
        by_role[t.role] = by_role.get(t.role, TensorBytes()) + tb
        if q is None:
            kept += tb.total
        if t.role == Role.MTP:
            mtp += tb.total
            copy = layer_copy_spec(t.name, q.format if q is not None else "bf16", t.shape)
            if copy is not None:
                mtp_copied += tb.total - tensor_bytes(t, copy).total
        elif t.role == Role.EMBEDDING:
            embedding += tb.total
        elif t.role == Role.LM_HEAD:
            lm_head += tb.total
            head_params += t.numel
        elif t.layer is None:
            final_norm += tb.total
        elif t.role == Role.ROUTED_EXPERT:
            layer_experts[t.layer] += tb.total
            expert_params[t.layer] += t.numel
        else:
            layer_dense[t.layer] += tb.total
            dense_params[t.layer] += t.numel
    draft_copy = 0
    if mtp:
        head = next((t for t in spec.tensors if t.role == Role.LM_HEAD), None)
        q = recipe.spec_for(head) if head is not None else None
        draft_copy = copy_bytes(c.vocab_size, c.hidden_size, q.format if q is not None else "bf16")
    e = c.num_experts
    for i, b in enumerate(layer_experts):
        if b % e:
            raise QuantkitError(f"layer {i}: routed expert bytes {b} do not split evenly over {e} experts")
    base = Budget(
        scheme=recipe.name,
        settings=settings,
        weights_by_role=by_role,
        layer_dense=layer_dense,
        expert_bytes=[b // e for b in layer_experts],
        layer_cache=[],
        num_experts=e,
        embedding=embedding,
        lm_head=lm_head,
        final_norm=final_norm,
        mtp=mtp,
        kv_cache=0,
        recurrent_state=0,
        conv_state=0,
        activations=0,
        logits=0,
        kept_high_precision=kept,
        layer_dense_params=dense_params,
        expert_params=[p // e for p in expert_params],
        lm_head_params=head_params,
        mtp_weights=mtp,
        mtp_draft_copy=draft_copy,
        mtp_copy_saving=mtp_copied,
    )
    return with_settings(base, c, settings)


def with_settings(b: Budget, c: TextConfig, s: RunSettings) -> Budget:
    """The same weights with caches and buffers sized for other run settings (cheap: no tensor walk)."""
    s.validate(c)
    if s.include_mtp != b.settings.include_mtp:
        raise QuantkitError("with_settings cannot change include_mtp; compute a new budget")
    kv_tok = kv_bytes_per_token(c, s.cache_dtype)
    rec, conv = linear_state_bytes(c)
    # snapshots: a copy of each linear layer's states apiece; the snapshots of one prefill share one KV
    snaps, kv_copies = s.prompt_cache_snapshots, -(-s.prompt_cache_snapshots // SNAPSHOTS_PER_PROMPT)
    layer_cache = [
        kv_tok * s.context * (s.batch + kv_copies) if kind == "full_attention" else (rec + conv) * (s.batch + snaps)
        for kind in c.layer_types
    ]
    n_full, n_lin = len(c.full_attention_layers), len(c.linear_attention_layers)
    mtp_kv = kv_tok * s.context * s.batch * c.mtp_num_hidden_layers if s.include_mtp else 0
    return replace(
        b,
        settings=s,
        layer_cache=layer_cache,
        kv_cache=kv_tok * s.context * s.batch * n_full + mtp_kv,
        mtp=b.mtp_weights - b.mtp_copy_saving + b.mtp_draft_copy + mtp_kv,
        recurrent_state=rec * n_lin * s.batch,
        conv_state=conv * n_lin * s.batch,
        prompt_cache=(rec + conv) * n_lin * snaps + kv_tok * s.context * n_full * kv_copies
        + kv_copies * 2 * (c.vocab_size + (c.hidden_size if s.include_mtp else 0)),
        activations=batch_activation_bytes(c, s),
        # the runtime computes logits for the last position of each sequence only (transformers'
        # generate passes logits_to_keep=1), in fp32
        logits=s.batch * c.vocab_size * 4,
    )


def batch_activation_bytes(c: TextConfig, s: RunSettings) -> int:
    """Peak activations of `s.batch` sequences: the runtime prefills one prompt at a time, chunk by chunk (the
    others step between its chunks: quantkit/runtime/batch.py), and a decode step runs one token per sequence,
    so the widest forward is a prefill chunk or the batch's rows, whichever is wider."""
    return activation_bytes_per_token(c) * max(min(s.prefill_chunk, s.context), s.batch)


def slot_state_bytes(c: TextConfig, s: RunSettings) -> list[int]:
    """Per decoder layer, the state of `s.batch` sequences at `s.context` tokens: K/V of a full-attention layer,
    recurrent + conv state of a Gated DeltaNet layer (what `with_settings` budgets in `layer_cache`, without the
    prompt cache's snapshots)."""
    kv_tok = kv_bytes_per_token(c, s.cache_dtype)
    rec, conv = linear_state_bytes(c)
    return [kv_tok * s.context * s.batch if kind == "full_attention" else (rec + conv) * s.batch
            for kind in c.layer_types]


CARD_PARAMS = 35.0e9  # the model card's parameter count for Qwen-AgentWorld-35B-A3B


def card_params(spec: ModelSpec) -> float:
    """The parameter count the card formula takes: the card's 35.0B for the model it describes (34.66B
    text + 0.84B MTP rounds to it), the spec's own total for any other model."""
    return CARD_PARAMS if abs(spec.text_params - 34.66e9) < 0.01 * 34.66e9 else float(spec.total_params)


def card_estimate_gb(bits: int, context: int = 4096, params: float = CARD_PARAMS) -> float:
    """The model card's estimate: 1.05 x weights + KV, KV = 0.5 GB x bits/16 at 4,096 tokens (scaled
    linearly with context here). Rounded to 0.1 GB as the card prints it. For another model, `params`
    is its own count and the KV term is scaled by its size relative to the card's 35.0B."""
    weights = params * bits / 8 / GB
    kv = 0.5 * bits / 16 * context / 4096 * (1.0 if params == CARD_PARAMS else params / CARD_PARAMS)
    return round(1.05 * weights + kv, 1)
