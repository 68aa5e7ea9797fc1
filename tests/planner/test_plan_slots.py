"""Slots budgeted (quantkit/planner/slots.py, quantkit/server/parallel.py): `quantkit plan --parallel N` counts
each conversation's K/V and Gated DeltaNet recurrent + conv state and the batch's activations; `serve` refuses
a --parallel that does not fit what is free, in one line naming the memory, and picks its default from what
fits; both commands (and the server's own check) take one range of slots, refused in one line."""

from __future__ import annotations

import json

import pytest

from quantkit.checkpoint.spec import default_spec, parse_text_config
from quantkit.errors import ArgumentError, ArgumentTypeError, QuantkitError
from quantkit.planner.budget import RunSettings, batch_activation_bytes, slot_state_bytes
from quantkit.planner.slots import (
    DEFAULT_PARALLEL_MAX,
    MAX_SLOTS,
    check_parallel,
    check_slots,
    default_parallel,
    slots_fit,
    slots_need,
)
from quantkit.runtime import load_model
from quantkit.server.parallel import choose_parallel
from quantkit.sizes import format_size

from helpers.cli import run_cli
from helpers.probe import count, expect_one_line
from helpers.runtime import quantized

C = default_spec().config
CPU = ["cpu"] * len(C.layer_types)


def test_slots_need_counts_each_conversation_state_and_the_batch():
    one, four = slots_need(C, 1, 4096, CPU, "cpu"), slots_need(C, 4, 4096, CPU, "cpu")
    s = RunSettings(context=4096, batch=4, cache_dtype="bf16")
    assert four.total == sum(slot_state_bytes(C, s)) + batch_activation_bytes(C, s) + 4 * C.vocab_size * 4
    assert one.per_slot == four.per_slot > 0
    # four rows are narrower than one prefill chunk: the extra slots add their states and logits alone
    assert four.total - one.total == 3 * one.per_slot + 3 * C.vocab_size * 4
    # a longer context holds more K/V per slot; the recurrent state does not grow with it
    assert slots_need(C, 1, 8192, CPU, "cpu").per_slot > one.per_slot
    # each layer's state lies on its layer's device, the activations and logits on the lm_head's
    half = len(CPU) // 2
    split = slots_need(C, 4, 4096, ["cuda:0"] * half + ["cpu"] * (len(CPU) - half), "cpu")
    assert split.by_device["cuda:0"] == sum(slot_state_bytes(C, s)[:half])
    assert split.total == four.total


def test_a_budget_that_fits_two_slots_refuses_64_in_one_line():
    free = {"cpu": slots_need(C, 2, 4096, CPU, "cpu").total}
    assert slots_fit(C, free, 4096, CPU, "cpu", MAX_SLOTS) == 2
    check_parallel(slots_need(C, 2, 4096, CPU, "cpu"), free, 2)  # fits: no refusal
    with pytest.raises(QuantkitError) as e:
        check_parallel(slots_need(C, MAX_SLOTS, 4096, CPU, "cpu"), free, 2)
    msg = str(e.value)
    assert "\n" not in msg and f"--parallel {MAX_SLOTS} needs" in msg and "on cpu" in msg
    assert f"{format_size(free['cpu'])} is free there" in msg and "use --parallel 2 or fewer" in msg
    assert slots_fit(C, {"cpu": 0}, 4096, CPU, "cpu", MAX_SLOTS) == 0
    with pytest.raises(QuantkitError, match="not even one slot fits"):
        check_parallel(slots_need(C, 1, 4096, CPU, "cpu"), {"cpu": 0}, 0)


def test_the_default_parallel_is_what_fits_at_least_two_where_memory_allows():
    assert [default_parallel(f) for f in (0, 1, 2, 3, 4, 5, MAX_SLOTS)] == [1, 1, 2, 3, 4, 4, DEFAULT_PARALLEL_MAX]
    room = slots_need(C, 2, 4096, CPU, "cpu").total
    assert default_parallel(slots_fit(C, {"cpu": room}, 4096, CPU, "cpu", MAX_SLOTS)) == 2
    assert default_parallel(slots_fit(C, {"cpu": room - 1}, 4096, CPU, "cpu", MAX_SLOTS)) == 1
    assert default_parallel(slots_fit(C, {"cpu": 1 << 50}, 4096, CPU, "cpu", MAX_SLOTS)) == DEFAULT_PARALLEL_MAX


def test_plan_parallel_budgets_every_slot(capsys, monkeypatch):
    got = {}
    for n in (1, 4):
        code, out, err = run_cli(["plan", "--gpu", "none", "--ram", "512GB", "--scheme", "int4", "--json",
                                  "--parallel", str(n)], capsys, monkeypatch)
        assert code == 0, err
        got[n] = json.loads(out)["plan"]
    assert got[4]["settings"]["batch"] == 4
    for part in ("kv_cache", "recurrent_state", "conv_state"):
        assert got[4]["components"][part] == 4 * got[1]["components"][part] > 0
    assert got[4]["total_bytes"] > got[1]["total_bytes"]


@pytest.fixture(scope="module")
def q4(tiny_model):
    return quantized(tiny_model, "int4")


def test_serve_refuses_a_parallel_that_does_not_fit_in_one_line(q4, capsys, monkeypatch):
    c = parse_text_config(json.loads((q4 / "config.json").read_text()))
    room = slots_need(c, 2, 256, ["cpu"] * len(c.layer_types), "cpu").total
    monkeypatch.setattr("quantkit.server.parallel.available_bytes", lambda dev: room)
    code, out, err = run_cli(["serve", str(q4), "--port", "0", "--context", "256", "--prompt-cache-size", "0",
                              "--parallel", str(MAX_SLOTS)], capsys, monkeypatch)
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err and f"--parallel {MAX_SLOTS} needs" in lines[0]
    assert f"{format_size(room)} is free there" in lines[0] and "--parallel 2 or fewer" in lines[0]
    assert "serving" not in out


def test_serve_picks_the_slots_that_fit_and_keeps_one_where_two_do_not(q4):
    rt = load_model(q4, context=256)
    c = parse_text_config(rt.config)
    room = slots_need(c, 3, 256, rt.placement.layer_device, rt.placement.lm_head).total
    assert choose_parallel(rt, None, 256, {"cpu": room}) == 3
    assert choose_parallel(rt, None, 256, {"cpu": room // 10}) == 1
    assert choose_parallel(rt, 2, 256, {"cpu": room}) == 2
    with pytest.raises(QuantkitError, match="use --parallel 3 or fewer"):
        choose_parallel(rt, 4, 256, {"cpu": room})


def test_slots_that_draft_count_their_own_mtp_cache(tiny_model_mtp):
    """Each slot of a server that drafts keeps its own cache of the MTP layer (the batch's `RowDrafter`): its bf16
    K/V at the context, counted per slot where drafting is on (the default, or --mtp N) and not with --mtp 0, so
    the memory that fits three slots without drafts fits fewer with them."""
    rt = load_model(quantized(tiny_model_mtp, "int4"), context=256)
    c, p = parse_text_config(rt.config), rt.placement
    plain = slots_need(c, 3, 256, p.layer_device, p.lm_head)
    drafts = slots_need(c, 3, 256, p.layer_device, p.lm_head, mtp_device="cpu")
    cache = rt.model.mtp.new_cache(256)
    per_slot = sum(t.numel() * t.element_size() for t in (*cache.keys.values(), *cache.values.values()))
    assert drafts.total - plain.total == 3 * per_slot > 0 and drafts.per_slot - plain.per_slot == per_slot
    fit = [n for n in (1, 2, 3) if slots_need(c, n, 256, p.layer_device, p.lm_head, mtp_device="cpu").total
           <= plain.total]
    assert rt.draft_plan is not None and choose_parallel(rt, None, 256, {"cpu": plain.total}) == max([1, *fit]) < 3
    rt.set_mtp(0)
    assert choose_parallel(rt, None, 256, {"cpu": plain.total}) == 3


@pytest.mark.parametrize("value", ["0", str(MAX_SLOTS + 1), "1048576", "2.5", "lots"])
def test_plan_and_serve_take_one_parallel_range_with_one_message(tmp_path, capsys, monkeypatch, value):
    """`plan --parallel` budgets the slots `serve --parallel` decodes: the same range, refused in the same line."""
    lines = {}
    for cmd in (["plan", "--gpu", "none", "--ram", "512GB"], ["serve", str(tmp_path)]):
        code, out, err = run_cli([*cmd, "--parallel", value], capsys, monkeypatch)
        line = expect_one_line(code, out, err, "--parallel", exit_code=2)
        lines[cmd[0]] = line.split("': ", 1)[1].split(" (see `quantkit")[0]  # past the flag's spellings
    assert lines["plan"] == lines["serve"] and f"[1, {MAX_SLOTS}]" in lines["plan"]
    assert list(tmp_path.iterdir()) == []


def test_plan_budgets_the_most_slots_serve_takes(capsys, monkeypatch):
    code, out, err = run_cli(["plan", "--gpu", "none", "--ram", "512GB", "--scheme", "int4", "--json",
                              "--parallel", str(MAX_SLOTS)], capsys, monkeypatch)
    assert code == 0, err
    assert json.loads(out)["plan"]["settings"]["batch"] == MAX_SLOTS


@pytest.mark.parametrize("slots, error", [(0, ArgumentError), (MAX_SLOTS + 1, ArgumentError), (-3, ArgumentError),
                                          (True, ArgumentTypeError), (2.0, ArgumentTypeError),
                                          ("4", ArgumentTypeError)])
def test_the_library_checks_the_same_range(slots, error):
    count()
    with pytest.raises(error, match=f"parallel {slots!r}: give .*1 to {MAX_SLOTS}") as e:
        check_slots(slots)
    assert isinstance(e.value, QuantkitError)
    assert check_slots(MAX_SLOTS) == MAX_SLOTS and check_slots(1) == 1
