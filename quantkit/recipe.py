"""Recipes: which quantization format each tensor role gets. Pure data.

A `Recipe` maps every `Role` to a `QuantSpec` or to None (kept as is, in `keep_dtype`). Tensors that
are not matrices (norms, conv1d, A_log, dt_bias) are always kept. MTP tensors follow the rule of the
role they would have in a decoder layer (`mtp_subrole`), so a kept MTP layer is quantized like the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from quantkit.errors import QuantkitError
from quantkit.formats import QuantSpec
from quantkit.spec import Role, TensorSpec, role_of

INT8 = QuantSpec("int8", None, True)
INT4_G128 = QuantSpec("int4", 128, True)
NF4 = QuantSpec("nf4", 64, True)
FP4 = QuantSpec("fp4", 64, True)
MXFP4 = QuantSpec("mxfp4", 32, True)

_MATRIX_ROLES = (
    Role.ROUTED_EXPERT, Role.SHARED_EXPERT, Role.ATTENTION, Role.LINEAR_ATTENTION, Role.EMBEDDING, Role.LM_HEAD,
)


@dataclass(frozen=True)
class Recipe:
    """A rule per role. Roles absent from `rules` (and ROUTER, NORM) are kept in `keep_dtype`."""

    name: str
    rules: dict[Role, QuantSpec | None] = field(default_factory=dict)
    keep_dtype: str = "bfloat16"
    description: str = ""
    nominal_bits: int = 16  # the bit width the model card's estimate uses for this recipe

    def spec_for(self, t: TensorSpec) -> QuantSpec | None:
        """The QuantSpec for one tensor, or None to keep it in `keep_dtype`."""
        if not t.is_matrix:
            return None
        role = mtp_subrole(t.name) if t.role == Role.MTP else t.role
        return self.rules.get(role)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "keep_dtype": self.keep_dtype,
            "nominal_bits": self.nominal_bits,
            "rules": {r.value: (q.to_dict() if q else None) for r, q in self.rules.items()},
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Recipe:
        try:
            rules = {Role(k): (QuantSpec.from_dict(v) if v else None) for k, v in d.get("rules", {}).items()}
            return cls(name=d["name"], rules=rules, keep_dtype=d.get("keep_dtype", "bfloat16"),
                       nominal_bits=int(d.get("nominal_bits", 16)))
        except (KeyError, ValueError, TypeError, AttributeError):
            raise QuantkitError(f"malformed recipe {d!r}") from None


def mtp_subrole(name: str) -> Role:
    """The decoder-layer role an `mtp.*` tensor plays (`mtp.fc` counts as attention: a dense projection)."""
    rest = name[len("mtp."):] if name.startswith("mtp.") else name
    if rest.startswith("fc."):
        return Role.ATTENTION
    return role_of("model.language_model." + rest)


def _uniform(name: str, q: QuantSpec, bits: int, desc: str) -> Recipe:
    return Recipe(name, {r: q for r in _MATRIX_ROLES}, description=desc, nominal_bits=bits)


RECIPES: dict[str, Recipe] = {
    "bf16": Recipe("bf16", {}, "bfloat16", "all weights in bf16, as published", 16),
    "fp16": Recipe("fp16", {}, "float16", "all weights in fp16", 16),
    "int8": _uniform("int8", INT8, 8, "int8 per output channel on every matrix; router and norms bf16"),
    "int4": _uniform("int4", INT4_G128, 4, "int4 group 128 symmetric on every matrix; router and norms bf16"),
    "nf4": _uniform("nf4", NF4, 4, "bitsandbytes NF4 (block 64) on every matrix; router and norms bf16"),
    "fp4": _uniform("fp4", FP4, 4, "bitsandbytes FP4 (block 64) on every matrix; router and norms bf16"),
    "mxfp4": _uniform("mxfp4", MXFP4, 4, "OCP MXFP4 on every matrix; router and norms bf16"),
    # The default 4-bit recipe: only routed experts (93% of the weights) go to 4 bits. Attention, linear
    # attention and the shared expert are the sensitive, always-active part (REFERENCE section 3: the
    # best Q4_K_M keeps them at 8 bits); lm_head at int8 per channel. The embedding stays bf16: it is
    # only gathered one row per token and lives in CPU RAM by default, so bits there buy nothing.
    "quality": Recipe(
        "quality",
        {
            Role.ROUTED_EXPERT: INT4_G128,
            Role.ATTENTION: INT8,
            Role.LINEAR_ATTENTION: INT8,
            Role.SHARED_EXPERT: INT8,
            Role.LM_HEAD: INT8,
            Role.EMBEDDING: None,
        },
        description="routed experts int4 g128; attention, linear attention, shared expert, lm_head int8; "
        "router, norms, embedding bf16",
        nominal_bits=4,
    ),
}

# Higher is closer to the bf16 model (used to pick a recommendation, not a measured ranking).
QUALITY_RANK = {"bf16": 10, "fp16": 9, "int8": 8, "quality": 7, "int4": 6, "nf4": 5, "mxfp4": 4, "fp4": 3}


def get_recipe(name: str) -> Recipe:
    try:
        return RECIPES[name.lower()]
    except KeyError:
        raise QuantkitError(f"unknown scheme {name!r}; known: {', '.join(RECIPES)}") from None
