"""The GGUF type table (quantkit.export.gguf_types) against the gguf package's own constants, and the type
choice per tensor that both the exporter and the planner use."""

from __future__ import annotations

import gguf
import pytest

from quantkit.errors import QuantkitError
from quantkit.export.gguf_types import GGML, LLAMA_TYPES, check_type, tensor_bytes, tensor_type


def test_type_table_matches_ggml() -> None:
    for name, t in GGML.items():
        q = gguf.GGMLQuantizationType[name]
        assert t.id == int(q) and (t.block, t.block_bytes) == gguf.GGML_QUANT_SIZES[q], name
    for ftype, lt in LLAMA_TYPES.items():
        assert lt.ftype == int(getattr(gguf.LlamaFileType, "MOSTLY_" + ftype.upper())), ftype


def test_bytes_and_fallbacks() -> None:
    shape = (256, 512, 2048)  # the real model's gate experts: ne [2048, 512, 256]
    assert tensor_bytes(shape, "Q4_K") == 256 * 512 * 2048 // 256 * 144
    assert tensor_type("blk.0.ffn_gate_exps.weight", shape, "q4_k_m") == ("Q4_K", "")
    assert tensor_type("blk.0.ffn_down_exps.weight", (256, 2048, 512), "q4_k_m") == ("Q5_K", "")
    ty, note = tensor_type("blk.0.ffn_down_exps.weight", (8, 64, 96), "q4_k_m")
    assert ty == "Q5_1" and "96" in note  # llama.cpp's own fallback for Q5_K
    ty, note = tensor_type("blk.0.ffn_down_exps.weight", (8, 64, 48), "q4_k_m")
    assert ty == "F16" and "48" in note  # not even a 32-block
    assert tensor_type("blk.0.ffn_down_exps.weight", (8, 64, 48), "q8_0")[0] == "F16"
    assert tensor_type("blk.0.attn_norm.weight", (2048,), "q4_k_m")[0] == "F32"
    assert tensor_type("blk.0.ffn_gate_inp.weight", (256, 2048), "iq4_xs")[0] == "F32"
    assert tensor_type("blk.3.attn_q.weight", (8192, 2048), "q4_k_s")[0] == "Q8_0"
    assert tensor_type("output.weight", (248320, 2048), "q4_k_m")[0] == "Q8_0"
    assert tensor_type("output.weight", (248320, 64), "q4_k_m")[0] == "Q8_0"
    assert tensor_type("blk.0.ffn_up_exps.weight", shape, "mixed")[0] == "Q4_0"
    assert tensor_type("blk.0.ffn_up_exps.weight", shape, "mixed", "mxfp4")[0] == "MXFP4"


def test_unknown_type_lists_the_known_ones() -> None:
    with pytest.raises(QuantkitError, match="q4_k_m.*iq4_xs"):
        check_type("q4_km")
    assert check_type("Q4_K_M") == "q4_k_m"


def test_default_type_is_the_measured_one() -> None:
    """The default --type is what reports/bench-gguf.json measured (re-run `python -m benchmarks.gguf` to change it),
    and its selection rule picks it from the rows recorded there."""
    import json
    from pathlib import Path

    from benchmarks.gguf import choose_default
    from quantkit.export.gguf_types import DEFAULT_TYPE

    d = json.loads((Path(__file__).parents[2] / "reports" / "bench-gguf.json").read_text())
    assert d["default"] == DEFAULT_TYPE == choose_default(d["rows"])
