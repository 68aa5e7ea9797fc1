"""The GGUF type table: every `quantkit export gguf --type`, the ggml type each tensor gets under it, and
that tensor's bytes. Pure data and arithmetic (no gguf, torch or llama_cpp import), so the planner can
size a GGUF for any type without writing one.

Two kinds of `--type`:
- written by quantkit itself (`NATIVE_TYPES`: mixed, q8_0, q4_0, mxfp4, f16, bf16, f32): the `gguf`
  package's quantizers (quantkit.export.gguf);
- written by llama.cpp's own quantizer through llama-cpp-python (`LLAMA_TYPES`: the K-quants and IQ4
  types the `gguf` package cannot write): quantkit streams a bf16 GGUF, then `llama_model_quantize`
  runs with our recipe as per-tensor overrides (quantkit.export.gguf_quantize).

The recipe under a llama.cpp type (`LlamaType`): routed experts' gate/up at the type's base K-type, their
down_proj at `down` (raised a step for the _m types: down_proj is the experts' sensitive matrix in
published KL measurements of this model's GGUFs, and reports/bench-gguf.md measures it), attention, linear attention and the
shared expert at Q8_0 (the best published Q4_K_M of this model keeps them there), output.weight at
Q8_0 (as quantkit's quality recipe keeps lm_head at 8 bits: at llama.cpp's usual Q6_K it was the largest
error term on the decisive tiny model, q6_k's KL 5.0e-3 against q8_0's 7.6e-4), token_embd at Q8_0 (llama.cpp keeps it on the CPU; at the experts' Q4_K it tripled q4_k_m's KL on
the tiny decisive model, 1.0e-3 -> 2.9e-3, reports/bench-gguf.md), norms, router, conv1d, A_log,
dt_bias F32 (llama.cpp leaves them as they are in the bf16 GGUF). The MTP layer's NextN block (blk.N past the
trunk) follows the same table by name: its experts as routed experts, `nextn.eh_proj` (a dense projection)
with attention.

Fallback: a matrix whose row length (ne[0], the numpy shape's last dim) is not a multiple of its type's
block size falls back per tensor: under a llama.cpp type by llama.cpp's own rule (Q4_K -> Q5_0, Q5_K ->
Q5_1, Q6_K -> Q8_0, IQ4_XS -> IQ4_NL, Q3_K -> Q4_0; F16 when the fallback does not fit either), under a
native type to F16 (quantkit.export.gguf). `tensor_type` returns the type and a note naming the reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from quantkit.checkpoint.gguf_layout import is_f32_only
from quantkit.errors import QuantkitError

# the one install line for llama-cpp-python, printed as written (brackets and all)
INSTALL_LINE = 'pip install "quantkit[engines]" (from a clone: pip install -e ".[engines]")'


@dataclass(frozen=True)
class GgmlType:
    name: str  # as llama.cpp prints it ("Q4_K")
    id: int  # enum ggml_type
    block: int  # weights per block
    block_bytes: int  # bytes per block

    def row_bytes(self, n: int) -> int:
        return n // self.block * self.block_bytes


def _t(name: str, id: int, block: int, nbytes: int) -> GgmlType:
    return GgmlType(name, id, block, nbytes)


GGML: dict[str, GgmlType] = {t.name: t for t in (
    _t("F32", 0, 1, 4), _t("F16", 1, 1, 2), _t("BF16", 30, 1, 2),
    _t("Q4_0", 2, 32, 18), _t("Q4_1", 3, 32, 20), _t("Q5_0", 6, 32, 22), _t("Q5_1", 7, 32, 24),
    _t("Q8_0", 8, 32, 34), _t("MXFP4", 39, 32, 17), _t("IQ4_NL", 20, 32, 18),
    _t("Q2_K", 10, 256, 84), _t("Q3_K", 11, 256, 110), _t("Q4_K", 12, 256, 144), _t("Q5_K", 13, 256, 176),
    _t("Q6_K", 14, 256, 210), _t("IQ4_XS", 23, 256, 136),
)}
GGML_BY_ID = {t.id: t for t in GGML.values()}


@dataclass(frozen=True)
class LlamaType:
    """A `--type` written by llama.cpp's quantizer: its llama_ftype and our recipe under it."""

    ftype: int  # enum llama_ftype
    experts: str  # routed experts' gate/up (and the file's base type)
    down: str  # routed experts' down_proj
    rest: str = "Q8_0"  # attention, linear attention, shared expert
    output: str = "Q8_0"  # lm_head: Q6_K made it the largest error term (reports/bench-gguf.md)
    embd: str = "Q8_0"  # token_embd: llama.cpp keeps it on the CPU, so its bytes cost RAM, not VRAM


LLAMA_TYPES: dict[str, LlamaType] = {
    "q3_k_m": LlamaType(12, "Q3_K", "Q4_K"),
    "q4_k_s": LlamaType(14, "Q4_K", "Q4_K"),
    "q4_k_m": LlamaType(15, "Q4_K", "Q5_K"),
    "q5_k_s": LlamaType(16, "Q5_K", "Q5_K"),
    "q5_k_m": LlamaType(17, "Q5_K", "Q6_K"),
    "q6_k": LlamaType(18, "Q6_K", "Q6_K"),
    "iq4_nl": LlamaType(25, "IQ4_NL", "IQ4_NL"),
    "iq4_xs": LlamaType(30, "IQ4_XS", "IQ4_XS"),
}
# The default `quantkit export gguf --type`, chosen by reports/bench-gguf.md (`python -m benchmarks.gguf`): the lowest
# KL against bf16 through llama.cpp among the 4-bit-class types. Written by llama.cpp's quantizer, so without
# llama-cpp-python the CLI falls back to FALLBACK_TYPE (quantkit's own writer) and says so.
DEFAULT_TYPE = "q4_k_m"
FALLBACK_TYPE = "mixed"
NATIVE_TYPES = ("mixed", "q8_0", "q4_0", "mxfp4", "f16", "bf16", "f32")
ALL_TYPES = NATIVE_TYPES + tuple(LLAMA_TYPES)
# llama.cpp's per-tensor fallback when a row does not split into the type's blocks (llama-quant.cpp)
LLAMA_FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0",
                  "IQ4_XS": "IQ4_NL"}
EXPERT_GATE_UP = ("ffn_gate_exps.weight", "ffn_up_exps.weight")
EXPERT_DOWN = "ffn_down_exps.weight"


def check_type(ftype: str) -> str:
    """`ftype` lower-cased, or a one-line error listing the known types."""

    t = ftype.lower()
    if t not in ALL_TYPES:
        raise QuantkitError(f"--type {ftype!r}: use one of {', '.join(ALL_TYPES)}")
    return t


def is_expert(name: str) -> bool:
    return name.endswith(EXPERT_GATE_UP) or name.endswith(EXPERT_DOWN)


def wanted_type(name: str, shape: tuple[int, ...], ftype: str, expert_type: str | None = None) -> str:
    """The ggml type `--type ftype` asks for GGUF tensor `name` before any row-length fallback."""
    if is_f32_only(name, shape):
        return "F32"
    if ftype in LLAMA_TYPES:
        lt = LLAMA_TYPES[ftype]
        if name.endswith(EXPERT_DOWN):
            return lt.down
        if name.endswith(EXPERT_GATE_UP):
            return lt.experts
        return {"output.weight": lt.output, "token_embd.weight": lt.embd}.get(name, lt.rest)
    if ftype == "mixed":
        return (expert_type or "q4_0").upper() if is_expert(name) else "Q8_0"
    return ftype.upper()


def fallback(name: str, row: int, want: str, llama: bool) -> tuple[str, str]:
    """(type, note): `want` if a row of `row` weights splits into its blocks, else the fallback."""
    t = GGML[want]
    if row % t.block == 0:
        return want, ""
    alt = LLAMA_FALLBACK.get(want, "F16") if llama else "F16"
    if row % GGML[alt].block:
        alt = "F16"
    return alt, f"row length {row} is not a multiple of {t.block}, so {want} cannot hold it: {alt} instead"


def tensor_type(name: str, shape: tuple[int, ...], ftype: str, expert_type: str | None = None) -> tuple[str, str]:
    """(ggml type name, fallback note or "") of GGUF tensor `name` with numpy shape `shape` under `ftype`."""
    return fallback(name, shape[-1], wanted_type(name, shape, ftype, expert_type), ftype in LLAMA_TYPES)


def tensor_bytes(shape: tuple[int, ...], type_name: str) -> int:
    t = GGML[type_name]
    return math.prod(shape[:-1]) * t.row_bytes(shape[-1])


def overrides(ftype: str) -> list[tuple[str, str]]:
    """(regex, ggml type) pairs for llama.cpp's tt_overrides under a llama.cpp type: every tensor it may
    quantize is matched, so llama.cpp's own mixture logic never picks a type we did not plan (it still
    applies its row-length fallback, which `tensor_type` mirrors). First match wins."""
    lt = LLAMA_TYPES[ftype]
    return [(r"^output\.weight$", lt.output), (r"^token_embd\.weight$", lt.embd),
            (r"ffn_(gate|up)_exps\.weight$", lt.experts), (r"ffn_down_exps\.weight$", lt.down),
            (r"ffn_gate_inp_shexp\.weight$", "F32"), (r"(attn_|ssm_|_shexp\.|nextn\.eh_proj\.)", lt.rest)]


def default_type() -> tuple[str, str]:
    """(the default --type here, a note when it is the fallback because llama-cpp-python is missing)."""
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is not None:
        return DEFAULT_TYPE, ""
    return FALLBACK_TYPE, (f"llama-cpp-python is not installed, so the file is {FALLBACK_TYPE} (quantkit's own "
                           f"writer); the measured default {DEFAULT_TYPE} needs it: {INSTALL_LINE}")
