"""`quantkit export gguf`, proven by llama.cpp itself (llama-cpp-python, built from its sdist in CI).

The exported GGUF of the decisive-routing tiny model (real qwen3_5_moe architecture: Gated DeltaNet with
fewer key than value heads, so the value-head reordering is exercised, gated attention, shared + routed
experts, zero-centred norms) is loaded by `llama_cpp.Llama` and its logits are compared with transformers'
fp32 on the same weights:
- f32: against the checkpoint itself (no quantization anywhere): near-exact;
- q8_0 / q4_0 / mxfp4 / mixed: against transformers running the GGUF's own weights, dequantized and mapped
  back (so the bound says "llama.cpp computes this model", whatever the quantization error), and against
  the bf16 checkpoint (the quantization error each type costs, printed and bounded).
Bounds were measured on this machine and set with margin (see the constants below); the model's routing
is decisive, so expert choice cannot flip under rounding and the bounds do not hide a flaky tie.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from quantkit.checkpoint.gguf_layout import pieces_for
from quantkit.export.gguf import export_gguf
from quantkit.export.source import ExportSource

from helpers.cli import run_cli

# CI builds llama-cpp-python and sets QUANTKIT_REQUIRE_ENGINES=1, so a missing build fails there instead
# of skipping the proof; elsewhere (a machine without the 4-minute build) these tests skip.
if os.environ.get("QUANTKIT_REQUIRE_ENGINES") == "1":
    import llama_cpp
else:
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (CI builds it)")
import gguf  # noqa: E402

N_SEQ, SEQ_LEN = 3, 48
# (top-1 agreement at least, max |logit error| at most) for llama.cpp vs transformers on the same weights.
# Measured (3 x 48 tokens): f32 1.0 / 7.0e-5; q8_0 1.0 / 8.1e-3; q4_0 1.0 / 7.5e-3; mxfp4 1.0 / 7.9e-3;
# mixed 1.0 / 8.1e-3. The quantized files' residual is llama.cpp quantizing ACTIVATIONS to 8 bits in its
# block dot products (transformers multiplies in fp32); bounds are about 2.5x the measurement.
SAME_WEIGHTS = {"f32": (1.0, 5e-4), "q8_0": (0.99, 2e-2), "q4_0": (0.99, 2e-2), "mxfp4": (0.99, 2e-2),
                "mixed": (0.99, 2e-2)}
# top-1 agreement with the bf16 checkpoint at least (quantization error included). Measured: q8_0 1.0
# (max 1.2e-2), q4_0 0.993 (max 0.133), mxfp4 0.993 (max 0.161), mixed 1.0 (max 1.5e-2).
VS_BF16 = {"f32": 1.0, "q8_0": 0.99, "q4_0": 0.97, "mxfp4": 0.97, "mixed": 0.99}


def prompts() -> torch.Tensor:
    from quantkit.testing.tiny import probe_ids

    return probe_ids(N_SEQ, SEQ_LEN)


def llama_logits(path: Path, ids: torch.Tensor) -> np.ndarray:
    llm = llama_cpp.Llama(model_path=str(path), logits_all=True, n_ctx=SEQ_LEN + 16, n_batch=SEQ_LEN + 16,
                          n_threads=2, verbose=False)
    out = []
    for row in ids.tolist():
        llm.reset()
        llm.eval(row)
        out.append(np.array(llm.scores[: len(row)], dtype=np.float32))
    llm.close()
    return np.stack(out)


def hf_logits(model, ids: torch.Tensor) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=ids).logits.float().numpy()


def gguf_weights(path: Path, src: Path) -> dict[str, torch.Tensor]:
    """The GGUF's tensors dequantized and mapped back to canonical (transformers-side) tensors: the
    conversions undone (norm - 1, A_log = log(-ssm_a), value heads back to grouped order, gate/up fused)."""
    reader = gguf.GGUFReader(str(path))
    raw = {t.name: t for t in reader.tensors}
    s = ExportSource.open(src)
    out: dict[str, torch.Tensor] = {}
    for st in s.tensors():
        pcs = pieces_for(st.name, st.shape, s.text)
        if not pcs:
            continue
        full = torch.zeros(st.shape, dtype=torch.float32)
        for pc in pcs:
            t = raw[pc.gguf_name]
            w = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
            w = w.reshape(pc.shape)
            if pc.value == "norm+1":
                w = w - 1
            elif pc.value == "-exp":
                w = torch.log(-w)
            if pc.col_perm is not None:
                w = w.index_select(w.dim() - 1, torch.argsort(pc.col_perm))
            if pc.row_perm is not None:
                w = w.index_select(0 if w.dim() == 1 else w.dim() - 2, torch.argsort(pc.row_perm))
            if pc.rows is not None:
                full[..., pc.rows, :] = w
            else:
                full = w.reshape(st.shape)
        out[st.name] = full
    s.close()
    return out


def reference_with(src: Path, weights: dict[str, torch.Tensor]):
    """transformers' fp32 model of `src` with its weights replaced by `weights` (canonical names)."""
    from quantkit.testing.tiny import load_reference_model

    model = load_reference_model(src)
    sd = model.state_dict()
    new = {}
    for name, w in weights.items():
        key = "model." + name[len("model.language_model."):] if name.startswith("model.language_model.") else name
        assert key in sd, key
        new[key] = w.to(sd[key].dtype).reshape(sd[key].shape)
    missing = set(sd) - set(new)
    assert not missing, sorted(missing)[:3]
    model.load_state_dict(new)
    return model


def compare(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    top1 = float((a.argmax(-1) == b.argmax(-1)).mean())
    return top1, float(np.abs(a - b).max())


@pytest.fixture(scope="module")
def exports(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("gguf")
    return {ty: export_gguf(tiny_model, d / f"tiny-{ty}.gguf", ty).path for ty in SAME_WEIGHTS}


@pytest.fixture(scope="module")
def bf16_logits(tiny_model: Path) -> np.ndarray:
    from quantkit.testing.tiny import load_reference_model

    return hf_logits(load_reference_model(tiny_model), prompts())


def test_f32_export_matches_transformers(exports: dict[str, Path], bf16_logits: np.ndarray) -> None:
    got = llama_logits(exports["f32"], prompts())
    top1, err = compare(got, bf16_logits)
    print(f"f32: top-1 {top1:.4f}, max |dlogit| {err:.2e}")
    assert top1 >= SAME_WEIGHTS["f32"][0] and err <= SAME_WEIGHTS["f32"][1]


@pytest.mark.parametrize("ty", ["q8_0", "q4_0", "mxfp4", "mixed"])
def test_quantized_export_matches_transformers_on_its_weights(ty: str, exports: dict[str, Path], tiny_model: Path,
                                                              bf16_logits: np.ndarray) -> None:
    ids = prompts()
    got = llama_logits(exports[ty], ids)
    ref = hf_logits(reference_with(tiny_model, gguf_weights(exports[ty], tiny_model)), ids)
    top1, err = compare(got, ref)
    q_top1, q_err = compare(got, bf16_logits)
    print(f"{ty}: vs same weights top-1 {top1:.4f} max {err:.2e}; vs bf16 top-1 {q_top1:.4f} max {q_err:.2e}")
    assert top1 >= SAME_WEIGHTS[ty][0] and err <= SAME_WEIGHTS[ty][1], (top1, err)
    assert q_top1 >= VS_BF16[ty], q_top1


def kl(ref: np.ndarray, got: np.ndarray) -> float:
    r = torch.log_softmax(torch.from_numpy(ref).double(), -1)
    g = torch.log_softmax(torch.from_numpy(got).double(), -1)
    return float((r.exp() * (r - g)).sum(-1).mean())


def test_mixed_default_experts_are_the_measured_better_type(tiny_model: Path, tmp_path: Path,
                                                              bf16_logits: np.ndarray) -> None:
    """mixed's Q4_0 experts (fp16 scale per 32) beat MXFP4 (power-of-two scale per 32) through llama.cpp.
    Measured: KL vs bf16 3.7e-6 (Q4_0) vs 4.8e-6 (MXFP4); expert weight SQNR 21.3 vs 18.9 dB."""
    out = {}
    for et in ("q4_0", "mxfp4"):
        res = export_gguf(tiny_model, tmp_path / f"{et}.gguf", "mixed", expert_type=et)
        assert {t.qtype.name for t in res.tensors if "_exps" in t.name} == {et.upper()}
        out[et] = kl(bf16_logits, llama_logits(res.path, prompts()))
    print(f"mixed experts: KL vs bf16 q4_0 {out['q4_0']:.2e}, mxfp4 {out['mxfp4']:.2e}")
    assert out["q4_0"] < out["mxfp4"]


def test_mixed_types_follow_the_recipe(exports: dict[str, Path]) -> None:
    reader = gguf.GGUFReader(str(exports["mixed"]))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == "Q4_0" and types["blk.0.ffn_down_exps.weight"] == "Q4_0"
    for n in ("blk.0.attn_qkv.weight", "blk.0.ssm_out.weight", "blk.3.attn_q.weight", "blk.0.ffn_up_shexp.weight",
              "output.weight", "token_embd.weight"):
        assert types[n] == "Q8_0", n
    for n in ("blk.0.ffn_gate_inp.weight", "blk.0.ssm_a", "blk.0.ssm_conv1d.weight", "blk.0.attn_norm.weight",
              "blk.0.ffn_gate_inp_shexp.weight", "output_norm.weight", "blk.0.ssm_dt.bias"):
        assert types[n] == "F32", n
    f = {k: reader.fields[k] for k in reader.fields}
    assert bytes(f["general.architecture"].parts[-1]).decode() == "qwen35moe"
    assert bytes(f["tokenizer.ggml.pre"].parts[-1]).decode() == "qwen35"
    assert "tokenizer.chat_template" in f


def test_tokenizer_and_generation(exports: dict[str, Path], tiny_model: Path) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    llm = llama_cpp.Llama(model_path=str(exports["f32"]), n_ctx=256, n_threads=2, verbose=False)
    text = "<|im_start|>user\n$ git status\nOn branch main, 2048 tokens: hello world!<|im_end|>\n"
    assert llm.tokenize(text.encode(), add_bos=False, special=True) == tok.encode(text).ids
    # greedy generation: llama.cpp's continuation equals transformers' (decisive routing, f32 weights)
    from quantkit.testing.tiny import load_reference_model

    prompt = tok.encode("<|im_start|>user\nThe agent world model predicts").ids
    ref = load_reference_model(tiny_model)
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
    got = []
    for t in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        got.append(t)
        if len(got) == 12:
            break
    assert got == want
    chat = llm.create_chat_completion(messages=[{"role": "user", "content": "hello"}], max_tokens=8, temperature=0)
    assert chat["usage"]["completion_tokens"] >= 1
    llm.close()


def test_quantkit_codes_are_reused(tiny_model: Path, tmp_path: Path) -> None:
    """A quantkit MXFP4 folder exports its bytes as they are (the same file as exporting the bf16 source to
    MXFP4, since quantkit's MXFP4 is byte-identical to ggml's), and int4 g32 becomes Q4_0 without
    requantizing: llama.cpp then matches transformers on the quantkit folder's own dequantized weights."""
    from quantkit.checkpoint.reader import Checkpoint
    from quantkit.checkpoint.spec import Role
    from quantkit.formats import QuantSpec
    from quantkit.quantize.run import QuantizeOptions, run_quantize
    from quantkit.recipe import Recipe

    mats = (Role.ROUTED_EXPERT, Role.SHARED_EXPERT, Role.ATTENTION, Role.LINEAR_ATTENTION, Role.LM_HEAD,
            Role.EMBEDDING)
    qm = tmp_path / "qm"
    run_quantize(Checkpoint.open(tiny_model), qm, QuantizeOptions(Recipe("m", dict.fromkeys(mats, QuantSpec("mxfp4", 32)))))
    r1 = export_gguf(qm, tmp_path / "a.gguf", "mxfp4")
    export_gguf(tiny_model, tmp_path / "b.gguf", "mxfp4")
    reused = {t.name for t in r1.tensors if t.how == "reused"}
    # every MXFP4 tensor is reused except ssm_out (its value-head column reorder moves 16-wide heads
    # inside 32-wide blocks here (tiny head dim), so it is requantized and says so) and ssm_alpha/ssm_beta
    # (in_proj_a/b: every recipe keeps them bf16, recipe.KEPT_MATRICES, so the export quantizes them)
    mx = {t.name for t in r1.tensors if t.qtype.name == "MXFP4"}
    assert mx - reused == {f"blk.{i}.{n}.weight" for i in range(3) for n in ("ssm_out", "ssm_alpha", "ssm_beta")}
    a, b = ({t.name: t.data.tobytes() for t in gguf.GGUFReader(str(p)).tensors} for p in (tmp_path / "a.gguf",
                                                                                       tmp_path / "b.gguf"))
    assert all(a[n] == b[n] for n in reused)  # copied codes = ggml's own MXFP4 of the bf16 weights

    qi = tmp_path / "qi"
    run_quantize(Checkpoint.open(tiny_model), qi, QuantizeOptions(Recipe("i", {Role.ROUTED_EXPERT: QuantSpec("int4", 32)})))
    r3 = export_gguf(qi, tmp_path / "c.gguf", "mixed")
    reused = {t.name for t in r3.tensors if t.how == "reused"}
    assert reused and all("_exps" in n for n in reused) and len(reused) == 12  # 4 layers x gate, up, down
    s = ExportSource.open(qi)
    ref = reference_with(tiny_model, {t.name: s.dense(t.name) for t in s.tensors()})
    ids = prompts()
    got, want = llama_logits(tmp_path / "c.gguf", ids), hf_logits(ref, ids)
    # experts exactly as stored; the rest Q8_0 of bf16, so the bound is q8_0's
    top1, err = compare(got, want)
    assert top1 >= 0.95, top1


def test_row_length_fallback(tmp_path: Path) -> None:
    """Experts with intermediate size 48: down_proj rows (48) take no 32-block type; they fall back to F16,
    the result says so, and llama.cpp still matches transformers."""
    from quantkit.testing.tiny import load_reference_model, make_tiny_model

    src = make_tiny_model(tmp_path / "t48", decisive=True, intermediate=48)
    res = export_gguf(src, tmp_path / "t48.gguf", "q8_0")
    fb = {t.name: t for t in res.tensors if t.how == "fallback"}
    assert set(fb) == {f"blk.{i}.ffn_down_exps.weight" for i in range(4)} | {
        f"blk.{i}.ffn_down_shexp.weight" for i in range(4)}
    assert all(t.qtype.name == "F16" and "not a multiple of 32" in t.note for t in fb.values())
    ids = prompts()[:1]
    top1, err = compare(llama_logits(res.path, ids), hf_logits(load_reference_model(src), ids))
    assert top1 >= 0.99, top1


def test_bad_inputs_one_line_each(tiny_model: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    code, _, err = run_cli(["export", "gguf", str(tmp_path / "nope"), str(tmp_path / "o.gguf")], capsys, monkeypatch)
    assert code == 2 and "no such checkpoint folder" in err and len(err.strip().splitlines()) == 1
    bad = tmp_path / "bad"
    shutil.copytree(tiny_model, bad)
    shard = sorted(bad.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:200])
    code, _, err = run_cli(["export", "gguf", str(bad), str(tmp_path / "o.gguf")], capsys, monkeypatch)
    assert code == 2 and "re-download it" in err and len(err.strip().splitlines()) == 1
    code, _, err = run_cli(["export", "gguf", str(tiny_model), str(tmp_path / "o.gguf"), "--type", "q2_k"],
                           capsys, monkeypatch)
    assert code == 2 and "--type" in err and len(err.strip().splitlines()) == 1
    existing = tmp_path / "exists.gguf"
    existing.write_bytes(b"keep")
    code, _, err = run_cli(["export", "gguf", str(tiny_model), str(existing)], capsys, monkeypatch)
    assert code == 2 and "--overwrite" in err and existing.read_bytes() == b"keep"
    notok = tmp_path / "notok"
    shutil.copytree(tiny_model, notok)
    tj = json.loads((notok / "tokenizer.json").read_text())
    tj["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r"\s+"
    (notok / "tokenizer.json").write_text(json.dumps(tj))
    code, _, err = run_cli(["export", "gguf", str(notok), str(tmp_path / "t.gguf")], capsys, monkeypatch)
    assert code == 2 and "pre-tokenizer" in err and not (tmp_path / "t.gguf").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporaries left behind
    code, out, _ = run_cli(["export", "gguf", str(tiny_model), str(tmp_path / "ok.gguf")], capsys, monkeypatch)
    assert code == 0 and "qwen35" in out and (tmp_path / "ok.gguf").is_file()
    code, out, _ = run_cli(["export", "gguf", str(tiny_model), str(tmp_path / "ok.gguf"), "--overwrite", "-t", "q8_0"],
                           capsys, monkeypatch)
    assert code == 0


@pytest.mark.parametrize("drop", ["mtp.fc.weight", "mtp.layers.0.mlp.experts.5.up_proj.weight"])
def test_incomplete_mtp_layer_is_refused_and_no_mtp_leaves_it_out(drop: str, tiny_model_mtp: Path, tmp_path: Path,
                                                                   capsys, monkeypatch) -> None:
    """A checkpoint whose MTP layer lacks a tensor llama.cpp's NextN block needs (its eh_proj, one expert of a
    stack) is refused in one line naming it, nothing written; --no-mtp exports the rest, and says so."""
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    shutil.copytree(tiny_model_mtp, src)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    shard = src / index["weight_map"].pop(drop)
    tensors = load_file(shard)
    del tensors[drop]
    save_file(tensors, shard, metadata={"format": "pt"})
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    out = tmp_path / "o.gguf"
    code, _, err = run_cli(["export", "gguf", str(src), str(out), "-t", "q8_0"], capsys, monkeypatch)
    want = "nextn.eh_proj.weight" if drop == "mtp.fc.weight" else "7 of the 8 experts of blk.4.ffn_up_exps.weight"
    assert code == 2 and want in err and "--no-mtp" in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    code, so, err = run_cli(["export", "gguf", str(src), str(out), "-t", "q8_0", "--no-mtp"], capsys, monkeypatch)
    assert code == 0, err
    assert "note: MTP layer not exported (--no-mtp" in so
    names = {t.name for t in gguf.GGUFReader(str(out)).tensors}
    assert "blk.3.attn_q.weight" in names and not any(n.startswith("blk.4.") for n in names)


def test_mtp_expert_codes_are_reused_in_stack_order(tiny_model_mtp: Path, tmp_path: Path) -> None:
    """A quantkit MXFP4 folder's MTP experts are copied into the NextN block's stacks, expert e at row e: the same
    bytes as the bf16 source's MTP experts quantized to MXFP4 by the export (quantkit's MXFP4 is ggml's)."""
    from quantkit.checkpoint.reader import Checkpoint
    from quantkit.checkpoint.spec import Role
    from quantkit.formats import QuantSpec
    from quantkit.quantize.run import QuantizeOptions, run_quantize
    from quantkit.recipe import Recipe

    qm = tmp_path / "qm"
    with Checkpoint.open(tiny_model_mtp) as ck:
        run_quantize(ck, qm, QuantizeOptions(Recipe("m", {Role.ROUTED_EXPERT: QuantSpec("mxfp4", 32)})))
    reused = export_gguf(qm, tmp_path / "a.gguf", "mxfp4")
    export_gguf(tiny_model_mtp, tmp_path / "b.gguf", "mxfp4")
    how = {t.name: t.how for t in reused.tensors}
    stacks = [f"blk.4.ffn_{p}_exps.weight" for p in ("gate", "up", "down")]
    assert all(how[n] == "reused" for n in stacks)
    a, b = ({t.name: t for t in gguf.GGUFReader(str(p)).tensors} for p in (tmp_path / "a.gguf", tmp_path / "b.gguf"))
    for n in stacks:
        assert a[n].data.shape[0] == 8 and a[n].data.tobytes() == b[n].data.tobytes(), n
