"""`quantkit export gguf --type q4_k_m|...` through llama.cpp's own quantizer, proven by llama.cpp itself.

A decisive-routing tiny model whose rows take K-quant blocks (hidden 256, expert intermediate 256: the
K-quants' super-block is 256) is exported to every llama.cpp type, with and without an importance matrix
(collected from transformers' forward on calibration text, written in llama.cpp's imatrix GGUF format),
loaded and run by `llama_cpp.Llama`, and compared with llama.cpp running the bf16 export (KL divergence and
top-1 agreement). Each file's tensor types are read back and must be the recipe's
(quantkit.export.gguf_types.tensor_type), so the planner's byte sizes are the file's.

The MTP layer: the tiny model with one (`quantkit tiny-model --mtp-layer`) exports it as llama.cpp's NextN block,
read back with the `gguf` reader (names, `nextn_predict_layers`, `block_count`, values against the checkpoint),
loaded by `llama_cpp.Llama` (which leaves the block on disk: the trunk's logits are the --no-mtp file's, bit
for bit), and its MTP graph run through llama-cpp-python's C API as llama-server's draft-mtp runs it (an
LLAMA_CONTEXT_TYPE_MTP context on the same weights, fed the pairs (token p + 1, final-normed hidden p) by
`llama_process`), against quantkit's own MTP layer (runtime/model/qwen3_5_moe.py) on the same pairs. The target's
hidden states come from `llama_get_embeddings_ith` (the same final-normed tensor llama.cpp's MTP seed is); a
second chained draft, fed the MTP graph's own hidden state, is not driven: that state is read only by
`llama_get_embeddings_nextn`, a staging C++ function (src/llama-ext.h) the library exports under its mangled
name only and the binding does not wrap (the MTP graph sets no t_embd for llama_get_embeddings_ith).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from quantkit.bench.llama_worker import llama_logits
from quantkit.checkpoint.gguf_file import read_gguf
from quantkit.errors import QuantkitError
from quantkit.export.gguf import export_gguf
from quantkit.export.gguf_types import LLAMA_TYPES, tensor_bytes, tensor_type

from helpers.cli import TINY_KW, run_cli

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


@pytest.mark.slow
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


@pytest.mark.slow
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


# ---- the MTP layer as llama.cpp's NextN block ------------------------------------------------------------

MTP_IDS = [5, 17, 100, 33, 250, 7, 9, 61, 400, 12, 3, 88, 150, 42, 600, 21]
# (top-1 agreement at least, max |logit error| at most) of llama.cpp's MTP graph against quantkit's MTP layer on
# the same pairs (quantkit computes in bf16). Measured (15 pairs): f32 from the bf16 checkpoint 1.0 / 3.5e-3;
# mixed from the int4 g32 folder (its experts' codes reused as Q4_0; llama.cpp's Q8_0 activations) 1.0 / 8.8e-3.
# Error bounds about 2.5x; the random MTP layer's closest top-2 gap is 1.2e-2, so mixed may flip one of 15.
# Either half of eh_proj's input in the wrong place, or a norm without its + 1, is off by 0.5 or more.
MTP_BOUND = {"f32": (1.0, 9e-3), "mixed": (0.93, 2.2e-2)}


def llama_mtp(path: Path, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp on `path` through llama-cpp-python's C API, as llama-server's draft-mtp drives it: one decode of
    `ids` with embeddings on (the trunk's final-normed hidden states, what llama.cpp's MTP seed is), then its MTP
    graph in an LLAMA_CONTEXT_TYPE_MTP context on the same weights, `llama_process` on the pairs
    (ids[p + 1], hidden[p]). (trunk logits [n, V], MTP logits [n - 1, V], hidden [n, H])."""
    import ctypes

    import llama_cpp as L

    def rows(ctx: object, n: int, width: int, embd: bool = False) -> np.ndarray:
        get = L.llama_get_embeddings_ith if embd else L.llama_get_logits_ith
        return np.stack([np.ctypeslib.as_array(get(ctx, i), (width,)).copy() for i in range(n)])

    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.load_mtp = True  # llama.cpp skips the NextN block unless asked (llama-server: --spec-type draft-mtp)
    model = L.llama_model_load_from_file(str(path).encode(), mp)
    assert model, path
    n, n_embd = len(ids), L.llama_model_n_embd(model)
    vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    ctxs, batch, bx = [], None, None
    try:
        assert L.llama_model_n_layer_nextn(model) == 1
        for kind in (L.LLAMA_CONTEXT_TYPE_DEFAULT, L.LLAMA_CONTEXT_TYPE_MTP):
            cp = L.llama_context_default_params()
            cp.n_ctx = cp.n_batch = cp.n_ubatch = 64
            cp.n_threads = cp.n_threads_batch = 2
            cp.embeddings = kind == L.LLAMA_CONTEXT_TYPE_DEFAULT
            cp.ctx_type = kind
            ctxs.append(L.llama_init_from_model(model, cp))
            assert ctxs[-1], f"context type {kind}"
        tgt, dft = ctxs
        batch = L.llama_batch_init(n, 0, 1)
        for i, t in enumerate(ids):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = t, i, 1, True
            batch.seq_id[i][0] = 0
        batch.n_tokens = n
        assert L.llama_decode(tgt, batch) == 0
        logits, hidden = rows(tgt, n, vocab), rows(tgt, n, n_embd, embd=True)
        bx = L.llama_batch_ext_init(dft)
        keep = []  # what the batch points into, alive until llama_process has read it
        for p in range(n - 1):
            idx = L.llama_batch_ext_add_token(bx, 0, ids[p + 1])
            pos = (L.llama_pos * 4)(p + 1)
            h = np.ascontiguousarray(hidden[p], dtype=np.float32)
            keep += [pos, h]
            embd = L.llama_embd(h.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, n_embd)
            assert idx == p and L.llama_batch_ext_set_pos(bx, idx, pos)
            assert L.llama_batch_ext_set_embd_token(bx, idx, embd) and L.llama_batch_ext_set_output_logits(bx, idx, True)
        assert L.llama_process(dft, L.LLAMA_PROCESS_TYPE_DECODE, bx) == 0
        return logits, rows(dft, n - 1, vocab), hidden
    finally:
        if bx is not None:
            L.llama_batch_ext_free(bx)
        if batch is not None:
            L.llama_batch_free(batch)
        for c in ctxs:
            if c:
                L.llama_free(c)
        L.llama_model_free(model)


def quantkit_mtp(folder: Path, ids: list[int], hidden: np.ndarray) -> np.ndarray:
    """quantkit's MTP layer on the same pairs (ids[p + 1], hidden[p]), one at a time as its drafts run, every
    row of the head scored."""
    from quantkit.runtime import load_model

    rt = load_model(folder, forced_route="torch", mtp_copies=False)  # the layer's matrices as stored, not int4
    mtp = rt.model.mtp
    mtp.draft_rows = 0
    cache = mtp.new_cache(64)
    h = torch.from_numpy(hidden)
    with torch.no_grad():
        return np.stack([mtp.forward(rt.model, [ids[p + 1]], h[p:p + 1], cache)[0].float().view(-1).numpy()
                         for p in range(len(ids) - 1)])


@pytest.fixture(scope="module")
def mtp_int4(tiny_model_mtp: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny_model_mtp quantized with its MTP layer kept: experts (the MTP layer's too) int4 symmetric g32 (Q4_0's
    own codes), attention, shared expert and MTP fc int8."""
    from quantkit.checkpoint.reader import Checkpoint
    from quantkit.checkpoint.spec import Role
    from quantkit.formats import QuantSpec
    from quantkit.quantize.run import QuantizeOptions, run_quantize
    from quantkit.recipe import INT8, Recipe

    out = tmp_path_factory.mktemp("mtpq") / "int4g32"
    rules = {Role.ROUTED_EXPERT: QuantSpec("int4", 32), Role.ATTENTION: INT8, Role.SHARED_EXPERT: INT8}
    with Checkpoint.open(tiny_model_mtp) as ck:
        run_quantize(ck, out, QuantizeOptions(Recipe("experts-int4-g32", rules)))
    return out


def test_mtp_layer_is_llama_cpps_nextn_block(tiny_model_mtp: Path, tmp_path: Path) -> None:
    from quantkit.checkpoint.reader import Checkpoint

    res = export_gguf(tiny_model_mtp, tmp_path / "mtp.gguf", "f32")
    rd = gguf.GGUFReader(str(res.path))
    key = {k: f.parts[f.data[0]].tolist()[0] for k, f in rd.fields.items() if k.startswith("qwen35moe.")
           and len(f.data) == 1}
    assert key["qwen35moe.block_count"] == 5 and key["qwen35moe.nextn_predict_layers"] == 1
    rec = rd.fields["qwen35moe.attention.recurrent_layers"]
    assert [bool(rec.parts[i][0]) for i in rec.data] == [True, True, True, False, False]
    t = {x.name: np.array(x.data) for x in rd.tensors}
    blk4 = {n[len("blk.4."):] for n in t if n.startswith("blk.4.")}
    assert blk4 == {"nextn.eh_proj.weight", "nextn.enorm.weight", "nextn.hnorm.weight",
                    "nextn.shared_head_norm.weight", "attn_norm.weight", "post_attention_norm.weight",
                    "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "attn_q_norm.weight",
                    "attn_k_norm.weight", "ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight",
                    "ffn_down_exps.weight", "ffn_gate_inp_shexp.weight", "ffn_gate_shexp.weight",
                    "ffn_up_shexp.weight", "ffn_down_shexp.weight"}
    with Checkpoint.open(tiny_model_mtp) as ck:
        def w(name: str) -> np.ndarray:
            return ck.load(name).float().numpy()

        assert np.array_equal(t["blk.4.nextn.eh_proj.weight"], w("mtp.fc.weight"))  # no half of its input moved
        for g, c in (("enorm", "pre_fc_norm_embedding"), ("hnorm", "pre_fc_norm_hidden"), ("shared_head_norm", "norm")):
            assert np.array_equal(t[f"blk.4.nextn.{g}.weight"], w(f"mtp.{c}.weight") + 1), g  # x (1 + w) as llama's x w
        assert np.array_equal(t["blk.4.attn_q.weight"], w("mtp.layers.0.self_attn.q_proj.weight"))
        for p in ("gate", "up", "down"):
            assert t[f"blk.4.ffn_{p}_exps.weight"].shape[0] == 8
            for e in range(8):
                assert np.array_equal(t[f"blk.4.ffn_{p}_exps.weight"][e],
                                      w(f"mtp.layers.0.mlp.experts.{e}.{p}_proj.weight")), (p, e)
    # without MTP drafting llama.cpp leaves the block on disk: the trunk is the --no-mtp file's, bit for bit
    plain = export_gguf(tiny_model_mtp, tmp_path / "plain.gguf", "f32", mtp=False)
    assert not any(n.startswith("blk.4.") for n in {x.name for x in gguf.GGUFReader(str(plain.path)).tensors})
    assert "qwen35moe.nextn_predict_layers" not in gguf.GGUFReader(str(plain.path)).fields
    ids = torch.tensor([MTP_IDS])
    assert np.array_equal(llama_logits(res.path, ids, 2), llama_logits(plain.path, ids, 2))


@pytest.mark.parametrize("ftype", ["f32", "mixed"])
def test_llama_cpps_mtp_graph_drafts_what_quantkits_mtp_layer_does(ftype: str, tiny_model_mtp: Path, mtp_int4: Path,
                                                                  tmp_path: Path) -> None:
    """f32 of the bf16 checkpoint, and mixed of the int4 folder (MTP experts' codes reused as Q4_0, its fc and
    attention Q8_0 by their roles): llama.cpp's MTP graph gives quantkit's MTP layer's logits on the same pairs."""
    src = tiny_model_mtp if ftype == "f32" else mtp_int4
    res = export_gguf(src, tmp_path / f"{ftype}.gguf", ftype)
    types = {t.name: (t.qtype.name, t.how) for t in res.tensors}
    if ftype == "mixed":
        for p in ("gate", "up", "down"):
            assert types[f"blk.4.ffn_{p}_exps.weight"] == ("Q4_0", "reused"), p
        assert types["blk.4.nextn.eh_proj.weight"][0] == types["blk.4.attn_q.weight"][0] == "Q8_0"
    logits, mtp, hidden = llama_mtp(res.path, MTP_IDS)
    assert np.isfinite(logits).all() and np.isfinite(mtp).all()
    want = quantkit_mtp(src, MTP_IDS, hidden)
    top1 = float((mtp.argmax(-1) == want.argmax(-1)).mean())
    err = float(np.abs(mtp - want).max())
    print(f"{ftype}: llama.cpp MTP vs quantkit MTP top-1 {top1:.3f}, max |dlogit| {err:.2e} "
          f"(logits up to {np.abs(want).max():.2f})")
    assert top1 >= MTP_BOUND[ftype][0] and err <= MTP_BOUND[ftype][1], (top1, err)


def test_mtp_block_through_llama_cpps_quantizer(tiny_model_mtp: Path, tmp_path: Path) -> None:
    """q4_k_m: llama.cpp's quantizer takes the NextN block with the recipe (experts at the type, eh_proj and
    attention Q8_0, row-length fallbacks as planned), and its MTP graph still runs on the result."""
    res = export_gguf(tiny_model_mtp, tmp_path / "q.gguf", "q4_k_m")
    assert_types_are_the_plan(res.path, "q4_k_m")
    types = {t.name: t.type for t in read_gguf(res.path).tensors}
    assert types["blk.4.ffn_gate_exps.weight"] == types["blk.0.ffn_gate_exps.weight"] == "Q5_0"  # Q4_K's fallback
    assert types["blk.4.nextn.eh_proj.weight"] == types["blk.4.attn_q.weight"] == "Q8_0"
    assert types["blk.4.nextn.enorm.weight"] == "F32"
    _, mtp, _ = llama_mtp(res.path, MTP_IDS[:6])
    assert mtp.shape == (5, 832) and np.isfinite(mtp).all()
