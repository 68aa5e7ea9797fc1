"""`quantkit chat` keeps the hybrid cache across turns: each turn prefills only its new tokens (/stats shows
prefilled vs reused), and /system, /clear, /load and the context policy rebuild it, saying so once."""

from __future__ import annotations

import re

import pytest

from quantkit.runtime import SamplingParams, load_model

from helpers.chat import run_chat

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def rt(tiny_model):
    r = load_model(tiny_model, recipe="bf16")
    r.set_prompt_cache(1 << 28)
    return r


def turn_figures(text: str) -> list[tuple[int, int, int]]:
    """(prompt, prefilled, reused) per turn line."""
    return [(int(a), int(b), int(c)) for a, b, c in
            re.findall(r"^\[prompt (\d+) tok.*?prefilled (\d+), reused (\d+)\]", text, re.M)]


def test_ten_turns_prefill_only_new_tokens(rt):
    lines = [f"ls -la /srv/step{i} and show the files of the state {i}" for i in range(10)] + ["/stats"]
    chat, out = run_chat(rt, lines)
    figs = turn_figures(out)
    assert len(figs) == 10 and figs[0][2] == 0
    for (p0, _f0, _r0), (p1, f1, r1) in zip(figs, figs[1:], strict=False):
        assert r1 > 0 and f1 + r1 == p1
        # the whole previous prompt but its generation prompt (10 tokens with the tiny tokenizer) came from the cache
        assert r1 >= p0 - 12
        assert f1 < p1 - p0 + 16  # only the last answer, the new message and the generation prompt were read
    m = re.search(r"this session prefilled (\d+) tokens, reused (\d+)", out)
    assert m and int(m[1]) == sum(f for _p, f, _r in figs) and int(m[2]) == sum(r for _p, _f, r in figs)
    assert "cache rebuilt" not in out


def test_commands_that_change_the_start_rebuild_once(rt, tmp_path):
    saved = tmp_path / "c.json"
    lines = ["first question", "second question", "/system You are a search engine.", "third question",
             "fourth question", f"/save {saved}", "/clear", "fifth", "sixth", f"/load {saved}", "seventh",
             "/nothink", "eighth"]
    _chat, out = run_chat(rt, lines)
    notes = re.findall(r"\(cache rebuilt: (\S+) changed", out)
    # /load brings back a conversation whose snapshots are still cached, and /nothink keeps the history as
    # rendered: both go on reusing
    assert notes == ["/system", "/clear"]
    figs = turn_figures(out)
    assert len(figs) == 8
    fourth, seventh, eighth = figs[3], figs[6], figs[7]
    assert figs[2][2] < 12 and figs[4][2] < 12  # after /system and /clear: only <|im_start|>system... is shared
    assert seventh[2] >= fourth[0] - 12 and eighth[2] >= seventh[0] - 12


def test_context_overflow_rebuilds_and_says_why(tiny_model):
    rt = load_model(tiny_model, recipe="bf16", context=160)
    rt.set_prompt_cache(1 << 28)
    _chat, out = run_chat(rt, [f"message number {i} with some words in it" for i in range(8)],
                          SamplingParams(temperature=0, max_new_tokens=6))
    assert "dropped the" in out
    assert "(cache rebuilt: the context overflow changed the conversation" in out


def test_cache_off_prefills_everything(rt):
    rt.set_prompt_cache(0)
    try:
        _chat, out = run_chat(rt, ["one", "two", "/stats"])
    finally:
        rt.set_prompt_cache(1 << 28)
    assert all(r == 0 and f == p for p, f, r in turn_figures(out))
    assert "prompt cache: off" in out
