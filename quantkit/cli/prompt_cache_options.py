"""`--prompt-cache-dir DIR` and `--prompt-cache-disk-size SIZE` (serve, chat, generate): the prompt cache kept on
disk, found again after a restart (quantkit/runtime/prompt_disk.py). Checked before the model loads: an empty
DIR, one inside the model folder and one another user could write (quantkit/runtime/prompt_folder.py) are
refused in one line."""

from __future__ import annotations

from pathlib import Path

import typer

from quantkit.errors import QuantkitError
from quantkit.planner.disk_cache import parse_disk_size
from quantkit.runtime.prompt_disk import check_outside
from quantkit.runtime.prompt_folder import cache_folder, check_private


def _folder(text: str) -> Path:
    # a parser, since Typer's Path turns "" into "." (the current folder) before a command could see it
    try:
        return cache_folder(text)
    except QuantkitError as e:
        raise typer.BadParameter(str(e).removeprefix("--prompt-cache-dir ")) from None


_folder.__name__ = "Path"  # the kind tests/cli/test_cli_vocabulary.py knows this flag by

CACHE_DIR = typer.Option(None, "--prompt-cache-dir", parser=_folder,
                         help="keep prompt-cache snapshots in files in this folder too, so a restart restores a "
                         "prompt seen before instead of prefilling it (bound to these weights; a folder only you "
                         "can write: see docs/prompt-cache.md)")
DISK_SIZE = typer.Option(None, "--prompt-cache-disk-size",
                         help="most bytes of this model's entries in --prompt-cache-dir, least recently used "
                         "removed first: e.g. 8GB, 512MB [default: a quarter of the free space there]")


def parse_disk_cache(folder: Path | None, size: str | None, model: str | Path) -> int | None:
    """The disk bound in bytes (None: the default) after checking the options (one line per mistake), before
    the model loads."""
    if folder is not None:
        if Path(model).exists():
            check_outside(folder, Path(model))
        check_private(folder)
    if size is None:
        return None
    if folder is None:
        raise QuantkitError(f"--prompt-cache-disk-size {size}: bounds the disk prompt cache; give "
                            "--prompt-cache-dir DIR too")
    return parse_disk_size(size)
