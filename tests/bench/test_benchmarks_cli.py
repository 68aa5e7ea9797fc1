"""The lab benches' reports (benchmarks/cli.py): the guard leaves a missing folder alone (a bench that refuses
makes nothing) and never replaces a file a bench did not write; the writer makes the folder, so a long run does not
end on it."""

from __future__ import annotations

import json

import pytest

from benchmarks.cli import guard_reports, write_json
from quantkit.errors import QuantkitError


def test_guard_allows_a_missing_folder_and_the_writer_makes_it(tmp_path):
    reports = tmp_path / "new" / "reports"
    assert guard_reports(reports, "step-rows") == reports
    assert not reports.exists()  # nothing made before the bench has run
    write_json(reports / "bench-step-rows.json", {"command": "x"})
    assert json.loads((reports / "bench-step-rows.json").read_text()) == {"command": "x"}


def test_guard_reports_keeps_a_file_no_bench_wrote(tmp_path):
    (tmp_path / "bench-step-rows.json").write_text('{"mine": 1}\n')
    with pytest.raises(QuantkitError, match="bench-step-rows.json"):
        guard_reports(tmp_path, "step-rows")
