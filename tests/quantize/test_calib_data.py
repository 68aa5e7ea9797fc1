"""Calibration data: the default corpus, user files (JSONL chats, plain text) and their refusals."""

from __future__ import annotations

import json

import pytest

from quantkit.errors import QuantkitError
from quantkit.quantize.calib_data import MIN_TOKENS, default_documents, load_tokens, read_documents
from quantkit.runtime.engine import load_tokenizer

from helpers.cli import run_cli


@pytest.fixture(scope="module")
def tok(tiny_model):
    return load_tokenizer(tiny_model)


def test_default_corpus_covers_the_agentworld_domains_through_the_chat_template(tok):
    docs = list(default_documents(n_docs=10))
    systems = " ".join(d[0]["content"] for d in docs)
    for word in ("terminal", "MCP", "search engine", "operating system", "browser"):
        assert word in systems
    assert any("<tool_call>" in m["content"] for d in docs for m in d)
    td = load_tokens(None, tok, chunk_size=256, max_tokens=4096)
    assert td.chunks.shape == (16, 256) and td.total_tokens >= 4096
    text = tok.decode(td.chunks[0])
    assert "<|im_start|>system" in text and "<predicted_observation>" in text
    # deterministic: the same tokens (and fingerprint) every time
    assert load_tokens(None, tok, chunk_size=256, max_tokens=4096).fingerprint() == td.fingerprint()


def test_jsonl_chats_and_plain_text_are_read(tmp_path, tok):
    chats = tmp_path / "c.jsonl"
    msgs = [{"role": "user", "content": "ls /tmp " * 50}, {"role": "assistant", "content": "a.txt b.txt " * 80}]
    chats.write_text("\n".join(json.dumps({"messages": msgs}) for _ in range(20)) + "\n")
    docs = read_documents(chats)
    assert len(docs) == 20 and docs[0] == msgs
    td = load_tokens(chats, tok, chunk_size=128, max_tokens=2048)
    assert "<|im_start|>user" in tok.decode(td.chunks[0]) and td.source == "c.jsonl"
    txt = tmp_path / "t.txt"
    txt.write_text("first document\n\nsecond document\n")
    assert read_documents(txt) == ["first document", "second document"]


@pytest.mark.parametrize("content, want", [
    (None, "does not exist"),
    (b"", "is empty"),
    (b"\xff\xfe\x00bad", "not UTF-8"),
    (b'{"messages": [{"role": "user", "content": "hi"}]}\n{"oops": 1}\n', "line 2 is not a JSONL chat"),
    (b"just a few words", f"at least {MIN_TOKENS} are needed"),
])
def test_bad_calibration_files_are_refused_in_one_line(tmp_path, tiny_model, capsys, monkeypatch, content, want):
    data = tmp_path / "data.jsonl" if content and content.startswith(b"{") else tmp_path / "data.txt"
    if content is not None:
        data.write_bytes(content)
    code, out, err = run_cli(["stats", tiny_model, "--data", data, "--out", tmp_path / "s"], capsys, monkeypatch)
    assert code == 2 and want in err and "Traceback" not in err + out
    assert str(data.name) in err
    assert not (tmp_path / "s").exists()


def test_too_few_tokens_names_the_count(tok):
    with pytest.raises(QuantkitError, match=r"\d+ calibration tokens"):
        load_tokens(None, tok, chunk_size=128, max_tokens=512)


def test_deeply_nested_jsonl_is_one_line(tmp_path, tiny_model, capsys, monkeypatch):
    """A line nested thousands of levels deep ends in one line, not a RecursionError (issue 26)."""
    from helpers.probe import expect_one_line

    data = tmp_path / "deep.jsonl"
    data.write_text('{"messages": ' + "[" * 5000 + "]" * 5000 + "}\n")
    code, out, err = run_cli(["stats", tiny_model, "--data", data, "--out", tmp_path / "s"], capsys, monkeypatch)
    expect_one_line(code, out, err, "deep.jsonl line 1 is not a JSONL chat")
    assert not (tmp_path / "s").exists()
