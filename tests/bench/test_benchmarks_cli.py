"""The lab benches' shared reports guard (benchmarks/cli.py): a run must not end on a folder it could have made at
its start, and never replaces a file a bench did not write."""

from __future__ import annotations

import pytest

from benchmarks.cli import guard_reports
from quantkit.errors import QuantkitError


def test_guard_reports_makes_a_missing_folder_before_the_run(tmp_path):
    reports = tmp_path / "new" / "reports"
    assert guard_reports(reports, "step-rows") == reports
    assert reports.is_dir()


def test_guard_reports_keeps_a_file_no_bench_wrote(tmp_path):
    (tmp_path / "bench-step-rows.json").write_text('{"mine": 1}\n')
    with pytest.raises(QuantkitError, match="bench-step-rows.json"):
        guard_reports(tmp_path, "step-rows")
