"""How many conversations a server decodes together (`quantkit serve --parallel N`): the memory of N slots on the
devices that hold them, whether N fits what is free, and the default N; `MAX_SLOTS` and `check_slots`, the one
range of N that `plan --parallel`, `serve --parallel` and the server's scheduler take. Pure arithmetic over the byte counts
the caller measured, with the budget's own functions (quantkit/planner/budget.py: `slot_state_bytes`,
`batch_activation_bytes`), so `quantkit plan --parallel N` and `serve` count the same bytes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from quantkit.checkpoint.spec import TextConfig
from quantkit.errors import ArgumentError, ArgumentTypeError, QuantkitError
from quantkit.planner.budget import (
    DEFAULT_PREFILL_CHUNK,
    RunSettings,
    batch_activation_bytes,
    kv_bytes_per_token,
    slot_state_bytes,
)
from quantkit.sizes import format_size

# --parallel at most, for plan and serve alike: more rows per step than this only queue up behind the memory
# bandwidth
MAX_SLOTS = 64
# the default --parallel at most: agent loops rarely run more at once, and each slot beyond the cores' memory
# bandwidth adds little throughput while its state stays reserved
DEFAULT_PARALLEL_MAX = 4


def check_slots(slots: int) -> int:
    """`slots` when it is a whole number in 1..MAX_SLOTS; else one line naming the range (the CLI's `--parallel`
    parser, quantkit/cli/options.py PARALLEL, states the same range)."""
    if isinstance(slots, bool) or not isinstance(slots, int):
        raise ArgumentTypeError(f"parallel {slots!r}: give a whole number of slots, 1 to {MAX_SLOTS}")
    if not 1 <= slots <= MAX_SLOTS:
        raise ArgumentError(f"parallel {slots}: give 1 to {MAX_SLOTS} slots")
    return slots


@dataclass(frozen=True)
class SlotsNeed:
    """The bytes `slots` conversations need beyond the weights, per device."""

    slots: int
    context: int
    by_device: dict[str, int]
    per_slot: int  # one conversation's K/V and recurrent + conv state at `context` tokens, all layers

    @property
    def total(self) -> int:
        return sum(self.by_device.values())


def slots_need(c: TextConfig, slots: int, context: int, layer_device: Sequence[str], head_device: str,
               prefill_chunk: int = DEFAULT_PREFILL_CHUNK, cache_dtype: str = "bf16",
               mtp_device: str | None = None) -> SlotsNeed:
    """Each layer's state of `slots` conversations on that layer's device; the batch's activations (the
    widest forward: a prefill chunk or the slots' rows) and its fp32 logits on the lm_head's device; with
    `mtp_device` (the MTP layer's, where it drafts), each slot's bf16 K/V of that layer there too."""
    if len(layer_device) != len(c.layer_types):
        raise QuantkitError(f"{len(layer_device)} layer devices for a model of {len(c.layer_types)} layers")
    s = RunSettings(context=context, batch=slots, cache_dtype=cache_dtype, prefill_chunk=prefill_chunk)
    s.validate(c)
    by_device: dict[str, int] = {}
    for dev, b in zip(layer_device, slot_state_bytes(c, s), strict=True):
        by_device[dev] = by_device.get(dev, 0) + b
    by_device[head_device] = by_device.get(head_device, 0) + batch_activation_bytes(c, s) + slots * c.vocab_size * 4
    one = sum(slot_state_bytes(c, RunSettings(context=context, batch=1, cache_dtype=cache_dtype)))
    if mtp_device is not None:  # each row's drafter keeps its own cache of the MTP layer (runtime/batch_drafts.py)
        mtp = kv_bytes_per_token(c, "bf16", c.mtp_num_hidden_layers) * context
        by_device[mtp_device] = by_device.get(mtp_device, 0) + slots * mtp
        one += mtp
    return SlotsNeed(slots, context, by_device, one)


def short_of(need: SlotsNeed, free: Mapping[str, int]) -> str | None:
    """The first device where `need` exceeds what is free, or None when it fits everywhere."""
    return next((d for d, b in need.by_device.items() if b > free.get(d, 0)), None)


def slots_fit(c: TextConfig, free: Mapping[str, int], context: int, layer_device: Sequence[str], head_device: str,
              limit: int, prefill_chunk: int = DEFAULT_PREFILL_CHUNK, cache_dtype: str = "bf16",
              mtp_device: str | None = None) -> int:
    """The most slots, up to `limit`, whose state and activations (and MTP K/V: `slots_need`) fit `free`
    (device -> bytes); 0 when not one."""
    lo, hi = 0, limit  # the need grows with the slot count, so the largest that fits is a bisection away
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if short_of(slots_need(c, mid, context, layer_device, head_device, prefill_chunk, cache_dtype, mtp_device),
                    free):
            hi = mid - 1
        else:
            lo = mid
    return lo


def default_parallel(fit: int) -> int:
    """`serve`'s --parallel when none is given: the slots that fit (`slots_fit`), at most DEFAULT_PARALLEL_MAX,
    and 1 (one request at a time, as before slots) where not even two fit."""
    return max(1, min(fit, DEFAULT_PARALLEL_MAX))


def check_parallel(need: SlotsNeed, free: Mapping[str, int], fit: int) -> None:
    """Refuse `need` when it exceeds what is free on one of its devices, in one line naming the memory."""
    dev = short_of(need, free)
    if dev is None:
        return
    instead = f"use --parallel {fit} or fewer" if fit else "not even one slot fits: free some memory"
    raise QuantkitError(
        f"--parallel {need.slots} needs {format_size(need.by_device[dev])} on {dev} for its slots "
        f"({format_size(need.per_slot)} of K/V and recurrent state per conversation at {need.context} tokens, plus "
        f"the batch's activations), but {format_size(free.get(dev, 0))} is free there; {instead}, or a smaller "
        "--context")
