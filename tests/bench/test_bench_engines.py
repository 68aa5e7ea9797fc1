"""`quantkit bench engines`: the bandwidth bound for llama.cpp (the bytes one decode step reads from a GGUF), the
targets per instruction set, and --isa."""

from __future__ import annotations

import pytest

from quantkit.bench.engines import gguf_step_bytes, targets
from quantkit.checkpoint.gguf_file import read_gguf
from quantkit.export.gguf import export_gguf

from helpers.cli import run_cli


def test_gguf_step_bytes_reads_top_k_of_the_experts_and_one_embedding_row(tiny_model, tmp_path):
    path = export_gguf(tiny_model, tmp_path / "t.gguf", "bf16").path
    tensors = read_gguf(path).tensors
    emb = next(t for t in tensors if t.name == "token_embd.weight")
    experts = [t for t in tensors if "_exps." in t.name]
    n_exp = experts[0].shape[0]
    assert experts and all(t.shape[0] == n_exp for t in experts)
    everything = sum(t.nbytes for t in tensors) - emb.nbytes + emb.nbytes // emb.shape[0]
    assert gguf_step_bytes(path, n_exp) == everything  # every expert: the whole file but the embedding
    exp_bytes = sum(t.nbytes for t in experts)
    assert gguf_step_bytes(path, 2) == everything - exp_bytes + sum(t.nbytes * 2 // n_exp for t in experts)


def _rows(q4: float, l4: float, qb: float, lb: float, rounds: tuple[list[float], ...]) -> list[dict]:
    rows = []
    for (engine, bits, tps, pre), r in zip((("llama.cpp", "4-bit mixed", l4, 200.0), ("llama.cpp", "bf16", lb, 190.0),
                                            ("quantkit", "4-bit (experts int4 g32)", q4, 400.0),
                                            ("quantkit", "bf16", qb, 230.0)), rounds, strict=True):
        rows.append({"engine": engine, "bits": bits, "decode_tps": tps, "prefill_tps": pre, "decode_tps_rounds": r})
    return rows


def test_targets_pair_each_engine_with_llama_cpp_at_the_same_bits():
    rows = _rows(50.0, 40.0, 20.0, 30.0, ([40.0, 20.0], [30.0, 15.0], [50.0, 30.0], [20.0, 15.0]))
    got = {t["target"]: t for t in targets(rows)}
    assert got["4-bit decode"]["ratio"] == 50.0 / 40.0 and got["4-bit decode"]["met"]
    assert got["4-bit decode"]["median_round_ratio"] == (50 / 40 + 30 / 20) / 2
    assert got["bf16 decode"]["ratio"] == 20.0 / 30.0 and not got["bf16 decode"]["met"]  # 0.67x < 0.8x
    assert got["bf16 decode"]["median_round_ratio"] == (20 / 30 + 15 / 15) / 2
    assert got["4-bit prefill"]["ratio"] == 2.0 and "median_round_ratio" not in got["4-bit prefill"]
    assert "**MISSED**, 0.67x" in render_targets(rows)


def test_targets_skip_an_engine_that_did_not_run():
    rows = [r for r in _rows(50.0, 40.0, 20.0, 30.0, ([1.0], [1.0], [1.0], [1.0])) if r["bits"] != "bf16"]
    assert [t["target"] for t in targets(rows)] == ["4-bit decode", "4-bit prefill"]


def render_targets(rows: list[dict]) -> str:
    from quantkit.bench.engines import render

    d = {"machine": {"cpu": "x", "cores": 2, "ram_gb": 1, "torch": "t", "load_avg_at_start": 0.0}, "shape":
         {"hidden": 8, "vocab": 8, "layers": 1, "experts": 2, "top_k": 1}, "command": "c", "seconds": 1.0,
         "threads": 2, "read_bandwidth_gbs": 1.0, "read_bandwidth_probes_gbs": [1.0], "prompt_tokens": 1,
         "new_tokens": 1, "reps": 1, "rounds": 2, "gguf_mixed": {"bytes": 1, "seconds": 1.0, "counts": {}, "types": {}},
         "rows": [{**r, "decode_vs_llama_4bit": 1.0, "step_bytes": 1, "bound_tps": 1.0, "of_bound": 1.0, "top1": 1.0,
                   "kl": 0.0, "max_abs": 0.0, "file_mb": 1.0, "same_greedy_as_llama_4bit": True} for r in rows]}
    return render(d).split("## Targets")[1]


def test_targets_per_instruction_set_each_against_the_same_llama_cpp():
    """quantkit at two instruction sets (the native table and the forced AVX2 one): each is judged against the
    same llama.cpp rows and named by its table."""
    rows = _rows(50.0, 40.0, 40.0, 30.0, ([1.0], [1.0], [1.0], [1.0]))
    rows[2]["isa"] = rows[3]["isa"] = "avx512bf16"
    rows += [{**rows[2], "isa": "avx2", "decode_tps": 44.0}, {**rows[3], "isa": "avx2", "decode_tps": 28.0}]
    got = {t["target"]: t for t in targets(rows)}
    assert got["4-bit decode (avx512bf16)"]["ratio"] == 50.0 / 40.0 and got["4-bit decode (avx512bf16)"]["met"]
    assert got["4-bit decode (avx2)"]["ratio"] == 44.0 / 40.0 and not got["4-bit decode (avx2)"]["met"]  # < 1.2x
    assert got["bf16 decode (avx2)"]["ratio"] == 28.0 / 30.0 and not got["bf16 decode (avx2)"]["met"]
    assert got["bf16 decode (avx512bf16)"]["met"] and len(got) == 6


@pytest.mark.parametrize("value,why", [("avx9", "is not one of generic, avx2, avx512"), ("avx2,,sse", "'sse'")])
def test_bench_engines_isa_option_refuses_unknown_names(value, why, capsys, monkeypatch):
    code, _, err = run_cli(["bench", "engines", "--isa", value], capsys, monkeypatch)
    assert code == 2 and "error:" in err and why in err and "Traceback" not in err


def test_targets_pair_a_named_llama_build_with_quantkit_table_of_that_name():
    """--llama-build avx2=...: quantkit's avx2 table is judged against llama.cpp's own build and, apart, against
    llama.cpp's AVX2 build; the native table only against llama.cpp's own build."""
    rows = _rows(50.0, 40.0, 40.0, 30.0, ([1.0], [1.0], [1.0], [1.0]))
    rows[2]["isa"] = rows[3]["isa"] = "avx512bf16"
    rows += [{**rows[2], "isa": "avx2", "decode_tps": 44.0}, {**rows[3], "isa": "avx2", "decode_tps": 28.0},
             {**rows[0], "isa": "avx2", "decode_tps": 30.0, "prefill_tps": 100.0},
             {**rows[1], "isa": "avx2", "decode_tps": 20.0}]
    got = {t["target"]: t for t in targets(rows)}
    mine = "(avx2, against llama.cpp's avx2 build)"
    assert got["4-bit decode (avx2)"]["ratio"] == 44.0 / 40.0  # llama.cpp's own build still the first pairing
    assert got[f"4-bit decode {mine}"]["ratio"] == 44.0 / 30.0 and got[f"4-bit decode {mine}"]["met"]
    assert got[f"bf16 decode {mine}"]["ratio"] == 28.0 / 20.0
    assert got[f"4-bit prefill {mine}"]["ratio"] == 4.0
    assert not any("avx512bf16, against" in t for t in got) and len(got) == 9
    assert f"4-bit decode {mine} at least 1.2x llama.cpp's: **met**, 1.47x" in render_targets(rows)


@pytest.mark.parametrize("value,why", [("avx2", "give NAME=FOLDER"), ("sse9=/tmp", "'sse9' is not a kernel table"),
                                       ("generic=/nonexistent", "no libllama.so")])
def test_bench_engines_llama_build_option_refuses_bad_values(value, why, capsys, monkeypatch):
    code, _, err = run_cli(["bench", "engines", "--llama-build", value], capsys, monkeypatch)
    assert code == 2 and "error:" in err and why in err and "Traceback" not in err


@pytest.mark.slow
def test_llama_build_runs_in_its_own_process_as_the_in_process_rows(tiny_model, tmp_path):
    """The worker with the installed library (a build like any other) gives the in-process greedy tokens and
    logits: the subprocess path loses nothing on the way."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (CI builds it)")
    from pathlib import Path

    import numpy as np
    import torch

    from quantkit.bench.llama_worker import llama_decode, llama_logits, run_build

    gguf = export_gguf(tiny_model, tmp_path / "t.gguf", "bf16").path
    lib = Path(llama_cpp.__file__).parent / "lib"
    probe = torch.arange(2 * 12).reshape(2, 12) % 50
    prompt = list(range(3, 11))
    d, logits = run_build(lib, gguf, prompt, 6, 1, 1, probe)
    assert d["tokens"] == llama_decode(gguf, prompt, 6, 1, 1)["tokens"] and d["decode_tps"] > 0
    np.testing.assert_array_equal(logits, llama_logits(gguf, probe, 1))
    assert run_build(lib, gguf, prompt, 2, 1, 1, None)[1] is None


@pytest.mark.slow
def test_a_llama_build_that_cannot_load_is_one_error_naming_it(tiny_model, tmp_path):
    from quantkit.bench.llama_worker import run_build
    from quantkit.errors import QuantkitError

    pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (CI builds it)")
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libllama.so").write_bytes(b"not a library")
    with pytest.raises(QuantkitError, match=f"llama.cpp build in {tmp_path / 'lib'} failed: "):
        run_build(tmp_path / "lib", tmp_path / "none.gguf", [1, 2], 1, 1, 1, None)
