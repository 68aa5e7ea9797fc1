"""Planning for the machine at hand: does a saved plan fit what is free here now, what would fit instead, a plan
made on the spot, and the context `chat`, `generate` and `serve` take when none is given (`default_context`:
the longest at which the slots fit here, as `plan` counts it, up to DEFAULT_CONTEXT_CAP). Pure arithmetic over
byte counts the caller measured (the runtime loader asks the devices; this module never touches them)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from quantkit.checkpoint.spec import ModelSpec, Role
from quantkit.errors import QuantkitError
from quantkit.planner.budget import SNAPSHOTS_PER_PROMPT, RunSettings
from quantkit.planner.hardware import Hardware, build_hardware
from quantkit.planner.placement import Plan, max_context, solve, spec_fingerprint, suggestions
from quantkit.recipe import Recipe


def hardware_here(ram_available: int) -> Hardware:
    """The detected GPUs and the RAM that is free now (what the weights can take), not the total."""
    return build_hardware(None, ram_bytes=ram_available)


def check_plan(plan: Plan, spec: ModelSpec, folder: Path, plan_path: str, free_bytes: Mapping[str, int],
               here: Callable[[], Hardware]) -> None:
    """Refuse a plan for another model, one that does not fit its own hardware, or one that needs more than
    `free_bytes` (device id -> bytes free now) holds. `here` detects this machine, only to say what would fit."""
    fp = spec_fingerprint(spec)
    if plan.fingerprint != fp:
        raise QuantkitError(
            f"{plan_path}: plan was made for model {plan.model!r} (fingerprint {plan.fingerprint[:12]}), not for "
            f"{folder} ({fp[:12]}); make one with `quantkit plan --model {folder / 'config.json'} --out plan.json`")
    if any("." in d for d in plan.layer_device):
        raise QuantkitError(f"{plan_path}: a multi-node plan cannot run in one quantkit process")
    if not plan.fits:
        raise QuantkitError(f"{plan_path}: the plan itself does not fit its hardware ({plan.reason})")
    for d in plan.devices:
        need = d.used_bytes
        if need and need > free_bytes.get(d.id, 0):
            raise QuantkitError(
                f"{plan_path}: the plan puts {need / 1e9:.1f} GB on {d.id}, but only "
                f"{free_bytes.get(d.id, 0) / 1e9:.1f} GB is free there; {what_fits(spec, plan, here())}")


def what_fits(spec: ModelSpec, plan: Plan, here: Hardware) -> str:
    """A one-line suggestion of what would fit `here`."""
    try:
        settings = plan.settings
        p = solve(spec, Recipe.from_dict(plan.recipe), settings, here)
        if p.fits:
            return f"on this machine ({here.describe()}) this recipe fits as: {p.summary()} (run without --plan)"
        tips = suggestions(spec, here, settings, p)
        return f"on this machine ({here.describe()}) would fit: " + ("; ".join(tips) if tips else "nothing")
    except QuantkitError as e:
        return f"(could not plan for this machine: {e})"


def plan_here(spec: ModelSpec, recipe: Recipe, context: int, here: Hardware) -> Plan:
    """A plan for `here`; refuses with what would fit when nothing does."""
    settings = RunSettings(context=context)
    settings.validate(spec.config)
    p = solve(spec, recipe, settings, here)
    if not p.fits:
        tips = suggestions(spec, here, settings, p)
        raise QuantkitError(f"{recipe.name} does not fit this machine ({here.describe()}): {p.reason}"
                            + (f"; would fit: {'; '.join(tips)}" if tips else ""))
    return p


# The default context's ceiling: an agent session's turns fit in it, and beyond it each slot's K/V would hold
# memory that few sessions use; `-c` goes up to the model's maximum
DEFAULT_CONTEXT_CAP = 32768
# planned for when nothing is asked and nothing fits: plan_here then says what would
FALLBACK_CONTEXT = 4096


@dataclass(frozen=True)
class ContextChoice:
    """The context a run takes when none is given, and why, for its start-up line."""

    tokens: int
    why: str


def default_context(spec: ModelSpec, recipe: Recipe, here: Hardware, slots: int = 1,
                    cap: int = DEFAULT_CONTEXT_CAP) -> ContextChoice:
    """The longest context at which `slots` conversations fit `here` (`max_context`, the figure `quantkit plan`
    shows as max ctx), at most `cap` and the model's maximum."""
    top = min(cap, spec.config.max_position_embeddings)
    # counted as `quantkit plan` counts by default: the MTP layer where the model has one (the runtime loads it)
    # and the prompt cache's snapshots of one conversation
    base = RunSettings(context=min(FALLBACK_CONTEXT, top), batch=slots, prompt_cache_snapshots=SNAPSHOTS_PER_PROMPT,
                       include_mtp=any(t.role == Role.MTP for t in spec.tensors))
    base.validate(spec.config)
    fit = max_context(spec, recipe, base, here)
    who = "1 conversation" if slots == 1 else f"{slots} conversations at once"
    if fit >= top:
        if top == spec.config.max_position_embeddings:
            return ContextChoice(top, f"the model's maximum, which fits here for {who}")
        return ContextChoice(top, f"capped at {cap:,}; {fit:,} would fit here for {who}")
    if fit == 0:
        return ContextChoice(min(FALLBACK_CONTEXT, top), f"nothing fits here for {who}")
    return ContextChoice(fit, f"the most that fits here for {who}, as `quantkit plan` counts it")
