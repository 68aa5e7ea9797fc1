"""`--prompt-cache-dir DIR` and `--prompt-cache-disk-size SIZE` (serve, chat, generate): the prompt cache kept on
disk, found again after a restart (quantkit/runtime/prompt_disk.py)."""

from __future__ import annotations

from pathlib import Path

import typer

from quantkit.errors import QuantkitError
from quantkit.planner.disk_cache import parse_disk_size
from quantkit.runtime.prompt_disk import check_outside

CACHE_DIR = typer.Option(None, "--prompt-cache-dir",
                         help="keep prompt-cache snapshots in files in this folder too, so a restart restores a "
                         "prompt seen before instead of prefilling it (bound to these weights; see "
                         "docs/prompt-cache.md)")
DISK_SIZE = typer.Option(None, "--prompt-cache-disk-size",
                         help="most bytes of --prompt-cache-dir, least recently used entries removed first: e.g. "
                         "8GB, 512MB [default: a quarter of the free space there]")


def parse_disk_cache(folder: Path | None, size: str | None, model: str | Path) -> int | None:
    """The disk bound in bytes (None: the default) after checking the options (one line per mistake), before
    the model loads."""
    if folder is not None and Path(model).exists():
        check_outside(folder, Path(model))
    if size is None:
        return None
    if folder is None:
        raise QuantkitError(f"--prompt-cache-disk-size {size}: bounds the disk prompt cache; give "
                            "--prompt-cache-dir DIR too")
    return parse_disk_size(size)
