"""The output parsers on real-format strings: Qwen3.5's `<tool_call>` XML, after the runtime's channels.

A tiny random model does not write well-formed tool calls by itself, so the parsing is
proven here on the exact text Qwen3.5 emits (the format its chat template describes to the model and
renders for history), streamed in every chunking hypothesis finds, against the one-shot result.
"""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from quantkit.runtime.channels import ANSWER, THINKING
from quantkit.server.parsing import (
    OutputParser,
    StopMatcher,
    ToolCallParser,
    convert_value,
    parse_tool_block,
    parse_tool_calls,
)

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "weather for a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "ratio": {"type": "number"}, "tags": {"type": "array"}, "opts": {"type": "object"},
        "note": {"type": ["string", "null"]}}}}}]

CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")


def chunked(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(points, points[1:], strict=False)]


# --- tool calls ------------------------------------------------------------------------------------------

def test_qwen_xml_tool_call_becomes_openai_tool_call_with_typed_json_arguments():
    content, calls = parse_tool_calls("Let me check.\n\n" + CALL, TOOLS)
    assert content == "Let me check.\n\n"
    assert [c.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].arguments) == {"city": "Paris", "days": 3}
    assert calls[0].to_openai(0)["function"]["name"] == "get_weather"
    assert calls[0].id.startswith("call_")


def test_two_calls_and_multiline_values():
    text = (CALL + "\n" + "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew\nYork\n</parameter>\n"
            "<parameter=tags>\n[\"a\", \"b\"]\n</parameter>\n<parameter=opts>\n{\"x\": 1}\n</parameter>\n"
            "</function>\n</tool_call>")
    content, calls = parse_tool_calls(text, TOOLS)
    assert content.strip() == ""
    assert [json.loads(c.arguments) for c in calls] == [
        {"city": "Paris", "days": 3}, {"city": "New\nYork", "tags": ["a", "b"], "opts": {"x": 1}}]
    assert len({c.id for c in calls}) == 2


def test_values_follow_the_schema_type():
    s = TOOLS[0]["function"]["parameters"]["properties"]
    assert convert_value("3", s["days"]) == 3
    assert convert_value("3", s["city"]) == "3"  # a string parameter stays text even when it looks numeric
    assert convert_value("true", s["metric"]) is True
    assert convert_value("0.5", s["ratio"]) == 0.5
    assert convert_value("2", s["ratio"]) == 2
    assert convert_value("null", s["note"]) is None
    assert convert_value("three", s["days"]) == "three"  # does not convert: kept as the model wrote it
    assert convert_value("[1, 2]", None) == [1, 2]  # unknown parameter: JSON when it is JSON
    assert convert_value("just text", None) == "just text"


def test_json_body_and_malformed_blocks():
    calls = parse_tool_block('{"name": "get_weather", "arguments": {"city": "Rome"}}', TOOLS)
    assert calls and json.loads(calls[0].arguments) == {"city": "Rome"}
    # not a call: the text comes back as content instead of vanishing
    assert parse_tool_calls("<tool_call>nonsense</tool_call> after", TOOLS) == (
        "<tool_call>nonsense</tool_call> after", [])
    # cut off before </tool_call>
    assert parse_tool_calls("x <tool_call>\n<function=get_weather>\n<parameter=city>\nPa", TOOLS) == (
        "x <tool_call>\n<function=get_weather>\n<parameter=city>\nPa", [])


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["Let me check.\n\n" + CALL, CALL + "\n" + CALL, "no call <tool_ here", "a <tool_call>b",
                        "<tool_call>bad</tool_call>" + CALL + " tail"]),
       st.lists(st.integers(0, 300), max_size=15))
def test_streamed_tool_calls_equal_one_shot(text, cuts):
    p = ToolCallParser(TOOLS)
    content, calls = "", []
    for piece in chunked(text, cuts):
        c, k = p.feed(piece)
        content, calls = content + c, calls + k
    c, k = p.finish()
    want_content, want_calls = parse_tool_calls(text, TOOLS)
    assert content + c == want_content
    assert [(x.name, x.arguments) for x in calls + k] == [(x.name, x.arguments) for x in want_calls]


# --- stop strings and the whole pipeline -----------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 60), max_size=10))
def test_stop_strings_cut_at_the_first_match_in_any_chunking(cuts):
    text = "alpha beta STOP gamma END delta"
    m = StopMatcher(["END", "STOP"])
    out = "".join(m.feed(p) for p in chunked(text, cuts)) + m.finish()
    assert out == "alpha beta "
    assert m.stopped


def test_partial_stop_at_the_end_is_returned():
    m = StopMatcher(["STOP"])
    assert m.feed("abc ST") == "abc "
    assert m.finish() == "ST"
    assert not m.stopped


def feed_all(p: OutputParser, parts: list[tuple[str, str]]) -> tuple[str, str, list]:
    r, c, calls = "", "", []
    for channel, piece in parts:
        d = p.feed(piece, channel)
        r, c, calls = r + d.reasoning, c + d.content, calls + d.tool_calls
    d = p.finish()
    return r + d.reasoning, c + d.content, calls + d.tool_calls


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 400), max_size=20), st.lists(st.integers(0, 400), max_size=20))
def test_pipeline_reasoning_then_tool_call(cuts_r, cuts_a):
    p = OutputParser(tools=TOOLS)
    parts = [(THINKING, x) for x in chunked("I should look up the weather.", cuts_r)] + \
        [(ANSWER, x) for x in chunked(CALL, cuts_a)]
    r, c, calls = feed_all(p, parts)
    assert r == "I should look up the weather."
    assert c == ""
    assert [json.loads(x.arguments) for x in calls] == [{"city": "Paris", "days": 3}]


def test_tool_call_xml_inside_reasoning_is_not_a_call():
    r, c, calls = feed_all(OutputParser(tools=TOOLS), [(THINKING, "maybe " + CALL), (ANSWER, "No tool needed.")])
    assert calls == []
    assert r.startswith("maybe <tool_call>")
    assert c == "No tool needed."


def test_without_tools_the_xml_stays_content():
    p = OutputParser(tools=None)
    d = p.feed(CALL, ANSWER)
    assert d.content + p.finish().content == CALL and not d.tool_calls


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 60), max_size=10))
def test_stop_strings_apply_within_a_channel_and_a_switch_flushes_a_partial_one(cuts):
    # "ST" ends the reasoning: it is not the start of "STOP" once the answer begins
    p = OutputParser(stops=["STOP"])
    parts = [(THINKING, x) for x in chunked("think ST", cuts)] + [(ANSWER, x) for x in chunked("OP x STOP y", cuts)]
    r, c, _ = feed_all(p, parts)
    assert (r, c) == ("think ST", "OP x ") and p.stopped


def test_an_unclosed_tool_block_before_more_thinking_comes_back_as_content():
    r, c, calls = feed_all(OutputParser(tools=TOOLS), [(ANSWER, "<tool_call>\n<function=get"), (THINKING, "hm")])
    assert (r, c, calls) == ("hm", "<tool_call>\n<function=get", [])
