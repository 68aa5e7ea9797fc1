"""Turning generated text into an OpenAI message: stop strings, reasoning and answer, tool calls.

Every parser here is incremental (`feed(text)` as tokens arrive, `finish()` at the end) and holds back
only what could still be the start of a tag, so a stream's deltas concatenate to exactly what the
one-shot functions return for the same text, however it is chunked (tests check that property).

Reasoning is not parsed here: the runtime splits a generation into its "thinking" and "answer" channels
by token id (quantkit.runtime.channels), and `OutputParser` is fed each text delta with its channel.
Thinking becomes `reasoning_content`; the answer becomes `content` and tool calls.

Tool calls follow vLLM's `qwen3_coder` parser for the XML Qwen3.5 writes:
`<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nvalue\\n</parameter>\\n</function>\\n</tool_call>`;
each value is converted by the type the tool's JSON schema gives it (string kept as text, integer,
number, boolean, object/array/null parsed), a value of an unknown parameter is parsed as JSON when it
is JSON and kept as text otherwise. A JSON body (`<tool_call>{"name": ..., "arguments": {...}}`, the
Qwen3/Hermes format) is accepted too. A block that does not parse, or is never closed, comes back as
content text rather than being dropped. (vLLM's parsers are not a library we can import without vLLM.)
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from quantkit.runtime.channels import ANSWER, THINKING

TOOL_OPEN = "<tool_call>"
TOOL_CLOSE = "</tool_call>"


def _partial_suffix(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags`."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


# --- stop strings ----------------------------------------------------------------------------------------

class StopMatcher:
    """Cuts the text at the first stop string (the stop string itself is not returned, as in OpenAI's API)."""

    def __init__(self, stops: list[str] | None):
        self.stops = tuple(s for s in (stops or []) if s)
        self._buf = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        if not self.stops:
            return text
        buf = self._buf + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            self._buf = ""
            return buf[: min(hits)]
        keep = _partial_suffix(buf, self.stops)
        self._buf = buf[len(buf) - keep:]
        return buf[: len(buf) - keep]

    def finish(self) -> str:
        out, self._buf = ("" if self.stopped else self._buf), ""
        return out


# --- tool calls ------------------------------------------------------------------------------------------

@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI returns it
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        d: dict[str, Any] = {"id": self.id, "type": "function",
                             "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            d["index"] = index
        return d


def _param_types(tools: list[dict] | None) -> dict[str, dict[str, Any]]:
    """{function name: {parameter: schema}} from OpenAI `tools`."""
    out: dict[str, dict[str, Any]] = {}
    for t in tools or []:
        fn = t.get("function", t) if isinstance(t, dict) else {}
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            continue
        params = fn.get("parameters") or {}
        props = params.get("properties") if isinstance(params, dict) else None
        out[fn["name"]] = props if isinstance(props, dict) else {}
    return out


def convert_value(raw: str, schema: dict[str, Any] | None) -> Any:
    """A parameter's text as the JSON value its schema's type says (text kept when it does not convert)."""
    types = schema.get("type") if isinstance(schema, dict) else None
    types = [types] if isinstance(types, str) else list(types or [])
    if raw == "null" and ("null" in types or not types):
        return None
    if "string" in types:
        return raw
    s = raw.strip()
    for t in types:
        try:
            if t == "integer":
                return int(s)
            if t == "number":
                return int(s) if re.fullmatch(r"[-+]?\d+", s) else float(s)
            if t == "boolean" and s.lower() in ("true", "false"):
                return s.lower() == "true"
            if t in ("object", "array"):
                v = json.loads(s)
                if isinstance(v, dict if t == "object" else list):
                    return v
        except ValueError:
            continue
    if not types:
        try:
            return json.loads(s)
        except ValueError:
            return raw
    return raw


_FUNC_RE = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|\Z)", re.S)
_PARAM_RE = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.S)


def _strip_one_newline(s: str) -> str:
    if s.startswith("\n"):
        s = s[1:]
    if s.endswith("\n"):
        s = s[:-1]
    return s


def parse_tool_block(body: str, tools: list[dict] | None) -> list[ToolCall] | None:
    """The calls in the text between `<tool_call>` and `</tool_call>`, or None when it is not a call."""
    types = _param_types(tools)
    calls = []
    for m in _FUNC_RE.finditer(body):
        name = m.group(1).strip()
        schema = types.get(name, {})
        args = {}
        for p in _PARAM_RE.finditer(m.group(2)):
            key = p.group(1).strip()
            args[key] = convert_value(_strip_one_newline(p.group(2)), schema.get(key))
        calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
    if calls:
        return calls
    try:
        obj = json.loads(body.strip())
    except ValueError:
        return None
    if isinstance(obj, dict) and isinstance(obj.get("name"), str):
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            return [ToolCall(obj["name"], args)]
        return [ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))]
    return None


class ToolCallParser:
    """Splits content text into plain text deltas and complete tool calls (a call is sent once closed)."""

    def __init__(self, tools: list[dict] | None):
        self.tools = tools
        self._buf = ""
        self._in_call = False
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buf += text
        out, calls = [], []
        while True:
            if self._in_call:
                j = self._buf.find(TOOL_CLOSE)
                if j < 0:
                    break
                body = self._buf[:j]
                self._buf = self._buf[j + len(TOOL_CLOSE):]
                self._in_call = False
                parsed = parse_tool_block(body, self.tools)
                if parsed is None:
                    out.append(TOOL_OPEN + body + TOOL_CLOSE)
                else:
                    calls.extend(parsed)
                continue
            i = self._buf.find(TOOL_OPEN)
            if i >= 0:
                out.append(self._buf[:i])
                self._buf = self._buf[i + len(TOOL_OPEN):]
                self._in_call = True
                continue
            keep = _partial_suffix(self._buf, (TOOL_OPEN,))
            out.append(self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            break
        self.calls.extend(calls)
        return "".join(out), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        buf, self._buf = self._buf, ""
        if self._in_call:  # never closed (cut off): give the text back rather than guess a call
            self._in_call = False
            return TOOL_OPEN + buf, []
        return buf, []


def parse_tool_calls(text: str, tools: list[dict] | None) -> tuple[str, list[ToolCall]]:
    """One-shot (content without the calls, calls) of a whole answer."""
    p = ToolCallParser(tools)
    a, c1 = p.feed(text)
    b, c2 = p.finish()
    return a + b, c1 + c2


# --- the whole pipeline ----------------------------------------------------------------------------------

@dataclass
class OutputDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def __add__(self, other: OutputDelta) -> OutputDelta:
        return OutputDelta(self.reasoning + other.reasoning, self.content + other.content,
                           self.tool_calls + other.tool_calls)


class OutputParser:
    """The runtime's channel deltas -> stop strings -> reasoning / content -> tool calls (only in the answer).

    Stop strings are matched within a channel: a switch of channel flushes what was held back as a
    possible start of one."""

    def __init__(self, *, stops: list[str] | None = None, tools: list[dict] | None = None):
        self.stop = StopMatcher(stops)
        self.tools = ToolCallParser(tools) if tools else None
        self.channel = THINKING
        self.text = ""  # the generated text up to the stop string, for usage accounting and logs

    @property
    def stopped(self) -> bool:
        """A stop string was seen: generation should end."""
        return self.stop.stopped

    def _route(self, text: str, channel: str, final: bool) -> OutputDelta:
        self.text += text
        if channel == THINKING:
            return OutputDelta(reasoning=text)
        calls: list[ToolCall] = []
        if self.tools is not None:
            text, calls = self.tools.feed(text)
            if final:
                c2, calls2 = self.tools.finish()
                text, calls = text + c2, calls + calls2
        return OutputDelta(content=text, tool_calls=calls)

    def feed(self, text: str, channel: str) -> OutputDelta:
        d = OutputDelta()
        if channel != self.channel:
            d = self._route(self.stop.finish(), self.channel, final=False)
            self.channel = channel
        return d + self._route(self.stop.feed(text), channel, final=False)

    def finish(self) -> OutputDelta:
        d = self._route(self.stop.finish(), self.channel, final=self.channel == ANSWER)
        if self.channel != ANSWER and self.tools is not None:  # an answer's unclosed tool block, then thinking
            d = d + self._route("", ANSWER, final=True)
        return d
