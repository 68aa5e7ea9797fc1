"""Turning generated text into an OpenAI message: stop strings, reasoning apart from the answer, tool calls.

Every parser here is incremental (`feed(text)` as tokens arrive, `finish()` at the end) and holds back
only what could still be the start of a tag, so a stream's deltas concatenate to exactly what the
one-shot functions return for the same text, however it is chunked (tests check that property).

Reasoning follows vLLM's `qwen3` reasoning parser: text before `</think>` is `reasoning_content`, a
leading `<think>` in the output is dropped, the rest is `content`. Two deliberate differences, both
because we know the prompt: when the prompt opened the think block (thinking on, the template ends with
`<think>\\n`), an output cut off before `</think>` is all reasoning in both streaming and non-streaming
responses (vLLM returns it as content when not streaming, as reasoning when streaming); when thinking is
off the template has already closed the block, so a `</think>` in the output is just text unless the
output itself opened a block with `<think>`. The newlines the template puts around the tags are
trimmed (reasoning's ends, content's start), as Qwen's chat template does when it re-renders history.

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

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
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


# --- reasoning -------------------------------------------------------------------------------------------

class ReasoningSplitter:
    """Splits generated text into (reasoning, content) deltas; see the module docstring for the rules."""

    def __init__(self, in_reasoning: bool):
        self.mode = "reasoning" if in_reasoning else "content"
        self._buf = ""
        self._section_start = True  # nothing emitted yet in the current section: trim leading newlines
        self._open_checked = False  # a leading <think> has been looked for in this section
        self._held_newlines = ""  # reasoning's trailing newlines, emitted only if more reasoning follows

    def _start_section(self, mode: str) -> None:
        self.mode, self._section_start, self._open_checked, self._held_newlines = mode, True, False, ""

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        reasoning, content = [], []
        while True:
            if self._section_start:
                self._buf = self._buf.lstrip("\n")
            if not self._open_checked:
                # A leading <think>: dropped in reasoning, opens reasoning in content (see docstring).
                if len(self._buf) < len(THINK_OPEN) and THINK_OPEN.startswith(self._buf):
                    break  # could still become <think>: wait
                self._open_checked = True
                if self._section_start and self._buf.startswith(THINK_OPEN):
                    self._buf = self._buf[len(THINK_OPEN):]
                    if self.mode == "content":
                        self._start_section("reasoning")
                        self._open_checked = True
                    continue
            if self.mode == "content":
                if self._buf:
                    content.append(self._buf)
                    self._section_start = False
                self._buf = ""
                break
            i = self._buf.find(THINK_CLOSE)
            if i >= 0:
                body = self._buf[:i].rstrip("\n")
                if body:
                    reasoning.append(self._held_newlines + body)
                self._buf = self._buf[i + len(THINK_CLOSE):]
                self._start_section("content")
                self._open_checked = True  # a <think> after </think> is content text
                continue
            keep = _partial_suffix(self._buf, (THINK_CLOSE,))
            ready, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep:]
            body = ready.rstrip("\n")
            if body:
                reasoning.append(self._held_newlines + body)
                self._held_newlines = ""
                self._section_start = False
            self._held_newlines += ready[len(body):]
            break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        buf, self._buf = self._buf, ""
        if self._section_start:
            buf = buf.lstrip("\n")
        if not buf:
            return "", ""
        if self.mode == "reasoning":
            body = buf.rstrip("\n")  # an unclosed block: its trailing newlines are trimmed like a closed one
            return (self._held_newlines + body if body else ""), ""
        return "", buf


def split_reasoning(text: str, in_reasoning: bool) -> tuple[str, str]:
    """One-shot (reasoning, content) of a whole output."""
    sp = ReasoningSplitter(in_reasoning)
    r1, c1 = sp.feed(text)
    r2, c2 = sp.finish()
    return r1 + r2, c1 + c2


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


class OutputParser:
    """Generated text -> stop strings -> reasoning / content -> tool calls (only in the answer)."""

    def __init__(self, *, in_reasoning: bool, stops: list[str] | None = None, tools: list[dict] | None = None):
        self.stop = StopMatcher(stops)
        self.reasoning = ReasoningSplitter(in_reasoning)
        self.tools = ToolCallParser(tools) if tools else None
        self.text = ""  # the generated text up to the stop string, for usage accounting and logs

    @property
    def stopped(self) -> bool:
        """A stop string was seen: generation should end."""
        return self.stop.stopped

    def _after_stop(self, text: str, final: bool) -> OutputDelta:
        self.text += text
        r, c = self.reasoning.feed(text)
        if final:
            r2, c2 = self.reasoning.finish()
            r, c = r + r2, c + c2
        calls: list[ToolCall] = []
        if self.tools is not None:
            c, calls = self.tools.feed(c)
            if final:
                c2, calls2 = self.tools.finish()
                c, calls = c + c2, calls + calls2
        return OutputDelta(r, c, calls)

    def feed(self, text: str) -> OutputDelta:
        return self._after_stop(self.stop.feed(text), final=False)

    def finish(self) -> OutputDelta:
        return self._after_stop(self.stop.finish(), final=True)
