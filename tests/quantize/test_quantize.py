"""The streaming quantizer end to end, through the CLI, on tiny checkpoints of the real architecture."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import quantkit.cli
import quantkit.quantize.run as qz
from quantkit.checkpoint.contract import INDEX_NAME
from quantkit.checkpoint.reader import Checkpoint
from quantkit.formats import QuantSpec, get_format
from quantkit.quantize.manifest import JOURNAL_NAME, MANIFEST_NAME

from helpers.cli import interrupt_quantizer_after, run_main, sigkill_mid_run
from helpers.quantize import main_cli, qconfig, runner, stored

quantkit.cli._register()
LM = "model.language_model."
WEIGHT_FILES = ("*.safetensors",)


def cli(*args: str):
    return runner.invoke(quantkit.cli.app, [str(a) for a in args], catch_exceptions=False)


def dequantized(folder: Path) -> dict[str, torch.Tensor]:
    """Every weight of a quantized folder back in fp32, by the formats' own dequantize."""
    st = stored(folder)
    qc = qconfig(folder)
    out = {}
    for name, d in qc["tensors"].items():
        spec = QuantSpec.from_dict(d)
        parts = {k[len(name) + 1:]: v for k, v in st.items() if k.startswith(name + ".")}
        out[name] = get_format(spec.format).dequantize(parts, spec, tuple(d["shape"]), torch.float32)
    for k, v in st.items():
        if k not in out and k.rsplit(".", 1)[0] not in qc["tensors"]:
            out[k] = v.float()
    return out


def source_weights(src: Path) -> dict[str, torch.Tensor]:
    ck = Checkpoint.open(src)
    return {t.name: ck.load(t.name).float() for t in ck.canonical()}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def q4(tiny_model, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("q") / "q4"
    r = cli("quantize", tiny_model, "--bits", "4", "--out", out, "--max-shard-size", "100KB")
    assert r.exit_code == 0, r.output
    return out


def test_bits4_quality_recipe_end_to_end(tiny_model, q4):
    qc = qconfig(q4)
    assert qc["quant_method"] == "quantkit" and qc["version"] == 1 and qc["recipe"]["name"] == "quality"
    fmts = {n: d["format"] for n, d in qc["tensors"].items()}
    assert fmts[f"{LM}layers.0.mlp.experts.gate_up_proj"] == "int4"
    assert fmts[f"{LM}layers.0.mlp.experts.down_proj"] == "int4"
    assert fmts[f"{LM}layers.0.linear_attn.in_proj_qkv.weight"] == "int8"
    assert fmts[f"{LM}layers.0.mlp.shared_expert.gate_proj.weight"] == "int8"
    assert fmts["lm_head.weight"] == "int8"
    st = stored(q4)
    # kept in bf16 under their own names
    for n in ("layers.0.mlp.gate.weight", "layers.0.mlp.shared_expert_gate.weight", "layers.0.linear_attn.A_log",
              "layers.0.linear_attn.conv1d.weight", "embed_tokens.weight", "norm.weight"):
        assert LM + n in st and LM + n not in qc["tensors"], n
    assert not any(k.startswith("mtp.") for k in st)
    # int4 parts: codes two per byte, a bf16 scale per group
    w = st[f"{LM}layers.0.mlp.experts.gate_up_proj.qweight"]
    shape = qc["tensors"][f"{LM}layers.0.mlp.experts.gate_up_proj"]["shape"]
    g = qc["tensors"][f"{LM}layers.0.mlp.experts.gate_up_proj"]["group_size"]
    assert w.dtype == torch.uint8 and list(w.shape) == [*shape[:-1], shape[-1] // 2]
    assert list(st[f"{LM}layers.0.mlp.experts.gate_up_proj.scales"].shape) == [*shape[:-1], shape[-1] // g]
    # every weight comes back close to the source; kept ones exactly
    src = source_weights(tiny_model)
    deq = dequantized(q4)
    assert set(deq) == {n for n in src if not n.startswith("mtp.")}
    for n, d in deq.items():
        f = qc["tensors"].get(n, {}).get("format")
        bound = {"int4": 0.16, "int8": 0.02, None: 0.0}[f]  # rows are only 32-64 wide
        assert rel(d, src[n]) <= bound, (n, f, rel(d, src[n]))
    # non-weight files copied, weights of the source not
    for f in tiny_model.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("chat_template.jinja", "generation_config.json"):
            assert (q4 / f.name).read_bytes() == f.read_bytes()
    assert not list(q4.glob("*.bin")) and not list(q4.glob(".*.tmp"))
    assert (q4 / MANIFEST_NAME).is_file() and not (q4 / JOURNAL_NAME).exists()
    assert json.loads((q4 / "config.json").read_text())["text_config"]["mtp_num_hidden_layers"] == 0


def test_output_is_a_valid_sharded_checkpoint(q4):
    idx = json.loads((q4 / INDEX_NAME).read_text())
    shards = sorted(q4.glob("model-*.safetensors"))
    assert len(shards) > 2 and all(s.name.endswith(f"-of-{len(shards):05d}.safetensors") for s in shards)
    qc = qconfig(q4)
    seen = {}
    for s in shards:
        with safe_open(s, "pt") as f:
            keys = list(f.keys())
        seen.update(dict.fromkeys(keys, s.name))
        bases = {k.rsplit(".", 1)[0] if k.rsplit(".", 1)[0] in qc["tensors"] else k for k in keys}
        # bounded: a shard goes over the bound only when it holds one tensor bigger than the bound
        assert s.stat().st_size <= 100_000 + 8192 or len(bases) == 1, (s.name, bases)
    assert seen == idx["weight_map"]
    r = cli("verify", q4)
    assert r.exit_code == 0 and "OK" in r.output, r.output


def test_report_per_role(q4):
    rep = json.loads((q4 / "quantkit-report.json").read_text())
    roles = {r["role"]: r for r in rep["roles"]}
    re_ = roles["routed_expert"]
    assert re_["bytes_after"] < re_["bytes_before"] / 3 and 4.0 < re_["bits_per_weight"] < 5.0
    assert 0 < re_["rel_error"] < 0.16 and re_["sqnr_db"] > 15
    assert roles["linear_attention"]["sqnr_db"] > 35  # int8
    assert roles["norm"]["rel_error"] is None and roles["norm"]["bits_per_weight"] == 16
    assert rep["total"]["count"] == len(rep["tensors"])
    md = (q4 / "quantkit-report.md").read_text()
    assert "| routed_expert | int4 |" in md


@pytest.mark.parametrize("args,expert_fmt,attn_fmt", [
    (["--bits", "8"], "int8", "int8"),
    (["--format", "nf4"], "nf4", "int8"),
    (["--format", "fp4"], "fp4", "int8"),
    (["--format", "mxfp4"], "mxfp4", "int8"),
    (["--format", "nf4", "--uniform"], "nf4", "nf4"),
    (["--group-size", "32", "--override", "linear_attention=4", "--override", "lm_head=bf16"], "int4", "int4"),
])
def test_formats_and_recipes(tiny_model, tmp_path, args, expert_fmt, attn_fmt):
    out = tmp_path / "q"
    r = cli("quantize", tiny_model, "--out", out, *args)
    assert r.exit_code == 0, r.output
    assert cli("verify", out).exit_code == 0
    qc = qconfig(out)
    assert qc["tensors"][f"{LM}layers.0.mlp.experts.down_proj"]["format"] == expert_fmt
    assert qc["tensors"][f"{LM}layers.0.linear_attn.out_proj.weight"]["format"] == attn_fmt
    src = source_weights(tiny_model)
    deq = dequantized(out)
    bound = {"int8": 0.02, "int4": 0.16, "nf4": 0.16, "fp4": 0.2, "mxfp4": 0.2}  # 64-wide rows
    for n, d in qc["tensors"].items():
        assert rel(deq[n], src[n]) < bound[d["format"]], n
    if "lm_head=bf16" in args:
        assert "lm_head.weight" not in qc["tensors"] and torch.equal(deq["lm_head.weight"], src["lm_head.weight"])
        assert qc["tensors"][f"{LM}layers.0.mlp.experts.down_proj"]["group_size"] == 32


def test_mtp_is_kept_by_default_and_no_mtp_drops_it(tiny_model_mtp, tmp_path):
    out = tmp_path / "q"
    assert cli("quantize", tiny_model_mtp, "--out", out).exit_code == 0
    st = stored(out)
    qc = qconfig(out)
    e0 = "mtp.layers.0.mlp.experts.0.gate_proj.weight"
    assert qc["tensors"][e0]["format"] == "int4" and e0 + ".qweight" in st and e0 not in st
    assert qc["tensors"]["mtp.layers.0.self_attn.q_proj.weight"]["format"] == "int8"
    assert "mtp.norm.weight" in st and qc["mtp"] == "kept"
    assert json.loads((out / "config.json").read_text())["text_config"]["mtp_num_hidden_layers"] == 1
    assert cli("verify", out).exit_code == 0
    out2 = tmp_path / "q2"
    assert cli("quantize", tiny_model_mtp, "--out", out2, "--no-mtp").exit_code == 0
    assert not any(k.startswith("mtp.") for k in stored(out2)) and qconfig(out2)["mtp"] == "dropped"
    assert json.loads((out2 / "config.json").read_text())["text_config"]["mtp_num_hidden_layers"] == 0
    assert cli("verify", out2).exit_code == 0


def test_transformers_layout_gives_the_published_layout(tiny_model, tiny_model_transformers_layout, tmp_path):
    out = tmp_path / "q"
    assert cli("quantize", tiny_model_transformers_layout, "--out", out).exit_code == 0
    st = stored(out)
    assert f"{LM}layers.0.mlp.experts.gate_up_proj.qweight" in st
    assert not any(".experts.0." in k or k.startswith("model.layers.") for k in st)
    src = source_weights(tiny_model_transformers_layout)
    deq = dequantized(out)
    n = f"{LM}layers.1.mlp.experts.down_proj"
    assert rel(deq[n], src[n]) < 0.16
    assert cli("verify", out).exit_code == 0
    # the fixture holds the same weights as tiny_model: the shards are byte-identical
    pub = tmp_path / "pub"
    assert cli("quantize", tiny_model, "--out", pub).exit_code == 0
    shards = sorted(p.name for p in pub.glob("model-*.safetensors"))
    assert shards == sorted(p.name for p in out.glob("model-*.safetensors"))
    assert all((pub / s).read_bytes() == (out / s).read_bytes() for s in shards)


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if not p.name.startswith("quantkit-report")}


def test_deterministic_and_slab_size_does_not_change_bytes(tiny_model, tmp_path, monkeypatch):
    from quantkit.quantize import stream
    from quantkit.quantize.run import QuantizeOptions, run_quantize
    from quantkit.recipe import build_recipe

    ck = Checkpoint.open(tiny_model)
    a, b = tmp_path / "a", tmp_path / "b"
    run_quantize(ck, a, QuantizeOptions(build_recipe(4, uniform=True), max_shard_size=300_000))
    reads = []
    orig_read = stream.Reader._read_into

    def spy_read(self, file, off, n, buf):
        reads.append(n)
        return orig_read(self, file, off, n, buf)

    monkeypatch.setattr(stream.Reader, "_read_into", spy_read)
    run_quantize(ck, b, QuantizeOptions(build_recipe(4, uniform=True), max_shard_size=300_000, slab_bytes=5000))
    assert _files(a) == _files(b)
    # every tensor was read in blocks of about the slab size (one expert or row at least), none whole
    gate_up = next(t for t in ck.canonical() if t.name.endswith("experts.gate_up_proj"))
    one_expert = gate_up.shape[1] * gate_up.shape[2] * 2
    assert reads and max(reads) <= max(5000, one_expert) < 2 * one_expert <= gate_up.shape[0] * one_expert


def _quantize_cmd(src: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "quantkit", "quantize", str(src), "--out", str(out), "--bits", "4",
            "--uniform", "--max-shard-size", "60KB", *extra]


@pytest.mark.slow
def test_kill_at_a_random_point_then_resume_is_byte_identical(tiny_model, tmp_path):
    ref = tmp_path / "ref"
    subprocess.run(_quantize_cmd(tiny_model, ref), check=True, capture_output=True)
    n_shards = len(list(ref.glob("model-*.safetensors")))
    assert n_shards >= 4
    out = tmp_path / "out"
    if not sigkill_mid_run(_quantize_cmd(tiny_model, out), out, "model-00001-*.safetensors", 5, 0.05):
        pytest.skip("the run finished before it could be killed")
    assert not (out / MANIFEST_NAME).exists()  # an interrupted folder never looks complete
    assert main_cli("verify", out).exit_code != 0
    r = subprocess.run(_quantize_cmd(tiny_model, out, "--resume"), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert _files(out) == _files(ref)
    assert cli("verify", out).exit_code == 0


def test_ctrl_c_leaves_a_resumable_folder(tiny_model, tmp_path, monkeypatch):
    out = tmp_path / "q"
    orig = interrupt_quantizer_after(monkeypatch, 30)
    r = main_cli("quantize", tiny_model, "--out", out, "--max-shard-size", "60KB")
    assert r.exit_code == 130
    assert "--resume" in r.output and "interrupted" in r.output
    assert (out / JOURNAL_NAME).is_file() and not (out / MANIFEST_NAME).exists()
    assert not list(out.glob(".*.tmp"))
    done = json.loads((out / JOURNAL_NAME).read_text())["done"]
    assert done
    monkeypatch.setattr(qz, "_quantize_tensor", orig)
    r = main_cli("quantize", tiny_model, "--out", out, "--max-shard-size", "60KB")
    assert r.exit_code == 2 and "--resume" in r.output  # exists: refused without --resume
    r = cli("quantize", tiny_model, "--out", out, "--max-shard-size", "60KB", "--resume")
    assert r.exit_code == 0 and f"reused {len(done)} finished shards" in r.output
    ref = tmp_path / "ref"
    assert cli("quantize", tiny_model, "--out", ref, "--max-shard-size", "60KB").exit_code == 0
    assert _files(out) == _files(ref)
    # resume with other options is refused, a finished folder says so
    r = main_cli("quantize", tiny_model, "--out", out, "--resume")
    assert r.exit_code == 2 and "already complete" in r.output


def test_resume_redoes_a_damaged_finished_shard(tiny_model, tmp_path, monkeypatch):
    out, ref = tmp_path / "q", tmp_path / "ref"
    assert cli("quantize", tiny_model, "--out", ref, "--max-shard-size", "60KB").exit_code == 0
    orig = interrupt_quantizer_after(monkeypatch, 40)
    assert main_cli("quantize", tiny_model, "--out", out, "--max-shard-size", "60KB").exit_code == 130
    monkeypatch.setattr(qz, "_quantize_tensor", orig)
    first = out / sorted(json.loads((out / JOURNAL_NAME).read_text())["done"])[0]
    data = bytearray(first.read_bytes())
    data[-1] ^= 0xFF
    first.write_bytes(bytes(data))
    r = cli("quantize", tiny_model, "--out", out, "--max-shard-size", "60KB", "--resume")
    assert r.exit_code == 0
    assert _files(out) == _files(ref)


def test_verify_names_each_problem(q4, tmp_path):
    def fresh() -> Path:
        d = tmp_path / f"v{len(list(tmp_path.iterdir()))}"
        shutil.copytree(q4, d)
        return d

    shards = sorted(p.name for p in q4.glob("model-*.safetensors"))
    d = fresh()
    (d / shards[1]).unlink()
    r = main_cli("verify", d)
    assert r.exit_code == 1 and f"{shards[1]}: missing" in r.output
    d = fresh()
    with open(d / shards[0], "r+b") as f:
        f.truncate(1000)
    r = main_cli("verify", d)
    assert r.exit_code == 1 and f"{shards[0]}: truncated" in r.output
    d = fresh()
    b = bytearray((d / shards[2]).read_bytes())
    b[len(b) // 2] ^= 1
    (d / shards[2]).write_bytes(bytes(b))
    r = main_cli("verify", d)
    assert r.exit_code == 1 and f"{shards[2]}: altered" in r.output
    assert main_cli("verify", d, "--quick").exit_code == 0  # sizes only: the flip is not seen
    d = fresh()
    (d / MANIFEST_NAME).unlink()
    r = main_cli("verify", d)
    assert r.exit_code == 2 and "no quantkit-manifest.json" in r.output
    # config that does not match the stored parts (manifest updated so only the config check can catch it)
    for mutate, want in [
        (lambda qc: qc["tensors"][f"{LM}layers.0.mlp.experts.down_proj"].update(shape=[8, 64, 64]), "needs"),
        (lambda qc: qc["tensors"].update({f"{LM}layers.0.mlp.gate.weight": {
            "format": "int8", "group_size": None, "symmetric": True, "shape": [8, 64], "dtype": "bfloat16"}}),
         "missing"),
    ]:
        d = fresh()
        cfg = json.loads((d / "config.json").read_text())
        mutate(cfg["quantization_config"])
        (d / "config.json").write_text(json.dumps(cfg))
        man = json.loads((d / MANIFEST_NAME).read_text())
        from quantkit.quantize.manifest import sha256_file

        man["files"]["config.json"] = {"size": (d / "config.json").stat().st_size,
                                       "sha256": sha256_file(d / "config.json")}
        (d / MANIFEST_NAME).write_text(json.dumps(man))
        r = main_cli("verify", d)
        assert r.exit_code == 1 and want in r.output, r.output


def test_dry_run_writes_nothing(tiny_model, tmp_path):
    out = tmp_path / "q"
    r = cli("quantize", tiny_model, "--out", out, "--dry-run")
    assert r.exit_code == 0 and "routed_expert" in r.output and "dry run" in r.output
    assert not out.exists()


# --- bad input: one line, exit 2, nothing that looks complete ---------------------------------------------

def _copy(src: Path, tmp_path: Path) -> Path:
    d = tmp_path / "src"
    shutil.copytree(src, d)
    return d


def _shards(src: Path) -> list[Path]:
    return sorted(src.glob("*.safetensors"))


def _bad(src: Path, out: Path, *extra: str, subprocess_: bool = False) -> str:
    """Run a quantize that must fail: one `error:` line, exit 2, no traceback, nothing that looks complete.
    `subprocess_` runs the installed entry point (quantkit.cli.main) instead of the in-process app."""
    if subprocess_:
        r = run_main("quantize", src, "--out", out, *extra)
        code, text = r.returncode, r.stderr
    else:
        res = main_cli("quantize", src, "--out", out, *extra)
        code, text = res.exit_code, res.output
    assert code == 2, (code, text)
    # progress lines (printed where the output is not a terminal, from the first tensor on) are not errors
    lines = [x for x in text.strip().splitlines() if x.strip() and not x.startswith("quantizing: ")]
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in text, text
    assert not (out / MANIFEST_NAME).exists() and not (out / "config.json").exists()
    return lines[0]


def test_bad_pickle_checkpoint_refused(tmp_path):
    src = tmp_path / "pt"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe"}))
    torch.save({"w": torch.zeros(2)}, src / "pytorch_model.bin")
    msg = _bad(src, tmp_path / "out", subprocess_=True)
    assert "pytorch_model.bin" in msg or ".bin" in msg


def test_bad_missing_and_truncated_shard(tiny_model, tmp_path):
    src = _copy(tiny_model, tmp_path)
    shard = _shards(src)[-1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    assert shard.name in _bad(src, tmp_path / "o1")
    shard.unlink()
    assert shard.name in _bad(src, tmp_path / "o2")


def test_bad_corrupt_header(tiny_model, tmp_path):
    src = _copy(tiny_model, tmp_path)
    shard = _shards(src)[0]
    data = bytearray(shard.read_bytes())
    data[8:40] = b"\x00\xff" * 16
    shard.write_bytes(bytes(data))
    assert shard.name in _bad(src, tmp_path / "o", subprocess_=True)


def test_bad_index_outside_folder(tiny_model, tmp_path):
    src = _copy(tiny_model, tmp_path)
    idx_path = src / INDEX_NAME
    if not idx_path.exists():
        pytest.skip("fixture is a single file")
    idx = json.loads(idx_path.read_text())
    k = next(iter(idx["weight_map"]))
    idx["weight_map"][k] = "../../etc/passwd"
    idx_path.write_text(json.dumps(idx))
    assert "outside" in _bad(src, tmp_path / "o")


def _rewrite_tensor(src: Path, name_part: str, fn) -> str:
    for shard in _shards(src):
        ts = load_file(shard)
        hit = [k for k in ts if name_part in k]
        if hit:
            ts[hit[0]] = fn(ts[hit[0]])
            save_file(ts, shard, metadata={"format": "pt"})
            return hit[0]
    raise AssertionError(name_part)


def test_bad_nan_names_the_tensor(tiny_model, tmp_path):
    src = _copy(tiny_model, tmp_path)

    def poison(t):
        t = t.clone()
        t.view(-1)[3] = float("nan")
        return t

    name = _rewrite_tensor(src, "layers.1.mlp.experts.down_proj", poison)
    assert name in _bad(src, tmp_path / "o")
    name = _rewrite_tensor(src, "layers.1.mlp.experts.down_proj", lambda t: torch.nan_to_num(t, nan=0.0))
    src2 = _copy(tiny_model, tmp_path / "b")
    name = _rewrite_tensor(src2, "input_layernorm", lambda t: torch.full_like(t, float("inf")))
    assert name in _bad(src2, tmp_path / "o2")


def test_bad_fp8_source(tiny_model, tmp_path):
    src = _copy(tiny_model, tmp_path)
    _rewrite_tensor(src, "self_attn.q_proj.weight", lambda t: t.to(torch.float8_e4m3fn))
    msg = _bad(src, tmp_path / "o")
    assert "fp8" in msg.lower() or "float8" in msg.lower() or "F8" in msg


def test_bad_existing_output_and_overwrite(tiny_model, tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "precious.txt").write_text("mine")
    assert "already exists" in _bad(tiny_model, out)
    assert "not a quantkit output" in _bad(tiny_model, out, "--overwrite")
    assert (out / "precious.txt").read_text() == "mine"
    assert "no quantkit run to resume" in _bad(tiny_model, out, "--resume")


def test_bad_disk_would_fill(tiny_model, tmp_path, monkeypatch):
    real = shutil.disk_usage
    monkeypatch.setattr(qz.shutil, "disk_usage", lambda p: real(p)._replace(free=10_000))
    out = tmp_path / "o"
    r = main_cli("quantize", tiny_model, "--out", out)
    assert r.exit_code == 2
    # in the units that fit (issue 43: it read "needs 0.00 GB, 0.00 GB free")
    assert "not enough free disk" in r.output and str(out) in r.output and "10.0 KB free" in r.output
    assert "0.00 GB" not in r.output and " MB," in " ".join(r.output.split())
    assert not out.exists()


def test_bad_options(tiny_model, tmp_path):
    for args, want in [(["--bits", "3"], "--bits 3"), (["--format", "q4_k"], "--format"),
                       (["--override", "nonsense=4"], "unknown role"), (["--max-shard-size", "lots"], "is not a size"),
                       (["--bits", "8", "--format", "nf4"], "4-bit format")]:
        assert want in _bad(tiny_model, tmp_path / "o", *args), args
        assert not (tmp_path / "o").exists()


def test_relative_paths_from_another_folder(tiny_model, tmp_path, monkeypatch):
    """`quantkit quantize t --out q4` run where `t` lives (the README's round trip): every path relative."""
    shutil.copytree(tiny_model, tmp_path / "t")
    monkeypatch.chdir(tmp_path)
    r = cli("quantize", "t", "--bits", "4", "--out", "q4")
    assert r.exit_code == 0, r.output
    assert cli("verify", "q4").exit_code == 0
