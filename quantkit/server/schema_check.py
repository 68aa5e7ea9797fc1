"""Tool definitions and `response_format` schemas checked before any grammar is built or any token generated.

Every JSON Schema keyword that the chat template, the grammar builder (quantkit/server/grammar.py), the grammar
engine or the tool-call parser (quantkit/server/parsing.py) reads must have its JSON type: `properties` an
object of schemas, `required` a list of names, `type` a type name or a list of them, `enum` a non-empty list,
lengths and counts integers from 0 to 2^32 - 1 (no larger repeat fits the engine's regexes), bounds numbers,
nested schemas objects (or true / false). Function and parameter names must fit the XML form Qwen writes calls
in (`<function=NAME>`, `<parameter=NAME>`): not empty, no `<`, `>` or control characters, no space at either
end. A function's parameters are an object schema (arguments are named). Anything else is a 400 naming the
field as the request spells it (`tools[0].function.parameters.properties`), never an exception inside the
grammar builder or a call the parser cannot read back.

The walk is iterative, so a schema's depth (bounded by the JSON parser's nesting limit anyway) cannot exhaust
the interpreter's stack.
"""

from __future__ import annotations

import json
import re
from typing import Any

from quantkit.server.errors import ApiError

JSON_TYPES = ("string", "number", "integer", "boolean", "object", "array", "null")
MAX_COUNT = (1 << 32) - 1

_SCHEMA = ("additionalProperties", "additionalItems", "not", "contains", "propertyNames", "if", "then", "else",
           "unevaluatedProperties", "unevaluatedItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties", "minContains",
           "maxContains")
_PAIRS = (("minLength", "maxLength"), ("minItems", "maxItems"), ("minProperties", "maxProperties"),
          ("minContains", "maxContains"))
_NUMBERS = ("minimum", "maximum", "multipleOf")
_EXCLUSIVE = ("exclusiveMinimum", "exclusiveMaximum")  # a number, or a boolean in draft 4
_STRINGS = ("pattern", "format", "$ref")
_PLAIN_KEY = re.compile(r"[A-Za-z0-9_$-]+")
_BAD_NAME = re.compile(r"[<>\x00-\x1f\x7f]")


def _kind(v: Any) -> str:
    """A JSON value's type as a message names it."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, int | float):
        return f"the number {v}"
    if isinstance(v, str):
        return "a string"
    return "a list" if isinstance(v, list) else "an object"


def _at(where: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{where}[{key}]"
    return f"{where}.{key}" if _PLAIN_KEY.fullmatch(key) else f"{where}[{json.dumps(key, ensure_ascii=False)}]"


def _refuse(where: str, message: str) -> ApiError:
    return ApiError(400, f"{where} {message}", param=where, code="invalid_schema")


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _check_one(schema: Any, where: str, todo: list[tuple[Any, str]]) -> None:
    """`schema`'s own keywords; the schemas inside it are appended to `todo`."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise _refuse(where, f"must be a JSON schema (an object, or true / false), not {_kind(schema)}")
    t = schema.get("type")
    if t is not None:
        names = t if isinstance(t, list) else [t]
        if not names or not all(isinstance(n, str) and n in JSON_TYPES for n in names):
            raise _refuse(_at(where, "type"), f"must be one of {', '.join(JSON_TYPES)} (or a list of them), "
                                              f"not {json.dumps(t, ensure_ascii=False)[:80]}")
    for key in _SCHEMA_MAPS:
        if key in schema:
            m = schema[key]
            if not isinstance(m, dict):
                raise _refuse(_at(where, key), f"must be an object mapping each name to its JSON schema, "
                                               f"not {_kind(m)}")
            todo.extend((v, _at(_at(where, key), k)) for k, v in m.items())
    for key in _SCHEMA_LISTS:
        if key in schema:
            seq = schema[key]
            if not isinstance(seq, list) or not seq:
                raise _refuse(_at(where, key), "must be a non-empty list of JSON schemas, not "
                              + (_kind(seq) if not isinstance(seq, list) else "an empty list"))
            todo.extend((v, _at(_at(where, key), i)) for i, v in enumerate(seq))
    for key in _SCHEMA:
        if key in schema:
            todo.append((schema[key], _at(where, key)))
    if "items" in schema:  # a schema, or (draft 4) a list of them, one per position
        items = schema["items"]
        if isinstance(items, list):
            todo.extend((v, _at(_at(where, "items"), i)) for i, v in enumerate(items))
        else:
            todo.append((items, _at(where, "items")))
    if "required" in schema:
        req = schema["required"]
        bad = [r for r in req if not isinstance(r, str)] if isinstance(req, list) else [req]
        if bad:
            raise _refuse(_at(where, "required"), "must be a list of property names (strings), not "
                          + (_kind(req) if not isinstance(req, list) else f"a list holding {_kind(bad[0])}"))
    if "enum" in schema:
        enum = schema["enum"]
        if not isinstance(enum, list) or not enum:
            raise _refuse(_at(where, "enum"), "must be a non-empty list of the allowed values, not "
                          + (_kind(enum) if not isinstance(enum, list) else "an empty list"))
    for key in _COUNTS:
        if key in schema:
            v = schema[key]
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_COUNT:
                raise _refuse(_at(where, key), f"must be an integer from 0 to {MAX_COUNT}, not {_kind(v)}")
    for lo, hi in _PAIRS:
        if lo in schema and hi in schema and schema[lo] > schema[hi]:
            raise _refuse(_at(where, lo), f"{schema[lo]} is more than {hi} {schema[hi]}: no value can match")
    for key in _NUMBERS:
        if key in schema and not _is_number(schema[key]):
            raise _refuse(_at(where, key), f"must be a number, not {_kind(schema[key])}")
    if "multipleOf" in schema and not schema["multipleOf"] > 0:
        raise _refuse(_at(where, "multipleOf"), f"must be more than 0, not {schema['multipleOf']}")
    for key in _EXCLUSIVE:
        if key in schema and not (_is_number(schema[key]) or isinstance(schema[key], bool)):
            raise _refuse(_at(where, key), f"must be a number, not {_kind(schema[key])}")
    for key in _STRINGS:
        if key in schema and not isinstance(schema[key], str):
            raise _refuse(_at(where, key), f"must be a string, not {_kind(schema[key])}")


def check_schema(schema: Any, where: str) -> None:
    """Raise a 400 `ApiError` naming the first keyword of `schema` (at `where`) of the wrong JSON type."""
    todo = [(schema, where)]
    while todo:
        s, w = todo.pop()
        _check_one(s, w, todo)


def _check_name(name: Any, where: str, what: str) -> None:
    if not isinstance(name, str) or not name.strip():
        raise _refuse(where, f"must be a non-empty {what} name")
    if _BAD_NAME.search(name) or name != name.strip():
        shown = f"{json.dumps(name, ensure_ascii=False)[:80]}: " if what == "function" else ""  # else in `where`
        raise _refuse(where, f"{shown}a {what} name cannot hold '<', '>' or control characters, nor start or "
                             f"end with a space (a call writes <{what}=NAME>)")


def check_tools(tools: list[dict[str, Any]]) -> None:
    """Each tool of a chat request (as `model_dump`ed from schemas.ToolDef): its name and its parameters'
    schema; a 400 `ApiError` naming the first field that is wrong."""
    for i, tool in enumerate(tools):
        fn = tool.get("function") or {}
        where = f"tools[{i}].function"
        _check_name(fn.get("name"), f"{where}.name", "function")
        params = fn.get("parameters")
        if params is None:
            continue
        pw = f"{where}.parameters"
        if params.get("type", "object") != "object":
            raise _refuse(f"{pw}.type", f"must be \"object\" (a function's arguments are named), not "
                                        f"{json.dumps(params['type'], ensure_ascii=False)[:80]}")
        check_schema(params, pw)
        for name in params.get("properties") or {}:
            _check_name(name, _at(f"{pw}.properties", name), "parameter")
