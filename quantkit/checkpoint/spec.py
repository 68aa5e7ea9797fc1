"""ModelSpec: every tensor of a qwen3_5_moe model with its name, shape, dtype and role, without weights."""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass, field
from enum import Enum
from importlib import resources
from pathlib import Path
from typing import Any

from quantkit.errors import QuantkitError
from quantkit.fileio import read_json_bounded

DEFAULT_MODEL = "Qwen-AgentWorld-35B-A3B"
SUPPORTED_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")


class Role(str, Enum):
    ROUTED_EXPERT = "routed_expert"
    SHARED_EXPERT = "shared_expert"
    ATTENTION = "attention"
    LINEAR_ATTENTION = "linear_attention"
    ROUTER = "router"
    EMBEDDING = "embedding"
    LM_HEAD = "lm_head"
    NORM = "norm"  # norms and other small vectors: conv1d, A_log, dt_bias, shared_expert_gate
    MTP = "mtp"
    VISION = "vision"


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str
    role: Role
    layer: int | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_matrix(self) -> bool:
        """A 2D weight or a 3D stack of expert matrices: what a weight-only quantizer can take."""
        return len(self.shape) in (2, 3) and not self.name.endswith("conv1d.weight")


@dataclass(frozen=True)
class TextConfig:
    """The fields of `text_config` the spec, budget and runtime need."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    attn_output_gate: bool
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    mtp_num_hidden_layers: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    dtype: str

    @property
    def full_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def linear_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]


_REQUIRED = {
    "vocab_size": int,
    "hidden_size": int,
    "num_hidden_layers": int,
    "num_attention_heads": int,
    "num_key_value_heads": int,
    "linear_num_key_heads": int,
    "linear_num_value_heads": int,
    "linear_key_head_dim": int,
    "linear_value_head_dim": int,
    "num_experts": int,
    "num_experts_per_tok": int,
    "moe_intermediate_size": int,
}


# Upper bounds on a config's sizes: 10-100x the largest of this family, so a malformed or hostile config.json
# (200k layers, a 2^40 vocabulary) is refused in one line instead of planning for minutes or hours.
DEFAULT_FIELD_LIMIT = 1 << 20
_LIMITS = {"num_hidden_layers": 1024, "num_experts": 1 << 14, "num_experts_per_tok": 1 << 10,
           "vocab_size": 1 << 22, "hidden_size": 1 << 17, "num_attention_heads": 1 << 12,
           "num_key_value_heads": 1 << 12, "linear_num_key_heads": 1 << 12, "linear_num_value_heads": 1 << 12}

_OPTIONAL_INTS = (("mtp_num_hidden_layers", 0, 0, 64), ("max_position_embeddings", 262144, 1, 1 << 26),
                  ("linear_conv_kernel_dim", 4, 1, 64), ("moe_intermediate_size", 1, 1, DEFAULT_FIELD_LIMIT))


def parse_text_config(cfg: dict[str, Any], source: str = "config.json") -> TextConfig:
    """Validate a config dict (multimodal `qwen3_5_moe` or bare `qwen3_5_moe_text`) into a TextConfig."""
    if not isinstance(cfg, dict):
        raise QuantkitError(f"{source}: expected a JSON object")
    mt = cfg.get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise QuantkitError(
            f"{source}: model_type {mt!r} is not supported; quantkit supports {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    text = cfg.get("text_config", cfg) if mt == "qwen3_5_moe" else cfg
    if mt == "qwen3_5_moe" and not isinstance(cfg.get("text_config"), dict):
        raise QuantkitError(f"{source}: field 'text_config' is missing or not an object")
    prefix = "text_config." if text is not cfg else ""
    for key, typ in _REQUIRED.items():
        val = text.get(key)
        if not isinstance(val, typ) or isinstance(val, bool) or val <= 0:
            raise QuantkitError(f"{source}: field '{prefix}{key}' must be a positive integer, got {val!r}")
        if val > _LIMITS.get(key, DEFAULT_FIELD_LIMIT):
            raise QuantkitError(f"{source}: field '{prefix}{key}' is {val}, beyond any model of this family "
                                f"(at most {_LIMITS.get(key, DEFAULT_FIELD_LIMIT):,}); is this the right config.json?")
    n_layers = text["num_hidden_layers"]
    layer_types = text.get("layer_types")
    if layer_types is None:
        interval = text.get("full_attention_interval", 4)
        if not isinstance(interval, int) or isinstance(interval, bool) or not 1 <= interval <= n_layers:
            raise QuantkitError(f"{source}: field '{prefix}full_attention_interval' must be an integer in "
                                f"[1, {n_layers}] (num_hidden_layers), got {interval!r}")
        layer_types = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)
        ]
    if (
        not isinstance(layer_types, list)
        or len(layer_types) != n_layers
        or any(t not in ("full_attention", "linear_attention") for t in layer_types)
    ):
        raise QuantkitError(
            f"{source}: field '{prefix}layer_types' must list {n_layers} entries of "
            "'full_attention' or 'linear_attention'"
        )
    if text["num_experts_per_tok"] > text["num_experts"]:
        raise QuantkitError(f"{source}: field '{prefix}num_experts_per_tok' exceeds num_experts")
    hidden = text["hidden_size"]
    heads = text["num_attention_heads"]
    # the same rules as the runtime's model_config: a config whose heads do not divide is refused by every command
    if heads % text["num_key_value_heads"]:
        raise QuantkitError(f"{source}: field '{prefix}num_attention_heads' must be a multiple of "
                            "num_key_value_heads")
    if text["linear_num_value_heads"] % text["linear_num_key_heads"]:
        raise QuantkitError(f"{source}: field '{prefix}linear_num_value_heads' must be a multiple of "
                            "linear_num_key_heads")
    head_dim = text.get("head_dim")
    if head_dim is None and hidden % heads:
        raise QuantkitError(f"{source}: field '{prefix}hidden_size' ({hidden}) is not a multiple of "
                            f"num_attention_heads ({heads}); give head_dim")
    if head_dim is not None and (not isinstance(head_dim, int) or isinstance(head_dim, bool)
                                 or not 1 <= head_dim <= DEFAULT_FIELD_LIMIT):
        raise QuantkitError(f"{source}: field '{prefix}head_dim' must be a positive integer, got {head_dim!r}")
    shared = text.get("shared_expert_intermediate_size", text["moe_intermediate_size"])
    if not isinstance(shared, int) or isinstance(shared, bool) or not 0 <= shared <= DEFAULT_FIELD_LIMIT:
        raise QuantkitError(f"{source}: field '{prefix}shared_expert_intermediate_size' must be an integer in "
                            f"[0, {DEFAULT_FIELD_LIMIT:,}], got {shared!r}")
    for key, default, lo, hi in _OPTIONAL_INTS:
        val = text.get(key, default)
        if val is None and default == 0:
            continue
        if not isinstance(val, int) or isinstance(val, bool) or not lo <= val <= hi:
            raise QuantkitError(f"{source}: field '{prefix}{key}' must be an integer in [{lo}, {hi:,}], got {val!r}")
    return TextConfig(
        vocab_size=text["vocab_size"],
        hidden_size=hidden,
        num_hidden_layers=n_layers,
        layer_types=tuple(layer_types),
        num_attention_heads=heads,
        num_key_value_heads=text["num_key_value_heads"],
        head_dim=head_dim or hidden // heads,
        attn_output_gate=bool(text.get("attn_output_gate", True)),
        linear_num_key_heads=text["linear_num_key_heads"],
        linear_num_value_heads=text["linear_num_value_heads"],
        linear_key_head_dim=text["linear_key_head_dim"],
        linear_value_head_dim=text["linear_value_head_dim"],
        linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
        num_experts=text["num_experts"],
        num_experts_per_tok=text["num_experts_per_tok"],
        moe_intermediate_size=text["moe_intermediate_size"],
        shared_expert_intermediate_size=shared,
        mtp_num_hidden_layers=int(text.get("mtp_num_hidden_layers", 0) or 0),
        max_position_embeddings=int(text.get("max_position_embeddings", 262144)),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))),
        dtype=str(text.get("dtype") or text.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
    )


@dataclass
class ModelSpec:
    """All tensors of the model. `exact` is True when read from safetensors headers."""

    name: str
    config: TextConfig
    tensors: list[TensorSpec]
    raw_config: dict[str, Any] = field(default_factory=dict)
    exact: bool = False

    def params_by_role(self) -> dict[Role, int]:
        out: dict[Role, int] = defaultdict(int)
        for t in self.tensors:
            out[t.role] += t.numel
        return dict(out)

    def bytes_by_role(self) -> dict[Role, int]:
        out: dict[Role, int] = defaultdict(int)
        for t in self.tensors:
            out[t.role] += t.numel * dtype_bytes(t.dtype)
        return dict(out)

    @property
    def total_params(self) -> int:
        return sum(t.numel for t in self.tensors)

    @property
    def text_params(self) -> int:
        """Parameters of the language model proper (no MTP, no vision)."""
        return sum(t.numel for t in self.tensors if t.role not in (Role.MTP, Role.VISION))

    @property
    def active_params_per_token(self) -> int:
        """Parameters read per decoded token: all non-expert text weights except the embedding (one row
        is read), plus top-k of the routed experts."""
        c = self.config
        by = self.params_by_role()
        dense = sum(v for r, v in by.items() if r not in (Role.ROUTED_EXPERT, Role.EMBEDDING, Role.MTP, Role.VISION))
        return dense + by.get(Role.ROUTED_EXPERT, 0) * c.num_experts_per_tok // c.num_experts + c.hidden_size

    def expert_params(self) -> int:
        """Parameters of one routed expert (gate, up and down)."""
        c = self.config
        return 3 * c.hidden_size * c.moe_intermediate_size

    def layer_tensors(self, layer: int) -> list[TensorSpec]:
        return [t for t in self.tensors if t.layer == layer and t.role not in (Role.MTP, Role.VISION)]


_DTYPE_BYTES = {
    "float32": 4, "F32": 4, "float16": 2, "F16": 2, "bfloat16": 2, "BF16": 2,
    "float8_e4m3fn": 1, "F8_E4M3": 1, "float8_e5m2": 1, "F8_E5M2": 1,
    "int8": 1, "I8": 1, "uint8": 1, "U8": 1, "int32": 4, "I32": 4, "int64": 8, "I64": 8,
    "int16": 2, "I16": 2, "bool": 1, "BOOL": 1, "F64": 8, "float64": 8,
}


def dtype_bytes(dtype: str) -> int:
    try:
        return _DTYPE_BYTES[dtype]
    except KeyError:
        raise QuantkitError(f"unknown dtype {dtype!r}") from None


_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def role_of(name: str) -> Role:
    """The role of a tensor from its checkpoint name (published or transformers' save layout)."""
    if name.startswith("mtp."):
        return Role.MTP
    if name.startswith(("model.visual.", "visual.", "model.vision_tower.")):
        return Role.VISION
    if name.endswith("embed_tokens.weight"):
        return Role.EMBEDDING
    if name == "lm_head.weight":
        return Role.LM_HEAD
    if ".mlp.experts." in name:
        return Role.ROUTED_EXPERT
    if ".mlp.shared_expert_gate." in name:
        return Role.NORM
    if ".mlp.shared_expert." in name:
        return Role.SHARED_EXPERT
    if name.endswith(".mlp.gate.weight"):
        return Role.ROUTER
    if ".linear_attn." in name:
        if name.endswith("_proj.weight") or ".in_proj_" in name:
            return Role.LINEAR_ATTENTION
        return Role.NORM
    if ".self_attn." in name:
        if name.endswith("_proj.weight"):
            return Role.ATTENTION
        return Role.NORM
    return Role.NORM


def mtp_subrole(name: str) -> Role:
    """The decoder-layer role an `mtp.*` tensor plays (`mtp.fc` counts as attention: a dense projection)."""
    rest = name[len("mtp."):] if name.startswith("mtp.") else name
    if rest.startswith("fc."):
        return Role.ATTENTION
    return role_of("model.language_model." + rest)


def layer_of(name: str) -> int | None:
    if name.startswith("mtp."):
        return None
    m = _LAYER_RE.search(name)
    return int(m.group(1)) if m else None


def _layer_tensors(c: TextConfig, p: str, kind: str, fused_experts: bool) -> list[tuple[str, tuple[int, ...]]]:
    h = c.hidden_size
    out: list[tuple[str, tuple[int, ...]]] = [
        (f"{p}input_layernorm.weight", (h,)),
        (f"{p}post_attention_layernorm.weight", (h,)),
    ]
    if kind == "linear_attention":
        kd = c.linear_num_key_heads * c.linear_key_head_dim
        vd = c.linear_num_value_heads * c.linear_value_head_dim
        conv = 2 * kd + vd
        a = f"{p}linear_attn."
        out += [
            (f"{a}in_proj_qkv.weight", (conv, h)),
            (f"{a}in_proj_z.weight", (vd, h)),
            (f"{a}in_proj_b.weight", (c.linear_num_value_heads, h)),
            (f"{a}in_proj_a.weight", (c.linear_num_value_heads, h)),
            (f"{a}conv1d.weight", (conv, 1, c.linear_conv_kernel_dim)),
            (f"{a}dt_bias", (c.linear_num_value_heads,)),
            (f"{a}A_log", (c.linear_num_value_heads,)),
            (f"{a}norm.weight", (c.linear_value_head_dim,)),
            (f"{a}out_proj.weight", (h, vd)),
        ]
    else:
        a = f"{p}self_attn."
        q = c.num_attention_heads * c.head_dim
        kv = c.num_key_value_heads * c.head_dim
        out += [
            (f"{a}q_proj.weight", (q * (2 if c.attn_output_gate else 1), h)),
            (f"{a}k_proj.weight", (kv, h)),
            (f"{a}v_proj.weight", (kv, h)),
            (f"{a}o_proj.weight", (h, q)),
            (f"{a}q_norm.weight", (c.head_dim,)),
            (f"{a}k_norm.weight", (c.head_dim,)),
        ]
    m = f"{p}mlp."
    e, i, si = c.num_experts, c.moe_intermediate_size, c.shared_expert_intermediate_size
    out.append((f"{m}gate.weight", (e, h)))
    if fused_experts:
        out += [(f"{m}experts.gate_up_proj", (e, 2 * i, h)), (f"{m}experts.down_proj", (e, h, i))]
    else:
        for j in range(e):
            out += [
                (f"{m}experts.{j}.gate_proj.weight", (i, h)),
                (f"{m}experts.{j}.up_proj.weight", (i, h)),
                (f"{m}experts.{j}.down_proj.weight", (h, i)),
            ]
    out += [
        (f"{m}shared_expert.gate_proj.weight", (si, h)),
        (f"{m}shared_expert.up_proj.weight", (si, h)),
        (f"{m}shared_expert.down_proj.weight", (h, si)),
        (f"{m}shared_expert_gate.weight", (1, h)),
    ]
    return out


def spec_from_config(cfg: dict[str, Any], name: str = "model", source: str = "config.json",
                     include_mtp: bool = True) -> ModelSpec:
    """The spec of the published checkpoint layout, derived from config.json alone."""
    c = parse_text_config(cfg, source)
    dtype = c.dtype
    lm = "model.language_model."
    items: list[tuple[str, tuple[int, ...]]] = [(f"{lm}embed_tokens.weight", (c.vocab_size, c.hidden_size))]
    for i, kind in enumerate(c.layer_types):
        items += _layer_tensors(c, f"{lm}layers.{i}.", kind, fused_experts=True)
    items.append((f"{lm}norm.weight", (c.hidden_size,)))
    if not c.tie_word_embeddings:
        items.append(("lm_head.weight", (c.vocab_size, c.hidden_size)))
    if include_mtp:
        for k in range(c.mtp_num_hidden_layers):
            h = c.hidden_size
            items += [
                ("mtp.fc.weight", (h, 2 * h)),
                ("mtp.pre_fc_norm_embedding.weight", (h,)),
                ("mtp.pre_fc_norm_hidden.weight", (h,)),
                ("mtp.norm.weight", (h,)),
            ]
            items += _layer_tensors(c, f"mtp.layers.{k}.", "full_attention", fused_experts=False)
    tensors = [TensorSpec(n, s, dtype, role_of(n), layer_of(n)) for n, s in items]
    return ModelSpec(name=name, config=c, tensors=tensors, raw_config=cfg, exact=False)


def default_config_path() -> Path:
    return Path(str(resources.files("quantkit") / "profiles" / "models" / DEFAULT_MODEL / "config.json"))


def load_config(path: Path) -> dict[str, Any]:
    return read_json_bounded(path, "config")


def default_spec() -> ModelSpec:
    path = default_config_path()
    return spec_from_config(load_config(path), name=DEFAULT_MODEL, source=str(path))


def text_config_dict(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's config (under `text_config` when nested) as transformers' text config takes it."""
    tc = config.get("text_config", config)
    return {k: v for k, v in tc.items() if k != "model_type"}
