"""runtime/devices.HeapGuard: a prefill gives the C heap's free pages back once its resident memory has grown
past the slack, and counts what stays resident afterwards as held, not as slack."""

from __future__ import annotations

from quantkit.runtime import devices


def test_resident_bytes_reads_this_process():
    assert devices.resident_bytes() > 10 << 20


def test_heap_guard_trims_only_past_the_slack_and_moves_its_floor(monkeypatch):
    rss, trims = [1000], []

    def trim():
        trims.append(rss[0])
        rss[0] -= 300  # what the heap gave back

    monkeypatch.setattr(devices, "resident_bytes", lambda: rss[0])
    monkeypatch.setattr(devices, "release_free_heap", trim)
    g = devices.HeapGuard(slack=500)
    rss[0] = 1500
    assert not g.check() and trims == []  # at the slack: nothing
    rss[0] = 1600
    assert g.check() and trims == [1600] and g.floor == 1300
    rss[0] = 1700
    assert not g.check()  # 400 over the new floor: the 300 that stayed are held, not slack
    rss[0] = 1900
    assert g.check() and trims == [1600, 1900]


def test_a_prefill_checks_the_heap_between_its_layers(tiny_model, monkeypatch):
    """The model's multi-token forward asks its guard after every layer; a one-token step never does."""
    from quantkit.runtime import load_model
    from quantkit.runtime.model.qwen3_5_moe import STACK_VERIFY_ROWS

    model = load_model(tiny_model).model
    calls = []
    monkeypatch.setattr(devices.HeapGuard, "check", lambda self: calls.append(1) or False)
    cache = model.new_cache(64)
    model.forward(list(range(1, STACK_VERIFY_ROWS + 3)), cache)
    assert len(calls) == len(model.layers)
    model.forward([5], cache)
    assert len(calls) == len(model.layers)
