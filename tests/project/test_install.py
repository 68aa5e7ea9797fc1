"""The non-editable install works: a built wheel carries the profiles and the console script, and runs
from another directory without the source tree on the path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_installs_and_runs_outside_the_repo(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), str(ROOT)],
        check=True,
        cwd=tmp_path,
    )
    (wheel,) = wheels.glob("quantkit-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "quantkit/profiles/models/Qwen-AgentWorld-35B-A3B/config.json" in names
    # the CPU kernel builds from the installed sources
    from quantkit.kernels import build as kernel_build

    for src in kernel_build.SOURCES + kernel_build.HEADERS:
        assert f"quantkit/kernels/csrc/{src.name}" in names
    assert any(n.endswith("entry_points.txt") for n in names)
    entry_points = next(zipfile.ZipFile(wheel).read(n) for n in names if n.endswith("entry_points.txt"))
    assert b"quantkit = quantkit.cli:main" in entry_points

    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        check=True,
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # The installed copy comes first on the path, ahead of the editable install of the repo.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(target)
    code = (
        "import quantkit, quantkit.checkpoint.spec as s; "
        f"assert quantkit.__file__.startswith({str(target)!r}), quantkit.__file__; "
        "print(s.default_spec().text_params)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=elsewhere, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) == 34_660_610_688
    plan = subprocess.run(
        [sys.executable, "-m", "quantkit", "plan", "--gpu", "rtx4090", "--ram", "64GB", "--json"],
        cwd=elsewhere, env=env, capture_output=True, text=True,
    )
    assert plan.returncode == 0, plan.stderr
    schemes = {s["scheme"]: s for s in json.loads(plan.stdout)["schemes"]}
    assert schemes["int4"]["card_estimate_gb"] == 18.5
    assert schemes["int4"]["fits"] is True
