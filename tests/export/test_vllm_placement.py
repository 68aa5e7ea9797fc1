"""`quantkit plan --export vllm`: what the vLLM line asks of each GPU, by the bytes of the folder it serves."""

from __future__ import annotations

import json
from pathlib import Path

from quantkit.checkpoint.spec import default_spec
from quantkit.export.vllm_placement import UTILIZATION, vllm_fit
from quantkit.planner.budget import RunSettings

from helpers.cli import run_cli

GIB = 1 << 30


def folder_tensor_bytes(folder: Path) -> int:
    from safetensors import safe_open

    total = 0
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as sf:
            for k in sf.keys():
                sl = sf.get_slice(k)
                n = 1
                for d in sl.get_shape():
                    n *= d
                total += n * {"I32": 4, "BF16": 2, "F16": 2, "F32": 4, "I64": 8, "I8": 1, "U8": 1}[sl.get_dtype()]
    return total


def test_weights_are_the_export_folders_bytes(tiny_model: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    from quantkit.checkpoint.reader import spec_from_path
    from quantkit.export.vllm_placement import export_recipe
    from quantkit.planner.budget import compute_budget

    code, _, err = run_cli(["export", "vllm", str(tiny_model), str(tmp_path / "ct"), "--rest", "int8", "--target",
                            "gpu"], capsys, monkeypatch)
    assert code == 0, err
    spec = spec_from_path(str(tiny_model))
    pred = compute_budget(spec, export_recipe("quality"), RunSettings()).weights
    got = folder_tensor_bytes(tmp_path / "ct")
    # the export keeps linear attention's tiny in_proj_a/b in bf16 and stores int64 weight_shape entries
    assert abs(pred - got) / got < 0.05, (pred, got)


def test_the_line_says_when_the_card_is_too_small(capsys, monkeypatch) -> None:
    spec = default_spec()
    big = vllm_fit(spec, "quality", RunSettings(context=32768), 80 * GIB, 1, 1)
    assert big.fits and sum(big.per_gpu.values()) <= UTILIZATION * 80 * GIB and big.max_tokens >= 32768
    small = vllm_fit(spec, "quality", RunSettings(context=32768), 16 * GIB, 1, 1)
    assert not small.fits and small.max_tokens == 0
    split = vllm_fit(spec, "quality", RunSettings(context=32768), 16 * GIB, 2, 1)
    assert split.per_gpu["weights"] * 2 <= big.per_gpu["weights"] + 2
    code, out, err = run_cli(["plan", "--gpu", "rtx4090", "-s", "quality", "-c", "64k", "--export", "vllm", "--json"],
                             capsys, monkeypatch)
    assert code == 0, err
    d = json.loads(out)["export"]
    assert d["vllm"]["gpu_total"] <= d["vllm"]["budget"] or any("vLLM needs" in w for w in d["warnings"])
