"""Recipes: which quantization format each tensor role gets. Pure data.

A `Recipe` maps every `Role` to a `QuantSpec` or to None (kept as is, in `keep_dtype`). Tensors that
are not matrices (norms, conv1d, A_log, dt_bias) are always kept. MTP tensors follow the rule of the
role they would have in a decoder layer (`model.spec.mtp_subrole`), so a kept MTP layer is quantized like the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quantkit.checkpoint.spec import Role, TensorSpec, mtp_subrole
from quantkit.errors import QuantkitError
from quantkit.fileio import read_json_bounded
from quantkit.formats import QuantSpec, available_formats, default_group

INT8 = QuantSpec("int8", None, True)
INT4_G128 = QuantSpec("int4", 128, True)
NF4 = QuantSpec("nf4", 64, True)
FP4 = QuantSpec("fp4", 64, True)
MXFP4 = QuantSpec("mxfp4", 32, True)

# Matrices every recipe keeps in `keep_dtype`: linear attention's in_proj_a / in_proj_b set each head's
# decay and write strength in the Gated DeltaNet (32 rows each), so a rounding error there scales the
# whole recurrent state of a head; the MoE recipes of GPTQ-style quantizers keep them, and they are about
# 0.02% of the weights.
KEPT_MATRICES = ("linear_attn.in_proj_a.weight", "linear_attn.in_proj_b.weight")

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
        if not t.is_matrix or t.name.endswith(KEPT_MATRICES):
            return None
        role = mtp_subrole(t.name) if t.role == Role.MTP else t.role
        return self.rules.get(role)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "keep_dtype": self.keep_dtype,
            "nominal_bits": self.nominal_bits,
            "description": self.description,
            "rules": {r.value: (q.to_dict() if q else None) for r, q in self.rules.items()},
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Recipe:
        try:
            rules = {Role(k): (QuantSpec.from_dict(v) if v else None) for k, v in d.get("rules", {}).items()}
            return cls(name=d["name"], rules=rules, keep_dtype=d.get("keep_dtype", "bfloat16"),
                       description=d.get("description", ""), nominal_bits=int(d.get("nominal_bits", 16)))
        except (KeyError, ValueError, TypeError, AttributeError):
            raise QuantkitError(f"malformed recipe {d!r}") from None


def _uniform(name: str, q: QuantSpec, bits: int, desc: str) -> Recipe:
    return Recipe(name, {r: q for r in _MATRIX_ROLES}, description=desc, nominal_bits=bits)


RECIPES: dict[str, Recipe] = {
    "bf16": Recipe("bf16", {}, "bfloat16", "all weights in bf16, as published", 16),
    "fp16": Recipe("fp16", {}, "float16", "all weights in fp16", 16),
    "int8": _uniform("int8", INT8, 8, "int8 per output channel on every matrix; router, norms and in_proj_a/b bf16"),
    "int4": _uniform("int4", INT4_G128, 4, "int4 group 128 symmetric on every matrix; router, norms and in_proj_a/b bf16"),
    "nf4": _uniform("nf4", NF4, 4, "bitsandbytes NF4 (block 64) on every matrix; router, norms and in_proj_a/b bf16"),
    "fp4": _uniform("fp4", FP4, 4, "bitsandbytes FP4 (block 64) on every matrix; router, norms and in_proj_a/b bf16"),
    "mxfp4": _uniform("mxfp4", MXFP4, 4, "OCP MXFP4 on every matrix; router, norms and in_proj_a/b bf16"),
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
        "router, norms, embedding, in_proj_a/b bf16",
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


# --- Building a recipe from the quantizer's options, and the per-tensor decision -------------------

FORMAT_CHOICES = ("int", "nf4", "fp4", "mxfp4")
_GROUPS = {"int4": (32, 64, 128, 256), "nf4": (32, 64, 128, 256, 512, 1024, 2048, 4096),
           "fp4": (32, 64, 128, 256, 512, 1024, 2048, 4096), "mxfp4": (32,)}
_KEEP_WORDS = ("bf16", "bfloat16", "16", "keep", "none", "fp16", "float16")


def four_bit_spec(fmt: str = "int", group_size: int | None = None, symmetric: bool = True) -> QuantSpec:
    """The 4-bit QuantSpec for `--format` (int = int4) and `--group-size`."""
    name = "int4" if fmt in ("int", "int4") else fmt
    if name not in _GROUPS:
        raise QuantkitError(f"format {fmt!r} is not a 4-bit format; use one of {', '.join(FORMAT_CHOICES)}")
    g = group_size or default_group(name)
    if g not in _GROUPS[name]:
        raise QuantkitError(f"group size {g} is not supported by {name}; use one of {', '.join(map(str, _GROUPS[name]))}")
    if name != "int4" and not symmetric:
        raise QuantkitError(f"{name} is symmetric only; asymmetric applies to int4")
    return QuantSpec(name, g, symmetric)


def parse_spec_text(text: str, group_size: int | None = None) -> QuantSpec | None:
    """`8`, `4`, `int8`, `int4`, `int4:g64`, `int4:g64:asym`, `nf4`, `fp4`, `mxfp4`, `bf16`/`keep` (None)."""
    t = text.strip().lower()
    if t in _KEEP_WORDS:
        return None
    head, *opts = t.split(":")
    g = group_size
    sym = True
    for o in opts:
        if o.startswith("g") and o[1:].isdigit():
            g = int(o[1:])
        elif o in ("asym", "asymmetric"):
            sym = False
        elif o in ("sym", "symmetric"):
            sym = True
        else:
            raise QuantkitError(f"spec {text!r}: unknown option {o!r}; options are gN, sym, asym")
    if head in ("8", "int8"):
        if opts:
            raise QuantkitError(f"spec {text!r}: int8 is per output channel and takes no options")
        return INT8
    if head in ("4", "int4", "int"):
        return four_bit_spec("int", g, sym)
    if head in ("nf4", "fp4", "mxfp4"):
        return four_bit_spec(head, g, sym)
    raise QuantkitError(f"spec {text!r} does not parse; use 8, 4, int8, int4[:gN][:asym], nf4, fp4, mxfp4 or bf16")


def parse_override(text: str, group_size: int | None = None) -> tuple[Role, QuantSpec | None]:
    """`ROLE=SPEC`, e.g. `linear_attention=8`, `routed_expert=nf4`, `lm_head=bf16`."""
    if "=" not in text:
        raise QuantkitError(f"override {text!r}: expected ROLE=SPEC, e.g. linear_attention=8")
    role_s, spec_s = (s.strip() for s in text.split("=", 1))
    try:
        role = Role(role_s.lower())
    except ValueError:
        raise QuantkitError(
            f"override {text!r}: unknown role {role_s!r}; roles: {', '.join(r.value for r in Role)}"
        ) from None
    if role in (Role.NORM, Role.VISION, Role.MTP):
        raise QuantkitError(f"override {text!r}: {role.value} tensors are always kept as they are")
    return role, parse_spec_text(spec_s, group_size)


def load_recipe_file(path: str) -> Recipe:
    """A JSON recipe: `{"name": ..., "rules": {ROLE: SPEC-or-null}}`, optionally `"base": "quality"` to
    start from a built-in recipe. A SPEC is a dict (`{"format": "int4", "group_size": 64}`) or a string
    as in --override."""
    from pathlib import Path

    p = Path(path)
    d = read_json_bounded(p, "recipe file", 1 << 20)
    if not isinstance(d, dict) or not isinstance(d.get("rules", {}), dict):
        raise QuantkitError(f"{p}: a recipe file is a JSON object with a 'rules' object")
    base = get_recipe(d["base"]) if "base" in d else Recipe(str(d.get("name", p.stem)), {})
    rules = dict(base.rules)
    for k, v in d.get("rules", {}).items():
        try:
            role = Role(k)
        except ValueError:
            raise QuantkitError(f"{p}: unknown role {k!r}; roles: {', '.join(r.value for r in Role)}") from None
        if v is None or isinstance(v, str):
            rules[role] = parse_spec_text(v or "keep")
        else:
            q = QuantSpec.from_dict(v)
            rules[role] = None if q.format in _KEEP_WORDS else (
                INT8 if q.format == "int8" else four_bit_spec(q.format, q.group_size, q.symmetric))
    return Recipe(str(d.get("name", p.stem)), rules, str(d.get("keep_dtype", base.keep_dtype)),
                  str(d.get("description", base.description)), int(d.get("nominal_bits", base.nominal_bits)))


def build_recipe(bits: int = 4, fmt: str = "int", group_size: int | None = None, uniform: bool = False,
                 overrides: list[str] | tuple[str, ...] = (), recipe_file: str | None = None,
                 scheme: str | None = None) -> Recipe:
    """The recipe `quantkit quantize` runs: `--scheme NAME` (the names `plan` uses), `--recipe FILE` or
    `--bits/--format/--group-size/--uniform`, then each `--override ROLE=SPEC`. --bits 4 is the `quality`
    recipe with `--format` on the routed experts (on every matrix with --uniform); --bits 8 is int8 on every
    matrix."""
    if fmt not in FORMAT_CHOICES:
        raise QuantkitError(f"--format {fmt!r}: use one of {', '.join(FORMAT_CHOICES)}")
    if scheme:
        if recipe_file:
            raise QuantkitError("--scheme names a recipe and --recipe reads one from a file: give one of them")
        r = get_recipe(scheme)
    elif recipe_file:
        if recipe_file.lower() in RECIPES and not Path(recipe_file).exists():
            raise QuantkitError(f"--recipe {recipe_file!r} is a scheme's name: write --scheme {recipe_file} "
                                "(--recipe reads a JSON recipe file)")
        r = load_recipe_file(recipe_file)
    elif bits == 8:
        if fmt != "int":
            raise QuantkitError(f"--format {fmt} is a 4-bit format; with --bits 8 the format is int8")
        if group_size:
            raise QuantkitError("--group-size does not apply to --bits 8 (int8 is per output channel)")
        r = RECIPES["int8"]
    elif bits == 4:
        q4 = four_bit_spec(fmt, group_size)
        tag = q4.format + (f"-g{q4.group_size}" if q4.group_size != default_group(q4.format) else "")
        if uniform:
            r = Recipe(f"uniform-{tag}", {ro: q4 for ro in _MATRIX_ROLES},
                       description=f"{tag} on every matrix; router, norms and in_proj_a/b bf16", nominal_bits=4)
        else:
            base = RECIPES["quality"]
            rules = dict(base.rules)
            rules[Role.ROUTED_EXPERT] = q4
            name = "quality" if q4 == INT4_G128 else f"quality-{tag}"
            desc = base.description.replace("int4 g128", tag) if q4 != INT4_G128 else base.description
            r = Recipe(name, rules, base.keep_dtype, desc, 4)
    else:
        raise QuantkitError(f"--bits {bits}: use 8 or 4")
    if overrides:
        rules = dict(r.rules)
        for o in overrides:
            role, q = parse_override(o, group_size)
            rules[role] = q
        r = Recipe(r.name + "+overrides", rules, r.keep_dtype,
                   r.description + "; overrides: " + ", ".join(overrides), r.nominal_bits)
    return r


@dataclass(frozen=True)
class Decision:
    """What the quantizer does with one tensor: `spec` None = stored as is. `note` says why, when the
    recipe's choice could not be applied (fallback) or the tensor is kept for a reason of its own."""

    spec: QuantSpec | None
    note: str = ""


def decide(recipe: Recipe, t: TensorSpec) -> Decision:
    """The recipe's spec for `t` if the tensor can take it; else int8 (any matrix can), else keep."""
    if t.role == Role.VISION:
        return Decision(None, "vision weights are kept as they are")
    if not t.is_matrix:
        return Decision(None)
    q = recipe.spec_for(t)
    if q is None or q.format in _KEEP_WORDS:
        return Decision(None)
    if q.format == "int8":
        return Decision(q)
    row = t.shape[-1]
    g = q.group_size or (default_group(q.format) if q.format in available_formats() else None) or 1
    if row % g == 0:
        return Decision(q)
    # A smaller group of the same format keeps the bits (small models, odd rows); else int8, any row.
    for g2 in sorted(_GROUPS.get(q.format, ()), reverse=True):
        if g2 < g and row % g2 == 0:
            return Decision(QuantSpec(q.format, g2, q.symmetric),
                            f"{q.format} group {g} does not divide the row length {row}: group {g2} instead")
    return Decision(INT8, f"{q.format} group {g} does not divide the row length {row}: int8 instead")


def parse_recipe_names(values: list[str] | None) -> list[str]:
    """Recipe names from repeatable, comma-separated options (`--scheme int4,int8`); unknown: one-line error."""
    return [get_recipe(x.strip()).name for s in (values or []) for x in s.split(",") if x.strip()]
