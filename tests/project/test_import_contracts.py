"""The package graph's contracts (pyproject.toml [tool.importlinter]) hold on the tree and catch what they
exist for: an upward import, a cycle between two modules of a package, a private module reached from
outside its package. Each planted import runs `lint-imports` on a copy of the package, so the real tree is
never touched. Private names (`_x`) are not imported across modules either (import-linter sees modules,
not names, so that rule is checked here on the source)."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT = Path(sys.executable).with_name("lint-imports")

pytestmark = pytest.mark.skipif(not LINT.is_file(), reason="import-linter is not installed (the test extra)")


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    # the copy is imported from `root` alone: PYTHONPATH puts it ahead of the installed package
    return subprocess.run([str(LINT), "--config", str(root / "pyproject.toml"), "--no-cache"], cwd=root,
                          capture_output=True, text=True, env={"PYTHONPATH": str(root), "PATH": ""})


def _copy(tmp_path: Path) -> Path:
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    shutil.copytree(ROOT / "quantkit", tmp_path / "quantkit",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.bin", "csrc", "profiles"))
    return tmp_path


def _plant(root: Path, module: str, line: str) -> None:
    p = root / (module.replace(".", "/") + ".py")
    p.write_text(p.read_text() + "\n" + line + "\n")


def test_the_tree_keeps_every_contract(tmp_path):
    r = _lint(_copy(tmp_path))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout


@pytest.mark.parametrize("module, line, broken", [
    # a base module reaching the CLI, the top layer
    ("quantkit.fileio", "from quantkit.cli import app  # noqa", "quantkit.fileio is not allowed to import quantkit.cli"),
    # the formats reaching the planner, two layers up
    ("quantkit.formats.int8", "from quantkit.planner import budget  # noqa",
     "quantkit.formats is not allowed to import quantkit.planner"),
])
def test_an_upward_import_breaks_the_layers(tmp_path, module, line, broken):
    root = _copy(tmp_path)
    _plant(root, module, line)
    r = _lint(root)
    assert r.returncode != 0
    assert broken in r.stdout, r.stdout[-3000:]


def test_a_cycle_inside_a_package_breaks_the_acyclic_contract(tmp_path):
    root = _copy(tmp_path)
    # quantize.report sits below quantize.run (run writes the report): the way back closes a cycle
    _plant(root, "quantkit.quantize.report", "from quantkit.quantize import run  # noqa")
    r = _lint(root)
    assert r.returncode != 0
    assert "No cycles are allowed in quantkit.quantize" in r.stdout, r.stdout[-3000:]


def test_a_private_module_reached_from_outside_breaks_the_contract(tmp_path):
    root = _copy(tmp_path)
    (root / "quantkit/formats/_private.py").write_text("X = 1\n")
    _plant(root, "quantkit.quantize.grid", "from quantkit.formats._private import X  # noqa")
    r = _lint(root)
    assert r.returncode != 0
    assert "quantkit.quantize.grid -> quantkit.formats._private" in r.stdout, r.stdout[-3000:]


def _private_imports(root: Path) -> list[str]:
    """`from quantkit.x import _name` in any module other than quantkit.x itself."""
    found = []
    for p in sorted((root / "quantkit").rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("quantkit"):
                found += [f"{p.relative_to(root)}:{node.lineno} {node.module}.{a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    return found


def test_no_private_name_is_imported_across_modules():
    assert _private_imports(ROOT) == []


def test_the_private_name_check_sees_a_planted_one(tmp_path):
    (tmp_path / "quantkit").mkdir()
    (tmp_path / "quantkit/a.py").write_text("def f():\n    from quantkit.b import _hidden\n")
    assert _private_imports(tmp_path) == ["quantkit/a.py:2 quantkit.b._hidden"]
