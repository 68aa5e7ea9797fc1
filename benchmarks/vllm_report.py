"""The vLLM check's verdicts and its report (benchmarks/vllm_check.py gathers the figures).

Targets (issue 53): every layout `export vllm` writes either loads in vLLM CPU with teacher-forced top-1 agreement
>= TOP1 and mean |d logprob| <= DLOGPROB against quantkit's folder, or export refuses it for vLLM CPU before writing
(and then vLLM CPU indeed does not load it: a refusal of a layout that loads is a failure too); vLLM's MTP
acceptance within ACCEPTANCE of quantkit's on the same prompts, quantkit drafting with the layer as stored (the
weights vLLM's drafter holds; quantkit's default int4 copies are shown beside); the line export printed starts
and answers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TOP1 = 0.9
DLOGPROB = 0.03
ACCEPTANCE = 0.05
SHOWN_TOKENS = 16


def acceptance(x: dict[str, Any] | None) -> float | None:
    if not x or not x.get("drafted"):
        return None
    return x["accepted"] / x["drafted"]


def verdicts(d: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for row in d["layouts"]:
        what = f"export vllm --rest {row['rest']} on vLLM CPU"
        v = row["vllm"]
        if "refused" in row:
            ok = not v["ok"]
            detail = ("export refuses it before writing; vLLM CPU indeed fails to load it: " + v.get("error", "")
                      if ok else "export refuses it, yet vLLM CPU loads it")
        elif not v["ok"]:
            ok, detail = False, f"vLLM CPU fails at {v.get('stage')}: {v.get('error')}"
        else:
            t = row["teacher"]
            ok = t["top1_agreement"] >= TOP1 and t["mean_abs_dlogprob"] <= DLOGPROB
            detail = (f"loads; teacher-forced top-1 agreement {t['top1_agreement']:.3f} (target >= {TOP1}), mean "
                      f"|d logprob| {t['mean_abs_dlogprob']:.4f} (target <= {DLOGPROB})")
        out.append({"what": what, "ok": ok, "detail": detail})
    m = d["mtp"]
    a_v = acceptance(m["vllm"].get("spec")) if m["vllm"].get("ok") else None
    a_q = acceptance(d["quantkit"]["mtp_as_stored"])
    trained = {k: (m["by_kind"].get(k) or {}).get("trained", {}).get("acceptance")
               for k in ("vllm", "quantkit_as_stored")}
    what = "MTP drafter acceptance, vLLM against quantkit"
    if a_v is None or a_q is None:
        out.append({"what": what, "ok": False,
                    "detail": "vLLM's MTP run failed: " + str(m["vllm"].get("error")) if a_v is None
                    else "quantkit drafted nothing"})
    else:
        # all prompts, and the trained ones apart: there the drafter knows the continuations, so a drafter vLLM fed
        # wrongly would lose the most
        ok = abs(a_v - a_q) <= ACCEPTANCE and (None in trained.values() or
                                               abs(trained["vllm"] - trained["quantkit_as_stored"]) <= ACCEPTANCE)
        out.append({"what": what, "ok": ok,
                    "detail": f"all prompts: vLLM {a_v:.3f}, quantkit {a_q:.3f}; trained prompts: vLLM "
                              f"{_f(trained['vllm'])}, quantkit {_f(trained['quantkit_as_stored'])} (quantkit drafting "
                              f"with the layer as stored; target within {ACCEPTANCE} on both)"})
    s = d.get("served")
    if s is not None:
        out.append({"what": "the vLLM CPU line export printed", "ok": bool(s["ok"]),
                    "detail": (f"starts in {s['start_seconds']:.0f} s and answers over the OpenAI API; greedy tokens "
                               f"{'the same as' if s.get('same_as_offline') else 'NOT the same as'} the offline run"
                               if s["ok"] else f"fails: {s.get('error')}")})
    return out


def _f(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def _tok_s(steps: float, seconds: float) -> float | None:
    return steps / seconds if seconds > 0 else None


def vllm_speed(v: dict[str, Any], new_tokens: int, prompt_tokens: list[int]) -> tuple[float | None, float | None]:
    """(prefill tok/s, decode tok/s) of a worker's timed runs: a 1-token run is the prefill, an N-token run's
    excess over it the N - 1 decode steps."""
    if not v.get("ok"):
        return None, None
    pre = sum(v["prefill_seconds"])
    dec = sum(t - p for t, p in zip(v["total_seconds"], v["prefill_seconds"], strict=True))
    return _tok_s(sum(prompt_tokens), pre), _tok_s(len(prompt_tokens) * (new_tokens - 1), dec)


def render(d: dict[str, Any]) -> str:
    m, ck, pr = d["machine"], d["checkpoint"], d["prompts"]
    env = ", ".join(f"{k} {v}" for k, v in d["vllm_env"].items())
    tr = ck.get("training") or {}
    lines = [
        "# vLLM loads what `quantkit export vllm` writes",
        "",
        f"Command: `{d['command']}` (driver: `{d['driver']}`), {d['seconds'] / 60:.0f} min.",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['ram_gb']} GB RAM, quantkit's table {m['isa']}; load average "
        f"{m['load_avg_at_start']:.1f} at the start (other jobs shared the machine). Both engines ran with "
        f"{d['threads']} threads. vLLM's venv: {env}. {d['cpu_backend']['note']}.",
        "",
        f"Checkpoint: realistic shapes (hidden 2048, experts 512 wide, head 256), {ck['shape']['layers']} layers (one "
        f"Gated DeltaNet, one full attention), {ck['shape']['experts']} experts top-{ck['shape']['top_k']}, the test "
        "tokenizer's vocabulary, random weights, with an MTP layer trained on the model's own greedy continuations "
        f"(`quantkit tiny-model --realistic --mtp-layer --train-mtp`: {tr.get('options', {}).get('steps', '?')} "
        f"steps on {tr.get('pairs', 0):,} positions; top-1 agreement with the model on its training continuations "
        f"{_f(tr.get('train_agreement'), '.2f')}, on held-out ones {_f(tr.get('held_out_after'), '.2f')}). "
        f"quantkit's folder: `quantkit quantize --scheme {ck['scheme']}` of it (routed experts int4 g128; attention, "
        "linear attention, shared expert, lm_head int8).",
        "",
        f"Prompts: {pr['count']} chat turns ({pr['kinds'].count('trained')} drawn from the MTP layer's training "
        f"prompts, {pr['kinds'].count('held-out')} held out), {min(pr['prompt_tokens'])}-{max(pr['prompt_tokens'])} "
        f"tokens, {pr['new_tokens']} greedy tokens each (end of turn ignored). Teacher-forced: every position of "
        "each prompt + quantkit's continuation.",
        "",
        "## Targets",
        "",
        "| target | result | detail |",
        "| --- | --- | --- |",
    ]
    lines += [f"| {v['what']} | {'pass' if v['ok'] else 'FAIL'} | {v['detail']} |" for v in d["verdicts"]]
    q = d["quantization"]
    lines += ["", "## Each layout in vLLM CPU", "",
              "Teacher-forced against quantkit's folder: top-1 agreement and mean |d logprob| of each sequence's own "
              "token; where the top-1 differs, quantkit's log-probability gap between the two tokens (a near tie is "
              "small).", "",
              "| export | what `export vllm --target cpu` says | vLLM CPU | MoE backend | load s | top-1 agreement | "
              "mean abs d logprob | gap at disagreements (median / max) | greedy continuations identical |",
              "| --- | --- | --- | --- | ---: | ---: | ---: | --- | --- |"]
    for row in d["layouts"]:
        v = row["vllm"]
        says = f"refuses: {row['refused']}" if "refused" in row else "writes it, prints the vLLM CPU line"
        if v["ok"]:
            t, g = row["teacher"], row["greedy"]
            lines.append(f"| `--rest {row['rest']}` | {says} | loads | {_backend(v.get('backend'))} | "
                         f"{v['load_seconds']:.0f} | {t['top1_same']}/{t['positions']} ({t['top1_agreement']:.3f}) | "
                         f"{t['mean_abs_dlogprob']:.4f} | {_f(t['disagreement_gap_median'], '.3f')} / "
                         f"{_f(t['disagreement_gap_max'], '.3f')} | {g['identical']}/{g['prompts']} |")
        else:
            lines.append(f"| `--rest {row['rest']}`{' (written with ' + row['written_with'] + ')' if 'written_with' in row else ''} "
                         f"| {says} | fails ({v.get('stage')}): {v.get('error')} | {_backend(v.get('backend'))} | - | - "
                         "| - | - | - |")
    lines += [f"| quantization itself (quantkit, unquantized checkpoint against its folder) | - | - | - | - | "
              f"{q['top1_same']}/{q['positions']} ({q['top1_agreement']:.3f}) | {q['mean_abs_dlogprob']:.4f} | "
              f"{_f(q['disagreement_gap_median'], '.3f')} / {_f(q['disagreement_gap_max'], '.3f')} | - |"]
    lines += _greedy_side_by_side(d)
    lines += _mtp(d)
    lines += _speed(d)
    lines += _served(d)
    return "\n".join(lines) + "\n"


def _backend(name: str | None) -> str:
    """vLLM's name for the MoE kernel family it logged, with what it runs on."""
    return {"CPU": "'CPU' (Intel AMX)", "ZEN_CPU": "'ZEN_CPU' (AMD zentorch)"}.get(name or "", name or "-")


def _greedy_side_by_side(d: dict[str, Any]) -> list[str]:
    loaded = [r for r in d["layouts"] if r["vllm"]["ok"]]
    if not loaded:
        return []
    kinds = d["prompts"]["kinds"]
    shown = [kinds.index(k) for k in ("trained", "held-out") if k in kinds]
    out = ["", "## Greedy tokens side by side", "",
           f"The first {SHOWN_TOKENS} greedy token ids of one trained and one held-out prompt (a token that differs "
           "from quantkit's in **bold**); every prompt's tokens are in the JSON.", "",
           "| prompt | engine | tokens |", "| --- | --- | --- |"]
    for i in shown:
        ref = d["quantkit"]["tokens"][i][:SHOWN_TOKENS]
        out.append(f"| {i} ({kinds[i]}) | quantkit | {' '.join(map(str, ref))} |")
        for r in loaded:
            got = r["tokens"][i][:SHOWN_TOKENS]
            cells = [str(t) if j < len(ref) and t == ref[j] else f"**{t}**" for j, t in enumerate(got)]
            out.append(f"| {i} ({kinds[i]}) | vLLM `--rest {r['rest']}` | {' '.join(cells)} |")
    return out


def _mtp(d: dict[str, Any]) -> list[str]:
    m = d["mtp"]
    by = m["by_kind"]
    rows = [("vLLM CPU (`--rest bf16` export)", "vllm", m["vllm"].get("spec") if m["vllm"].get("ok") else None),
            ("quantkit, the layer as stored", "quantkit_as_stored", d["quantkit"]["mtp_as_stored"]),
            ("quantkit, its default (dense MTP matrices as int4 copies)", "quantkit", d["quantkit"]["mtp"])]
    tr = d["checkpoint"].get("training") or {}
    out = ["", "## The MTP drafter", "",
           f"Greedy decode of the same prompts drafting {m['draft']} token a step with the exported MTP layer; vLLM "
           "with prefix caching off (its CPU MTP path needs it). Acceptance: accepted / drafted.", "",
           "The layer was trained on the unquantized model's own continuations and learned those (top-1 agreement "
           f"{_f(tr.get('train_agreement'), '.2f')}) far better than it generalises (held-out "
           f"{_f(tr.get('held_out_after'), '.2f')}: a random model's next token is close to a hash of its context). "
           "quantkit's folder and the export are the quantized model, whose greedy path leaves those continuations "
           "within a few tokens, so the trained prompts accept far less than that and the held-out ones almost "
           "nothing, in both engines alike: the comparison is of the two engines running one drafter, not of the "
           "drafter's quality.", "",
           "| engine | trained prompts | held-out prompts | all | prompts whose greedy tokens are those without drafts |",
           "| --- | ---: | ---: | ---: | --- |"]
    for label, key, total in rows:
        k = by.get(key, {})
        cell = [f"{x['accepted']}/{x['drafted']} ({_f(x['acceptance'])})" if x else "-"
                for x in (k.get("trained"), k.get("held-out"))]
        if total is None:
            out.append(f"| {label} | - | - | failed: {m['vllm'].get('error')} | - |")
            continue
        same = m["same_as_without"] if key == "vllm" else total.get("same_as_without")
        out.append(f"| {label} | {cell[0]} | {cell[1]} | {total['accepted']}/{total['drafted']} "
                   f"({_f(acceptance(total))}) | {same['identical']}/{same['prompts'] if same else '-'} |")
    return out


def _speed(d: dict[str, Any]) -> list[str]:
    pr = d["prompts"]
    n = pr["new_tokens"]
    qk = d["quantkit"]
    out = ["", "## Speed on the same prompts", "",
           f"Single stream, {pr['count']} prompts one after another, {n} new tokens each, best effort on a shared "
           "machine (read the ratios within this run). quantkit: its own prefill and decode clocks. vLLM: a 1-token "
           "run of each prompt is its prefill, the N-token run's excess over it the N - 1 decode steps; prefix "
           "caching off so each run computes the prompt. Both engines ran each prompt once untimed first (a prompt "
           f"length's first-call costs), then {d.get('timed_runs', 1)} timed runs, the fastest kept per prompt: "
           "other jobs on the machine stall a run now and then.", "",
           "| engine | weights | prefill tok/s | decode tok/s | decode tok/s drafting with MTP |",
           "| --- | --- | ---: | ---: | ---: |"]
    q_pre = _tok_s(qk["plain"]["prompt_tokens"], qk["plain"]["prefill_seconds"])
    q_dec = _tok_s(qk["plain"]["decode_steps"], qk["plain"]["decode_seconds"])
    q_mtp = _tok_s(qk["mtp"]["decode_steps"], qk["mtp"]["decode_seconds"]) if qk["mtp"] else None
    out.append(f"| quantkit | its folder ({d['checkpoint']['scheme']}) | {_f(q_pre, '.1f')} | {_f(q_dec, '.1f')} | "
               f"{_f(q_mtp, '.1f')} |")
    mtp = d["mtp"]["vllm"]
    for row in d["layouts"]:
        pre, dec = vllm_speed(row["vllm"], n, pr["prompt_tokens"])
        if pre is None:
            continue
        with_mtp = vllm_speed(mtp, n, pr["prompt_tokens"])[1] if row["rest"] == "bf16" else None
        out.append(f"| vLLM CPU | export `--rest {row['rest']}` | {_f(pre, '.1f')} | {_f(dec, '.1f')} | "
                   f"{_f(with_mtp, '.1f')} |")
    return out


def _served(d: dict[str, Any]) -> list[str]:
    s = d.get("served")
    if s is None:
        return ["", "## The served line", "", "Not run (`--no-serve`, or export printed no vLLM CPU line)."]
    out = ["", "## The served line", "",
           "The line `quantkit export vllm --target cpu` printed, run as printed with the check venv's folder first "
           "on PATH (a port added), then one greedy completion of the first prompt over `/v1/completions`:", "",
           f"`{s['line']}`", ""]
    if s["ok"]:
        out.append(f"Up in {s['start_seconds']:.0f} s; its {len(s.get('tokens') or [])} tokens are "
                   f"{'the same as' if s.get('same_as_offline') else 'NOT the same as'} the offline MTP run's.")
    else:
        out.append(f"Failed: {s.get('error')} (log: `{Path(s['log']).name}` in the workdir).")
    return out
