"""Writing files so that nothing is ever half-written: every output quantkit writes goes to a hidden temporary
name beside its target, is fsynced, then renamed into place; readers see the old file or the new one.

`temp_name` is the one naming rule for those temporaries, so a later run can find (and remove) its own
leftovers after a kill."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any


def temp_name(path: Path) -> Path:
    """The hidden temporary name a file is written under before it is renamed into place."""
    return path.with_name(f".{path.name}.tmp")


def fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def replace_folder(tmp: Path, out: Path) -> None:
    """Move the finished folder `tmp` to `out` (a sibling) by rename; an old `out` is renamed away first and
    removed only after, so `out` is at every moment absent, the old folder or the new one, never half."""
    if out.exists():
        trash = out.parent / f".{out.name}.old-{os.getpid()}"
        os.replace(out, trash)
        os.replace(tmp, out)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, out)
    fsync_dir(out.parent)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to a temporary name, fsync, then rename over `path`: readers see old or new, never half."""
    tmp = temp_name(path)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())


def write_atomic(path: Path, text: str) -> None:
    """`atomic_write_bytes` for text, creating the parent folder first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, text.encode())
