"""Thinking apart from the answer by token id (quantkit.runtime.channels), on the tiny model's trained
tokenizer, whose `<think>`/`</think>` are the added tokens Qwen3.5's are: the exact ids the model emits."""

from __future__ import annotations

import pytest

from quantkit.runtime.channels import ANSWER, THINKING, ChannelSplitter
from quantkit.runtime.engine import load_tokenizer


@pytest.fixture(scope="module")
def tok(tiny_model):
    return load_tokenizer(tiny_model)


def ids_of(tok, text: str) -> list[int]:
    """Token ids of `text`, the tags in it as their single added tokens (as the model generates them)."""
    ids = tok.encode(text, add_special_tokens=False)
    v = tok.get_vocab()
    assert text.count("<think>") == ids.count(v["<think>"]) and text.count("</think>") == ids.count(v["</think>"])
    return ids


def split(tok, ids: list[int], thinking: bool) -> tuple[tuple[str, str], list[tuple[str, str]]]:
    v = tok.get_vocab()
    sp = ChannelSplitter(tok, (v["<think>"], v["</think>"]), thinking)
    events = [sp.feed(i) for i in ids]
    return (sp.text(THINKING), sp.text(ANSWER)), events


@pytest.mark.parametrize(("text", "thinking", "want"), [
    # thinking on: the prompt ends "<think>\n", the model writes the rest of the block and the answer
    ("The user greets me.\n</think>\n\nHello!", True, ("The user greets me.", "Hello!")),
    ("<think>\nstep 1\n\nstep 2\n</think>\n\nanswer\n\nmore", True, ("step 1\n\nstep 2", "answer\n\nmore")),
    # thinking off: the template closed the block; a <think> the model writes opens one again
    ("<think>\nhmm\n</think>\n\nanswer", False, ("hmm", "answer")),
    ("still thinking when max_tokens hit\n\n", True, ("still thinking when max_tokens hit", "")),
    ("plain answer", False, ("", "plain answer")),
    ("a</think>b", False, ("", "ab")),  # a close tag in the answer closes nothing and adds no text
    ("</think>", True, ("", "")),
    ("<think></think>only content", False, ("", "only content")),
])
def test_channels_follow_the_tag_ids(tok, text, thinking, want):
    texts, events = split(tok, ids_of(tok, text), thinking)
    assert texts == want
    for ch in (THINKING, ANSWER):  # the deltas of a channel add up to its text
        assert "".join(d for c, d in events if c == ch) == texts[ch == ANSWER]


def test_inner_newlines_are_kept_and_only_trailing_ones_held_back(tok):
    ids = ids_of(tok, "a\n\nb\n\n")
    (thinking, _), events = split(tok, ids, True)
    assert thinking == "a\n\nb"
    # the held newlines come out with the next thinking text, not before it
    (thinking, _), _ = split(tok, ids + ids_of(tok, "c\n</think>x"), True)
    assert thinking == "a\n\nb\n\nc"


def test_tags_belong_to_thinking_and_add_no_text(tok):
    v = tok.get_vocab()
    _, events = split(tok, ids_of(tok, "x\n</think>\n\ny<think>z"), True)
    ids = ids_of(tok, "x\n</think>\n\ny<think>z")
    for i, (ch, delta) in zip(ids, events, strict=True):
        if i in (v["<think>"], v["</think>"]):
            assert (ch, delta) == (THINKING, "")


def test_a_tag_spelled_in_ordinary_tokens_stays_text(tok):
    v = tok.get_vocab()
    ids = tok.encode("see <thi", add_special_tokens=False) + tok.encode("nk> here", add_special_tokens=False)
    assert v["<think>"] not in ids
    assert split(tok, ids, False)[0] == ("", "see <think> here")
