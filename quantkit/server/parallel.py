"""`quantkit serve --parallel`: the slot count a loaded runtime serves, checked against the memory free on the
devices holding its states (the planner's arithmetic: quantkit/planner/slots.py)."""

from __future__ import annotations

from typing import Any

from quantkit.checkpoint.spec import parse_text_config
from quantkit.planner.slots import MAX_SLOTS, check_parallel, default_parallel, slots_fit, slots_need
from quantkit.runtime.devices import available_bytes


def free_for_slots(runtime: Any) -> dict[str, int]:
    """What each device holding a layer or the lm_head has free now, less the prompt cache's bound on the device
    holding the states (its snapshots fill up to it while the slots decode)."""
    devs = dict.fromkeys([*runtime.placement.layer_device, runtime.placement.lm_head, *_mtp_device(runtime)])
    free = {d: available_bytes(d) for d in devs}
    sd = runtime.state_device
    free[sd] = max(0, free.get(sd, 0) - int(runtime.prompt_cache.max_bytes))
    return free


def choose_parallel(runtime: Any, requested: int | None, context: int, free: dict[str, int] | None = None) -> int:
    """`requested` slots when they fit at `context` tokens each (else one line naming the memory), or the
    default (`default_parallel`) when None."""
    c = parse_text_config(runtime.config)
    p = runtime.placement
    free = free_for_slots(runtime) if free is None else free
    mtp = next(iter(_mtp_device(runtime)), None)
    fit = slots_fit(c, free, context, p.layer_device, p.lm_head, MAX_SLOTS, mtp_device=mtp)
    if requested is None:
        return default_parallel(fit)
    check_parallel(slots_need(c, requested, context, p.layer_device, p.lm_head, mtp_device=mtp), free, fit)
    return requested


def _mtp_device(runtime: Any) -> list[str]:
    """The MTP layer's device where it drafts (each slot then keeps a cache of it), else none."""
    mtp = runtime.model.mtp
    return [str(mtp.layer.device)] if mtp is not None and (runtime.draft_plan is not None or runtime.mtp) else []
