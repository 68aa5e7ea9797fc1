"""vLLM's platforms in the lines quantkit prints (quantkit/export/vllm_cpu.py): a CPU-only plan gets vLLM CPU's
command (`python -m vllm.entrypoints.openai.api_server`, its KV space, the bf16-rest export) and names the MoE
backend the CPU would use (AMX, zentorch, or none: then no line); a GPU plan keeps `vllm serve` and the int8 rest;
drafting with MTP turns prefix caching off on both; `export vllm --rest int8` for vLLM CPU is refused before
anything is written, and the line export prints serves the folder it wrote. (That vLLM CPU actually runs these:
scripts/vllm-check.sh, tests/export/test_vllm_check.py.)"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

import quantkit.export.launch as launch
from quantkit.checkpoint.spec import default_spec
from quantkit.export.vllm_cpu import CPU_SERVER, cpu_backend
from quantkit.planner.budget import RunSettings
from quantkit.planner.hardware import build_hardware
from quantkit.planner.placement import solve
from quantkit.recipe import RECIPES

from helpers.cli import one_line_error, run_cli

AMD = "vendor_id\t: AuthenticAMD\nflags\t\t: fpu avx2 avx512f avx512_bf16\n"
INTEL_AMX = "vendor_id\t: GenuineIntel\nflags\t\t: fpu avx2 avx512f amx_bf16 amx_tile amx_int8\n"
INTEL_PLAIN = "vendor_id\t: GenuineIntel\nflags\t\t: fpu avx2 avx512f avx512_bf16\n"


def _speculative(line: list[str]) -> int:
    if "--speculative-config" not in line:
        return 0
    return json.loads(line[line.index("--speculative-config") + 1])["num_speculative_tokens"]


def test_cpu_backend_by_cpu() -> None:
    assert cpu_backend(AMD).name == "zentorch" and "zentorch==" in cpu_backend(AMD).note
    assert cpu_backend(INTEL_AMX).name == "AMX" and "Intel AMX" in cpu_backend(INTEL_AMX).note
    none = cpu_backend(INTEL_PLAIN)
    assert none.name is None and "no MoE kernel" in none.note and "quantkit or llama.cpp" in none.note
    assert cpu_backend("").name is None


@pytest.mark.parametrize("cpu", [AMD, INTEL_AMX, INTEL_PLAIN], ids=["amd", "intel-amx", "intel"])
@pytest.mark.parametrize("scheme", ["quality", "int4"])
def test_cpu_only_plan_gets_vllm_cpu_line(cpu: str, scheme: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch, "cpu_backend", lambda info=None: cpu_backend(cpu))
    spec = default_spec()
    hw = build_hardware(["none"], "256GB", None, 1, None)
    assert not hw.gpus
    plan = solve(spec, RECIPES[scheme], RunSettings(context=8192, include_mtp=True), hw)
    lp = launch.launch_plan("vllm", plan, hw, spec.name, "SRC", spec)
    export = shlex.split(lp.export_command)
    assert export[:4] == ["quantkit", "export", "vllm", "SRC"]
    assert export[export.index("--rest") + 1] == "bf16" and export[export.index("--target") + 1] == "cpu"
    assert any("cannot run --rest int8" in w for w in lp.warnings) == (scheme == "quality")
    if cpu is INTEL_PLAIN:  # no MoE kernel for int4 experts: no line, and why
        assert lp.command == "" and any("no MoE kernel" in w for w in lp.warnings)
        return
    line = shlex.split(lp.command)
    env = dict(a.split("=", 1) for a in line[:2])
    assert set(env) == {"VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND"} and int(env["VLLM_CPU_KVCACHE_SPACE"]) >= 1
    assert " ".join(line[2:5]) == CPU_SERVER and line[line.index("--model") + 1] == export[4]
    assert "vllm" not in line[:2] and "serve" not in line  # vllm-cpu's `vllm` script does not run
    assert line[line.index("--max-model-len") + 1] == "8192" and "--language-model-only" in line
    assert line[line.index("--host") + 1] == "127.0.0.1"
    assert _speculative(line) == 1 and "--no-enable-prefix-caching" in line
    assert any(("zentorch" if cpu is AMD else "Intel AMX") in n for n in lp.notes)
    assert any("prefix caching off" in n for n in lp.notes)
    # the KV space grows with the context the line serves
    big = solve(spec, RECIPES[scheme], RunSettings(context=262144, include_mtp=True), hw)
    line_big = shlex.split(launch.launch_plan("vllm", big, hw, spec.name, "SRC", spec).command)
    assert int(line_big[0].split("=")[1]) > int(env["VLLM_CPU_KVCACHE_SPACE"])


def test_gpu_plan_keeps_marlin_layout_and_turns_prefix_caching_off_when_drafting() -> None:
    spec = default_spec()
    hw = build_hardware(["2xh100"], "256GB", None, 1, None)
    for include_mtp in (True, False):
        plan = solve(spec, RECIPES["quality"], RunSettings(context=4096, include_mtp=include_mtp), hw)
        lp = launch.launch_plan("vllm", plan, hw, spec.name, "SRC", spec)
        assert lp.export_command.endswith("--rest int8 --target gpu")
        line = shlex.split(lp.command)
        assert line[:3] == ["vllm", "serve", lp.export_command.split()[4]]
        assert ("--no-enable-prefix-caching" in line) == include_mtp == (_speculative(line) == 1)
        assert any("#53912" in n for n in lp.notes) == include_mtp


def test_export_refuses_int8_for_vllm_cpu_before_writing(tiny_model_mtp: Path, tmp_path: Path, capsys,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from helpers.runtime import quantized

    src = quantized(tiny_model_mtp, "quality")
    for extra in (["--target", "cpu"], []):  # this machine has no CUDA GPU: its default target is vLLM CPU
        code, out, err = run_cli(["export", "vllm", src, tmp_path / "int8", "--rest", "int8", *extra], capsys,
                                 monkeypatch)
        one_line_error(code, out, err, "vLLM CPU cannot run --rest int8", "uint8b128", "--rest bf16", "--target gpu")
        assert not (tmp_path / "int8").exists() and not list(tmp_path.iterdir())
    code, out, err = run_cli(["export", "vllm", src, tmp_path / "x", "--target", "tpu"], capsys, monkeypatch)
    one_line_error(code, out, err, "--target 'tpu'", "gpu or cpu")
    code, out, err = run_cli(["export", "vllm", src, tmp_path / "g32", "--target", "cpu", "--group-size", "32"],
                             capsys, monkeypatch)
    one_line_error(code, out, err, "--group-size 32: vLLM CPU loads int4 experts at group 128", "--target gpu")
    assert not list(tmp_path.iterdir())

    code, out, err = run_cli(["export", "vllm", src, tmp_path / "int8", "--rest", "int8", "--target", "gpu"],
                             capsys, monkeypatch)
    assert code == 0, err
    gpu = shlex.split(next(ln for ln in out.splitlines() if ln.startswith("vllm serve")))
    assert gpu[2] == str(tmp_path / "int8") and _speculative(gpu) == 1 and "--no-enable-prefix-caching" in gpu

    code, out, err = run_cli(["export", "vllm", src, tmp_path / "bf16", "--target", "cpu"], capsys, monkeypatch)
    assert code == 0, err
    assert out.index("target: vLLM CPU") < out.index("Serve with vLLM CPU")  # the backend named before writing
    line = shlex.split(next(ln for ln in out.splitlines() if CPU_SERVER in ln))
    assert line[line.index("--model") + 1] == str(tmp_path / "bf16")
    cfg = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert int(line[line.index("--max-model-len") + 1]) <= cfg["text_config"]["max_position_embeddings"]
    assert _speculative(line) == 1 and "--no-enable-prefix-caching" in line  # the folder keeps the MTP layer
    assert cfg["quantization_config"]["config_groups"]["group_0"]["targets"] == ["Linear"]  # rest bf16
    groups = {g["weights"]["group_size"] for g in cfg["quantization_config"]["config_groups"].values()
              if g["weights"]["num_bits"] == 4}
    assert groups == {32} and "may not start there" in out  # the tiny rows (32) do not split into 128


def test_a_cpu_export_regroups_group_32_experts_to_the_group_vllm_cpu_loads(tmp_path: Path, capsys,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM CPU's MoE kernels load group 128, not group 32 (Q4_0's): `--target cpu` writes experts stored at group
    32 at 128 where their rows split into it (requantized, and said so); `--target gpu` keeps the codes."""
    from quantkit.bench.serve_checkpoint import recipe
    from quantkit.testing.tiny import make_tiny_model

    src = make_tiny_model(tmp_path / "g32", hidden=128, intermediate=128, quantized=recipe())
    for target, want in (("cpu", 128), ("gpu", 32)):
        code, out, err = run_cli(["export", "vllm", src, tmp_path / target, "--target", target], capsys, monkeypatch)
        assert code == 0, err
        cfg = json.loads((tmp_path / target / "config.json").read_text())["quantization_config"]["config_groups"]
        assert {g["weights"]["group_size"] for g in cfg.values() if g["weights"]["num_bits"] == 4} == {want}
        assert (f"group {want}" in out) and (("requantized" in out) == (target == "cpu")) and "may not" not in out
