"""`quantkit export gguf --type q4_k_m|...` through llama.cpp's own quantizer, proven by llama.cpp itself.

A decisive-routing tiny model whose rows take K-quant blocks (hidden 256, expert intermediate 256: the
K-quants' super-block is 256) is exported to every llama.cpp type, with and without an importance matrix
(collected from transformers' forward on calibration text, written in llama.cpp's imatrix GGUF format),
loaded and run by `llama_cpp.Llama`, and compared with llama.cpp running the bf16 export (KL divergence and
top-1 agreement). Each file's tensor types are read back and must be the recipe's
(quantkit.export.gguf_types.tensor_type), so the planner's byte sizes are the file's.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from quantkit.bench.engines import llama_logits
from quantkit.errors import QuantkitError
from quantkit.export.gguf import export_gguf
from quantkit.export.gguf_types import LLAMA_TYPES, tensor_bytes, tensor_type
from quantkit.model.gguf_file import read_gguf

from conftest import TINY_KW, run_cli

if os.environ.get("QUANTKIT_REQUIRE_ENGINES") == "1":
    import llama_cpp  # noqa: F401
else:
    pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (CI builds it)")
import gguf  # noqa: E402

K_KW = {**TINY_KW, "hidden": 256, "intermediate": 256}
N_SEQ, SEQ_LEN = 3, 48
# mean KL divergence against llama.cpp on the bf16 export, at most (3 x 48 tokens). Measured on this machine:
# q3_k_m 3.4e-3, q4_k_s 1.1e-3, q4_k_m 8.1e-4, q5_k_s 3.5e-4, q5_k_m 2.9e-4, q6_k 1.7e-4, iq4_nl 1.2e-3,
# iq4_xs 1.3e-3 (top-1 1.0 for all); q4_k_s with the test's imatrix 1.0e-3. Bounds are about 2.5x.
KL_BOUND = {"q3_k_m": 8.5e-3, "q4_k_s": 3e-3, "q4_k_m": 2e-3, "q5_k_s": 9e-4, "q5_k_m": 7.5e-4, "q6_k": 4.5e-4,
            "iq4_nl": 3.2e-3, "iq4_xs": 3.2e-3}


@pytest.fixture(scope="module")
def kmodel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from quantkit.testing.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("k") / "t256", decisive=True, **K_KW)


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    from quantkit.testing.tiny import probe_ids

    return probe_ids(N_SEQ, SEQ_LEN)


@pytest.fixture(scope="module")
def bf16_ref(kmodel: Path, ids: torch.Tensor, tmp_path_factory: pytest.TempPathFactory) -> np.ndarray:
    path = export_gguf(kmodel, tmp_path_factory.mktemp("kb") / "bf16.gguf", "bf16").path
    return llama_logits(path, ids, 2)


@pytest.fixture(scope="module")
def imatrix_file(kmodel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Expert statistics on calibration text that is not the evaluation probe."""
    from quantkit.testing.imatrix import collect_expert_imatrix, write_imatrix_gguf
    from quantkit.testing.tiny import load_reference_model
    from quantkit.testing.tokenizer import build_tokenizer, tiny_corpus

    tok = build_tokenizer()
    lines = tiny_corpus(200, seed=3)
    calib = torch.tensor([tok.encode("".join(lines[i * 20:(i + 1) * 20])).ids[:64] for i in range(4)])
    sums = collect_expert_imatrix(load_reference_model(kmodel), calib)
    return write_imatrix_gguf(sums, tmp_path_factory.mktemp("im") / "imatrix.gguf", chunks=4, chunk_size=64)


def kl(ref: np.ndarray, got: np.ndarray) -> float:
    from quantkit.bench.engines import _kl

    return _kl(ref, got)


def assert_types_are_the_plan(path: Path, ftype: str) -> None:
    info = read_gguf(path)
    for t in info.tensors:
        want, _ = tensor_type(t.name, t.shape, ftype)
        assert t.type == want, (t.name, t.type, want)
        assert t.nbytes == tensor_bytes(t.shape, t.type)


@pytest.mark.parametrize("ftype", list(LLAMA_TYPES))
def test_each_llama_type_loads_runs_and_stays_close(ftype: str, kmodel: Path, ids: torch.Tensor,
                                                    bf16_ref: np.ndarray, tmp_path: Path) -> None:
    res = export_gguf(kmodel, tmp_path / f"{ftype}.gguf", ftype)
    assert_types_are_the_plan(res.path, ftype)
    lt = LLAMA_TYPES[ftype]
    types = {t.name: t.qtype.name for t in res.tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == lt.experts and types["blk.0.ffn_down_exps.weight"] == lt.down
    for n in ("blk.0.attn_qkv.weight", "blk.3.attn_q.weight", "blk.0.ffn_up_shexp.weight"):
        assert types[n] == "Q8_0", n
    for n in ("blk.0.ffn_gate_inp.weight", "blk.0.ssm_a", "blk.0.attn_norm.weight", "blk.0.ffn_gate_inp_shexp.weight"):
        assert types[n] == "F32", n
    assert res.nbytes == res.path.stat().st_size
    got = llama_logits(res.path, ids, 2)
    d = kl(bf16_ref, got)
    top1 = float((got.argmax(-1) == bf16_ref.argmax(-1)).mean())
    print(f"{ftype}: KL vs bf16 {d:.2e}, top-1 {top1:.3f}, {res.nbytes} bytes")
    assert d <= KL_BOUND[ftype] and top1 >= 0.97, (d, top1)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no intermediates left


def test_more_bits_less_divergence(kmodel: Path, ids: torch.Tensor, bf16_ref: np.ndarray, tmp_path: Path) -> None:
    d = {t: kl(bf16_ref, llama_logits(export_gguf(kmodel, tmp_path / f"{t}.gguf", t).path, ids, 2))
         for t in ("q3_k_m", "q4_k_m", "q6_k")}
    print(d)
    assert d["q6_k"] < d["q4_k_m"] < d["q3_k_m"]


def test_imatrix_is_used_and_helps_where_it_weights(kmodel: Path, imatrix_file: Path, ids: torch.Tensor,
                                                     bf16_ref: np.ndarray, tmp_path: Path) -> None:
    """With the importance matrix, llama.cpp's K-quant search weights each column's error by its mean
    square input: the experts' input-weighted error must drop, and the file must still run and stay close."""
    from quantkit.export.source import ExportSource

    plain = export_gguf(kmodel, tmp_path / "plain.gguf", "q4_k_s")
    withim = export_gguf(kmodel, tmp_path / "im.gguf", "q4_k_s", imatrix=imatrix_file)
    assert any("importance matrix" in n for n in withim.notes)
    rd = {p: {t.name: t for t in gguf.GGUFReader(str(p)).tensors} for p in (plain.path, withim.path)}
    im = {t.name: np.asarray(t.data, dtype=np.float32) for t in gguf.GGUFReader(str(imatrix_file)).tensors}
    src = ExportSource.open(kmodel)
    w = src.dense("model.language_model.layers.1.mlp.experts.down_proj").float().numpy()  # [E, H, I]
    src.close()
    name = "blk.1.ffn_down_exps.weight"
    s2, cnt = im[name + ".in_sum2"], im[name + ".counts"].reshape(-1, 1)
    imp = np.where(cnt > 0, s2 / np.maximum(cnt, 1), 1.0)  # [E, I]
    err = {}
    for p in (plain.path, withim.path):
        t = rd[p][name]
        deq = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(w.shape)
        err[p] = float((((deq - w) ** 2) * imp[:, None, :]).sum())
    assert rd[plain.path][name].data.tobytes() != rd[withim.path][name].data.tobytes()
    assert err[withim.path] < err[plain.path], err
    d_plain, d_im = (kl(bf16_ref, llama_logits(r.path, ids, 2)) for r in (plain, withim))
    print(f"q4_k_s KL vs bf16: {d_plain:.2e} without, {d_im:.2e} with the imatrix; weighted err {err}")
    assert d_im <= KL_BOUND["q4_k_s"] and d_im <= 1.1 * d_plain


def test_cli_q4_k_m_with_and_without_imatrix(kmodel: Path, imatrix_file: Path, tmp_path: Path, capsys,
                                             monkeypatch) -> None:
    for extra in ([], ["--imatrix", str(imatrix_file)]):
        out = tmp_path / f"q{len(extra)}.gguf"
        code, o, err = run_cli(["export", "gguf", str(kmodel), str(out), "--type", "q4_k_m", *extra], capsys,
                               monkeypatch)
        assert code == 0, err
        assert "Q4_K" in o and "Q5_K" in o and read_gguf(out).arch == "qwen35moe"
        assert ("importance matrix" in o) == bool(extra)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q0.gguf", "q2.gguf"]


def test_row_length_fallback_is_llama_cpps_and_said(tiny_model: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    """The default tiny model (hidden 64, experts 32 wide) takes no 256-blocks: every K tensor falls back per
    llama.cpp's rule (Q4_K -> Q5_0, Q5_K -> Q5_1), the plan predicts it, the CLI names each, and it runs."""
    out = tmp_path / "fb.gguf"
    code, o, err = run_cli(["export", "gguf", str(tiny_model), str(out), "-t", "q4_k_m"], capsys, monkeypatch)
    assert code == 0, err
    assert_types_are_the_plan(out, "q4_k_m")
    types = {t.name: t.type for t in read_gguf(out).tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == "Q5_0" and types["blk.0.ffn_down_exps.weight"] == "Q5_1"
    assert "blk.0.ffn_gate_exps.weight: Q5_0 (fallback; row length 64 is not a multiple of 256" in o
    assert llama_logits(out, torch.zeros(1, 4, dtype=torch.long) + 5, 2).shape[1] == 4


def _write_fake_imatrix(path: Path, entries: dict[str, tuple[int, int]]) -> Path:
    from quantkit.testing.imatrix import write_imatrix_gguf

    sums = {n: (np.ones((m, k), np.float32), np.ones(m, np.float32)) for n, (m, k) in entries.items()}
    return write_imatrix_gguf(sums, path)


def test_bad_inputs_one_line_each(kmodel: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    out = tmp_path / "o.gguf"

    def cli(*args: str) -> tuple[int, str]:
        code, _, err = run_cli(["export", "gguf", str(kmodel), str(out), *args], capsys, monkeypatch)
        assert len(err.strip().splitlines()) == 1, err
        assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
        return code, err

    code, err = cli("-t", "q4_k_x")
    assert code == 2 and "q4_k_m" in err and "iq4_xs" in err and "mixed" in err
    other = _write_fake_imatrix(tmp_path / "other.gguf", {"blk.0.ffn_down_exps.weight": (8, 512)})
    code, err = cli("-t", "q4_k_m", "--imatrix", str(other))
    assert code == 2 and "blk.0.ffn_down_exps.weight" in err and "another model" in err
    alien = _write_fake_imatrix(tmp_path / "alien.gguf", {"blk.0.ffn_down_exps.weight": (8, 256),
                                                          "blk.77.ffn_down_exps.weight": (8, 256)})
    code, err = cli("-t", "q4_k_m", "--imatrix", str(alien))
    assert code == 2 and "blk.77" in err and "another model" in err
    notim = export_gguf(kmodel, tmp_path / "model.gguf", "q8_0").path
    code, err = cli("-t", "q4_k_m", "--imatrix", str(notim))
    assert code == 2 and "not an importance-matrix GGUF" in err
    trunc = tmp_path / "trunc.gguf"
    trunc.write_bytes(other.read_bytes()[:-100])
    code, err = cli("-t", "q4_k_m", "--imatrix", str(trunc))
    assert code == 2 and "truncated" in err
    code, err = cli("-t", "q8_0", "--imatrix", str(other))
    assert code == 2 and "--imatrix applies" in err
    import quantkit.outputs as outputs

    with monkeypatch.context() as mp:  # free disk is checked before anything is written
        mp.setattr(outputs.shutil, "disk_usage", lambda _p: shutil._ntuple_diskusage(1 << 40, 1 << 40, 1 << 20))
        code, err = cli("-t", "q4_k_m")
        assert code == 2 and "not enough free disk" in err
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # the optional binding missing
    code, err = cli("-t", "q4_k_m")
    assert code == 2 and "pip install" in err and "llama-cpp-python" in err


@pytest.mark.parametrize("when", ["quantize", "interrupt"])
def test_failure_and_ctrl_c_leave_nothing(when: str, kmodel: Path, tmp_path: Path, monkeypatch) -> None:
    import quantkit.export.gguf as gx

    def boom(src: Path, dst: Path, *a: object, **k: object) -> None:
        assert src.is_file() and src.name.startswith(".")  # the bf16 intermediate exists now
        dst.write_bytes(b"GGUF partial")
        if when == "interrupt":
            raise KeyboardInterrupt
        raise QuantkitError("llama.cpp's quantizer failed (test)")

    monkeypatch.setattr(gx, "quantize_gguf", boom)
    with pytest.raises(KeyboardInterrupt if when == "interrupt" else QuantkitError):
        export_gguf(kmodel, tmp_path / "x.gguf", "q4_k_m")
    assert list(tmp_path.iterdir()) == []
