"""Hostile statistics files (issue 26): hand-made or damaged `quantkit stats` files given to
`quantize --method gptq|imatrix --stats`, `plan --routing` and `export imatrix`. Each is refused in one
`error:` line naming the file and the field, before anything is written; NaN or infinite statistics never
reach a quantizer, an imatrix or a report."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from quantkit.errors import QuantkitError
from quantkit.quantize.report import finite
from quantkit.quantize.stats import LM, Stats

from helpers.cli import run_cli
from helpers.probe import count, expect_one_line

Q = f"{LM}layers.3.self_attn.q_proj.weight"  # a dense linear of the full-attention layer
GU = f"{LM}layers.0.mlp.experts.gate_up_proj"
DN = f"{LM}layers.0.mlp.experts.down_proj"
ROUTING = f"{LM}layers.0.mlp.routing"


def _read(src: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(src), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata())  # noqa: SIM118


def _forge(edit: Callable[[dict[str, torch.Tensor], dict[str, str]], None]) -> Callable[[Path, Path], None]:
    def make(src: Path, dst: Path) -> None:
        tensors, meta = _read(src)
        edit(tensors, meta)
        save_file(tensors, str(dst), metadata=meta)
    return make


def _raw(header: object) -> Callable[[Path, Path], None]:
    """A file whose header is `header` (JSON), no data."""
    def make(_src: Path, dst: Path) -> None:
        raw = json.dumps(header).encode()
        dst.write_bytes(struct.pack("<Q", len(raw)) + raw)
    return make


def _raw_text(header: str) -> Callable[[Path, Path], None]:
    def make(_src: Path, dst: Path) -> None:
        dst.write_bytes(struct.pack("<Q", len(header)) + header.encode())
    return make


def _truncated(src: Path, dst: Path) -> None:
    data = src.read_bytes()
    dst.write_bytes(data[: len(data) // 2])


def _bad_offsets(src: Path, dst: Path) -> None:
    data = src.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    hdr = json.loads(data[8:8 + n])
    a, b = hdr[f"{Q}.hessian"]["data_offsets"]
    hdr[f"{Q}.hessian"]["data_offsets"] = [a + 4, b + 4]
    raw = json.dumps(hdr).encode()
    dst.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])


def _set(key: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[Path, Path], None]:
    def edit(t: dict[str, torch.Tensor], _m: dict[str, str]) -> None:
        t[key] = fn(t[key]).contiguous()
    return _forge(edit)


def _meta(key: str, value: str) -> Callable[[Path, Path], None]:
    def edit(_t: dict[str, torch.Tensor], m: dict[str, str]) -> None:
        m[key] = value
    return _forge(edit)


def _other_model(_t: dict[str, torch.Tensor], m: dict[str, str]) -> None:
    cfg = json.loads(m["config"])
    (cfg.get("text_config") or cfg)["num_experts"] = 16
    m["config"] = json.dumps(cfg)


def _extra(t: dict[str, torch.Tensor], _m: dict[str, str]) -> None:
    t["evil.hessian"] = torch.zeros(2, 2)


def _bad_layer(t: dict[str, torch.Tensor], m: dict[str, str]) -> None:
    """No config to check shapes against (as hand-made routing files), and a layer index that is no number."""
    del m["config"]
    t[f"{LM}layers.x.mlp.routing"] = t.pop(ROUTING)


def _nan_at(flat_index: int, value: float) -> Callable[[torch.Tensor], torch.Tensor]:
    def fn(x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        x.view(-1)[flat_index] = value
        return x
    return fn


ALL = ("gptq", "imatrix", "plan", "export")
# id: (how the file is made, what the one line names, the commands that must refuse it)
CASES = {
    "header-a-list": (_raw([1, 2]), "not a JSON object", ALL),
    "header-nested-5000-deep": (_raw_text("[" * 5000 + "]" * 5000), "not valid JSON", ALL),
    "metadata-a-list": (_raw({"__metadata__": ["quantkit-stats"]}), "__metadata__", ALL),
    "metadata-a-number": (_raw({"__metadata__": {"format": "quantkit-stats", "version": 1}}), "__metadata__", ALL),
    "dtype-a-list": (_raw({"x": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}), "dtype", ALL),
    "truncated": (_truncated, "truncated", ALL),
    "bad-offsets": (_bad_offsets, "offsets", ALL),
    "tokens-a-word": (_meta("tokens", "many"), "tokens", ALL),
    "chunk-count-negative": (_meta("chunk_count", "-3"), "chunk_count", ALL),
    "config-not-json": (_meta("config", "{"), "'config'", ALL),
    "config-a-list": (_meta("config", "[1]"), "'config'", ALL),
    "hessian-bigger": (_set(f"{Q}.hessian", lambda x: torch.zeros(x.shape[0] + 1, x.shape[1] + 1)), Q, ALL),
    "hessian-smaller": (_set(f"{DN}.hessian", lambda x: x[:, :-1, :-1]), DN, ALL),
    "counts-cut-short": (_set(f"{GU}.count", lambda x: x[:-1]), f"{GU}.count", ALL),
    "counts-as-floats": (_set(f"{GU}.count", lambda x: x.float()), "int64", ALL),
    "routing-cut-short": (_set(ROUTING, lambda x: x[:-2]), ROUTING, ALL),
    "another-models-config": (_forge(_other_model), "the model needs", ALL),
    "a-foreign-tensor": (_forge(_extra), "evil.hessian", ALL),
    "a-layer-index-of-letters": (_forge(_bad_layer), "layers.x.mlp.routing", ALL),
    "nan-hessian": (_set(f"{Q}.hessian", _nan_at(5, math.nan)), "NaN", ("gptq", "imatrix")),
    "inf-in-sum2": (_set(f"{GU}.in_sum2", _nan_at(3, math.inf)), "NaN or infinite", ("gptq", "imatrix", "export")),
    "nan-heldout": (_set(f"{DN}.heldout_hessian", _nan_at(7, math.nan)), "NaN", ("gptq", "imatrix")),
    "negative-routing": (_set(ROUTING, _nan_at(1, -5)), "negative", ("gptq", "plan")),
}


def _commands(kind: str, src: Path, f: Path, tmp: Path) -> list:
    return {"gptq": ["quantize", src, "--out", tmp / "q", "--method", "gptq", "--stats", f],
            "imatrix": ["quantize", src, "--out", tmp / "q", "--method", "imatrix", "--stats", f],
            "plan": ["plan", "--model", src, "--routing", f],
            "export": ["export", "imatrix", f, tmp / "x.gguf"]}[kind]


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_statistics_file_is_one_line_and_writes_nothing(case, tiny_model, tiny_stats, tmp_path, capsys,
                                                                monkeypatch):
    make, needle, kinds = CASES[case]
    f = tmp_path / "forged.stats"
    make(tiny_stats, f)
    for kind in kinds:
        code, out, err = run_cli(_commands(kind, tiny_model, f, tmp_path), capsys, monkeypatch)
        line = expect_one_line(code, out, err, needle)
        assert "forged.stats" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["forged.stats"]


def test_the_real_statistics_file_passes_every_check(tiny_model, tiny_stats):
    """The checks refuse nothing `quantkit stats` writes (else the cases above would prove nothing)."""
    from quantkit.checkpoint.reader import Checkpoint

    count()
    st = Stats.open(tiny_stats)
    st.check_model(Checkpoint.open(tiny_model))
    st.check_all()
    assert st.get(f"{Q}.hessian").shape[0] == st.get(f"{Q}.in_sum2").shape[0]


def test_a_nan_read_through_the_api_is_refused(tiny_stats, tmp_path):
    count()
    f = tmp_path / "nan.stats"
    _set(f"{GU}.in_sum2", _nan_at(0, math.nan))(tiny_stats, f)
    st = Stats.open(f)  # the header is fine: the values are checked when read
    st.get(f"{Q}.hessian")
    with pytest.raises(QuantkitError, match="NaN or infinite"):
        st.get(f"{GU}.in_sum2")


def test_a_report_never_holds_a_bare_nan():
    count()
    data = {"a": math.nan, "b": [1.0, math.inf, {"c": -math.inf}], "d": 2.5, "e": "nan"}
    text = json.dumps(finite(data), allow_nan=False)
    assert json.loads(text) == {"a": None, "b": [1.0, None, {"c": None}], "d": 2.5, "e": "nan"}
