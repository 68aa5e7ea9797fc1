"""`quantkit profile-host` (formerly `calibrate`): time quantkit's runtime kernels and layer ops on this host for
the planner. Calibration statistics of a model are `quantkit stats`, hence the new name."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import typer
from rich import box
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from quantkit import sizes
from quantkit.checkpoint.contract import read_quant_config
from quantkit.checkpoint.reader import spec_from_path
from quantkit.checkpoint.spec import load_config
from quantkit.cli import DEV_PANEL, app, console, err_console, print_table
from quantkit.cli.options import COUNT, notice
from quantkit.cli.progress import step_status
from quantkit.errors import QuantkitError
from quantkit.fileio import write_atomic
from quantkit.outputs import guard_output, json_with_keys
from quantkit.planner.budget import DEFAULT_PREFILL_CHUNK, RunSettings
from quantkit.planner.hardware import Hardware, Host
from quantkit.planner.host_costs import default_profile_path, load_profile, mismatch
from quantkit.planner.placement import RECIPES, solve
from quantkit.recipe import Recipe, parse_recipe_names
from quantkit.runtime.calibrate import calibrate
from quantkit.termtext import plural
from quantkit.threads import available_cpus, busy_note, load_average


def _own_recipe(model: str | None) -> list[Recipe]:
    """A quantkit output folder's own recipe: what `profile-host --model DIR` times by default."""
    if not model or not (Path(model) / "config.json").is_file():
        return []

    qc = read_quant_config(Path(model), load_config(Path(model) / "config.json"))
    return [Recipe.from_dict(qc["recipe"])] if qc else []


MAX_WORKING_SET = 16 * sizes.GB


@app.command("profile-host", rich_help_panel=DEV_PANEL)
def calibrate_cmd(
    ctx: typer.Context,
    model: str = typer.Option(None, "--model", "-m", help="config.json, checkpoint folder or cached HF id"),
    scheme: list[str] = typer.Option(None, "--scheme", "-s", help="schemes whose kernels to time (default: a "
                                     "quantized folder's own recipe, else all)"),
    out: Path = typer.Option(None, "--out", "-o",
                             help="profile file (default: this host's cache, read by `plan`)"),
    working_set: str = typer.Option("256MB", "--working-set", help="weights cycled per kernel (above the LLC)"),
    passes: int = typer.Option(3, "--passes", parser=COUNT, help="timed passes per kernel (the best is kept)"),
    steps: int = typer.Option(24, "--steps", parser=COUNT, help="decode steps timed for the layer ops"),
    prefill_tokens: int = typer.Option(DEFAULT_PREFILL_CHUNK, "--prefill-tokens", parser=COUNT,
                                       help="tokens of the prefill chunk timed (the runtime's chunk)"),
) -> None:
    """Measure quantkit's CPU runtime on this host, part by part, so `quantkit plan` can estimate it."""
    if ctx.info_name == "calibrate":
        notice("quantkit calibrate", "quantkit profile-host")

    spec = spec_from_path(model)
    recipes = [RECIPES[n] for n in parse_recipe_names(scheme)] or _own_recipe(model) or list(RECIPES.values())
    ws = sizes.parse_size(working_set, "--working-set (256MB defeats the CPU caches)", minimum=sizes.MB)
    if ws > MAX_WORKING_SET:  # it is allocated: a bound keeps a typo from taking the machine's memory
        raise QuantkitError(f"--working-set {working_set}: at most {MAX_WORKING_SET // sizes.GB} GB (the largest CPU "
                            "caches hold a few hundred MB; 256MB already defeats them)")
    path = out or default_profile_path(spec.config)
    guard_output(path, kind="file", overwrite=True, create_parents=True, flag="--out " if out else "",
                 owned=json_with_keys("host", "dims", "matmul_s"))  # only a runtime profile is replaced
    cols = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TimeRemainingColumn(), TextColumn("[dim]{task.fields[what]}"))
    err_console.print(f"profiling this host for {', '.join(r.name for r in recipes)}: each part timed "
                      f"{plural(passes, 'time')}, a few minutes on a small host; other work on the host slows the "
                      "figures",
                      highlight=False)
    load_before, plain = load_average(), not err_console.is_terminal
    with Progress(*cols, console=err_console, transient=True, disable=plain) as bar, \
            (step_status(err_console, "profiling") if plain else nullcontext(None)) as say:
        task = bar.add_task("profiling", total=None, what="")

        def on_item(what: str, done: int, total: int) -> None:
            bar.update(task, completed=done, total=total, what=what)
            if say is not None:  # not a terminal: a plain line every few seconds
                say(f"{done}/{total} parts ({what})")

        prof = calibrate(spec, recipes, working_set=ws, passes=passes, steps=steps, prefill_tokens=prefill_tokens,
                         on_item=on_item)
    busy = busy_note(load_before, load_average(), int(prof.host["threads"]), available_cpus())
    if path.is_file():
        try:
            old = load_profile(path)
            if mismatch(old, spec.config, prof.host) is None:
                prof = old.merged(prof)  # keep the formats timed before
        except QuantkitError:
            pass  # an unreadable old profile is replaced
    write_atomic(path, prof.to_json())

    t = Table(title=f"Kernel us per batch-1 call, weights out of cache ({prof.host['cpu']}, "
              f"{prof.host['threads']} threads, torch {prof.host['torch']})", title_justify="left",
              box=box.SIMPLE_HEAD)
    shapes = sorted({s for v in prof.matmul_s.values() for s in v}, key=lambda s: [int(x) for x in s.split("x")])
    keys = sorted(prof.matmul_s)
    t.add_column("matrix")
    for key in keys:
        t.add_column(key, justify="right")
    for s in shapes:
        t.add_row(s, *[f"{prof.matmul_s[k][s] * 1e6:.0f}" if s in prof.matmul_s[k] else "-" for k in keys])
    print_table(t)
    fused = ", ".join(f"{k} {s} {t * 1e3:.2f} ms" for k, v in sorted(prof.moe_s.items()) for s, t in sorted(v.items()))
    console.print(f"routed experts per layer and token, one fused call for the top "
                  f"{spec.config.num_experts_per_tok}: {fused or 'none (no format here fuses on this host)'}")
    ops = ", ".join(f"{k} layer {v * 1e3:.2f} ms" for k, v in sorted(prof.layer_ops_s.items()))
    console.print(f"ops per decode step without kernels or routed experts: {ops}; unfused experts' loop "
                  f"{prof.expert_loop_s * 1e3:.2f} ms; rest of the step {prof.shell_s * 1e3:.2f} ms; "
                  f"argmax over {spec.config.vocab_size} logits "
                  f"{prof.argmax_s[str(spec.config.vocab_size)] * 1e3:.2f} ms")
    if prof.prefill_tokens:
        pops = ", ".join(f"{k} layer {v * 1e3:.1f} ms" for k, v in sorted(prof.prefill_ops_s.items()))
        pmoe = ", ".join(f"{k} {s} {t * 1e3:.1f} ms" for k, v in sorted(prof.prefill_moe_s.items())
                         for s, t in sorted(v.items()))
        console.print(f"one prefill chunk of {prof.prefill_tokens} tokens: ops without kernels or routed experts "
                      f"{pops}; a layer's routed experts {pmoe}")
    hw = Hardware((), Host(ram_bytes=1 << 40))  # every scheme resident in RAM: what the CPU alone decodes
    est = []
    for r in recipes:
        p = solve(spec, r, RunSettings(context=4096), hw, profile=prof, profile_source=str(path))
        if p.runtime_speed:
            rs = p.runtime_speed
            est.append(f"{r.name} {rs.decode_tok_s:.1f}"
                       + (f" (prefill {rs.prefill_tok_s:.0f})" if rs.prefill_tok_s is not None else ""))
    console.print(f"quantkit runtime decode on this CPU alone, tok/s: {', '.join(est)}")
    console.print(f"profile saved to {path} ({prof.seconds:.0f} s); `quantkit plan` reads it")
    if busy:
        err_console.print(f"warning: {busy}", style="yellow", highlight=False)


app.command("calibrate", hidden=True)(calibrate_cmd)  # the old name, for one release
