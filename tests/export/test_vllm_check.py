"""The vLLM check (scripts/vllm-check.sh, benchmarks/vllm_check.py), run when the environment asks for it:
QUANTKIT_REQUIRE_VLLM=1 runs it on a small budget against the check's venv (built beforehand by the script:
QUANTKIT_VLLM_VENV, default .venv-vllm) and requires every target met; a missing venv then fails. Otherwise the
module skips at once: nothing here imports vLLM, the main venv never has it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

if os.environ.get("QUANTKIT_REQUIRE_VLLM") != "1":
    pytest.skip("the vLLM check runs with QUANTKIT_REQUIRE_VLLM=1 (bash scripts/vllm-check.sh builds its venv)",
                allow_module_level=True)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(5400)]


def test_vllm_loads_every_export_layout(tmp_path: Path) -> None:
    venv = Path(os.environ.get("QUANTKIT_VLLM_VENV", ROOT / ".venv-vllm"))
    if not venv.is_absolute():
        venv = ROOT / venv
    assert (venv / "bin" / "python").is_file(), \
        f"QUANTKIT_REQUIRE_VLLM=1 but {venv} has no python: build it with `bash scripts/vllm-check.sh` first"
    env = {**os.environ, "QUANTKIT_PYTHON": sys.executable, "QUANTKIT_VLLM_VENV": str(venv)}
    p = subprocess.run(["bash", "scripts/vllm-check.sh", "--reports", str(tmp_path), "--prompts", "2",
                        "--new-tokens", "16"], cwd=ROOT, env=env, capture_output=True, text=True)
    d = json.loads((tmp_path / "bench-vllm.json").read_text()) if (tmp_path / "bench-vllm.json").is_file() else None
    assert d is not None, p.stdout[-3000:] + p.stderr[-3000:]
    failed = [f"{v['what']}: {v['detail']}" for v in d["verdicts"] if not v["ok"]]
    assert not failed and p.returncode == 0, failed or p.stderr[-3000:]
    assert [r["rest"] for r in d["layouts"]] == ["bf16", "int8"]
    assert (tmp_path / "bench-vllm.md").read_text().startswith("# vLLM loads what `quantkit export vllm` writes")
