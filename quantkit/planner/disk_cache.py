"""What `quantkit plan --prompt-cache-disk-size SIZE` says about the prompt cache on disk
(quantkit/runtime/prompt_disk.py): how many snapshots of a full-context prompt the bound holds."""

from __future__ import annotations

from quantkit import sizes
from quantkit.checkpoint.spec import TextConfig
from quantkit.planner.budget import snapshot_bytes

MIN_DISK_BYTES = 1 << 20  # below this not even a short prompt's state fits


def parse_disk_size(text: str) -> int:
    """--prompt-cache-disk-size under the one size rule (a bare number is bytes), at least MIN_DISK_BYTES."""
    return sizes.parse_size(text, "--prompt-cache-disk-size", minimum=MIN_DISK_BYTES)


def disk_cache_note(c: TextConfig, context: int, disk_bytes: int) -> str:
    """One line: the bound, one entry's size at `context` tokens (a file holds one snapshot, its KV its own) and
    at a short prompt, and how many full-context entries fit."""
    full, short = snapshot_bytes(c, context), snapshot_bytes(c, min(context, 2048))
    fits = disk_bytes // full if full else 0
    return (f"prompt cache on disk (--prompt-cache-dir, bound {disk_bytes / 1e9:.1f} GB): an entry is "
            f"{full / 1e9:.2f} GB at {context:,} tokens ({short / 1e6:.0f} MB at {min(context, 2048):,}), so it holds "
            f"{fits:,} full-context prompt{'s' if fits != 1 else ''}; restored after a restart instead of prefilled. "
            "Disk, not RAM: not in the budget above")
