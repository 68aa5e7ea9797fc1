"""Benchmarks that write reports/ (markdown + json); `quantkit bench <name>` runs them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from quantkit.fileio import write_atomic


def write_reports(reports: Path, stem: str, data: dict[str, Any], markdown: str, indent: int = 2) -> None:
    """reports/STEM.json and reports/STEM.md, each written atomically."""
    write_atomic(reports / f"{stem}.json", json.dumps(data, indent=indent) + "\n")
    write_atomic(reports / f"{stem}.md", markdown)
