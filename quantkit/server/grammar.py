"""Structured output by constrained decoding: `response_format` json_object / json_schema and forced tool calls.

The grammar engine is llguidance 1.9 (llama.cpp's optional one: a 3 MB wheel with no dependencies; the mask
is computed lazily per token). Against xgrammar (vLLM's, SGLang's) on Qwen3.5's 248k vocabulary, llguidance
builds its token table once per model and then costs less per token and per new grammar, and it has no
dependencies, where xgrammar pulls torch, transformers, triton and apache-tvm-ffi.

`Grammars(tokenizer, eos_ids, think_end)` is built once per model (the tokenizer's token table); per request:
- `json(schema)`: a JSON value matching `schema` (None: any JSON object: `json_object`);
- `tool_calls(tools, name)`: one or more calls in the Qwen XML form the chat template writes
  (`<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nvalue\\n</parameter>\\n</function>\\n</tool_call>`),
  of the named function or any of `tools`, each parameter's value by its JSON schema (a string: text
  without `<`, within minLength..maxLength; a string enum: one of its values; anything else: JSON by
  llguidance's %json), required parameters always, optional ones in the schema's order;
- `constraint(grammar, opens_reasoning)`: the `Constraint` the logits hook applies (quantkit/server/logits.py).
  While the prompt left the model thinking, nothing is masked until `</think>`: the grammar is for the
  answer, as vLLM applies it after its reasoning parser.

A schema or tool the engine cannot compile raises `GrammarError` with llguidance's message (it names the
construct); the server answers 400.
"""

from __future__ import annotations

import json
from typing import Any

import torch

# JSON the way the template and clients write it: no free-form whitespace, which a weak model fills forever
_JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """The grammar library refused a schema or a tool definition."""


def _one_line(err: str, limit: int = 400) -> str:
    """llguidance's multi-line message (with a caret line under the construct) as one line."""
    lines = [ln.strip() for ln in err.strip().splitlines()]
    text = " ".join(ln for ln in lines if ln and set(ln) != {"^"})
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _lark_str(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def _value_rule(schema: Any) -> str:
    """The lark expression for one parameter value (without the closing tag)."""
    if not isinstance(schema, dict):
        schema = {}
    enum = schema.get("enum")
    if schema.get("type") == "string" and isinstance(enum, list) and enum and all(isinstance(e, str) for e in enum):
        return "(" + " | ".join(_lark_str(e) for e in enum) + ")"
    if schema.get("type") == "string":
        lo, hi = schema.get("minLength"), schema.get("maxLength")
        if isinstance(lo, int) or isinstance(hi, int):
            return f"/[^<]{{{lo if isinstance(lo, int) else 0},{hi if isinstance(hi, int) else ''}}}/"
        return "/[^<]*/"
    js = {**schema, "x-guidance": _JSON_OPTIONS}
    return "%json " + json.dumps(js, ensure_ascii=False)


def tool_call_lark(tools: list[dict[str, Any]], name: str | None,
                   tags: tuple[str, str] = ('"<tool_call>"', '"</tool_call>"')) -> str:
    """A lark grammar for one or more Qwen XML tool calls (of `name` only when given). `tags`: the lark
    for the opening and closing tags (`<[ID]>` where the tokenizer has them as tokens of their own)."""
    fns = [t.get("function", t) for t in tools]
    if name is not None:
        fns = [f for f in fns if f.get("name") == name]
        if not fns:
            raise GrammarError(f"tool_choice names the function {name!r}, which is not in tools")
    rules, alts = [], []
    for i, fn in enumerate(fns):
        params = fn.get("parameters") or {}
        props = params.get("properties") or {}
        required = [p for p in params.get("required") or [] if p in props]
        body = []
        for j, (pname, pschema) in enumerate(props.items()):
            rule = f"p{i}_{j}"
            rules.append(f"{rule}: {_lark_str(f'<parameter={pname}>' + chr(10))} {_value_rule(pschema)} "
                         f"{_lark_str(chr(10) + '</parameter>' + chr(10))}")
            body.append(rule if pname in required else f"{rule}?")
        head = _lark_str(f"\n<function={fn['name']}>\n")
        rules.append(f"call{i}: {tags[0]} {head} {' '.join(body)} {_lark_str('</function>' + chr(10))} {tags[1]}")
        alts.append(f"call{i}")
    # a named function: that one call (OpenAI's meaning); "required": one call or more
    start = "start: call" if name is not None else 'start: call ("\\n" call)*'
    return "\n".join([start, f"call: {' | '.join(alts)}", *rules])


class _LLConstraint:
    """A grammar's mask on the logits (see quantkit/server/logits.py's Constraint)."""

    def __init__(self, matcher: Any, n_vocab: int, wait_for: int | None):
        import llguidance.torch as llt

        self._llt = llt
        self.matcher = matcher
        self.n_vocab = n_vocab
        self.wait_for = wait_for
        self.bitmask = llt.allocate_token_bitmask(1, n_vocab)

    def mask(self, logits: torch.Tensor) -> None:
        if self.wait_for is not None or self.matcher.is_error():
            return
        self._llt.fill_next_token_bitmask(self.matcher, self.bitmask, 0)
        head = logits[: self.n_vocab]
        # llguidance fills the mask on the host; on a GPU route it is one 4-bytes-per-32-tokens upload per token
        mask = self.bitmask if head.device.type == "cpu" else self.bitmask.to(head.device, non_blocking=True)
        self._llt.apply_token_bitmask_inplace(head, mask)
        if logits.numel() > self.n_vocab:  # the model's padded vocabulary rows: never text
            logits[self.n_vocab:] = float("-inf")

    def accept(self, token: int) -> None:
        if self.wait_for is not None:
            if token == self.wait_for:
                self.wait_for = None
            return
        if not self.matcher.is_error():
            self.matcher.consume_token(token)


class Grammars:
    """Grammars for one model's tokenizer (the token table is built once)."""

    def __init__(self, tokenizer: Any, eos_ids: list[int], think_end: int | None = None):
        import llguidance
        import llguidance.hf

        self._ll = llguidance
        self.n_vocab = len(tokenizer)
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=self.n_vocab, eos_token=list(eos_ids))
        self.think_end = think_end
        # an added token (`<tool_call>`) is one token to llguidance, written `<[ID]>` in lark, never its letters
        vocab = tokenizer.get_vocab()
        self.tags = tuple(f"<[{vocab[t]}]>" if t in vocab else _lark_str(t) for t in ("<tool_call>", "</tool_call>"))

    def _check(self, grammar: str, what: str) -> str:
        err = self._ll.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if err:
            raise GrammarError(f"{what} cannot be compiled into a grammar: {_one_line(err)}")
        return grammar

    def json(self, schema: dict[str, Any] | None, what: str = "response_format.json_schema.schema") -> str:
        if schema is not None and not isinstance(schema, dict):
            raise GrammarError(f"{what} must be a JSON object (a JSON schema)")
        try:
            g = self._ll.LLMatcher.grammar_from_json_schema(schema if schema is not None else {"type": "object"},
                                                             defaults=_JSON_OPTIONS)
        except (ValueError, TypeError) as e:
            raise GrammarError(f"{what} cannot be compiled into a grammar: {_one_line(str(e))}") from None
        return self._check(g, what)

    def tool_calls(self, tools: list[dict[str, Any]], name: str | None) -> str:
        return self._check(self._ll.LLMatcher.grammar_from_lark(tool_call_lark(tools, name, self.tags)), "tools")

    def constraint(self, grammar: str, opens_reasoning: bool) -> _LLConstraint:
        matcher = self._ll.LLMatcher(self.tokenizer, grammar)
        wait = self.think_end if opens_reasoning else None
        return _LLConstraint(matcher, self.n_vocab, wait)
