"""Atomic writes, sha256, the output manifest and the resume journal of a quantized folder.

`quantkit-manifest.json` is written LAST by the quantizer: a folder without it is not finished. It
lists every shard (and every other file the quantizer wrote or copied) with size and sha256, the
fingerprint of the source checkpoint and the options used. `.quantkit-progress.json` is the journal of
an unfinished run: the shards already renamed into place, with their sha256, so `--resume` can reuse
them after checking.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from quantkit.checkpoint.contract import JOURNAL_NAME, MANIFEST_NAME, MANIFEST_VERSION
from quantkit.checkpoint.reader import safe_member  # the loader's rule for the files a folder may name
from quantkit.errors import QuantkitError
from quantkit.fileio import atomic_write_json, read_json_bounded

_HASH_BUF = 8 << 20


def sha256_file(path: Path, progress: Any = None) -> str:
    """sha256 of a file, read in 8 MiB chunks; `progress(nbytes)` is called per chunk if given."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            buf = f.read(_HASH_BUF)
            if not buf:
                break
            h.update(buf)
            if progress is not None:
                progress(len(buf))
    return h.hexdigest()


def read_json(path: Path, what: str) -> Any:
    if not path.exists():
        raise QuantkitError(f"{path}: {what} is missing")
    return read_json_bounded(path, what)


@dataclass(frozen=True)
class FileEntry:
    size: int
    sha256: str


@dataclass
class Manifest:
    """What a finished quantized folder holds. `shards` are the safetensors shards; `files` the rest."""

    shards: dict[str, FileEntry]
    files: dict[str, FileEntry]
    source: dict[str, Any]
    options: dict[str, Any]
    version: int = MANIFEST_VERSION
    tool: str = "quantkit"

    def to_dict(self) -> dict[str, Any]:
        return {
            "tool": self.tool,
            "version": self.version,
            "source": self.source,
            "options": self.options,
            "shards": {k: asdict(v) for k, v in sorted(self.shards.items())},
            "files": {k: asdict(v) for k, v in sorted(self.files.items())},
        }

    @classmethod
    def from_dict(cls, d: Any, path: Path) -> Manifest:
        try:
            if d.get("tool") != "quantkit":
                raise ValueError("not written by quantkit")
            return cls(
                shards={k: FileEntry(int(v["size"]), str(v["sha256"])) for k, v in d["shards"].items()},
                files={k: FileEntry(int(v["size"]), str(v["sha256"])) for k, v in d.get("files", {}).items()},
                source=dict(d.get("source", {})),
                options=dict(d.get("options", {})),
                version=int(d.get("version", 0)),
            )
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise QuantkitError(f"{path}: malformed manifest ({e})") from None

    def write(self, folder: Path) -> Path:
        path = folder / MANIFEST_NAME
        atomic_write_json(path, self.to_dict())
        return path

    @classmethod
    def read(cls, folder: Path) -> Manifest:
        path = folder / MANIFEST_NAME
        if not path.is_file():
            # the hint fits what the folder is: an interrupted run (its journal is there), or not quantkit's
            if (folder / JOURNAL_NAME).is_file():
                raise QuantkitError(f"{folder}: no {MANIFEST_NAME}: an interrupted `quantkit quantize` run; finish "
                                    "it with the same command and --resume")
            raise QuantkitError(
                f"{folder}: no {MANIFEST_NAME}: not a folder written by `quantkit quantize` (a bf16 or other "
                "checkpoint has nothing to verify against); quantize it with `quantkit quantize "
                f"{folder} --scheme quality --out OUT`, or run it as it is with `quantkit chat {folder}`")
        return cls.from_dict(read_json(path, "manifest"), path)


def file_entry(path: Path, progress: Any = None) -> FileEntry:
    return FileEntry(path.stat().st_size, sha256_file(path, progress))


def check_file(folder: Path, name: str, entry: FileEntry, hash_it: bool = True, progress: Any = None) -> str | None:
    """None if `folder/name` matches `entry`, else a one-line problem naming the file."""
    try:
        p = safe_member(folder, name, MANIFEST_NAME)
    except QuantkitError as e:
        return str(e)
    if not p.is_file():
        return f"{name}: missing"
    size = p.stat().st_size
    if size != entry.size and name.endswith(".safetensors"):
        what = "truncated" if size < entry.size else "larger than recorded"
        return f"{name}: {what} ({size} bytes, manifest says {entry.size})"
    if size != entry.size:  # config.json re-indented, a tokenizer edited: changed, not necessarily cut short
        return (f"{name}: differs from the manifest's record ({size:,} bytes, the manifest's {entry.size:,}; "
                "edited after quantizing?): restore it, or quantize again")
    if hash_it and sha256_file(p, progress) != entry.sha256:
        return f"{name}: altered (its sha256 differs from the manifest's)"
    return None


@dataclass
class Journal:
    """Progress of an unfinished run: `key` fixes source + options + shard plan; `done` the shards in place."""

    key: str
    done: dict[str, FileEntry] = field(default_factory=dict)
    stats: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # per shard, for the final report
    files: list[str] = field(default_factory=list)  # the other files the run writes, recorded before it writes them
    # the source files' identities the shards in `done` were read from (quantize/source_guard.py); empty in
    # journals written before it was kept
    sources: dict[str, list[int]] = field(default_factory=dict)

    def save(self, folder: Path) -> None:
        atomic_write_json(
            folder / JOURNAL_NAME,
            {"key": self.key, "done": {k: asdict(v) for k, v in sorted(self.done.items())},
             "stats": {k: v for k, v in sorted(self.stats.items())}, "files": sorted(self.files),
             "sources": {k: v for k, v in sorted(self.sources.items())}},
        )

    @classmethod
    def load(cls, folder: Path) -> Journal | None:
        path = folder / JOURNAL_NAME
        if not path.is_file():
            return None
        d = read_json(path, "progress journal")
        try:
            done = {k: FileEntry(int(v["size"]), str(v["sha256"])) for k, v in d["done"].items()}
            stats = {str(k): list(v) for k, v in d.get("stats", {}).items()}
            sources = {str(k): [int(x) for x in v] for k, v in d.get("sources", {}).items()}
            return cls(str(d["key"]), done, stats, [str(n) for n in d.get("files", [])], sources)
        except (KeyError, TypeError, ValueError, AttributeError):
            raise QuantkitError(f"{path}: malformed progress journal; rerun with --overwrite") from None


def fingerprint(obj: Any) -> str:
    """A stable sha256 of JSON-able data (sorted keys)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
