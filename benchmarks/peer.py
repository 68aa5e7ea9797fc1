"""Two quantkit trees in one run (benchmarks/step_rows.py, benchmarks/generate_loop.py): this checkout against a
peer checkout (main before a change), each tree in a worker process of its own with its root on PYTHONPATH (its own
Python code and CPU kernel), asked one line at a time and answering one JSON line; and the run's common start
(the peer checked, the reports guarded, the threads and the checkpoint `bench serve --clients` serves)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import IO, Any

from benchmarks.cli import ROOT, command_line, guard_reports
from benchmarks.cli import threads as check_threads
from quantkit.bench.machine import machine_info
from quantkit.errors import QuantkitError


class Worker:
    """One tree's worker process (`script` run by path with `args`); its first line says it is ready."""

    def __init__(self, name: str, root: Path, script: Path, args: list[str]):
        env = {**os.environ, "PYTHONPATH": str(root)}
        self.name = name
        self.p = subprocess.Popen([sys.executable, str(script), *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True, env=env, cwd=root)
        self.route = self._reply()["route"]

    def _reply(self) -> dict[str, Any]:
        out: IO[str] = self.p.stdout  # type: ignore[assignment]
        for line in out:
            if line.startswith("{"):
                return json.loads(line)
        raise QuantkitError(f"the {self.name} worker ended early (exit {self.p.wait()}); its stderr says why")

    def ask(self, line: str) -> dict[str, Any]:
        assert self.p.stdin is not None
        self.p.stdin.write(f"{line}\n")
        self.p.stdin.flush()
        return self._reply()

    def close(self) -> None:
        if self.p.stdin is not None:
            self.p.stdin.close()
        self.p.wait()


def start(name: str, peer: Path, reports: Path, workdir: Path, model: Path | None, threads: int | None,
          rounds: int) -> dict[str, Any]:
    """The run's record before measuring: command, machine, model, threads, rounds and the two trees; the peer is
    checked and bench-NAME.* guarded first, the serve checkpoint made when no --model is given."""
    if not (peer / "quantkit" / "__init__.py").is_file():
        raise QuantkitError(f"--peer {peer}: not a quantkit checkout (no quantkit/__init__.py); give its root folder")
    guard_reports(reports, name.replace("_", "-"))
    n = check_threads(threads)
    if model is None:
        from quantkit.bench.serve_checkpoint import prepare

        model = prepare(workdir, print)
    return {"command": command_line(name, sys.argv[1:]), "machine": machine_info(), "model": str(model),
            "threads": n, "rounds": rounds, "trees": {"this": str(ROOT), "peer": str(peer.resolve())}}
