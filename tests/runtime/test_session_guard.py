"""Nothing lost in chat (issue 26): `--session` and `/save` go through the one output guard (a file quantkit
did not write, a symlink, a FIFO, a folder or an over-long name is refused in one line and the chat goes
on); a session is bound to its weights, not only to the config; saved state that is forged (wrong shapes
under a matching checksum, NaN, tokens that are not the conversation's) is never trusted."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest
import torch
from rich.console import Console
from safetensors import safe_open
from safetensors.torch import save

from quantkit.errors import QuantkitError
from quantkit.runtime import SamplingParams, load_model
from quantkit.runtime.chat import Chat, ChatSession
from quantkit.runtime.session_file import _digest, load_session, save_session

from helpers.chat import scripted_input
from helpers.cli import TINY_KW, run_cli
from helpers.probe import count, expect_one_line

pytestmark = pytest.mark.usefixtures("one_thread")
SP = SamplingParams(temperature=0, max_new_tokens=4)


def _rt(folder: Path):
    rt = load_model(folder, recipe="bf16")
    rt.set_prompt_cache(1 << 28)
    return rt


@pytest.fixture(scope="module")
def session(tiny_model, tmp_path_factory) -> tuple[Path, ChatSession]:
    """A one-turn chat on `tiny_model` saved with its state."""
    path = tmp_path_factory.mktemp("sess") / "s.qks"
    rt = _rt(tiny_model)
    lines = iter(["ls -la"])

    def read(_p: str) -> str:
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None
    c = Chat(rt, ChatSession(system="You are a shell."), SP, Console(file=io.StringIO()), read,
             autosave=lambda s: save_session(path, rt, s))
    c.run()
    return path, c.s


def _chat_without_model() -> tuple[Chat, io.StringIO]:
    buf = io.StringIO()
    s = ChatSession(system="sys", messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])
    return Chat(None, s, SamplingParams(), Console(file=buf, width=400)), buf


# --- where a session or a /save may be written ----------------------------------------------------------

def test_session_path_holding_another_file_is_refused_and_kept(tiny_model, tmp_path, capsys, monkeypatch):
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes")
    code, out, err = run_cli(["chat", tiny_model, "--session", notes], capsys, monkeypatch)
    expect_one_line(code, out, err, "not a quantkit output")
    assert notes.read_text() == "my notes"


def test_session_through_a_symlink_is_refused_and_the_link_kept(tiny_model, session, tmp_path, capsys,
                                                                monkeypatch):
    link = tmp_path / "link.qks"
    link.symlink_to(session[0])
    code, out, err = run_cli(["chat", tiny_model, "--session", link], capsys, monkeypatch)
    expect_one_line(code, out, err, "symbolic link")
    assert link.is_symlink() and os.readlink(link) == str(session[0])


def test_session_and_save_on_a_fifo_are_refused_without_hanging(tiny_model, tmp_path, capsys, monkeypatch):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    code, out, err = run_cli(["chat", tiny_model, "--session", fifo], capsys, monkeypatch)
    expect_one_line(code, out, err, "not a regular file")
    chat, buf = _chat_without_model()
    chat.command(f"/save {fifo}")
    count()
    assert "not a regular file" in buf.getvalue()


def test_save_never_replaces_a_file_chat_did_not_write(tmp_path):
    count()
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me")
    chat, buf = _chat_without_model()
    chat.command(f"/save {precious}")
    assert "not a quantkit output" in buf.getvalue() and precious.read_text() == "keep me"
    own = tmp_path / "conv.json"
    chat.command(f"/save {own}")
    chat.s.messages.append({"role": "user", "content": "again"})
    chat.command(f"/save {own}")  # its own earlier save is replaced
    assert len(json.loads(own.read_text())["messages"]) == 3


@pytest.mark.parametrize("target", ["folder", "long-name", "no-parent"])
def test_save_to_a_bad_place_is_one_line_and_the_chat_goes_on(target, tmp_path):
    count()
    path = {"folder": tmp_path, "long-name": tmp_path / ("x" * 300), "no-parent": tmp_path / "nope" / "c.json"}[target]
    chat, buf = _chat_without_model()
    chat.command(f"/save {path}")
    said = buf.getvalue().strip().splitlines()
    assert len(said) == 1 and str(path)[:40] in said[0], said
    assert len(chat.s.messages) == 2  # the conversation is untouched, and commands still work
    chat.command(f"/save {tmp_path / 'ok.json'}")
    assert (tmp_path / "ok.json").is_file()


def test_load_of_deeply_nested_json_keeps_the_conversation(tmp_path):
    count()
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 50_000 + "]" * 50_000)
    chat, buf = _chat_without_model()
    chat.command(f"/load {deep}")
    assert "nests too deeply" in buf.getvalue() and len(chat.s.messages) == 2
    with pytest.raises(QuantkitError, match="nests too deeply"):
        ChatSession.from_json("{" * 0 + "[" * 50_000 + "]" * 50_000, "x")


# --- a session belongs to its weights, and its state is checked ------------------------------------------

def test_a_session_does_not_resume_on_other_weights_of_the_same_config(session, tmp_path):
    from quantkit.testing.tiny import make_tiny_model

    count()
    other = make_tiny_model(tmp_path / "seed1", decisive=True, **{**TINY_KW, "seed": 1})
    with pytest.raises(QuantkitError, match="other weights"):
        load_session(session[0], _rt(other))


def _forged(path: Path, dst: Path, tensors_edit=None, ids_edit=None) -> Path:
    """A copy of session `path` with its state edited and the checksum made to match again."""
    with safe_open(str(path), "pt") as f:
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata())  # noqa: SIM118
    if tensors_edit:
        tensors_edit(tensors)
    if ids_edit:
        meta["ids"] = json.dumps(ids_edit(json.loads(meta["ids"])))
    meta["sha256"] = _digest(tensors)
    dst.write_bytes(save(tensors, metadata=meta))
    return dst


def _first(kind_suffix: str):
    def edit(t: dict[str, torch.Tensor]) -> None:
        k = next(k for k in sorted(t) if k.endswith(kind_suffix))
        t[k] = torch.zeros(*t[k].shape[:-1], t[k].shape[-1] + 1, dtype=t[k].dtype)
    return edit


def _nan(t: dict[str, torch.Tensor]) -> None:
    k = next(k for k in sorted(t) if k.endswith(".recurrent"))
    t[k] = t[k].clone()
    t[k].view(-1)[0] = float("nan")


STATE, TOKENS = "is not a finite state of shape", "tokens are not the conversation's"
FORGED = {  # id: (the edit, the reason the notice must give)
    "wrong-shape-recurrent": ({"tensors_edit": _first(".recurrent")}, STATE),
    "wrong-shape-keys": ({"tensors_edit": _first(".keys")}, STATE),
    "nan-state": ({"tensors_edit": _nan}, STATE),
    "garbage-ids": ({"ids_edit": lambda ids: [(i * 7919 + 13) % 1000 for i in ids]}, TOKENS),
    "ids-too-many": ({"ids_edit": lambda ids: ids + [1] * 50}, TOKENS),
}


@pytest.mark.parametrize("case", sorted(FORGED))
def test_forged_state_under_a_matching_checksum_is_never_trusted(case, tiny_model, session, tmp_path):
    count()
    edit, why = FORGED[case]
    path = _forged(session[0], tmp_path / f"{case}.qks", **edit)
    rt = _rt(tiny_model)
    r = load_session(path, rt)
    assert r.notice and why in r.notice and r.restored_tokens == 0 and len(rt.prompt_cache) == 0, r.notice
    assert r.session is not None and r.session.messages == session[1].messages  # the conversation is kept


def test_the_genuine_session_passes_the_same_checks(tiny_model, session):
    count()
    rt = _rt(tiny_model)
    r = load_session(session[0], rt)
    assert r.notice is None and r.restored_tokens > 0 and len(rt.prompt_cache) == 1


# --- text that is not text ------------------------------------------------------------------------------

def test_binary_stdin_to_generate_is_one_line(tiny_model):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "quantkit", "generate", str(tiny_model)], input=b"\xff\xfe\x00\x81 ls",
                       capture_output=True, env={**os.environ, "COLUMNS": "200"}, timeout=300)
    expect_one_line(r.returncode, r.stdout.decode(), r.stderr.decode(errors="replace"), "not UTF-8 text")


def test_a_chat_line_of_binary_bytes_is_refused_and_the_chat_goes_on():
    from types import SimpleNamespace

    count()
    buf = io.StringIO()
    rt = SimpleNamespace(folder=Path("m"), context=64, model=SimpleNamespace(mtp=None))
    chat = Chat(rt, ChatSession(), SamplingParams(), Console(file=buf, width=300),
                scripted_input(["ls \udcff\udcfe", "/save"]))
    chat.run()  # the surrogate line never reaches the tokenizer (it would raise TypeError there)
    assert "not UTF-8 text" in buf.getvalue() and "usage: /save FILE" in buf.getvalue() and chat.s.messages == []


def test_a_session_header_nested_thousands_deep_is_refused(tiny_model, tmp_path):
    import struct

    count()
    p = tmp_path / "deep.qks"
    header = "[" * 5000 + "]" * 5000
    p.write_bytes(struct.pack("<Q", len(header)) + header.encode())
    with pytest.raises(QuantkitError, match="not a quantkit chat session file"):
        load_session(p, _rt(tiny_model))
