"""The imatrix GGUF export: llama.cpp's layout and names, values equal to the statistics, and accepted
(and used) by llama.cpp's own quantizer through the binding."""

from __future__ import annotations

import ctypes
import hashlib

import numpy as np
import pytest
import torch

from quantkit.quantize.imatrix import llama_imatrix_array, read_imatrix_gguf, write_imatrix_gguf
from quantkit.quantize.stats import LM, Stats

from helpers.cli import run_cli


@pytest.fixture(scope="module")
def imatrix_file(tiny_stats, tmp_path_factory):
    return write_imatrix_gguf(tiny_stats, tmp_path_factory.mktemp("im") / "tiny.imatrix.gguf")


@pytest.mark.slow
def test_layout_and_values_follow_llama_cpp(imatrix_file, tiny_stats):
    import gguf

    r = gguf.GGUFReader(str(imatrix_file))

    def field(name):
        f = r.get_field(name)
        return f.contents() if hasattr(f, "contents") else f.parts[f.data[0]]

    assert field("general.type") == "imatrix"
    assert field("imatrix.chunk_size") == 128 and field("imatrix.chunk_count") == 14
    assert field("imatrix.datasets") == ["quantkit-default"]
    t = {x.name: x for x in r.tensors}
    stats = Stats.open(tiny_stats)
    gu = f"{LM}layers.0.mlp.experts.gate_up_proj"
    for g in ("blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight"):
        s2 = np.asarray(t[f"{g}.in_sum2"].data).reshape(8, 64)
        assert t[f"{g}.in_sum2"].data.dtype == np.float32
        np.testing.assert_allclose(s2, stats.get(f"{gu}.in_sum2").numpy(), rtol=1e-6)
        np.testing.assert_array_equal(np.asarray(t[f"{g}.counts"].data).reshape(8),
                                      stats.get(f"{gu}.count").float().numpy())
    assert "blk.3.attn_q.weight.in_sum2" in t and "output.weight.counts" in t and "blk.0.ssm_out.weight.in_sum2" in t
    imp = read_imatrix_gguf(imatrix_file)
    want = (stats.get(f"{gu}.in_sum2") / stats.get(f"{gu}.count")[:, None]).numpy().reshape(-1)
    np.testing.assert_allclose(imp["blk.0.ffn_gate_exps.weight"], want, rtol=1e-6)


def _quantize(src, dst, ftype, imatrix=None):
    import llama_cpp

    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = ftype
    p.nthread = 1
    arr = None
    if imatrix is not None:
        arr = llama_imatrix_array(imatrix)
        p.imatrix = ctypes.cast(arr, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(p))
    return rc, (hashlib.sha256(dst.read_bytes()).hexdigest() if rc == 0 else None)


def test_llama_cpp_quantizer_accepts_and_uses_the_imatrix(tiny_model, imatrix_file, tmp_path, capsys, monkeypatch):
    pytest.importorskip("llama_cpp")
    f16 = tmp_path / "t.gguf"
    code, _, err = run_cli(["export", "gguf", tiny_model, f16, "--type", "f16"], capsys, monkeypatch)
    assert code == 0, err
    imat = read_imatrix_gguf(imatrix_file)
    q4_0, q4_k_m = 2, 15
    for ftype in (q4_0, q4_k_m):
        rc0, plain = _quantize(f16, tmp_path / "a.gguf", ftype)
        rc1, weighted = _quantize(f16, tmp_path / "b.gguf", ftype, imat)
        assert rc0 == 0 and rc1 == 0
        assert plain != weighted  # the quantizer used the importance to choose its scales
    # a wrongly sized entry is refused by llama.cpp: it checks every entry against its tensor
    bad = dict(imat)
    bad["output.weight"] = bad["output.weight"][:-1]
    assert _quantize(f16, tmp_path / "c.gguf", q4_0, bad)[0] != 0


@pytest.mark.slow
def test_cli_writes_the_imatrix_beside_the_stats(tiny_model, tmp_path, capsys, monkeypatch):
    out, im = tmp_path / "s", tmp_path / "s.imatrix.gguf"
    code, so, err = run_cli(["stats", tiny_model, "--out", out, "--calib-tokens", "1024", "--chunk-size", "128",
                             "--imatrix", im], capsys, monkeypatch)
    assert code == 0, err
    imp = read_imatrix_gguf(im)
    assert all(np.isfinite(v).all() and (v >= 0).all() for v in imp.values())
    assert len(imp) == len(read_imatrix_gguf(im)) > 30
    assert torch.isfinite(Stats.open(out).get(f"{LM}layers.0.mlp.experts.down_proj.in_sum2")).all()
    # the same file from an existing statistics file
    im2 = tmp_path / "again.gguf"
    code, so, err = run_cli(["export", "imatrix", out, im2], capsys, monkeypatch)
    assert code == 0, err
    assert im2.read_bytes() == im.read_bytes()
    code, so, err = run_cli(["export", "imatrix", out, im2], capsys, monkeypatch)
    assert code == 2 and "exists; pass --overwrite" in err
