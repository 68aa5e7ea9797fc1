"""`quantkit plan --export`: the launch line loads exactly what the printed `quantkit export` line writes; a model
with an MTP layer drafts with it in both engines' lines (llama-server `--spec-type draft-mtp --spec-draft-n-max N`
on the GGUF's NextN block, vLLM `--speculative-config` method mtp), N from --mtp, and `--mtp 0` leaves it out of
the lines and of the GGUF; `plan --model FILE.gguf` drafts when the file has the block and refuses --mtp when not."""

from __future__ import annotations

import json
import os
import shlex

import pytest

from quantkit.checkpoint.spec import default_spec
from quantkit.export.launch import GGUF_TYPES, launch_plan
from quantkit.planner.budget import RunSettings
from quantkit.planner.hardware import build_hardware
from quantkit.planner.placement import solve
from quantkit.recipe import RECIPES

from helpers.cli import run_cli


def mtp_drafts(engine: str, line: list[str]) -> int:
    """Tokens a launch line drafts with the MTP layer (0: none), read from its flags as each engine reads them."""
    if engine == "llama.cpp":
        if "--spec-type" not in line:
            assert "--spec-draft-n-max" not in line
            return 0
        assert line[line.index("--spec-type") + 1] == "draft-mtp"
        return int(line[line.index("--spec-draft-n-max") + 1])
    if "--speculative-config" not in line:
        return 0
    cfg = json.loads(line[line.index("--speculative-config") + 1])
    assert cfg["method"] == "mtp" and set(cfg) == {"method", "num_speculative_tokens"}
    return cfg["num_speculative_tokens"]


@pytest.mark.parametrize("engine", ["llama.cpp", "vllm"])
@pytest.mark.parametrize("model,mtp,drafts", [("tiny", None, 0), ("mtp", None, 1), ("mtp", "0", 0)])
def test_launch_line_loads_what_the_export_line_writes(engine, model, mtp, drafts, tiny_model, tiny_model_mtp,
                                                       tmp_path, capsys, monkeypatch):
    if engine == "llama.cpp" and os.environ.get("QUANTKIT_REQUIRE_ENGINES") != "1":
        pytest.importorskip("llama_cpp", reason="quality's GGUF type is written by llama.cpp's quantizer")
    src = tiny_model if model == "tiny" else tiny_model_mtp
    code, out, err = run_cli(["plan", "--model", str(src), "--gpu", "rtx4090", "-s", "quality", "--json",
                              "--export", engine, *(["--mtp", mtp] if mtp else [])], capsys, monkeypatch)
    assert code == 0, err
    d = json.loads(out)["export"]
    export = shlex.split(d["export_command"])
    assert export[:3] == ["quantkit", "export", "gguf" if engine == "llama.cpp" else "vllm"]
    assert export[3] == str(src)
    # no unused NextN block in the GGUF (the vLLM export keeps the layer whatever --mtp; its fit counts it when drafting)
    assert ("--no-mtp-layer" in export) == (engine == "llama.cpp" and model == "mtp" and not drafts)
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(export[1:], capsys, monkeypatch)
    assert code == 0, err
    written = tmp_path / export[4]
    launch = shlex.split(d["command"])
    assert mtp_drafts(engine, launch) == drafts
    if engine == "llama.cpp":
        from quantkit.checkpoint.gguf_file import read_gguf

        assert written.is_file() and written.read_bytes()[:4] == b"GGUF"
        assert launch[0] == "llama-server" and launch[launch.index("-m") + 1] == export[4]
        info = read_gguf(written)
        assert info.get("nextn_predict_layers", 0) == (1 if drafts else 0)  # what draft-mtp loads is in the file
        assert d["llama_cpp"]["mtp_draft"] == drafts and d["llama_cpp"]["mtp_blocks"] == (1 if drafts else 0)
        assert ("mtp" in d["llama_cpp"]["gpu_bytes"][0]) == bool(drafts)  # the drafted layer is placed
    else:
        cfg = json.loads((written / "config.json").read_text())
        assert cfg["quantization_config"]["format"] == "pack-quantized"
        assert launch[:3] == ["vllm", "serve", export[4]]
        if drafts:  # vLLM's drafter reads the MTP layer from the served folder
            assert cfg["text_config"]["mtp_num_hidden_layers"] == 1
            idx = json.loads((written / "model.safetensors.index.json").read_text())["weight_map"]
            assert "mtp.fc.weight" in idx or "mtp.fc.weight_packed" in idx


def test_each_scheme_gets_a_launch_for_each_engine():
    spec = default_spec()
    hw = build_hardware(["2xh100"], "256GB", None, 1, None)
    st = RunSettings(context=4096)
    for scheme in RECIPES:
        plan = solve(spec, RECIPES[scheme], st, hw)
        gg = launch_plan("llama.cpp", plan, hw, spec.name, "SRC")
        assert f"--type {GGUF_TYPES[scheme]}" in gg.export_command and "-m " + gg.export_command.split()[4] in gg.command
        vl = launch_plan("vllm", plan, hw, spec.name, "SRC")
        if scheme in ("bf16", "fp16", "int8"):
            assert vl.export_command is None and vl.command.startswith("vllm serve SRC ")
            assert ("--quantization fp8" in vl.command) == (scheme == "int8")
        else:
            assert vl.command.startswith(f"vllm serve {vl.export_command.split()[4]} ")


def test_llama_server_gives_each_slot_the_planned_context_and_both_lines_serve_tools():
    """`--batch 4 -c 64k` budgets 4 x 64k of KV: llama-server's -c is all slots together, so the line must say
    -c 262144 -np 4 (not -c 65536, which is 16k per slot), and the placement must hold 4 x 64k of KV."""
    from quantkit.export.llama_placement import LlamaSettings, kv_layer_bytes, model_from_spec

    spec = default_spec()
    hw = build_hardware(["rtx4090"], "128GB", None, 1, None)
    plan = solve(spec, RECIPES["int4"], RunSettings(context=65536, batch=4), hw)
    line = shlex.split(launch_plan("llama.cpp", plan, hw, spec.name, "SRC").command)
    assert line[line.index("-c") + 1] == str(4 * 65536) and line[line.index("-np") + 1] == "4"
    assert "--jinja" in line  # the GGUF's chat template: tool calls need it
    gm = model_from_spec(spec, "q4_0")
    one = kv_layer_bytes(gm, LlamaSettings(context=65536, parallel=1))
    assert kv_layer_bytes(gm, LlamaSettings(context=65536, parallel=4)) == 4 * one
    vl = shlex.split(launch_plan("vllm", plan, build_hardware(["2xh100"], "256GB", None, 1, None), spec.name,
                                 "SRC").command)
    assert vl[vl.index("--tool-call-parser") + 1] == "qwen3_coder" and "--enable-auto-tool-choice" in vl
    assert vl[vl.index("--reasoning-parser") + 1] == "qwen3"


def test_both_engines_draft_with_the_mtp_layer_the_plan_keeps():
    """The published model has an MTP layer: a plan that keeps it drafts DEFAULT_MTP_DRAFT tokens (or --mtp's) in
    both lines, each placement counting the layer; a plan without it (--mtp 0) has no draft flags."""
    from quantkit.export.launch import DEFAULT_MTP_DRAFT

    spec = default_spec()
    for gpus, scheme in ((["rtx4090"], "int4"), (["2xh100"], "quality")):
        hw = build_hardware(gpus, "128GB", None, 1, None)
        kept = solve(spec, RECIPES[scheme], RunSettings(context=4096, include_mtp=True), hw)
        left = solve(spec, RECIPES[scheme], RunSettings(context=4096), hw)
        for engine in ("llama.cpp", "vllm"):
            lines = {n: launch_plan(engine, kept, hw, spec.name, "SRC", spec, mtp=n) for n in (None, 1, 3)}
            none = launch_plan(engine, left, hw, spec.name, "SRC", spec)
            for n, lp in lines.items():
                assert mtp_drafts(engine, shlex.split(lp.command)) == (n or DEFAULT_MTP_DRAFT), (engine, n)
            assert mtp_drafts(engine, shlex.split(none.command)) == 0
            if engine == "llama.cpp":
                assert "--no-mtp" in none.export_command and "--no-mtp" not in lines[None].export_command
                with_mtp, without = lines[None].placement, none.placement
                assert with_mtp.n_mtp == 1 and without.n_mtp == 0
                assert sum(with_mtp.gpu_totals()) > sum(without.gpu_totals())  # its weights, KV and draft buffer
            else:
                assert lines[None].vllm.per_gpu["weights"] > none.vllm.per_gpu["weights"]
                assert lines[None].vllm.per_gpu["kv_one_sequence"] > none.vllm.per_gpu["kv_one_sequence"]


def test_plan_of_a_gguf_drafts_when_it_has_the_nextn_block(tiny_model, tiny_model_mtp, tmp_path, capsys, monkeypatch):
    from quantkit.export.gguf import export_gguf

    with_mtp = export_gguf(tiny_model_mtp, tmp_path / "mtp.gguf", "q8_0").path
    without = export_gguf(tiny_model_mtp, tmp_path / "no-mtp.gguf", "q8_0", mtp=False).path

    def line(path, *extra: str) -> tuple[int, list[str] | str]:
        code, out, err = run_cli(["plan", "--model", str(path), "--gpu", "rtx4090", "--json", *extra], capsys,
                                 monkeypatch)
        return code, (shlex.split(json.loads(out)["export"]["command"]) if code == 0 else err)

    from quantkit.checkpoint.gguf_file import read_gguf
    from quantkit.export.llama_placement import model_from_gguf

    gm = model_from_gguf(read_gguf(with_mtp))  # the NextN block is not taken for a fifth trunk layer
    assert (gm.n_layer, gm.n_mtp, gm.full_attention) == (4, 1, (False, False, False, True)) and gm.mtp_bytes > 0
    for extra, want in (((), 1), (("--mtp", "3"), 3), (("--mtp", "0"), 0)):
        code, cmd = line(with_mtp, *extra)
        assert code == 0 and mtp_drafts("llama.cpp", cmd) == want, (extra, cmd)
        assert cmd[cmd.index("-ngl") + 1] == "99"
    code, cmd = line(without)
    assert code == 0 and mtp_drafts("llama.cpp", cmd) == 0
    code, err = line(without, "--mtp", "1")  # asked to draft with a layer the file does not carry
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "no-mtp.gguf has no MTP layer" in err and "drop --mtp" in err
    code, out, err = run_cli(["plan", "--model", str(with_mtp), "--gpu", "rtx4090"], capsys, monkeypatch)
    assert code == 0 and "MTP layer: drafting 1 a step" in out
