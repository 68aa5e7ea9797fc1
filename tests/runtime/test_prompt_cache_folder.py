"""A `--prompt-cache-dir` no one else can poison and no other model empties (quantkit/runtime/prompt_folder.py,
prompt_disk.py), tried as a hostile user or a careless one would: a model with a small bound evicts only its
own entries (another model's survive, the summary and one warning say the folder is over the bound); an entry
re-signed for another prompt, or of an older format, is never restored (greedy tokens as a cold run), reported
once and left in place; a folder or key others could write or read is refused in one line with nothing written;
an empty DIR is refused; only the leftovers of quantkit's dead writers are removed at open."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from safetensors.torch import load, save

from quantkit.errors import QuantkitError
from quantkit.runtime import load_model, prompt_disk
from quantkit.runtime.prompt_folder import KEY, load_key, sign

from helpers.cli import TINY_KW, run_cli
from helpers.probe import count, expect_one_line, tree_digest
from helpers.prompt_cache import cold, entries, fresh, read_header, run, text

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = os.geteuid() == 0


def prompts(model: Path, n: int) -> list[list[int]]:
    rt = load_model(model, recipe="bf16")
    return [rt.encode(f"prompt {k}\n" + text(50)) for k in range(n)]  # they part at the first line


@pytest.fixture(scope="module")
def other_model(tmp_path_factory):
    from quantkit.testing.tiny import make_tiny_model

    # the same shapes, other weights: another model's server sharing the folder
    return make_tiny_model(tmp_path_factory.mktemp("other") / "m", decisive=True, **{**TINY_KW, "seed": 1})


def test_a_small_bound_evicts_only_this_models_entries(tiny_model, other_model, tmp_path):
    d = tmp_path / "pc"
    ids = prompts(tiny_model, 5)
    theirs_rt = fresh(other_model, d)
    run(theirs_rt, ids[0])
    run(theirs_rt, ids[1])
    theirs = {p.name: p.read_bytes() for p in entries(d)}
    bound = int(max(map(len, theirs.values())) * 3.5)
    warnings: list[str] = []
    rt = fresh(tiny_model, d, disk_bytes=bound, warn=warnings.append)
    for x in ids:
        run(rt, x)
        ours = sum(p.stat().st_size for p in entries(d) if p.name not in theirs)
        assert 0 < ours <= bound
    disk = rt.prompt_cache.summary()["disk"]
    assert disk["evictions"] > 0 and disk["bytes"] == ours and disk["entries"] > 0
    assert {p.name: p.read_bytes() for p in entries(d) if p.name in theirs} == theirs  # all there, untouched
    assert disk["other_bytes"] == sum(map(len, theirs.values())) and disk["over_bound"]
    assert disk["ignored_other_weights"] == len(theirs)
    assert len(warnings) == 1 and "over --prompt-cache-disk-size" in warnings[0], warnings
    assert "only this model's entries count" in warnings[0]
    got, cached = run(fresh(other_model, d), ids[1])  # the other model, restarted, still restores its prompt
    assert cached > 0 and got == cold(other_model, ids[1])
    count()


def _forge(path: Path, ids: list[int], how: str, key: bytes) -> Path:
    """The entry at `path` made to answer the prompt `ids` starts with, as an attacker would: its token ids
    rewritten, its unkeyed sha256 recomputed, its signature kept, dropped, made with a guessed key or (the
    control) with the folder's own key; renamed to the name the other prompt's entry has."""
    header, _rest = read_header(path.read_bytes())
    tensors = load(path.read_bytes())
    meta = header["__metadata__"]
    n = len(json.loads(meta["ids"]))
    meta["ids"] = json.dumps(ids[:n])
    meta["sha256"] = prompt_disk.digest(meta, tensors)
    if how == "signature dropped":
        del meta["mac"]
    elif how != "stale signature":
        meta["mac"] = sign(os.urandom(32) if how == "guessed key" else key, prompt_disk.signed_fields(meta))
    out = path.with_name(f"{path.name[:22]}{prompt_disk._hash(ids[:n])[:24]}.safetensors")
    path.unlink()
    out.write_bytes(save(tensors, metadata=meta))
    return out


@pytest.mark.parametrize("how", ["stale signature", "signature dropped", "guessed key", "the folder's key"])
def test_an_entry_resigned_for_another_prompt_is_never_restored(tiny_model, tmp_path, how):
    """The attack of issue 51: prompt a's entries rewritten to answer prompt b. Without the folder's key
    (0600, its owner's) they are never restored: b answers as a cold run; one warning; left in place. With the
    key (the control) they are restored: the key is what keeps them out."""
    d = tmp_path / "pc"
    a, b = prompts(tiny_model, 2)
    run(fresh(tiny_model, d), a)
    forged = {p: p.read_bytes() for p in (_forge(p, b, how, (d / KEY).read_bytes()) for p in entries(d))}
    warnings: list[str] = []
    rt = fresh(tiny_model, d, warn=warnings.append)
    got, cached = run(rt, b)
    if how == "the folder's key":
        assert cached > 0 and not warnings
        return
    count()
    assert cached == 0 and got == cold(tiny_model, b)
    assert len(warnings) == 1 and "not signed with this folder's key" in warnings[0], warnings
    assert rt.prompt_cache.summary()["disk"]["ignored_unsigned"] == len(forged)
    assert all(p.read_bytes() == data for p, data in forged.items())  # not removed, not overwritten


def test_entries_of_an_older_format_are_ignored_reported_and_kept(tiny_model, tmp_path):
    """Entries an older quantkit wrote (format 1: no signature, named by the identity alone) are never
    restored, reported in one line, left in place, and never overwritten by this version's entries."""
    d = tmp_path / "pc"
    (a,) = prompts(tiny_model, 1)
    run(fresh(tiny_model, d), a)
    old = {}
    for p in entries(d):
        tensors = load(p.read_bytes())
        meta = read_header(p.read_bytes())[0]["__metadata__"]
        meta[prompt_disk.MAGIC] = "1"
        del meta["mac"]
        v1 = p.with_name(f"qkpc-{prompt_disk._hash(json.loads(meta['identity']))[:16]}{p.name[21:]}")
        p.unlink()
        v1.write_bytes(save(tensors, metadata=meta))
        old[v1] = v1.read_bytes()
    warnings: list[str] = []
    rt = fresh(tiny_model, d, warn=warnings.append)
    got, cached = run(rt, a)
    assert cached == 0 and got == cold(tiny_model, a)
    assert len(warnings) == 1 and "older quantkit (format 1" in warnings[0] and "left in place" in warnings[0]
    disk = rt.prompt_cache.summary()["disk"]
    assert disk["ignored_old_format"] == len(old) and disk["writes"] == len(old) and disk["entries"] == len(old)
    assert all(p.read_bytes() == data for p, data in old.items())
    assert run(fresh(tiny_model, d), a)[1] > 0  # this version's own entries are restored
    count()


def test_only_the_leftovers_of_dead_writers_are_removed_at_open(tiny_model, tmp_path):
    d = tmp_path / "pc"
    d.mkdir(mode=0o700)
    gone = subprocess.Popen([sys.executable, "-c", ""])
    gone.wait()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    entry = f"qkpc-{'0' * 16}-{'1' * 24}.safetensors"
    try:
        removed = [f".{entry}.tmp-{gone.pid}_140234", f".qkpc-probe-{gone.pid}_1", f"{KEY}.tmp-{gone.pid}_2"]
        kept = [f".{entry}.tmp", ".qkpc-notes.safetensors.tmp", f".{entry}.tmp-{gone.pid}", f".{entry}.tmpx",
                f".{entry}.tmp-{alive.pid}_3", f".qkpc-probe-{alive.pid}_4", f".qkpc-probe-{os.getpid()}_5",
                ".qkpc-probe-99999999_6", ".qkpc-probe-x", "notes.txt"]
        for name in removed + kept:
            (d / name).write_text(f"{name}'s bytes")
        (d / f".qkpc-probe-{gone.pid}_7").mkdir()  # not a file
        rt = fresh(tiny_model, d)
        run(rt, prompts(tiny_model, 1)[0])
    finally:
        alive.kill()
        alive.wait()
    assert not [n for n in removed if (d / n).exists()]
    assert all((d / n).read_text() == f"{n}'s bytes" for n in kept) and (d / f".qkpc-probe-{gone.pid}_7").is_dir()
    assert sorted(os.listdir(d)) == sorted([*kept, f".qkpc-probe-{gone.pid}_7", KEY, *(p.name for p in entries(d))])
    count(len(removed) + len(kept))


@pytest.mark.parametrize("value", ["", "   "])
def test_an_empty_dir_is_refused_in_one_line_with_nothing_written(tiny_model, tmp_path, capsys, monkeypatch, value):
    monkeypatch.chdir(tmp_path)
    for cmd in (["generate", tiny_model, "--prompt", "hi"], ["serve", tiny_model, "--port", "0"]):
        code, out, err = run_cli([*cmd, "--prompt-cache-dir", value], capsys, monkeypatch)
        expect_one_line(code, out, err, "an empty folder name")
    rt = load_model(tiny_model, recipe="bf16")
    with pytest.raises(QuantkitError, match="an empty folder name"):
        rt.set_prompt_cache(1 << 20, value, 1 << 30)
    count()
    assert os.listdir(tmp_path) == []


def _key(d: Path, mode: int = 0o600, data: bytes = b"k" * 32) -> Path:
    (d / KEY).write_bytes(data)
    (d / KEY).chmod(mode)
    return d / KEY


def _hostile(tmp_path: Path, case: str) -> Path:
    """A DIR another user could write, or whose key another could read or write."""
    d = tmp_path / "pc"
    if case == "open parent":
        (tmp_path / "open").mkdir()
        (tmp_path / "open").chmod(0o777)
        return tmp_path / "open" / "pc"
    d.mkdir(mode=0o700)
    if case in ("world-writable", "group-writable", "shared sticky"):
        d.chmod({"world-writable": 0o777, "group-writable": 0o770, "shared sticky": 0o1777}[case])
    elif case == "another owner":
        os.chown(d, 65534, 65534)
    elif case == "key readable":
        _key(d, 0o644)
    elif case == "key of another owner":
        os.chown(_key(d), 65534, 65534)
    elif case == "key a link":
        _key(tmp_path).rename(tmp_path / "elsewhere")
        (d / KEY).symlink_to(tmp_path / "elsewhere")
    elif case == "key too short":
        _key(d, data=b"12345")
    return d


@pytest.mark.parametrize("case,needle", [
    ("world-writable", "writable by others (mode 0777)"), ("group-writable", "writable by others (mode 0770)"),
    ("shared sticky", "pick a new folder inside it"), ("open parent", "above it is writable by others"),
    ("another owner", "owned by uid 65534, not this user"), ("key readable", "readable or writable by others"),
    ("key of another owner", "owned by uid 65534"), ("key a link", "not a regular file"),
    ("key too short", "5 bytes, not a quantkit prompt-cache key"),
])
def test_a_folder_others_could_write_is_refused_in_one_line(tiny_model, tmp_path, capsys, monkeypatch, case,
                                                           needle):
    if "owner" in case and not ROOT:
        pytest.skip("giving a folder to another user needs root")
    d = _hostile(tmp_path, case)
    before = tree_digest(tmp_path)
    for cmd in (["generate", tiny_model, "--prompt", "hi"], ["serve", tiny_model, "--port", "0"]):
        code, out, err = run_cli([*cmd, "--prompt-cache-dir", d], capsys, monkeypatch)
        assert str(d) in expect_one_line(code, out, err, needle)
    rt = load_model(tiny_model, recipe="bf16")
    with pytest.raises(QuantkitError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        rt.set_prompt_cache(1 << 20, d, 1 << 30)
    count()
    assert tree_digest(tmp_path) == before and d.exists() != (case == "open parent")  # nothing made


def test_a_new_folder_its_key_and_entries_are_private_whatever_the_umask(tiny_model, tmp_path):
    d = tmp_path / "new" / "pc"
    old = os.umask(0)
    try:
        rt = fresh(tiny_model, d)
        run(rt, prompts(tiny_model, 1)[0])
    finally:
        os.umask(old)
    assert (d.stat().st_mode & 0o777, d.parent.stat().st_mode & 0o777) == (0o700, 0o700)
    assert (d / KEY).stat().st_mode & 0o777 == 0o600 and (d / KEY).stat().st_size == 32
    assert entries(d) and all(p.stat().st_mode & 0o777 == 0o600 for p in entries(d))


def test_processes_opening_a_new_folder_at_once_agree_on_one_key(tmp_path):
    d = tmp_path / "pc"
    d.mkdir(mode=0o700)
    start, keys = threading.Barrier(8), []

    def opener():
        start.wait()
        keys.append(load_key(d))
    threads = [threading.Thread(target=opener) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(keys) == 8 and len(set(keys)) == 1 and os.listdir(d) == [KEY]
