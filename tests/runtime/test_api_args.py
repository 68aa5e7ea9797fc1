"""Hostile arguments to the in-process Python API (issue 51): `load_model`, `Runtime.generate_stream` /
`generate_ids`, `BatchGenerator.add` / `fork` check what they are given where it enters (quantkit/runtime/args.py)
and raise ArgumentTypeError (a TypeError) or ArgumentError (a ValueError), both QuantkitErrors, in one line
naming the argument: nothing loaded, rendered, prefilled or added, and the runtime generates as before after
every refusal. And `fork` inherits its parent's sampling (seed + k for its k-th fork, no hook) unless told
otherwise, each choice generating what the same sampling generates alone. On the tiny checkpoint."""

from __future__ import annotations

import math
import threading
from dataclasses import replace

import numpy as np
import pytest
import torch

from quantkit.errors import ArgumentError, ArgumentTypeError, QuantkitError
from quantkit.runtime import BatchGenerator, SamplingParams, load_model
from quantkit.runtime.options import RuntimeOptions

from helpers.probe import count

M = [{"role": "user", "content": "list the files in this folder"}]
T, V = ArgumentTypeError, ArgumentError


def _refused(call, error: type, name: str) -> str:
    """`call()` raises `error` (a QuantkitError too) in one line naming `name`."""
    count()
    with pytest.raises(error) as e:
        call()
    msg = str(e.value)
    assert isinstance(e.value, QuantkitError) and isinstance(e.value, TypeError if error is T else ValueError)
    assert "\n" not in msg and name in msg, msg
    return msg


@pytest.fixture(scope="module")
def rt(tiny_model):
    return load_model(tiny_model)


@pytest.fixture(scope="module")
def greedy(rt):
    """What the runtime answers to M greedily: every refusal must leave it answering the same."""
    return rt.generate(M, temperature=0, max_new_tokens=6, ignore_eos=True).token_ids


# --- load_model -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, error, name", [
    ({"options": "torch"}, T, "options"), ({"options": {"route": "torch"}}, T, "options"),
    ({"context": 0}, V, "context"), ({"context": -4096}, V, "context"), ({"context": True}, T, "context"),
    ({"context": 4096.0}, T, "context"), ({"context": "4k"}, T, "context"),
    ({"verify": "bogus"}, V, "verify"), ({"verify": ""}, V, "verify"), ({"verify": None}, T, "verify"),
    ({"plan": 3}, T, "plan"), ({"recipe": 4}, T, "recipe"), ({"progress": "print"}, T, "progress"),
    ({"mtp_copies": "yes"}, T, "mtp_copies"), ({"placement": "cpu"}, T, "placement"),
    ({"route": 1}, T, "route"), ({"forced_route": ["torch"]}, T, "forced_route"), ({"gather": [0]}, T, "gather"),
])
def test_load_model_refuses_a_bad_argument_before_reading_anything(tiny_model, monkeypatch, kw, error, name):
    import quantkit.runtime.loader as loader

    monkeypatch.setattr(loader, "resolve_model", lambda p: pytest.fail("the folder was read"))
    _refused(lambda: load_model(tiny_model, **kw), error, name)


def test_load_model_refuses_a_path_that_is_not_one():
    _refused(lambda: load_model(42), T, "path")
    _refused(lambda: load_model(None), T, "path")


def test_load_model_takes_options_and_a_context_as_documented(tiny_model):
    rt = load_model(tiny_model, options=RuntimeOptions(route="torch"), context=256, verify="off")
    assert rt.context == 256 and rt.route()["name"] == "torch"


# --- sampling: generate_stream, BatchGenerator.add and fork take the same options ----------------------------------

SAMPLING = [
    ({"temperature": math.nan}, V, "temperature"), ({"temperature": math.inf}, V, "temperature"),
    ({"temperature": -0.1}, V, "temperature"), ({"temperature": "hot"}, T, "temperature"),
    ({"temperature": True}, T, "temperature"),
    ({"top_p": 2}, V, "top_p"), ({"top_p": 0}, V, "top_p"), ({"top_p": math.nan}, V, "top_p"),
    ({"top_k": -1}, V, "top_k"), ({"top_k": 2.5}, T, "top_k"), ({"top_k": False}, T, "top_k"),
    ({"seed": "x"}, T, "seed"), ({"seed": True}, T, "seed"), ({"seed": 1.5}, T, "seed"),
    ({"seed": 1 << 64}, V, "seed"), ({"seed": -(1 << 63) - 1}, V, "seed"),
    ({"max_new_tokens": 0}, V, "max_new_tokens"), ({"max_new_tokens": True}, T, "max_new_tokens"),
    ({"max_new_tokens": 8.0}, T, "max_new_tokens"), ({"ignore_eos": "yes"}, T, "ignore_eos"),
    ({"hook": "grammar"}, T, "hook"), ({"temprature": 0}, T, "temprature"),
    ({"sampling": "greedy"}, T, "sampling"), ({"sampling": {"temperature": 0}}, T, "sampling"),
    ({"sampling": SamplingParams(temperature=math.nan)}, V, "temperature"),
    ({"sampling": SamplingParams(), "seed": "x"}, T, "seed"),  # an override is checked as the field itself
    ({"cancel": "stop"}, T, "cancel"),
]

PROMPT = [
    ({"messages": "hello"}, T, "messages"), ({"messages": {"role": "user", "content": "hi"}}, T, "messages"),
    ({"messages": []}, V, "messages"), ({"messages": ["hello"]}, T, "messages[0]"),
    ({"messages": [{"content": "hi"}]}, V, "messages[0]['role']"),
    ({"messages": [{"role": 1, "content": "hi"}]}, V, "messages[0]['role']"),
    ({"messages": [{"role": "user", "content": 5}]}, T, "messages[0]['content']"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": "ls"}]}, T, "messages[0]['tool_calls']"),
    ({"tools": "ls"}, T, "tools"), ({"tools": {"function": {"name": "ls"}}}, T, "tools"),
    ({"tools": [{"type": "function"}]}, V, "tools[0]"), ({"tools": ["ls"]}, T, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, V, "tools[0]['function']['name']"),
    ({"tools": [{"type": "retrieval", "function": {"name": "ls"}}]}, V, "tools[0]['type']"),
    ({"tools": [{"function": {"name": "ls", "parameters": "none"}}]}, T, "parameters"),
    ({"enable_thinking": "no"}, T, "enable_thinking"),
]


def _each(cases, call) -> None:
    """`call(kw)` for every (kw, error, name) case, each refused as `_refused` asserts (the case in any failure)."""
    for kw, error, name in cases:
        try:
            _refused(lambda kw=kw: call(dict(kw)), error, name)
        except BaseException as e:
            raise AssertionError(f"case {kw!r}: {e}") from e


def test_generate_stream_refuses_each_bad_argument_at_the_call(rt, greedy, one_thread):
    def call(kw):
        return rt.generate_stream(kw.pop("messages", M), **kw)  # refused at the call: no event is read

    _each(SAMPLING + PROMPT, call)
    assert rt.generate(M, temperature=0, max_new_tokens=6, ignore_eos=True).token_ids == greedy


IDS = [
    ({"ids": [-1]}, V, "ids[0]"), ({"ids": [1, 10**9]}, V, "ids[1]"), ({"ids": [1.0, 2.0]}, T, "ids[0]"),
    ({"ids": [True]}, T, "ids[0]"), ({"ids": "hello"}, T, "ids"), ({"ids": []}, V, "ids"),
    ({"ids": [1, "2"]}, T, "ids[1]"), ({"ids": torch.tensor([1.0, 2.0])}, T, "ids[0]"),
    ({"stop_ids": ["<|im_end|>"]}, T, "stop_ids[0]"), ({"stop_ids": [-5]}, V, "stop_ids[0]"),
    ({"stop_ids": 7}, T, "stop_ids"),
]


def test_generate_ids_refuses_ids_outside_the_vocabulary_at_the_call(rt, greedy, one_thread):
    def call(kw):
        return rt.generate_ids(kw.pop("ids", [1, 2, 3]), SamplingParams(temperature=0), **kw)

    _each([*IDS, ({"thinking": "yes"}, T, "thinking")], call)
    with pytest.raises(ArgumentError, match=rf"ids\[1\]={rt.model.vocab}: a token id is in \[0, {rt.model.vocab}\)"):
        rt.generate_ids([0, rt.model.vocab], SamplingParams())
    assert rt.generate(M, temperature=0, max_new_tokens=6, ignore_eos=True).token_ids == greedy


def test_ids_at_the_ends_of_the_vocabulary_and_integer_arrays_are_taken(rt, one_thread):
    sp = SamplingParams(temperature=0, max_new_tokens=2, ignore_eos=True)
    for ids in ([0, rt.model.vocab - 1], np.array([0, rt.model.vocab - 1]), torch.tensor([0, rt.model.vocab - 1])):
        got = [e.response for e in rt.generate_ids(ids, sp) if e.response is not None][0]
        assert got.prompt_tokens == 2 and got.generation_tokens == 2


def test_batch_add_refuses_each_bad_argument_and_adds_no_row(rt, greedy, one_thread):
    batch = BatchGenerator(rt)

    def call(kw):
        try:
            return batch.add(kw.pop("messages", None if "ids" in kw else M), **kw)
        finally:
            assert not batch and batch.rows == [] and batch.step() == []

    _each(SAMPLING + PROMPT + IDS + [({"messages": M, "ids": [1, 2]}, T, "messages or ids")], call)
    row = batch.add(M, temperature=0, max_new_tokens=6, ignore_eos=True)
    assert [ev.response.token_ids for r, ev in batch.run() if ev.response is not None and r == row] == [greedy]


def test_fork_refuses_each_bad_argument_and_the_parent_goes_on(rt, greedy, one_thread):
    batch = BatchGenerator(rt)
    parent = batch.add(M, temperature=0, max_new_tokens=6, ignore_eos=True)

    def call(kw):
        try:
            return batch.fork(kw.pop("row", parent), **kw)
        finally:
            assert batch.rows == [parent]

    _each(SAMPLING + [({"stop_ids": [rt.model.vocab]}, V, "stop_ids[0]"), ({"stop_ids": "eos"}, T, "stop_ids"),
                      ({"row": "0"}, T, "row"), ({"row": 0.0}, T, "row")], call)
    assert [ev.response.token_ids for _r, ev in batch.run() if ev.response is not None] == [greedy]


def test_batch_max_rows_is_a_whole_number(rt):
    _refused(lambda: BatchGenerator(rt, max_rows=0), V, "max_rows")
    _refused(lambda: BatchGenerator(rt, max_rows=2.0), T, "max_rows")
    _refused(lambda: BatchGenerator(rt, max_rows=True), T, "max_rows")


# --- fork inherits the parent's sampling ------------------------------------------------------------------------

class _Seen:
    """A sampling hook that changes nothing and records the tokens it was shown."""

    def __init__(self):
        self.tokens = []

    def process(self, logits):
        return logits

    def accept(self, token):
        self.tokens.append(token)


def _alone(rt, ids, sp):
    return [e.response for e in rt.generate_ids(ids, replace(sp)) if e.response is not None][0].token_ids


def test_a_fork_inherits_the_parents_sampling_with_its_own_seed(rt, one_thread):
    """fork(row) with no sampling: the parent's temperature / top_p / top_k / max_new_tokens / ignore_eos, the
    seed + 1 and + 2 for its first and second forks (as the server seeds choice j of `n`), and not its hook;
    each choice's tokens are the ones that sampling generates alone."""
    ids = rt.render_ids(M)[1]
    base = SamplingParams(temperature=1.5, top_p=1.0, top_k=0, seed=5, max_new_tokens=7, ignore_eos=True)
    want = {s: _alone(rt, ids, replace(base, seed=s)) for s in (5, 6, 7)}
    assert len({tuple(t) for t in want.values()}) == 3  # the seeds tell the choices apart
    hook = _Seen()
    batch = BatchGenerator(rt)
    parent = batch.add(ids=ids, sampling=replace(base, hook=hook))
    first, second = batch.fork(parent), batch.fork(parent)
    short = batch.fork(parent, max_new_tokens=3)  # one field overridden, the rest inherited (its seed + 3)
    greedy = batch.fork(parent, SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True))  # replaced
    last = {r: ev.response for r, ev in batch.run() if ev.response is not None}
    assert [last[r].token_ids for r in (parent, first, second)] == [want[5], want[6], want[7]]
    assert all(last[r].finish_reason == "length" and last[r].generation_tokens == 7 for r in (first, second))
    assert last[short].token_ids == _alone(rt, ids, replace(base, seed=8, max_new_tokens=3))
    assert last[greedy].token_ids == _alone(rt, ids, SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True))
    assert hook.tokens == want[5]  # the parent's hook saw the parent's tokens only


def test_a_fork_inherits_the_parents_stop_tokens_and_an_unseeded_parent_forks_unseeded(rt, one_thread):
    ids = rt.render_ids(M)[1]
    sp = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=False)
    ref = _alone(rt, ids, replace(sp, ignore_eos=True))
    stop = {ref[3]}  # the parent stops at this token's first place, and so does each fork
    until = ref[:ref.index(ref[3]) + 1]
    batch = BatchGenerator(rt)
    parent = batch.add(ids=ids, sampling=sp, stop_ids=stop)
    child = batch.fork(parent)
    own = batch.fork(parent, stop_ids=set())  # given: its own stop tokens (none) instead of the parent's
    assert batch._rows[child].sampling.seed is None
    last = {r: ev.response for r, ev in batch.run() if ev.response is not None}
    assert last[parent].finish_reason == last[child].finish_reason == "stop"
    assert last[child].token_ids == last[parent].token_ids == until
    assert last[own].token_ids[:len(until)] == until and last[own].finish_reason != "stop"


def test_a_cancel_flag_is_never_inherited(rt, one_thread):
    batch = BatchGenerator(rt)
    stop = threading.Event()
    parent = batch.add(M, temperature=0, max_new_tokens=4, ignore_eos=True, cancel=stop)
    child = batch.fork(parent)
    stop.set()
    last = {r: ev.response for r, ev in batch.run() if ev.response is not None}
    assert last[parent].finish_reason == "cancelled" and last[child].finish_reason == "length"
