"""The Python API's argument checks, in one place: `load_model`, `Runtime.generate_stream` / `generate_ids` /
`render_ids`, `BatchGenerator.add` / `fork` and `SamplingParams.validate` call these where an argument enters,
before anything is read, rendered or computed.

Each check raises in one line naming the argument and what it takes: `ArgumentTypeError` (a QuantkitError and a
TypeError) for a value of the wrong type, `ArgumentError` (a QuantkitError and a ValueError) for one out of
range (quantkit/errors.py). The rules: bools are not numbers; a whole number is an int (or a numpy / torch
integer scalar), never a float; a real number is finite; a token id is a whole number in [0, vocabulary);
messages are a list of dicts with a string `role`; a tool is an OpenAI function schema (a dict whose
`function` is a dict with a string `name`). The CLI and the server check their own inputs first; these
checks are what a caller of the library meets.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from quantkit.errors import ArgumentError, ArgumentTypeError

VERIFY_MODES = ("auto", "full", "quick", "off")  # load_model(verify=): what `quantkit.quantize.verify` checks
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what torch.Generator.manual_seed takes (OpenAI's int64 seed + n)
_MESSAGE_TEXT = ("content", "reasoning_content")


def _kind(value: Any) -> str:
    return type(value).__name__


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def whole(value: Any, name: str, lo: int | None = None, hi: int | None = None) -> int:
    """`value` as an int within [lo, hi] (either end open when None)."""
    if isinstance(value, bool):
        raise ArgumentTypeError(f"{name}={value!r}: give a whole number, not a bool")
    try:
        n = operator.index(value)
    except TypeError:
        raise ArgumentTypeError(f"{name}={_shown(value)}: give a whole number (int), not {_kind(value)}") from None
    if (lo is not None and n < lo) or (hi is not None and n > hi):
        span = f">= {lo}" if hi is None else f"<= {hi}" if lo is None else f"in [{lo}, {hi}]"
        raise ArgumentError(f"{name}={n}: give a whole number {span}")
    return n


def real(value: Any, name: str, lo: float, hi: float | None = None, *, lo_open: bool = False,
         note: str = "") -> float:
    """`value` as a finite float in [lo, hi] ((lo, hi] with `lo_open`); `note` ends the message."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"{name}={_shown(value)}: give a number, not {_kind(value)}")
    x = float(value)
    below = x <= lo if lo_open else x < lo
    if not math.isfinite(x) or below or (hi is not None and x > hi):
        span = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]" if hi is not None else f"{'>' if lo_open else '>='} {lo:g}"
        raise ArgumentError(f"{name}={value!r}: give a finite number {span}{note}")
    return x


def flag(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise ArgumentTypeError(f"{name}={_shown(value)}: give True or False, not {_kind(value)}")
    return value


def instance(value: Any, name: str, types: type | tuple[type, ...], what: str, optional: bool = True) -> Any:
    """`value` when it is one of `types` (or None with `optional`); else one line saying `what` it takes."""
    if (value is None and optional) or (value is not None and isinstance(value, types)):
        return value
    raise ArgumentTypeError(f"{name}={_shown(value)}: give {what}{' or None' if optional else ''}, not {_kind(value)}")


def callback(value: Any, name: str) -> Any:
    if value is not None and not callable(value):
        raise ArgumentTypeError(f"{name}={_shown(value)}: give a function or None, not {_kind(value)}")
    return value


def event(value: Any, name: str = "cancel") -> Any:
    """A cancel flag: None or anything with `is_set()` (a threading.Event)."""
    if value is not None and not callable(getattr(value, "is_set", None)):
        raise ArgumentTypeError(f"{name}={_shown(value)}: give a threading.Event or None, not {_kind(value)}")
    return value


def choice(value: Any, name: str, choices: Sequence[str]) -> str:
    if not isinstance(value, str):
        raise ArgumentTypeError(f"{name}={_shown(value)}: give one of {', '.join(choices)}, not {_kind(value)}")
    if value not in choices:
        raise ArgumentError(f"{name}={_shown(value)}: give one of {', '.join(choices)}")
    return value


def _sequence(value: Any, name: str, what: str) -> Sequence[Any]:
    """A list or tuple (not a str, a dict or a one-shot iterator, which would be read as something else)."""
    if not isinstance(value, (list, tuple)):
        raise ArgumentTypeError(f"{name}={_shown(value)}: give a list of {what}, not {_kind(value)}")
    return value


def token_ids(ids: Any, vocab: int, name: str = "ids") -> list[int]:
    """`ids` as a list of ints, each a token of a vocabulary of `vocab` ids. A 1-D integer tensor or array is
    taken as its list."""
    if hasattr(ids, "tolist") and not isinstance(ids, (list, tuple)):
        ids = ids.tolist() if getattr(ids, "ndim", 1) == 1 else ids
    seq = _sequence(ids, name, "token ids (ints)")
    if not seq:
        raise ArgumentError(f"{name}=[]: empty prompt: give at least one token id")
    out = []
    for i, t in enumerate(seq):
        if type(t) is not int:  # the common case costs one type check per token
            if isinstance(t, bool):
                raise ArgumentTypeError(f"{name}[{i}]={t!r}: give token ids as ints, not bool")
            try:
                t = operator.index(t)
            except TypeError:
                raise ArgumentTypeError(f"{name}[{i}]={_shown(t)}: give token ids as ints, not {_kind(t)}") from None
        if not 0 <= t < vocab:
            raise ArgumentError(f"{name}[{i}]={t}: a token id is in [0, {vocab}) (this model's vocabulary)")
        out.append(t)
    return out


def stop_token_ids(ids: Any, vocab: int, name: str = "stop_ids") -> set[int] | None:
    """None (the model's end-of-turn tokens) or a collection of token ids."""
    if ids is None:
        return None
    if isinstance(ids, (str, bytes, Mapping)) or not isinstance(ids, Iterable):
        raise ArgumentTypeError(f"{name}={_shown(ids)}: give a set of token ids (ints) or None, not {_kind(ids)}")
    ids = list(ids)
    return set(token_ids(ids, vocab, name)) if ids else set()


def messages(value: Any, name: str = "messages") -> list[Mapping[str, Any]]:
    """Chat-template messages: a non-empty list of dicts, each with a string `role`, its text fields strings
    (content may also be None, or a list of content parts)."""
    seq = _sequence(value, name, "message dicts ({'role': ..., 'content': ...})")
    if not seq:
        raise ArgumentError(f"{name}=[]: empty conversation: give at least one message")
    for i, m in enumerate(seq):
        where = f"{name}[{i}]"
        if not isinstance(m, Mapping):
            raise ArgumentTypeError(f"{where}={_shown(m)}: give a dict with 'role' and 'content', not {_kind(m)}")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ArgumentError(f"{where}['role']={_shown(role)}: give the role as a string "
                                "('system', 'user', 'assistant' or 'tool')")
        for f in _MESSAGE_TEXT:
            v = m.get(f)
            if v is not None and not isinstance(v, str) and not (f == "content" and isinstance(v, list)):
                raise ArgumentTypeError(f"{where}[{f!r}]={_shown(v)}: give a string, not {_kind(v)}")
        calls = m.get("tool_calls")
        if calls is not None and not isinstance(calls, list):
            raise ArgumentTypeError(f"{where}['tool_calls']={_shown(calls)}: give a list of tool calls, "
                                    f"not {_kind(calls)}")
    return list(seq)


def tools(value: Any, name: str = "tools") -> list[Mapping[str, Any]] | None:
    """None or OpenAI-style function schemas: [{"type": "function", "function": {"name": ..., ...}}]."""
    if value is None:
        return None
    seq = _sequence(value, name, "function schemas")
    for i, t in enumerate(seq):
        where = f"{name}[{i}]"
        if not isinstance(t, Mapping):
            raise ArgumentTypeError(f"{where}={_shown(t)}: give a function schema dict "
                                    "({'type': 'function', 'function': {'name': ...}}), not " + _kind(t))
        if t.get("type", "function") != "function":
            raise ArgumentError(f"{where}['type']={_shown(t.get('type'))}: only 'function' tools are rendered")
        fn = t.get("function")
        if not isinstance(fn, Mapping):
            raise ArgumentError(f"{where} has no 'function' dict: give {{'type': 'function', 'function': "
                                "{'name': ..., 'description': ..., 'parameters': {...}}}")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ArgumentError(f"{where}['function']['name']={_shown(fn.get('name'))}: give the function's name "
                                "as a string")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, Mapping):
            raise ArgumentTypeError(f"{where}['function']['parameters']={_shown(params)}: give a JSON schema dict, "
                                    f"not {_kind(params)}")
    return list(seq)


def sampling_field(name: str, value: Any) -> Any:
    """One field of a `SamplingParams` (quantkit/runtime/generate.py), named as the Python API spells it."""
    if name == "temperature":
        return real(value, name, 0, note=" (0 = greedy)")
    if name == "top_p":
        return real(value, name, 0, 1, lo_open=True)
    if name == "top_k":
        return whole(value, name, 0)
    if name == "seed":
        return None if value is None else whole(value, name, *SEED_RANGE)
    if name == "max_new_tokens":
        return whole(value, name, 1)
    if name == "ignore_eos":
        return flag(value, name)
    if name == "hook":
        if value is not None and not (callable(getattr(value, "process", None))
                                      and callable(getattr(value, "accept", None))):
            raise ArgumentTypeError(f"hook={_shown(value)}: give an object with process(logits) and "
                                    "accept(token), or None")
        return value
    raise ArgumentTypeError(f"unknown sampling option {name!r}")


def sampling_fields(sp: Any, names: Iterable[str]) -> None:
    """Each of `names`, a field of the SamplingParams `sp`."""
    for name in names:
        sampling_field(name, getattr(sp, name))
