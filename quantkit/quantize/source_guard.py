"""The quantizer's watch on its source: a source file changed while it is quantized ends the run in one line.

A shard rewritten in place during a run (same size, new bytes) gave a folder that verified, with some blocks
from the old bytes and some from the new (or zeros), and nothing told the user. Each source file's identity
(size, modification and change times, inode, device: `file_identity`) is taken when the checkpoint is opened,
before its header is read, and compared again before a finished shard is recorded in the journal and before the
folder's config, index and manifest are written. Every block of a shard is read before the shard is recorded,
so a shard the journal lists was written from the bytes the run started with; the journal also keeps the
identities, so `--resume` against a source that changed between runs redoes every shard instead of mixing two
versions of the weights.
"""

from __future__ import annotations

from pathlib import Path

from quantkit.checkpoint.reader import FileIdentity, file_identity
from quantkit.errors import QuantkitError


def _change(was: FileIdentity, now: FileIdentity) -> str:
    if now[3:] != was[3:]:
        return "was replaced by another file"
    if now[0] < was[0]:
        return f"was cut short ({now[0]:,} bytes, {was[0]:,} when the run began)"
    if now[0] > was[0]:
        return f"grew ({now[0]:,} bytes, {was[0]:,} when the run began)"
    return "was rewritten in place"


class SourceGuard:
    """The identities of a checkpoint's files as first opened; `check` raises one line naming a changed file."""

    def __init__(self, identities: dict[Path, FileIdentity]):
        self.identities = dict(identities)

    @classmethod
    def of(cls, ckpt: object) -> SourceGuard:
        """The identities `Checkpoint.open` took (taken now for a checkpoint made another way)."""
        ids = dict(getattr(ckpt, "identities", None) or {})
        for f in getattr(ckpt, "files", []):
            if Path(f) not in ids:
                ids[Path(f)] = file_identity(Path(f))
        return cls(ids)

    def check(self) -> None:
        for path, was in self.identities.items():
            try:
                now = file_identity(path)
            except OSError as e:
                raise QuantkitError(f"{path}: {e.strerror or 'cannot be read'} while it was being quantized; the "
                                    "output is left unfinished: restore the file, then run the same command with "
                                    "--resume") from None
            if now != was:
                raise QuantkitError(f"{path}: {_change(was, now)} while it was being quantized; the output is left "
                                    "unfinished: restore the file, then run the same command with --resume")

    def record(self) -> dict[str, list[int]]:
        """The identities by path, as the journal keeps them."""
        return {str(p): list(v) for p, v in sorted(self.identities.items())}
