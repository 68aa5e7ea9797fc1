"""Lines of model math at git revisions: issue 52's "lines of model math (Python + C++) down, not up".

`python benchmarks/one-engine/model_lines.py REV [REV ...]` (run in the repository) counts, in each revision's
quantkit/runtime/model/*.py (the model's Python) and quantkit/kernels/csrc/* (the C++ kernels), the lines that are
not blank and not only a comment (`#` in Python; `//` and `/* */` blocks in C++); docstrings count as lines.
Prints one line per file and the total per revision.
"""

from __future__ import annotations

import subprocess
import sys

PATHS = ("quantkit/runtime/model", "quantkit/kernels/csrc")


def counted(path: str, text: str) -> int:
    n, block = 0, False
    for line in text.splitlines():
        s = line.strip()
        if not s:
            continue
        if path.endswith(".py"):
            n += not s.startswith("#")
            continue
        if block:
            block = "*/" not in s
            continue
        if s.startswith("/*"):
            block = "*/" not in s
            continue
        n += not s.startswith("//")
    return n


def files(rev: str) -> list[str]:
    out = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, *PATHS], check=True, capture_output=True,
                         text=True).stdout
    return [f for f in out.splitlines() if f.endswith((".py", ".cpp", ".h"))]


def main(revs: list[str]) -> None:
    for rev in revs:
        total = 0
        for f in files(rev):
            text = subprocess.run(["git", "show", f"{rev}:{f}"], check=True, capture_output=True, text=True).stdout
            n = counted(f, text)
            total += n
            print(f"{rev}\t{n}\t{f}")
        print(f"{rev}\ttotal\t{total}")


if __name__ == "__main__":
    main(sys.argv[1:] or ["HEAD"])
