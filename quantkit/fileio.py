"""Reading and writing the files a user names, safely.

Writing: every output quantkit writes goes to a hidden temporary name beside its target, is fsynced, then
renamed into place; readers see the old file or the new one. `temp_name` / `pid_temp_name` are the only
naming rules for those temporaries (`.NAME.tmp`, `.NAME.tmp-PID`, `.NAME.old-PID`; NAME shortened with a hash
when the name is near the file system's limit: `temp_stem`), so `clean_leftovers` can find a killed run's
leftovers and remove them (never those of a run still alive).

Reading: `read_bytes_bounded` / `read_text_bounded` / `read_json_bounded` read a user-named file with a size
limit: `/dev/zero` or a 20 GB log given as `--plan` ends in one clear line, never in the OOM killer.

Where an output may go is decided by quantkit/outputs.py (`guard_output`), which uses these names."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import stat
from pathlib import Path
from typing import Any, BinaryIO

from quantkit.errors import QuantkitError

# The bound for a JSON/text file a user names (a plan, a recipe, a runtime profile, a chat session,
# a config.json, a tokenizer.json): the largest legitimate one (the 248k-token tokenizer.json) is ~11 MB.
DEFAULT_READ_LIMIT = 64 << 20


# Most file systems allow names of 255 bytes (os.pathconf's PC_NAME_MAX); quantkit's temporaries add a dot
# before the name and up to TEMP_ROOM bytes after it (`.tmp-` + a pid, at most 7 digits under Linux's pid_max
# of 2^22, + a tag such as `probe`), so a name within the limit but near it gets a shorter stem.
NAME_MAX = 255
TEMP_ROOM = 24


def temp_stem(name: str) -> str:
    """The part of an output's name its temporaries carry: the name itself, or for a name too long to take a
    temporary's dot and suffix, its head and a hash of the whole name (one stem per name, so a killed run's
    leftovers are still found by `clean_leftovers`)."""
    room = NAME_MAX - 1 - TEMP_ROOM
    if len(os.fsencode(name)) <= room:
        return name
    digest = hashlib.sha256(os.fsencode(name)).hexdigest()[:16]
    head = name
    while len(os.fsencode(head)) > room - 1 - len(digest):
        head = head[:-1]
    return f"{head}~{digest}"


def temp_name(path: Path) -> Path:
    """The hidden temporary name a file is written under before it is renamed into place."""
    return path.with_name(f".{temp_stem(path.name)}.tmp")


def pid_temp_name(path: Path, tag: str = "tmp") -> Path:
    """A per-process temporary beside `path` (`.NAME.tmp-PID`; tag "old" for a replaced output, "mid" for an
    intermediate file)."""
    return path.with_name(f".{temp_stem(path.name)}.{tag}-{os.getpid()}")


def check_name_length(path: Path, flag: str = "") -> None:
    """Refuse, in one line, a name longer than the file system holding `path` allows (checked before any work:
    the write would otherwise fail at its end)."""
    limit = NAME_MAX
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        limit = os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        pass
    for part in path.parts:
        n = len(os.fsencode(part))
        if n > limit:
            raise QuantkitError(f"{flag}{path}: a name of {n} bytes, longer than this file system allows ({limit}); "
                                "pick a shorter name")


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_leftovers(path: Path) -> list[Path]:
    """Remove the temporaries an interrupted run left for output `path` (`.NAME.tmp`, and `.NAME.tmp-PID`,
    `.NAME.old-PID` and `.NAME.mid-PID` of processes no longer running). Returns what was removed."""
    parent = path.parent
    if not parent.is_dir():
        return []
    pat = re.compile(r"^\." + re.escape(temp_stem(path.name)) + r"\.(?:tmp|(?:tmp|old|mid)-(\d+))(?:[A-Za-z0-9_]*)$")
    removed = []
    try:
        entries = list(parent.iterdir())
    except OSError:
        return []
    for p in entries:
        m = pat.match(p.name)
        if m is None or (m.group(1) and _alive(int(m.group(1)))):
            continue
        try:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
            removed.append(p)
        except OSError:
            pass
    return removed


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
        trash = pid_temp_name(out, "old")
        os.replace(out, trash)
        os.replace(tmp, out)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, out)
    fsync_dir(out.parent)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to a temporary name, fsync, then rename over `path`: readers see old or new, never half.
    A failed write (full disk, read-only file system) removes the temporary and says so in one line; one cut
    short (Ctrl-C, SIGTERM under quantkit.cli.signals) removes it too."""
    tmp = temp_name(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        if isinstance(e, OSError):
            raise QuantkitError(f"{path}: cannot write ({e.strerror}); free space or pick another location") from None
        raise
    fsync_dir(path.parent)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())


def write_atomic(path: Path, text: str) -> None:
    """`atomic_write_bytes` for text, creating the parent folder first."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise QuantkitError(f"{path}: cannot write (cannot create {path.parent}: {e.strerror}); "
                            "pick another location") from None
    atomic_write_bytes(path, text.encode())


def open_regular(path: Path, what: str = "file") -> BinaryIO:
    """`path` opened for reading, refused in one line unless it is a regular file: a FIFO would block the
    open (or the read) forever and a device never ends (opened non-blocking, then checked)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, "is a folder", str(path))
        raise QuantkitError(f"{path}: is not a regular file (a FIFO, socket or device); name the {what} itself")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def require_regular_file(path: str | Path, flag: str, what: str, make: str) -> None:
    """Refuse, in one line naming the option and the path as given, an input file that is missing, a folder or
    not a regular file (a device never ends, a FIFO blocks); `make` says how to get the right file (e.g. "make
    it with `quantkit stats MODEL --out FILE`"). Never suggests writing to the path given."""
    p = Path(path)
    try:
        mode = p.stat().st_mode
    except FileNotFoundError:
        raise QuantkitError(f"{flag} {p}: no such file; {make}") from None
    except OSError as e:
        raise QuantkitError(f"{flag} {p}: cannot read the {what} ({e.strerror})") from None
    if stat.S_ISDIR(mode):
        raise QuantkitError(f"{flag} {p}: is a folder; name the {what} itself")
    if not stat.S_ISREG(mode):
        raise QuantkitError(f"{flag} {p}: is not a regular file (a FIFO, socket or device); name the {what} itself")


def read_bytes_bounded(path: str | Path, what: str = "file", limit: int = DEFAULT_READ_LIMIT) -> bytes:
    """The bytes of a user-named file, at most `limit` of them: a larger file (or an endless device) is refused
    with one line naming it, after reading no more than `limit + 1` bytes."""
    p = Path(path)
    try:
        with open_regular(p, what) as f:
            data = f.read(limit + 1)
    except IsADirectoryError:
        raise QuantkitError(f"{p}: is a folder; name the {what}") from None
    except OSError as e:
        raise QuantkitError(f"{p}: cannot read {what} ({e.strerror})") from None
    if len(data) > limit:
        raise QuantkitError(f"{p}: {what} is larger than {limit / 1e6:.0f} MB; "
                            "is it the right file?")
    return data


def read_text_bounded(path: str | Path, what: str = "file", limit: int = DEFAULT_READ_LIMIT) -> str:
    data = read_bytes_bounded(path, what, limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise QuantkitError(f"{path}: {what} is not UTF-8 text (byte {e.start})") from None


def read_json_bounded(path: str | Path, what: str = "JSON file", limit: int = DEFAULT_READ_LIMIT) -> Any:
    text = read_text_bounded(path, what, limit)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise QuantkitError(f"{path}: {what} is not valid JSON (line {e.lineno}: {e.msg})") from None
    except RecursionError:
        raise QuantkitError(f"{path}: the {what} nests too deeply") from None
