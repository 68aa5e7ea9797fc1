"""A chat request as the chat template takes it: messages with text content, tools, tool_choice, thinking."""

from __future__ import annotations

import json
from typing import Any

from quantkit.server.errors import ApiError
from quantkit.server.schema_check import check_tools
from quantkit.server.schemas import ChatCompletionRequest


def text_bytes(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> int:
    n = sum(len(json.dumps(m, ensure_ascii=False).encode()) for m in messages)
    return n + (len(json.dumps(tools, ensure_ascii=False).encode()) if tools else 0)




def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    out = []
    for i, part in enumerate(content):
        if part.type != "text":
            raise ApiError(400, f"{where}.content[{i}]: content parts of type {part.type!r} are not supported "
                                f"(this model takes text only)", param=f"{where}.content")
        out.append(part.text)
    return "".join(out)


def template_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The request's messages as the chat template expects them (text content, tool-call arguments as dicts)."""
    out = []
    for i, m in enumerate(req.messages):
        where = f"messages[{i}]"
        role = "system" if m.role == "developer" else m.role
        d: dict[str, Any] = {"role": role, "content": _text(m.content, where)}
        if m.role == "assistant":
            if m.reasoning_content:
                d["reasoning_content"] = m.reasoning_content
            if m.tool_calls:
                calls = []
                for j, tc in enumerate(m.tool_calls):
                    args = tc.function.arguments
                    if isinstance(args, str):
                        try:
                            args = json.loads(args) if args.strip() else {}
                        except ValueError as e:
                            raise ApiError(400, f"{where}.tool_calls[{j}].function.arguments is not valid JSON: {e}",
                                           param=f"{where}.tool_calls") from None
                    if not isinstance(args, dict):
                        raise ApiError(400, f"{where}.tool_calls[{j}].function.arguments must be a JSON object",
                                       param=f"{where}.tool_calls")
                    calls.append({"id": tc.id, "type": "function",
                                  "function": {"name": tc.function.name, "arguments": args}})
                d["tool_calls"] = calls
        if m.role == "tool" and m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


def enable_thinking(req: ChatCompletionRequest) -> bool:
    kw = req.chat_template_kwargs or {}
    v = kw.get("enable_thinking", True)
    if not isinstance(v, bool):
        raise ApiError(400, "chat_template_kwargs.enable_thinking must be true or false",
                       param="chat_template_kwargs.enable_thinking")
    return v


def tool_choice(req: ChatCompletionRequest) -> tuple[list[dict[str, Any]] | None, str | None]:
    """(the tools the template renders, the call forced): forced None = the model decides ("auto"), "" = some
    call ("required"), a name = that function's call."""
    tc = req.tool_choice
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    if tools:  # whatever tool_choice says: the template renders them and the parser reads calls by them
        check_tools(tools)
    if tc is None or tc == "auto":
        return tools, None
    if tc == "none":
        return None, None
    forced: str | None = None
    if tc == "required":
        forced = ""
    elif isinstance(tc, dict) and tc.get("type") == "function" and isinstance(tc.get("function"), dict) \
            and isinstance(tc["function"].get("name"), str):
        forced = tc["function"]["name"]
    else:
        raise ApiError(400, f"tool_choice {json.dumps(tc)[:200]} is not \"auto\", \"none\", \"required\" or "
                            '{"type": "function", "function": {"name": ...}}', param="tool_choice")
    if not tools:
        raise ApiError(400, f"tool_choice {json.dumps(tc)[:200]} needs tools: the request has none",
                       param="tool_choice")
    if forced and forced not in {t["function"]["name"] for t in tools}:
        raise ApiError(400, f"tool_choice names the function {forced!r}, which is not in tools", param="tool_choice")
    return tools, forced
