"""The folder of the disk prompt cache (quantkit/runtime/prompt_disk.py): who may write it, the key that signs
its entries, and the leftovers of writers that died.

Trust: a restored entry becomes the model's state for a prompt, so whoever can write DIR could change other
users' answers. DIR must be owned by this user and writable by no one else (no group or world write bit), and
no folder above it may be writable by others unless it is sticky (as /tmp): else it is refused in one line
(`check_private`), before anything is written. quantkit creates DIR 0700 and its files 0600.

The key, `DIR/.qkpc-key`: 32 random bytes, created 0600 by the first process (written under a temporary name
and hard-linked into place, so processes opening a new DIR at once agree on one key), read by the others. It
must be a regular file of this user that no one else can read or write, else DIR is refused in one line.
Every entry's header carries an HMAC-SHA256 with this key over the format, identity, ids, kinds and the
entry's sha256 (`sign`): an entry without a valid one is never restored, and never removed (it cannot be
shown to be quantkit's). Whoever can read the key can sign entries; entries copied from another DIR are
restored only when that DIR's key is copied too.

Leftovers (`clean_dead_writers`, at open): only quantkit's own temporaries (`.qkpc-<entry>.tmp-PID_TID`,
`.qkpc-key.tmp-PID_TID`) and writability probes (`.qkpc-probe-PID_TID`) whose process is gone are removed;
any other name (a user's `.qkpc-x.safetensors.tmp`) is left alone."""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import stat
import threading
from pathlib import Path

from quantkit.errors import QuantkitError
from quantkit.fileio import fsync_dir

FLAG = "--prompt-cache-dir"
KEY = ".qkpc-key"
KEY_BYTES = 32
PID_MAX = 1 << 22  # Linux's largest pid_max: a larger "pid" in a name is no writer of quantkit's
_LEFTOVER = re.compile(r"^\.(?:qkpc-[0-9a-f]{16}-[0-9a-f]{24}\.safetensors\.tmp|qkpc-key\.tmp|qkpc-probe)"
                       r"-([0-9]{1,7})_[0-9]{1,20}$")


def cache_folder(folder: str | os.PathLike[str]) -> Path:
    """`folder` as a Path; an empty or blank name (which would mean the current folder) is refused."""
    if not str(folder).strip():
        raise QuantkitError(f"{FLAG} {str(folder)!r}: an empty folder name; give a folder, e.g. "
                            "~/.cache/quantkit/prompt-cache")
    return Path(folder).expanduser()


def check_private(folder: Path) -> None:
    """Refuse (one line) a DIR another user could write: not this user's, group/world writable, under a folder
    others can write (sticky ones excepted), or holding a key others can read or write. A DIR not made yet
    passes when the folders above it do."""
    given = Path(os.path.abspath(folder))
    real = given.resolve()
    uid = os.geteuid()
    for p in dict.fromkeys((real, *real.parents, *given.parents)):  # through a link: both ways up
        try:
            st = os.stat(p)
        except OSError:
            continue  # not there (yet), or out of reach: then it cannot be written either (open_store warns)
        mode = stat.S_IMODE(st.st_mode)
        if p == real and stat.S_ISDIR(st.st_mode):
            if st.st_uid != uid:
                raise QuantkitError(f"{FLAG} {folder}: owned by uid {st.st_uid}, not this user (uid {uid}); "
                                    "its entries could change the answers: pick a folder of your own")
            if mode & 0o022:
                fix = "pick a new folder inside it (quantkit makes it 0700)" if mode & stat.S_ISVTX else \
                    f"`chmod go-w {folder}`, or pick a folder only you can write"
                raise QuantkitError(f"{FLAG} {folder}: writable by others (mode {mode:04o}); its entries could "
                                    f"change the answers: {fix}")
        elif p != real and mode & 0o022 and not mode & stat.S_ISVTX:
            raise QuantkitError(f"{FLAG} {folder}: {p} above it is writable by others (mode {mode:04o}), who "
                                "could replace the folder: pick one under a folder only you can write")
    if real.is_dir():
        _check_key_file(real / KEY)


def _check_key_file(path: Path) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as e:
        raise QuantkitError(f"{path}: cannot read the prompt-cache key ({e.strerror or e})") from None
    mode = stat.S_IMODE(st.st_mode)
    why = ("not a regular file" if not stat.S_ISREG(st.st_mode)
           else f"owned by uid {st.st_uid}, not this user" if st.st_uid != os.geteuid()
           else f"readable or writable by others (mode {mode:04o})" if mode & 0o077
           else f"{st.st_size} bytes, not a quantkit prompt-cache key" if st.st_size != KEY_BYTES else None)
    if why:
        raise QuantkitError(f"{path}: {why}; whoever can read or write it can sign cache entries: remove it "
                            "(quantkit makes a new one; entries signed with the old one are then ignored)")


def load_key(folder: Path) -> bytes:
    """The folder's key, made first if there is none (QuantkitError when it cannot be trusted, OSError when
    it cannot be written)."""
    path = folder / KEY
    if not os.path.lexists(path):
        tmp = folder / f"{KEY}.tmp-{os.getpid()}_{threading.get_ident()}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            try:
                os.write(fd, secrets.token_bytes(KEY_BYTES))
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.link(tmp, path)  # never replaces one another process made meanwhile
            except FileExistsError:
                pass
            fsync_dir(folder)
        finally:
            try:
                tmp.unlink()
            except OSError:
                pass
    _check_key_file(path)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        key = os.read(fd, KEY_BYTES + 1)
    finally:
        os.close(fd)
    if len(key) != KEY_BYTES:
        raise QuantkitError(f"{path}: {len(key)} bytes, not a quantkit prompt-cache key; remove it (quantkit "
                            "makes a new one; entries signed with the old one are then ignored)")
    return key


def sign(key: bytes, fields: list[str]) -> str:
    """HMAC-SHA256 of the header fields (JSON text and hex, so they never hold a NUL byte)."""
    return hmac.new(key, b"\0".join(f.encode() for f in fields), hashlib.sha256).hexdigest()


def signed(key: bytes, fields: list[str], mac: object) -> bool:
    return isinstance(mac, str) and hmac.compare_digest(sign(key, fields), mac)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True  # another thread of this process may be writing
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # someone else's process: alive
    return True


def clean_dead_writers(folder: Path) -> list[Path]:
    """Remove quantkit's temporaries and probes in `folder` whose writer is gone; returns what was removed."""
    removed = []
    try:
        found = list(os.scandir(folder))
    except OSError:
        return removed
    for e in found:
        m = _LEFTOVER.match(e.name)
        if m is None or not 0 < int(m.group(1)) <= PID_MAX or _alive(int(m.group(1))):
            continue
        try:
            if e.is_file(follow_symlinks=False):
                os.unlink(e.path)
                removed.append(Path(e.path))
        except OSError:
            pass
    return removed
