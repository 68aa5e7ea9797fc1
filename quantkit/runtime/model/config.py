"""The model's shape and constants as the runtime needs them, read from config.json: `ModelConfig`.

Extends the planner's `TextConfig` (quantkit.checkpoint.spec: sizes, layer types, experts) with the numbers of the
forward: norm epsilon, rotary base and share, activation. A config this model cannot compute (another
activation, a rotary that depends on the length, attention with biases or without its output gate) is refused
in one line that names the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from quantkit.checkpoint.spec import TextConfig, parse_text_config
from quantkit.errors import QuantkitError


@dataclass(frozen=True)
class ModelConfig:
    text: TextConfig
    rms_eps: float
    rope_theta: float
    partial_rotary: float

    @property
    def rotary_dims(self) -> int:
        """Dimensions of each head that rotate (an even number; the rest pass through)."""
        return int(self.text.head_dim * self.partial_rotary) // 2 * 2

    @property
    def linear_key_dim(self) -> int:
        return self.text.linear_num_key_heads * self.text.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.text.linear_num_value_heads * self.text.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim


def _number(text: dict[str, Any], rope: dict[str, Any], key: str, default: float, where: str) -> float:
    val = rope.get(key, text.get(key, default))
    if isinstance(val, bool) or not isinstance(val, (int, float)) or not val > 0:
        raise QuantkitError(f"{where}: field '{key}' must be a positive number, got {val!r}")
    return float(val)


def model_config(config: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """`ModelConfig` of a qwen3_5_moe config dict (nested `text_config` or bare), or one line naming the field
    this runtime cannot compute."""
    tc = parse_text_config(config, source)
    text = config.get("text_config", config)
    prefix = "text_config." if text is not config else ""
    act = text.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise QuantkitError(f"{source}: field '{prefix}hidden_act' is {act!r}; this model computes silu only")
    if text.get("attention_bias", False):
        raise QuantkitError(f"{source}: field '{prefix}attention_bias' is true; the attention has no biases here")
    if not tc.attn_output_gate:
        raise QuantkitError(f"{source}: field '{prefix}attn_output_gate' is false; this model gates its attention")
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise QuantkitError(f"{source}: field '{prefix}rope_parameters' must be an object")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise QuantkitError(f"{source}: field '{prefix}rope_parameters.rope_type' is {kind!r}; "
                            "only the default rotary is supported")
    where = f"{source} ({prefix.rstrip('.') or 'config'})"
    partial = _number(text, rope, "partial_rotary_factor", 1.0, where)
    if partial > 1:
        raise QuantkitError(f"{where}: field 'partial_rotary_factor' is {partial}; it must be at most 1")
    if tc.linear_num_value_heads % tc.linear_num_key_heads:
        raise QuantkitError(f"{source}: field '{prefix}linear_num_value_heads' must be a multiple of "
                            "linear_num_key_heads")
    if tc.num_attention_heads % tc.num_key_value_heads:
        raise QuantkitError(f"{source}: field '{prefix}num_attention_heads' must be a multiple of "
                            "num_key_value_heads")
    return ModelConfig(tc, _number(text, {}, "rms_norm_eps", 1e-6, where),
                       _number(text, rope, "rope_theta", 10000.0, where), partial)
