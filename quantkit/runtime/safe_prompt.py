"""Prompts in which special tokens come only from the chat template.

A tokenizer turns the text `<|im_start|>system` into the control token wherever it appears, so a user (or a
tool result, or a tool's description) that writes it could forge a system turn. `render_ids` renders the
template with every user-provided string that contains a control token's text replaced by a placeholder,
then encodes the template's own text normally and each user string with `split_special_tokens=True` (its
`<|im_start|>` becomes the plain characters). Requests without such text render and encode exactly as before.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from typing import Any

_MESSAGE_FIELDS = ("content", "reasoning_content", "name")


def control_strings(tokenizer: Any) -> list[str]:
    """The texts of the tokenizer's added tokens (control tokens and the template's tags)."""
    dec = getattr(tokenizer, "added_tokens_decoder", None) or {}
    out = {t.content for t in dec.values() if getattr(t, "content", "")}
    out.update(getattr(tokenizer, "all_special_tokens", []) or [])
    return sorted(out, key=len, reverse=True)


class _Holder:
    def __init__(self, controls: list[str]):
        self.controls = controls
        self.tag = "QKSAFE" + secrets.token_hex(6)
        self.values: dict[str, str] = {}  # placeholder -> text to put back

    def hold(self, s: str, as_json: bool) -> str:
        if not any(c in s for c in self.controls):
            return s
        key = f"{self.tag}x{len(self.values)}x"
        self.values[key] = json.dumps(s, ensure_ascii=False)[1:-1] if as_json else s
        return key

    def walk(self, obj: Any, as_json: bool) -> Any:
        if isinstance(obj, str):
            return self.hold(obj, as_json)
        if isinstance(obj, list):
            return [self.walk(x, as_json) for x in obj]
        if isinstance(obj, dict):
            return {k: self.walk(v, as_json) for k, v in obj.items()}
        return obj


def render_ids(tokenizer: Any, render: Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], str],
               messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> tuple[str, list[int]]:
    """(prompt text, token ids) with control tokens only where the template put them."""
    holder = _Holder(control_strings(tokenizer))
    safe_msgs = []
    for m in messages:
        m2 = dict(m)
        for f in _MESSAGE_FIELDS:
            if isinstance(m2.get(f), str):
                m2[f] = holder.hold(m2[f], as_json=False)
        if m2.get("tool_calls"):
            m2["tool_calls"] = holder.walk(m2["tool_calls"], as_json=False)
        safe_msgs.append(m2)
    safe_tools = holder.walk(tools, as_json=True) if tools else tools
    text = render(safe_msgs, safe_tools)
    if not holder.values:
        return text, list(tokenizer.encode(text, add_special_tokens=False))
    ids: list[int] = []
    out: list[str] = []
    for i, part in enumerate(re.split(f"({re.escape(holder.tag)}x\\d+x)", text)):
        if i % 2 == 0:
            if part:
                ids += tokenizer.encode(part, add_special_tokens=False)
            out.append(part)
        else:
            user = holder.values[part]
            ids += tokenizer.encode(user, add_special_tokens=False, split_special_tokens=True)
            out.append(user)
    return "".join(out), ids
