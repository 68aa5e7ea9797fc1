"""The one guarded way to choose where an output goes (quantize --out/--report, plan --out, tiny-model, both
exporters). `guard_output` is called before any work and refuses, in one line naming the path and what to do:

- a location equal to, inside, or holding a source (resolved through symlinks): a source is never written;
- a name longer than the file system allows (a name up to that limit is fine: the temporaries beside it
  shorten theirs, fileio.temp_stem);
- a symbolic link (writing would replace the link), a FIFO, socket or device;
- an existing output without the command's `--overwrite`; with it, a folder (or file) that quantkit did not
  write (`owned` says how to recognise its own: a manifest, a marker file, a GGUF magic) is still refused,
  and so is a folder of its own holding files its records (marker, manifest, journal, tiny sidecar) do not
  list: quantkit deletes only what it wrote;
- a location that cannot be written (read-only file system, permissions), found by creating and removing a
  probe file there, so that a long run does not fail at its end;
- less free space than the output needs.

It then removes the temporaries that a killed earlier run left beside the output (fileio.clean_leftovers).
Folders quantkit writes carry `MARKER` (or their own manifest), so a later `--overwrite` recognises them."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

from quantkit.errors import QuantkitError
from quantkit.fileio import (
    atomic_write_json,
    check_name_length,
    clean_leftovers,
    read_json_bounded,
    temp_stem,
)
from quantkit.sizes import format_sizes

MARKER = ".quantkit-output.json"
# files that mark a folder as written by quantkit: the marker, the quantizer's manifest and journal, the tiny
# model's sidecar (their modules import fileio/outputs, so the names are listed here, not imported)
OWN_FOLDER_FILES = (MARKER, "quantkit-manifest.json", ".quantkit-progress.json", "quantkit-tiny.json")


# what each record lists of the files quantkit wrote beside it (the default report is the quantizer's too)
_RECORDS = ((MARKER, ("files",)), ("quantkit-manifest.json", ("shards", "files")),
            (".quantkit-progress.json", ("done", "files")), ("quantkit-tiny.json", ("files",)))
_OWN_EXTRA = ("quantkit-report.md", "quantkit-report.json")
_TEMPORARY = re.compile(r"^\..+\.(?:tmp|(?:tmp|old|mid)-\d+)\w*$")


def occupied(folder: Path) -> bool:
    """Whether `folder` holds anything but quantkit's hidden temporaries (what a write killed before its
    rename leaves: a folder with only those is as good as empty, and a rerun must be able to start in it)."""
    return any(not _TEMPORARY.match(p.name) for p in folder.iterdir())


def write_marker(folder: Path, writer: str) -> None:
    """Mark `folder` (written, about to be renamed into place) as quantkit's own output of `writer` (e.g.
    "export vllm"), listing the files in it, so a later `--overwrite` deletes nothing else."""
    files = sorted({p.name for p in folder.iterdir()} | {MARKER})
    atomic_write_json(folder / MARKER, {"writer": f"quantkit {writer}", "files": files})


def is_own_folder(folder: Path) -> bool:
    return any((folder / n).is_file() for n in OWN_FOLDER_FILES)


def written_files(folder: Path) -> set[str] | None:
    """The names quantkit's records in `folder` say it wrote there (None: no record lists any)."""
    names: set[str] = set()
    listed = False
    for record, keys in _RECORDS:
        if not (folder / record).is_file():
            continue
        try:
            d = read_json_bounded(folder / record, "quantkit record")
        except QuantkitError:
            continue
        for key in keys:
            v = d.get(key) if isinstance(d, dict) else None
            if isinstance(v, (dict, list)):
                names |= {str(n) for n in v} | {record}
                listed = True
    return names | set(_OWN_EXTRA) if listed else None


def foreign_entries(folder: Path) -> list[str]:
    """Entries of quantkit's own output `folder` that its records do not list (files the user added there)."""
    own = written_files(folder)
    entries = sorted(p.name for p in folder.iterdir())
    if own is None:
        return entries
    return [n for n in entries if n not in own and not _TEMPORARY.match(n)]


def has_magic(magic: bytes) -> Callable[[Path], bool]:
    """An `owned` test for files: the file starts with `magic` (e.g. b"GGUF")."""
    def test(p: Path) -> bool:
        try:
            with open(p, "rb") as f:
                return f.read(len(magic)) == magic
        except OSError:
            return False
    return test


def json_with_keys(*keys: str, limit: int = 64 << 20) -> Callable[[Path], bool]:
    """An `owned` test for JSON files: a JSON object holding every one of `keys` (read with a size bound)."""
    def test(p: Path) -> bool:
        try:
            d = read_json_bounded(p, "file", limit)
        except QuantkitError:
            return False
        return isinstance(d, dict) and all(k in d for k in keys)
    return test


def _nearest_existing(p: Path) -> Path:
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _overlap(out: Path, src: Path) -> bool:
    o, s = out.resolve(), src.resolve()
    if o == s or s in o.parents or o in s.parents:
        return True
    # a file inside a source folder through another name (hard link, bind mount) is the same inode
    try:
        return out.exists() and os.path.samefile(out, src)
    except OSError:
        return False


def check_not_source(out: Path, sources: Sequence[Path], flag: str = "") -> None:
    """Refuse an output equal to, inside, or holding any of `sources`."""
    for src in sources:
        if _overlap(Path(out), Path(src)):
            raise QuantkitError(f"{flag}{out}: overlaps the source {src}; quantkit never writes inside or over "
                                "a source: pick a location outside it")


def check_writable(folder: Path, out: Path, flag: str) -> None:
    """Create and remove a probe file in `folder` (permission bits do not stop root; a read-only mount does)."""
    probe = folder / f".{temp_stem(out.name)}.tmp-{os.getpid()}probe"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"\0")
        finally:
            os.close(fd)
    except OSError as e:
        raise QuantkitError(f"{flag}{out}: cannot write in {folder} ({e.strerror}); pick another location") from None
    finally:
        try:
            probe.unlink()
        except OSError:
            pass


def free_disk(path: Path) -> int:
    """Free bytes on the file system that holds `path` (or its nearest existing parent)."""
    return shutil.disk_usage(_nearest_existing(Path(path).resolve())).free


def check_free(out: Path, need: int, flag: str) -> None:
    free = free_disk(out.parent if not out.exists() else out)
    if need > free:
        need_s, free_s = format_sizes(need, free)  # in the unit that fits: a small output is not "0.00 GB"
        raise QuantkitError(f"{flag}{out}: not enough free disk: the output needs {need_s}, {free_s} free; "
                            "free space or pick another location")


def guard_output(out: Path, *, sources: Sequence[Path] = (), kind: str = "file", overwrite: bool = False,
                 owned: Callable[[Path], bool] | None = None, need_bytes: int = 0, flag: str = "",
                 create_parents: bool = False) -> None:
    """Refuse `out` as an output location unless it is safe (see the module docstring). `flag` names the
    option in messages ("--out "); `kind` is "file" or "folder"; `owned` recognises quantkit's own earlier
    output (default for folders: `is_own_folder`); `create_parents` allows a missing parent folder."""
    out = Path(out)
    try:
        _guard(out, sources, kind, overwrite, owned or (is_own_folder if kind == "folder" else None), need_bytes,
               flag, create_parents)
    except OSError as e:  # e.g. a name longer than the file system allows
        raise QuantkitError(f"{flag}{out}: cannot write there ({e.strerror}); pick another location") from None


def _guard(out: Path, sources: Sequence[Path], kind: str, overwrite: bool, owned: Callable[[Path], bool] | None,
           need_bytes: int, flag: str, create_parents: bool) -> None:
    check_name_length(out, flag)
    check_not_source(out, sources, flag)
    if out.is_symlink():  # writing would replace the link (or, for a folder, fail to remove it)
        raise QuantkitError(f"{flag}{out}: is a symbolic link; name the location itself "
                            f"({os.path.realpath(out)}) or pick another")
    if out.exists() and not (out.is_file() or out.is_dir()):
        raise QuantkitError(f"{flag}{out}: is not a regular file (a FIFO, socket or device); pick another location")
    if out.exists():
        if kind == "folder" and not out.is_dir():
            raise QuantkitError(f"{flag}{out}: exists and is not a folder; pick another location")
        if kind == "file" and out.is_dir():
            raise QuantkitError(f"{flag}{out}: is a folder; name the file to write")
        taken = kind == "file" or occupied(out)
        if taken and not overwrite:
            raise QuantkitError(f"{flag}{out}: exists; pass --overwrite to replace it, or pick another location")
        if taken and owned is not None and not owned(out):
            raise QuantkitError(f"{flag}{out}: exists and is not a quantkit output; refusing to replace it: "
                                "remove it yourself or pick another location")
        foreign = foreign_entries(out) if taken and kind == "folder" else []
        if foreign:
            shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
            raise QuantkitError(f"{flag}{out}: holds files quantkit did not write ({shown}); refusing to replace "
                                "it: move them out or pick another location")
    parent = out.parent
    if not parent.is_dir():
        if parent.exists():
            raise QuantkitError(f"{flag}{out}: {parent} is not a folder")
        if not create_parents:
            raise QuantkitError(f"{flag}{out}: no such folder {parent}; create it first")
    base = _nearest_existing(parent)
    check_writable(base, out, flag)
    if need_bytes:
        check_free(out, need_bytes, flag)
    clean_leftovers(out)
