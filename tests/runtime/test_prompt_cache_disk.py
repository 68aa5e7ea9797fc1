"""The prompt cache for raw prompts (checkpoints every prefill chunk) and on disk (`--prompt-cache-dir`): a
repeated or extended raw prompt restores a checkpoint with the logits of a full prefill; a restarted runtime
restores from disk what an earlier one wrote (prefilling only the rest, same tokens as cold); entries of other
weights are ignored, damaged ones skipped with one warning, the disk bound held; a DIR that cannot be used
turns the disk cache off with one warning; bad options are one line."""

from __future__ import annotations

import json
import os

import pytest
import torch

from quantkit.runtime import load_model, prompt_disk
from quantkit.runtime.generate import PREFILL_CHUNK, prefill
from quantkit.runtime.state_cache import PrefixCache, snapshot_points

from helpers.cli import TINY_KW, run_cli
from helpers.probe import expect_one_line, limited_dir
from helpers.prompt_cache import SP, cold, entries, fresh, read_header, run, text, with_header

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def rt(tiny_model):
    return load_model(tiny_model, recipe="bf16")


def test_checkpoints_fall_on_chunk_ends_of_the_last_segment():
    ids = [5] * 1300
    assert snapshot_points(ids, 0, frozenset({9}), 2, 512) == [512, 1024]
    assert snapshot_points(ids, 512, frozenset({9}), 2, 512) == [1024]
    ids[700] = 9  # a boundary: checkpoints count from it, after the boundary snapshots
    assert snapshot_points(ids, 0, frozenset({9}), 2, 512) == [700, 1212]
    assert snapshot_points([5] * 1024, 0, frozenset(), 2, 512) == [512, 1024]  # an aligned end is one
    assert snapshot_points(ids, 0, frozenset({9}), 2) == [700]  # without `every`: boundaries only


def test_repeated_and_extended_raw_prompt_restore_a_checkpoint_bit_exact(rt):
    """A prompt without any message boundary (what /v1/completions sends) is snapshotted at chunk ends and at
    its end: its repeat is reused whole (no token prefilled; the same logits, and the next step's from the
    restored state), while a version with another last line, or one that goes on past its end, restores the last
    chunk end before they part; every logit equals a full prefill's exactly."""
    a = rt.encode(text(50))
    b = rt.encode(text(50, "something else entirely"))
    longer = a + rt.encode(" and then some more")
    assert len(a) > 2 * PREFILL_CHUNK and not set(a) & rt.boundary_ids and len(a) % PREFILL_CHUNK
    common = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    cache = PrefixCache(1 << 28)
    with torch.inference_mode():
        ref = {k: prefill(rt.model, ids) for k, ids in (("a", a), ("b", b), ("longer", longer))}
        first = prefill(rt.model, a, prefix_cache=cache, boundary_ids=rt.boundary_ids)
        again = prefill(rt.model, a, prefix_cache=cache, boundary_ids=rt.boundary_ids)
        other = prefill(rt.model, b, prefix_cache=cache, boundary_ids=rt.boundary_ids)
        past = prefill(rt.model, longer, prefix_cache=cache, boundary_ids=rt.boundary_ids)
        step = {k: rt.model.forward([7], p.cache) for k, p in (("cold", ref["a"]), ("again", again))}
    assert first.cached_tokens == 0 and torch.equal(first.logits, ref["a"].logits)
    assert again.cached_tokens == len(a) and torch.equal(again.logits, ref["a"].logits)
    assert torch.equal(step["again"], step["cold"])
    assert other.cached_tokens == common // PREFILL_CHUNK * PREFILL_CHUNK > 0
    assert torch.equal(other.logits, ref["b"].logits)
    assert past.cached_tokens == len(a) // PREFILL_CHUNK * PREFILL_CHUNK > 0
    assert torch.equal(past.logits, ref["longer"].logits)


def test_restart_restores_from_disk_and_prefills_only_the_rest(tiny_model, tmp_path):
    d = tmp_path / "pc"
    ids = fresh(tiny_model).encode(text(50))
    want = cold(tiny_model, ids)
    first = fresh(tiny_model, d)
    assert run(first, ids) == (want, 0)
    assert entries(d) and first.prompt_cache.summary()["disk"]["writes"] == len(entries(d))
    again = fresh(tiny_model, d)  # a restart: nothing in memory
    got, cached = run(again, ids)
    assert got == want and cached == (len(ids) - 1) // PREFILL_CHUNK * PREFILL_CHUNK
    disk = again.prompt_cache.summary()["disk"]
    assert disk["hits"] == 1 and disk["restored_tokens"] == cached and disk["restore_seconds"] > 0
    assert 0 < disk["bytes"] <= disk["max_bytes"]


def test_a_conversation_resumes_across_a_restart(tiny_model, tmp_path):
    """Turn 1 in one process, turn 2 in another on the same DIR: turn 2 prefills only from the start of the
    last answer on, and answers as a cold run does."""
    d = tmp_path / "pc"
    msgs = [{"role": "system", "content": text(12)}, {"role": "user", "content": "$ ls /srv"}]
    first = fresh(tiny_model, d)
    r1 = first.generate(msgs, sampling=SP)
    p1 = first.last_prompt_ids
    turn2 = msgs + [{"role": "assistant", "content": r1.text}, {"role": "user", "content": "$ pwd"}]
    want = fresh(tiny_model, memory=0).generate(turn2, sampling=SP)
    second = fresh(tiny_model, d)
    r2 = second.generate(turn2, sampling=SP)
    assert r2.token_ids == want.token_ids and r2.cached_tokens >= snapshot_points(p1, 0, first.boundary_ids, 1)[0]
    assert r2.prefilled_tokens == r2.prompt_tokens - r2.cached_tokens < r2.prompt_tokens - len(p1) + 12
    assert second.prompt_cache.summary()["disk"]["hits"] == 1


def test_entries_of_other_weights_are_ignored_never_restored(tiny_model, tmp_path):
    from quantkit.testing.tiny import make_tiny_model

    d = tmp_path / "pc"
    ids = fresh(tiny_model).encode(text(50))
    run(fresh(tiny_model, d), ids)
    before = {p.name: p.read_bytes() for p in entries(d)}
    other = make_tiny_model(tmp_path / "other", decisive=True, **{**TINY_KW, "seed": 1})  # same shapes
    rt = fresh(other, d)
    got, cached = run(rt, ids)
    disk = rt.prompt_cache.summary()["disk"]
    assert cached == 0 and got == cold(other, ids)
    assert disk["ignored_other_weights"] == len(before) and disk["hits"] == 0 and disk["entries"] > 0
    assert all(p.read_bytes() == before[p.name] for p in entries(d) if p.name in before)  # left alone


@pytest.mark.parametrize("damage", ["truncated", "tensor byte"])
def test_damaged_entries_are_skipped_with_one_warning_and_removed(tiny_model, tmp_path, damage):
    """Damaged tensors under a header signed with the folder's key: quantkit's own entry, damaged: one warning
    each, removed (and written anew)."""
    d = tmp_path / "pc"
    ids = fresh(tiny_model).encode(text(50))
    run(fresh(tiny_model, d), ids)
    files = entries(d)
    damaged = {}
    for p in files:
        data = bytearray(p.read_bytes())
        if damage == "truncated":
            data = data[: len(data) - 100]
        else:
            data[-3] ^= 0x40
        p.write_bytes(bytes(data))
        damaged[p] = bytes(data)
    warnings: list[str] = []
    rt = fresh(tiny_model, d, warn=warnings.append)
    got, cached = run(rt, ids)
    assert cached == 0 and got == cold(tiny_model, ids)
    assert sorted(w.split(":")[0] for w in warnings) == sorted(str(p) for p in files), warnings
    assert all("damaged" in w for w in warnings) and rt.prompt_cache.summary()["disk"]["removed_damaged"] == len(files)
    assert not any(p.exists() and p.read_bytes() == damaged[p] for p in files)  # removed (and written anew)


@pytest.mark.parametrize("edit", ["checksum edited", "ids edited", "signature removed"])
def test_an_edited_header_is_never_restored_nor_removed(tiny_model, tmp_path, edit):
    """A header edited by hand fails the folder key's signature: reported in one warning line (not once per
    lookup), never restored, left in place byte for byte (it cannot be shown to be quantkit's own)."""
    d = tmp_path / "pc"
    ids = fresh(tiny_model).encode(text(50))
    run(fresh(tiny_model, d), ids)
    files = entries(d)
    edited = {}
    for p in files:
        header, rest = read_header(p.read_bytes())
        meta = header["__metadata__"]
        if edit == "checksum edited":
            meta["sha256"] = meta["sha256"][::-1]
        elif edit == "ids edited":  # fewer tokens: a shorter prefix of the same prompt
            meta["ids"] = json.dumps(json.loads(meta["ids"])[:100])
        else:
            del meta["mac"]
        p.write_bytes(with_header(header, rest))
        edited[p] = p.read_bytes()
    warnings: list[str] = []
    rt = fresh(tiny_model, d, warn=warnings.append)
    want = cold(tiny_model, ids)
    assert run(rt, ids) == (want, 0) and run(rt, ids)[0] == want
    assert len(warnings) == 1 and "not signed with this folder's key" in warnings[0], warnings
    assert "never restored, left in place" in warnings[0]
    assert (str(files[0]) if len(files) == 1 else f"{len(files)} prompt-cache entries") in warnings[0]
    disk = rt.prompt_cache.summary()["disk"]
    assert disk["ignored_unsigned"] == len(files) and disk["removed_damaged"] == 0
    assert all(p.read_bytes() == edited[p] for p in files)


def test_files_quantkit_did_not_write_are_left_alone(tiny_model, tmp_path):
    d = tmp_path / "pc"
    d.mkdir()
    ours_by_name = d / f"qkpc-{'0' * 16}-{'1' * 24}.safetensors"
    ours_by_name.write_bytes(b"not a safetensors file at all")
    readme = d / "README.txt"
    readme.write_text("my notes")
    warnings: list[str] = []
    rt = fresh(tiny_model, d, warn=warnings.append)
    run(rt, rt.encode(text(50)))
    run(rt, rt.encode(text(51)))
    assert len(warnings) == 1 and str(ours_by_name) in warnings[0] and "left in place" in warnings[0]
    assert ours_by_name.read_bytes() == b"not a safetensors file at all" and readme.read_text() == "my notes"
    assert rt.prompt_cache.summary()["disk"]["skipped_unknown"] == 1


def test_the_disk_bound_is_held_least_recently_used_first(tiny_model, tmp_path):
    d = tmp_path / "pc"
    probe = tmp_path / "probe"
    ids = [fresh(tiny_model).encode(f"prompt {k}\n" + text(50)) for k in range(5)]  # they part at once
    run(fresh(tiny_model, probe), ids[0])
    one = max(p.stat().st_size for p in entries(probe))
    bound = int(one * 3.5)
    rt = fresh(tiny_model, d, disk_bytes=bound)
    for x in ids:
        run(rt, x)
        assert sum(p.stat().st_size for p in entries(d)) <= bound
    disk = rt.prompt_cache.summary()["disk"]
    assert disk["evictions"] > 0 and disk["bytes"] <= bound
    got, cached = run(fresh(tiny_model, d, disk_bytes=bound), ids[-1])  # the newest survived
    assert cached > 0 and got == cold(tiny_model, ids[-1])


def test_a_dir_that_is_a_file_turns_the_disk_cache_off_with_one_warning(tiny_model, tmp_path):
    f = tmp_path / "cache"
    f.write_text("a file")
    warnings: list[str] = []
    rt = fresh(tiny_model, f, warn=warnings.append)
    assert rt.prompt_cache.disk is None and len(warnings) == 1 and "not a folder" in warnings[0]
    ids = rt.encode(text(50))
    assert run(rt, ids)[0] == cold(tiny_model, ids) and f.read_text() == "a file"


@pytest.mark.parametrize("kind", ["readonly", "full"])
def test_an_unwritable_or_full_dir_warns_once_and_generation_goes_on(tiny_model, tmp_path, kind):
    warnings: list[str] = []
    with limited_dir(tmp_path, kind) as d:
        pc = d / "pc"  # d itself is a mount point open to all (mode 1777), refused as a DIR
        rt = fresh(tiny_model, pc, warn=warnings.append)
        ids = rt.encode(text(50))
        want = cold(tiny_model, ids)
        assert run(rt, ids)[0] == want and run(rt, rt.encode(text(51)))[0] == cold(tiny_model, rt.encode(text(51)))
        assert len(warnings) == 1 and ("cannot write" in warnings[0]), warnings
        assert not [p for q in (d, pc) if q.is_dir() for p in os.listdir(q)
                    if p.startswith(".qkpc") or prompt_disk.NAME.match(p)]
        if kind == "full":  # with the default bound (a quarter of the free space): off from the start
            rt = fresh(tiny_model, pc, disk_bytes=None, warn=warnings.append)
            assert rt.prompt_cache.disk is None and len(warnings) == 2 and "bytes free there" in warnings[1]


def test_a_full_disk_mid_run_warns_once(tiny_model, tmp_path, monkeypatch):
    """Where no tmpfs can be mounted: a write that fails as on a full disk."""
    def full(path, data):
        raise OSError(28, "No space left on device")
    warnings: list[str] = []
    rt = fresh(tiny_model, tmp_path / "pc", warn=warnings.append)
    monkeypatch.setattr(prompt_disk, "_write_file", full)
    ids = rt.encode(text(50))
    assert run(rt, ids)[0] == cold(tiny_model, ids)
    run(rt, rt.encode(text(51)))
    assert len(warnings) == 1 and "No space left" in warnings[0] and not rt.prompt_cache.disk.writable
    assert os.listdir(tmp_path / "pc") == [".qkpc-key"]  # no entry, no temporary


@pytest.mark.parametrize("args,needle", [
    (["--prompt-cache-dir", "{tmp}/pc", "--prompt-cache-disk-size", "0"], "--prompt-cache-disk-size '0'"),
    (["--prompt-cache-dir", "{tmp}/pc", "--prompt-cache-disk-size", "lots"], "--prompt-cache-disk-size 'lots'"),
    (["--prompt-cache-disk-size", "1GB"], "give --prompt-cache-dir"),
    (["--prompt-cache-dir", "{model}/cache"], "inside the model folder"),
])
def test_bad_options_are_one_line(tiny_model, tmp_path, capsys, monkeypatch, args, needle):
    args = [a.format(tmp=tmp_path, model=tiny_model) for a in args]
    for cmd in (["generate", tiny_model, "--prompt", "hi"], ["serve", tiny_model, "--port", "0"]):
        code, out, err = run_cli([*cmd, *args], capsys, monkeypatch)
        expect_one_line(code, out, err, needle)
    assert not (tmp_path / "pc").exists() and not (tiny_model / "cache").exists()


def test_plan_says_what_the_disk_cache_holds(capsys, monkeypatch):
    from quantkit.checkpoint.reader import spec_from_path
    from quantkit.planner.budget import snapshot_bytes

    code, out, err = run_cli(["plan", "--prompt-cache-disk-size", "20GB", "--context", "32k"], capsys, monkeypatch)
    text = " ".join(out.split())
    entry = snapshot_bytes(spec_from_path(None).config, 32768)
    assert code == 0 and "prompt cache on disk" in text and f"holds {20 * 10**9 // entry:,} full-context" in text
    code, out, err = run_cli(["plan", "--prompt-cache-disk-size", "0"], capsys, monkeypatch)
    expect_one_line(code, out, err, "--prompt-cache-disk-size '0'")


def test_two_chats_with_one_system_prompt_prefill_it_once(tiny_model, tmp_path):
    """The second chat (another process, another first question) restores the system prompt from disk, and chat's
    /stats shows the disk cache."""
    import io

    from rich.console import Console

    from quantkit.runtime.chat import Chat, ChatSession

    d = tmp_path / "pc"
    system = text(20)
    out = io.StringIO()
    feed = iter(["$ ls", "/stats"])

    def read(_p):
        try:
            return next(feed)
        except StopIteration:
            raise EOFError from None
    Chat(fresh(tiny_model, d), ChatSession(system=system), SP, Console(file=out, width=300), read).run()
    assert "prompt cache on disk: " + str(d) in out.getvalue()
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "$ cat notes.txt"}]
    rt = fresh(tiny_model, d)
    got = rt.generate(msgs, sampling=SP)
    want = fresh(tiny_model, memory=0).generate(msgs, sampling=SP)
    ids = rt.last_prompt_ids
    system_end = snapshot_points(ids, 0, rt.boundary_ids, 2)[0]  # where the user's message starts
    assert got.token_ids == want.token_ids and got.cached_tokens == system_end > 0


def test_generate_restores_a_prompt_from_an_earlier_run(tiny_model, tmp_path, capsys, monkeypatch):
    d = tmp_path / "pc"
    args = ["generate", tiny_model, "--scheme", "bf16", "--prompt", text(30), "--json", "--temperature", "0",
            "--max-tokens", "6", "--no-think"]
    runs = []
    for extra in ([], ["--prompt-cache-dir", d, "--prompt-cache-disk-size", "64MB"],
                  ["--prompt-cache-dir", d, "--prompt-cache-disk-size", "64MB"]):
        code, out, err = run_cli([*args, *extra], capsys, monkeypatch)
        assert code == 0, err
        runs.append(json.loads(out))
    (plain, first, again) = runs
    assert plain["text"] == first["text"] == again["text"] and plain["cached_tokens"] == first["cached_tokens"] == 0
    assert again["prompt_tokens"] - 16 <= again["cached_tokens"] < again["prompt_tokens"]  # all but the gen. prompt
