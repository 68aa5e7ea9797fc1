"""`python -m benchmarks.mtp`: what speculative decoding with the MTP layer gains. Writes reports/bench-mtp.{md,json,png};
`--part oracle` or `--part trained` runs one part and keeps the other's rows from the report already there.

Oracle part, on a realistic-shape checkpoint with an MTP layer (real hidden, expert and head sizes; fewer layers and
experts; random weights). Random weights give an MTP layer that never agrees with the model, so the acceptance is
set instead: an oracle drafter runs the real MTP layer (its cost is paid) and then proposes the model's own greedy
continuation, a share 1 - acceptance of the drafts replaced by a wrong token (spread evenly: `OracleDrafter`).
For each draft count and acceptance, and for the default (`DraftPlan` choosing the count), greedy decode tok/s
(best of `reps`) beside decoding without drafts, in interleaved rounds; the greedy tokens are checked equal to the
run without drafts. Apart: the cost of a verify of T = 2..4 tokens against one decode step (median of `steps`
calls each).

Trained part, a real acceptance: the tests' tiny checkpoint with an MTP layer, written twice with the same seed,
once as is (a random layer) and once with its layer trained on the model's own greedy continuations
(quantkit.testing.mtp_train, the default `TrainOptions`), each quantized by `quantkit quantize`'s default recipe as a
user would. Greedy decode of held-out chat prompts (none the training drew) without drafts and with 1-3 drafts, in
interleaved rounds: acceptance (accepted / drafted), tok/s of the best round and its ratio to decoding without
drafts, and whether the greedy tokens are identical; the trained layer on the unquantized checkpoint too (what
quantizing the main model costs the acceptance). Where the oracle rows are in the report, the trained layer's
acceptance is also read off them as a realistic-shape speed-up estimate.

llama.cpp's MTP is not timed here: the GGUF export writes its NextN block and its MTP graph runs on it
(tests/export/test_export_gguf_llama.py), but llama-cpp-python binds neither llama-server's speculative loop nor the
call that chains a second draft (`llama_set_embeddings_nextn`, C++ only).
"""

from __future__ import annotations

import json
import math
import random
import statistics
import sys
import time
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch
import typer

from benchmarks.cli import guard_reports, run_command, shared
from benchmarks.cli import threads as resolve_threads
from quantkit.bench import write_reports
from quantkit.bench.engines import describe_machine
from quantkit.checkpoint.draft import DRAFT_ROWS
from quantkit.checkpoint.reader import Checkpoint
from quantkit.cli.options import MAX_COUNT
from quantkit.errors import QuantkitError
from quantkit.fileio import read_json_bounded
from quantkit.quantize.run import QuantizeOptions, run_quantize
from quantkit.recipe import Recipe, build_recipe
from quantkit.runtime import SamplingParams, load_model
from quantkit.runtime.batch_drafts import DraftPlan
from quantkit.testing.mtp_train import EVAL_SEED, TrainOptions, chat_prompts
from quantkit.testing.tiny import SIDECAR, make_tiny_model
from quantkit.threads import torch_threads

ACCEPTANCES = (0.5, 0.6, 0.7, 0.8, 0.88, 0.95, 1.0)
DRAFTS = (1, 2, 3)
TARGET_SPEEDUP = 1.5  # at acceptance 0.88 with one draft token
TARGET_VERIFY = 1.3  # a 2-token verify against one decode step
PARTS = ("oracle", "trained")
NEW_TOKENS = 96  # greedy tokens per generation: about 50 one-token drafts, the realised share within 0.02 of the set one


class OracleDrafter:
    """The MTP layer's draft (its cost paid), then the reference token instead, replaced by a wrong one on a share
    1 - acceptance of the drafts. Which drafts: in each block of BLOCK drafts, floor((j + 1) B w + u) -
    floor(j B w + u) of them (block j, w = 1 - acceptance, phase u set by `seed`) at places a seeded shuffle picks.
    So the first n drafts are on the set share at every block's end (within one draft where B w is not whole:
    0.88 gives 6 wrong of every 50), with no period for a verify of several drafts to fall in step with (an even
    schedule at 0.5 rejects every second draft: two drafts a verify then accept exactly one each time), and the
    wrong drafts fall as independent draws would within a block. Independent draws over the whole run (the
    textbook model) left the realised acceptance of a 48-token run 0.05 off either way, and the best of several
    runs picked the lucky ones."""

    BLOCK = 50  # about the drafts one generation of NEW_TOKENS makes with one draft a verify

    def __init__(self, real: Any, seq: list[int], acceptance: float, seed: int = 0):
        self.real, self.seq, self.acceptance = real, seq, acceptance
        self.wrong = Fraction(1.0 - acceptance).limit_denominator(1000) * self.BLOCK
        self.u = (seed * 0.3183098861837907) % 1.0  # 1/pi: a phase per seed
        self.rng = random.Random(seed)
        self.calls, self.block, self.places = 0, -1, frozenset()

    def __call__(self, model: Any, tokens: list[int], hidden: torch.Tensor, cache: Any) -> tuple[int, Any]:
        _, h = self.real(model, tokens, hidden, cache)
        pos = cache.n + 1  # pair i carries the token at position i + 1: its draft is position n + 1
        want = self.seq[pos] if pos < len(self.seq) else 0
        j, i = divmod(self.calls, self.BLOCK)
        self.calls += 1
        if j != self.block:
            n = math.floor((j + 1) * self.wrong + self.u) - math.floor(j * self.wrong + self.u)
            self.block, self.places = j, frozenset(self.rng.sample(range(self.BLOCK), n))
        if i in self.places:
            want = (want + 1) % model.vocab
        return want, h


def checkpoint(workdir: Path, layers: int, experts: int, vocab: int, log: Any) -> Path:
    src = workdir / f"realistic-mtp-{layers}x{experts}-v{vocab}"
    if not (src / "config.json").is_file():
        log(f"writing the realistic-shape checkpoint with an MTP layer {src}")
        make_tiny_model(src, realistic=True, layers=layers, experts=experts, top_k=8, vocab=vocab, mtp=True,
                        overwrite=True)
    return src


def decode(rt: Any, prompt: list[int], n: int, draft: int | None, reps: int) -> tuple[float, list[int], dict | None]:
    """Best greedy decode tok/s of `reps`, the tokens, the draft counts (draft None: the runtime's plan)."""
    rt.set_mtp(draft)
    best, toks, stats = 0.0, [], None
    for _ in range(reps):
        resp = None
        for e in rt.generate_ids(prompt, SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True),
                                 thinking=False, stop_ids=set()):
            resp = e.response or resp
        if resp.generation_tps > best:
            best, toks, stats = resp.generation_tps, list(resp.token_ids), resp.mtp
    return best, toks, stats


def verify_costs(rt: Any, prompt: list[int], steps: int) -> dict[str, float]:
    """Median seconds of one decode step (the route's own) and of verifies of 2..4 tokens, each at the same
    position (every token kept, the KV's fill set back after each call)."""
    m = rt.model
    out: dict[str, float] = {}
    with torch.inference_mode():
        cache = m.new_cache(len(prompt) + 16)
        m.forward(prompt, cache)
        n0 = cache.n
        for t in (1, 2, 3, 4):
            times = []
            for i in range(steps):
                toks = [(prompt[-1] + i + j) % 700 for j in range(t)]
                t0 = time.perf_counter()
                if t == 1:
                    m.forward(toks, cache)
                    cache.n = n0  # attention reads up to n only; the linear states drift, which costs the same
                else:
                    m.forward(toks, cache, all_logits=True, keep_positions=True)
                    cache.rewind(n0 + t)  # all kept, as a step keeps its token: a verify's own cost
                    cache.n = n0
                times.append(time.perf_counter() - t0)
            out[str(t)] = statistics.median(times)
    return out


def run_oracle(workdir: Path, layers: int = 4, experts: int = 64, vocab: int = 248320, prompt_len: int = 64,
               new_tokens: int = NEW_TOKENS, reps: int = 2, rounds: int = 2, steps: int = 20, threads: int | None = None,
               draft_vocab: int = DRAFT_ROWS, log: Any = print) -> dict[str, Any]:
    """The oracle part on the realistic-shape checkpoint (module docstring): the report's data, less "trained"."""
    t_all = time.perf_counter()
    if threads:
        torch.set_num_threads(threads)
    src = checkpoint(workdir, layers, experts, vocab, log)
    rec = build_recipe()  # `quantkit quantize`'s default, as bench engines and a user run it
    rt = load_model(src, recipe=rec.name, verify="quick")
    if rt.model.mtp is None:
        raise RuntimeError(f"{src} has no MTP layer")
    rt.model.mtp.draft_rows = draft_vocab
    head = rt.model.mtp.head(rt.model)
    real = rt.model.mtp.draft
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 700, (prompt_len,), generator=g).tolist()
    base: dict[str, Any] = {"tok_s": 0.0, "rounds": []}
    rows: dict[str, dict[str, Any]] = {}
    auto: dict[float, dict[str, Any]] = {}
    plans: dict[float, DraftPlan] = {}
    for rnd in range(rounds):
        log(f"round {rnd + 1}/{rounds}: no drafts")
        tps, ref, _ = decode(rt, prompt, new_tokens, 0, reps)
        base.update(tok_s=max(base["tok_s"], tps), tokens=ref)
        base["rounds"].append(round(tps, 2))
        for k in DRAFTS:
            for a in ACCEPTANCES:
                rt.model.mtp.draft = OracleDrafter(real, prompt + ref, a, seed=rnd)
                tps, toks, stats = decode(rt, prompt, new_tokens, k, reps)
                key = f"{k}@{a}"
                r = rows.setdefault(key, {"draft": k, "acceptance": a, "tok_s": 0.0, "rounds": []})
                r["rounds"].append(round(tps, 2))
                if tps > r["tok_s"]:
                    r.update(tok_s=tps, drafted=stats["drafted"], accepted=stats["accepted"])
                r["same_tokens"] = r.get("same_tokens", True) and toks == ref
        for a in ACCEPTANCES:  # the default: the plan chooses the count, keeping what it measured across runs
            rt.model.mtp.draft = OracleDrafter(real, prompt + ref, a, seed=rnd)
            plan = rt.draft_plan = plans.setdefault(a, DraftPlan())
            tps, toks, stats = decode(rt, prompt, new_tokens, None, reps)
            r = auto.setdefault(a, {"acceptance": a, "tok_s": 0.0, "rounds": []})
            r["rounds"].append(round(tps, 2))
            if tps > r["tok_s"]:
                r.update(tok_s=tps, drafted=stats["drafted"], accepted=stats["accepted"])
            r.update(same_tokens=r.get("same_tokens", True) and toks == ref, draft=plan.lone(), tried=plan.tried())
        rt.model.mtp.draft = real
    rt.set_mtp(0)
    costs = verify_costs(rt, prompt, steps)
    for r in [*rows.values(), *auto.values()]:
        r["speedup"] = r["tok_s"] / base["tok_s"] if base["tok_s"] else float("nan")
        r["measured_acceptance"] = r["accepted"] / r["drafted"] if r.get("drafted") else 0.0
    t = rt.model.cfg.text
    data = {
        "command": f"python -m benchmarks.mtp --layers {layers} --experts {experts} --vocab {vocab}"
                   + (f" --draft-vocab {draft_vocab}" if draft_vocab != DRAFT_ROWS else "")
                   + (f" --new-tokens {new_tokens}" if new_tokens != NEW_TOKENS else "")
                   + (f" --reps {reps}" if reps != 2 else "") + (f" --rounds {rounds}" if rounds != 2 else "")
                   + (f" --threads {threads}" if threads else ""),
        "draft_head": {"rows": head.rows, "top_from": head.tail, "reduced": head.reduced, "ranked": head.ranked},
        "machine": describe_machine(), "threads": torch.get_num_threads(), "route": rt.route()["name"],
        "shape": {"layers": t.num_hidden_layers, "experts": t.num_experts, "top_k": t.num_experts_per_tok,
                  "hidden": t.hidden_size, "vocab": t.vocab_size, "recipe": f"{rec.name} ({rec.description})"},
        "prompt_tokens": prompt_len, "new_tokens": new_tokens, "reps": reps, "rounds": rounds,
        "baseline_tok_s": base["tok_s"], "baseline_rounds": base["rounds"], "rows": list(rows.values()),
        "auto_rows": list(auto.values()),
        "verify_s": costs, "verify_ratio": {k: v / costs["1"] for k, v in costs.items()},
        "mtp_bytes": rt.model.mtp.nbytes(), "seconds": time.perf_counter() - t_all,
    }
    at = rows.get(f"1@{0.88}")
    data["targets"] = {
        "speedup_1_draft_at_0.88": {"target": TARGET_SPEEDUP, "got": at["speedup"] if at else None,
                                    "by_round": [x / b for x, b in zip(at["rounds"], base["rounds"], strict=True)]
                                    if at else []},
        "verify_2_vs_step": {"target": TARGET_VERIFY, "got": data["verify_ratio"]["2"]},
        "greedy_identical": all(r["same_tokens"] for r in [*rows.values(), *auto.values()]),
    }
    return data


# ---- the trained part: a real acceptance ----
TRAINED_SHAPE = {"layers": 4, "experts": 8, "top_k": 2, "hidden": 64, "intermediate": 32}  # the tests' tiny shape
TRAINED_PROMPTS = 24  # held-out chat prompts each configuration decodes
UNQUANTIZED = "bf16 (unquantized)"


def trained_folders(workdir: Path, train: TrainOptions, recipe: Recipe, log: Any) -> dict[str, Path]:
    """The tiny checkpoint with an MTP layer as written (random layer) and with its layer trained, each quantized
    with `recipe`; written again every run (seeded: the same bytes)."""
    out: dict[str, Path] = {}
    for name, opts in (("untrained", None), ("trained", train)):
        src = workdir / f"tiny-mtp-{name}"
        log(f"writing {src}" + (f" (training its MTP layer, {train.steps} steps)" if opts else ""))
        make_tiny_model(src, mtp=True, seed=train.seed, overwrite=True, train_mtp=opts, **TRAINED_SHAPE)
        q = workdir / f"tiny-mtp-{name}-{recipe.name}"
        with Checkpoint.open(src) as ck:
            run_quantize(ck, q, QuantizeOptions(recipe, mode="overwrite"))
        out[f"{name}-bf16"], out[f"{name}-quantized"] = src, q
    return out


def decode_prompts(rt: Any, prompts: list[list[int]], n: int, draft: int) -> dict[str, Any]:
    """Greedy decode of `n` tokens after each prompt with `draft` drafts per verify: the tokens, decode steps and
    seconds (what generation tok/s divides), the draft counts summed."""
    rt.set_mtp(draft)
    out: dict[str, Any] = {"tokens": [], "steps": 0, "seconds": 0.0, "drafted": 0, "accepted": 0}
    for ids in prompts:
        resp = None
        for e in rt.generate_ids(ids, SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True),
                                 thinking=False, stop_ids=set()):
            resp = e.response or resp
        out["tokens"].append(list(resp.token_ids))
        out["steps"] += max(0, resp.generation_tokens - 1)
        out["seconds"] += resp.decode_seconds
        if resp.mtp is not None:
            out["drafted"] += resp.mtp["drafted"]
            out["accepted"] += resp.mtp["accepted"]
    rt.set_mtp(0)
    return out


def measure_layer(folder: Path, n_prompts: int, new_tokens: int, rounds: int, seed: int, copies: bool = True
                  ) -> dict[str, Any]:
    """Greedy decode of held-out prompts without drafts and with 1-3 drafts, in interleaved rounds: tok/s of the
    best round, acceptance (accepted / drafted), whether the tokens equal those without drafts. `copies`: the
    MTP layer's dense matrices as the runtime holds them (int4), else as stored."""
    rt = load_model(folder, verify="quick", mtp_copies=copies)
    prompts = chat_prompts(rt, n_prompts, seed + EVAL_SEED)  # never among the training prompts
    best: dict[int, float] = {}
    runs: dict[int, dict[str, Any]] = {}
    same = dict.fromkeys(DRAFTS, True)
    for _ in range(rounds):
        for k in (0, *DRAFTS):
            r = decode_prompts(rt, prompts, new_tokens, k)
            tps = r["steps"] / r["seconds"] if r["seconds"] else 0.0
            if k == 0:
                ref = r["tokens"]
            else:
                same[k] = same[k] and r["tokens"] == ref
            if tps > best.get(k, -1.0):
                best[k], runs[k] = tps, r
    rows = [{"draft": k, "drafted": runs[k]["drafted"], "accepted": runs[k]["accepted"],
             "acceptance": runs[k]["accepted"] / runs[k]["drafted"] if runs[k]["drafted"] else 0.0,
             "tok_s": best[k], "speedup": best[k] / best[0] if best[0] else float("nan"),
             "same_tokens": same[k]} for k in DRAFTS]
    return {"baseline_tok_s": best[0], "rows": rows}


def run_trained(workdir: Path, new_tokens: int = NEW_TOKENS, rounds: int = 2, prompts: int = TRAINED_PROMPTS,
                train: TrainOptions | None = None, log: Any = print) -> dict[str, Any]:
    """The trained part (module docstring): the report's "trained" section."""
    t_all = time.perf_counter()
    train = train or TrainOptions()
    rec = build_recipe()  # `quantkit quantize`'s default
    with torch_threads(1):  # a tiny model's matmuls: thread hand-offs cost more than they save
        folders = trained_folders(workdir, train, rec, log)
        side = json.loads((folders["trained-bf16"] / SIDECAR).read_text())
        layers = []
        for key, layer, recipe, copies in (("untrained-quantized", "untrained (random)", rec.name, True),
                                           ("trained-quantized", "trained", rec.name, True),
                                           ("trained-quantized", "trained", rec.name, False),
                                           ("trained-bf16", "trained", UNQUANTIZED, True)):
            log(f"decoding {prompts} held-out prompts with the {layer} MTP layer, {recipe}"
                + ("" if copies else ", its matrices as stored"))
            layers.append({"layer": layer, "recipe": recipe, "copies": copies,
                           **measure_layer(folders[key], prompts, new_tokens, rounds, train.seed, copies)})
    return {"command": "python -m benchmarks.mtp --part trained"
                       + (f" --new-tokens {new_tokens}" if new_tokens != NEW_TOKENS else "")
                       + (f" --rounds {rounds}" if rounds != 2 else ""),
            "machine": describe_machine(), "threads": 1, "shape": TRAINED_SHAPE, "training": side["mtp_trained"],
            "recipe": {"name": rec.name, "description": rec.description},
            "prompts": prompts, "new_tokens": new_tokens, "rounds": rounds, "layers": layers,
            "greedy_identical": all(r["same_tokens"] for x in layers for r in x["rows"]),
            "seconds": time.perf_counter() - t_all}


def previous(reports: Path) -> dict[str, Any]:
    """The report this bench wrote last (its parts not run again are kept), or nothing."""
    try:
        d = read_json_bounded(reports / "bench-mtp.json")
    except QuantkitError:
        return {}
    return d if isinstance(d, dict) else {}


def run(reports: Path, workdir: Path, layers: int = 4, experts: int = 64, vocab: int = 248320, prompt_len: int = 64,
        new_tokens: int = NEW_TOKENS, reps: int = 2, rounds: int = 2, steps: int = 20, threads: int | None = None,
        draft_vocab: int = DRAFT_ROWS, parts: tuple[str, ...] = PARTS, log: Any = print) -> dict[str, Any]:
    """Run `parts` ("oracle", "trained") and write reports/bench-mtp.{md,json} (and .png with the oracle part);
    a part not run keeps its data from the report already there."""
    if not parts or not set(parts) <= set(PARTS):
        raise QuantkitError(f"bench mtp parts: {', '.join(PARTS)}")
    old = previous(reports) if set(parts) != set(PARTS) else {}
    workdir.mkdir(parents=True, exist_ok=True)
    if "oracle" in parts:
        data = run_oracle(workdir, layers, experts, vocab, prompt_len, new_tokens, reps, rounds, steps, threads,
                          draft_vocab, log)
    else:
        data = {k: v for k, v in old.items() if k != "trained"} if "rows" in old else {}
    if "trained" in parts:
        data["trained"] = run_trained(workdir, new_tokens, rounds, log=log)
    elif "trained" in old:
        data["trained"] = old["trained"]
    data.setdefault("command", data.get("trained", {}).get("command", "python -m benchmarks.mtp"))
    reports.mkdir(parents=True, exist_ok=True)
    if "oracle" in parts:
        plot(data, reports / "bench-mtp.png")
    write_reports(reports, "bench-mtp", data, render(data))
    return data


def plot(d: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for k in DRAFTS:
        pts = sorted((r["acceptance"], r["tok_s"]) for r in d["rows"] if r["draft"] == k)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"MTP, {k} draft{'s' if k > 1 else ''}")
    pts = sorted((r["acceptance"], r["tok_s"]) for r in d.get("auto_rows", []))
    if pts:
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="s", color="black", label="MTP, auto (the default)")
    ax.axhline(d["baseline_tok_s"], color="black", linestyle="--", label="no MTP")
    ax.set_xlabel("draft acceptance (oracle drafter)")
    ax.set_ylabel("decode tok/s")
    ax.set_title("quantkit 4-bit decode with MTP speculative decoding")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draft_head_line(d: dict[str, Any]) -> str:
    h, v = d.get("draft_head", {}), d["shape"]["vocab"]
    if not h.get("reduced"):
        return f"Draft head: the whole lm_head ({v:,} ids)."
    rows, top = h["rows"], h["top_from"]
    which = (f"the {rows:,} ids most frequent in text of the kinds an agent writes (checkpoint/draft.py's ranking)"
             if h.get("ranked") else f"ids 0-{rows - 1:,}")
    share = ("these ids hold 95-99% of the tokens of English, code, JSON, Chinese and other languages' text"
             if h.get("ranked") else "the lowest ids hold 91-96% of the tokens of English, code and JSON text but 46% "
             "of Chinese and 66% of other languages' (the ranked ids the runtime drafts from on this vocabulary "
             "now hold 95-99% of each)")
    return (f"Draft head: {which} and {top:,}-{v - 1:,} of the lm_head ({rows + v - top:,} of {v:,} rows, "
            "runtime/model/draft_head.py). The oracle's drafts ignore which ids the head scores; a real drafter's "
            "acceptance is lower by the share of target tokens outside them, which reports/draft-vocab/ measures "
            f"with Qwen3.5's tokenizer on held-out text: {share}.")


def render(d: dict[str, Any]) -> str:
    out = ["# MTP speculative decoding: decode tok/s against draft acceptance", ""]
    if "rows" in d:
        out += render_oracle(d)
    if "trained" in d:
        out += render_trained(d["trained"], d.get("rows"))
    return "\n".join(out)


def render_oracle(d: dict[str, Any]) -> list[str]:
    m, s = d["machine"], d["shape"]
    out = [f"Command: `{d['command']}` ({d['seconds']:.0f} s). Machine: {m['cpu']}, {m['cores']} cores, "
           f"{m['ram_gb']} GB RAM, instruction sets {m['isa']}, torch {m['torch']}, {d['threads']} threads, route "
           f"{d['route']}; load average at start {m['load_avg_at_start']:.1f}.", "",
           f"Checkpoint: realistic shapes (hidden {s['hidden']}, vocab {s['vocab']:,}) with {s['layers']} layers of "
           f"{s['experts']} experts, top-{s['top_k']}, and an MTP layer ({d['mtp_bytes'] / 1e6:.0f} MB as the runtime "
           "holds it: its fc, attention and shared expert as int4 copies, the draft head's rows too; the trained "
           f"part below measures what that costs in acceptance), random weights, {s['recipe']}. Greedy decode of "
           f"{d['new_tokens']} tokens after a {d['prompt_tokens']}-token prompt, best of {d['reps']} in each of "
           f"{d['rounds']} rounds.", "",
           "Random weights give an MTP layer that never agrees with the model, so an oracle drafter sets the "
           "acceptance: it runs the real MTP layer (its cost is paid), then proposes the model's own continuation, "
           "a share 1 - acceptance of its drafts wrong: that share of every 50 drafts (6 at 0.88; 0.95 alternates "
           "2 and 3), at places a seeded shuffle picks (independent draws left a run's share 0.05 off either way, "
           "and the best of several runs kept the lucky ones; an even schedule falls in step with verifies of "
           "several drafts). A real acceptance is measured apart, on a tiny model "
           "whose MTP layer was trained on its own greedy continuations (the last section, `--part trained`). "
           "llama.cpp's MTP is not beside it: quantkit's GGUF export writes the NextN block its MTP graph reads, "
           "and the graph runs on it (tests/export/test_export_gguf_llama.py drafts through llama-cpp-python's C API, "
           "as quantkit's MTP layer does), but the binding has neither llama-server's speculative loop nor the "
           "call that chains a second draft (`llama_set_embeddings_nextn` is C++ only), so llama.cpp's MTP decode "
           "speed is not measured here; `llama-server --spec-type draft-mtp` on the exported GGUF is the "
           "comparison to run.", "",
           draft_head_line(d), "",
           f"No MTP: **{d['baseline_tok_s']:.1f} tok/s**.", "",
           "| drafts | acceptance | decode tok/s | vs no MTP | accepted / drafted | same greedy tokens |",
           "|---:|---:|---:|---:|---:|---|"]
    for r in sorted(d["rows"], key=lambda r: (r["draft"], r["acceptance"])):
        out.append(f"| {r['draft']} | {r['acceptance']:.2f} | {r['tok_s']:.1f} | {r['speedup']:.2f}x | "
                   f"{r.get('accepted', 0)} / {r.get('drafted', 0)} | {'yes' if r['same_tokens'] else 'NO'} |")
    if d.get("auto_rows"):
        out += ["", "The default (no `--mtp`): the runtime's plan times steps of each shape it runs, tries more drafts "
                "where they would pay at the last shape's price, and takes the count with the most tokens per second "
                "at the acceptance measured (runtime/batch_drafts.py, `DraftPlan`); one plan per acceptance, kept "
                "across its runs as a chat session keeps it:", "",
                "| acceptance | decode tok/s | vs no MTP | drafts kept (tried) | accepted / drafted | same greedy tokens |",
                "|---:|---:|---:|---|---:|---|"]
        for r in sorted(d["auto_rows"], key=lambda r: r["acceptance"]):
            kept = "none (off)" if r["draft"] == 0 else str(r["draft"])
            out.append(f"| {r['acceptance']:.2f} | {r['tok_s']:.1f} | {r['speedup']:.2f}x | {kept} "
                       f"({', '.join(map(str, r['tried']))}) | {r.get('accepted', 0)} / {r.get('drafted', 0)} | "
                       f"{'yes' if r['same_tokens'] else 'NO'} |")
    out += ["", "![decode tok/s against acceptance](bench-mtp.png)", "",
            "A verify of T tokens against one decode step (median seconds; one step runs the route's own path, a "
            "verify the T-token path whose logits equal T steps bit for bit, in the kernel's stack on a stack "
            "route):", "",
            "| tokens | seconds | vs one step |", "|---:|---:|---:|"]
    for t, sec in d["verify_s"].items():
        out.append(f"| {t} | {sec * 1e3:.1f} ms | {d['verify_ratio'][t]:.2f}x |")
    tg = d["targets"]
    sp, vr = tg["speedup_1_draft_at_0.88"], tg["verify_2_vs_step"]
    out += ["", "## Targets", "",
            f"- one draft at acceptance 0.88 at least {sp['target']}x decoding without MTP: "
            f"**{'met' if sp['got'] and sp['got'] >= sp['target'] else 'MISSED'}**, {sp['got']:.2f}x"
            + (f" (best against best; round by round, each against its own run without drafts: "
               f"{', '.join(f'{x:.2f}x' for x in sp['by_round'])})" if sp.get("by_round") else ""),
            f"- a 2-token verify at most {vr['target']}x one decode step: "
            f"**{'met' if vr['got'] <= vr['target'] else 'MISSED'}**, {vr['got']:.2f}x",
            f"- greedy output identical with and without drafts: **{'met' if tg['greedy_identical'] else 'MISSED'}**",
            ""]
    return out


def oracle_speedup(rows: list[dict[str, Any]], draft: int, acceptance: float) -> float | None:
    """The oracle rows' speed-up at a measured acceptance (accepted / drafted) for `draft` drafts, interpolated
    linearly between the two rows around it; None outside their range."""
    pts = sorted((r["measured_acceptance"], r["speedup"]) for r in rows if r["draft"] == draft)
    for (a0, s0), (a1, s1) in zip(pts, pts[1:], strict=False):
        if a0 <= acceptance <= a1:
            return s0 if a1 == a0 else s0 + (s1 - s0) * (acceptance - a0) / (a1 - a0)
    return None


def weights_label(x: dict[str, Any]) -> str:
    """A trained-part row's weights: the recipe, and whether its MTP layer's dense matrices were held as stored."""
    return x["recipe"] + ("" if x.get("copies", True) else "; MTP fc, attention, shared expert as stored")


def render_trained(t: dict[str, Any], oracle: list[dict[str, Any]] | None) -> list[str]:
    m, s, tr = t["machine"], t["shape"], t["training"]
    o = tr["options"]
    out = ["## A trained MTP layer: a real acceptance", "",
           f"Command: `{t['command']}` ({t['seconds']:.0f} s, training included). Machine: {m['cpu']}, "
           f"{m['cores']} cores, torch {m['torch']}, {t['threads']} thread; load average at start "
           f"{m['load_avg_at_start']:.1f}.", "",
           f"Checkpoint: the tests' tiny shape (hidden {s['hidden']}, {s['layers']} layers of {s['experts']} experts, "
           f"top-{s['top_k']}, random weights) with an MTP layer trained by self-distillation "
           "(quantkit.testing.mtp_train, `quantkit tiny-model OUT --mtp-layer --train-mtp`): the model's own greedy "
           f"continuations of {o['prompts'] - o['held_out']} seeded chat prompts ({tr['pairs']:,} positions, "
           f"{o['new_tokens']} new tokens each), only `mtp.*` trained, teacher-forced on the model's final-normed "
           f"hidden states, {o['steps']} steps ({tr['seconds']:.0f} s on one thread, data included); its top-1 "
           f"agreement with the model over {o['held_out']} held-out prompts and their continuations went from "
           f"{tr['held_out_before']:.2f} to {tr['held_out_after']:.2f}. Quantized by `quantkit quantize`'s default "
           f"recipe, as a user would ({t['recipe']['name']}: {t['recipe']['description']}; the MTP layer's tensors "
           "by the same roles); the same checkpoint with its random MTP layer beside it. Greedy decode of "
           f"{t['new_tokens']} tokens after each of {t['prompts']} chat prompts none of the training drew, best "
           f"of {t['rounds']} rounds.", "",
           "| MTP layer | weights | drafts | accepted / drafted | acceptance | decode tok/s | vs no MTP | same greedy "
           "tokens |", "|---|---|---:|---:|---:|---:|---:|---|"]
    for x in t["layers"]:
        w = weights_label(x)
        out.append(f"| {x['layer']} | {w} | 0 | | | {x['baseline_tok_s']:.0f} | 1.00x | |")
        for r in x["rows"]:
            out.append(f"| {x['layer']} | {w} | {r['draft']} | {r['accepted']} / {r['drafted']} | "
                       f"**{r['acceptance']:.2f}** | {r['tok_s']:.0f} | {r['speedup']:.2f}x | "
                       f"{'yes' if r['same_tokens'] else 'NO'} |")
    trained = [x for x in t["layers"] if x["layer"] == "trained" and x.get("copies", True)]
    q = next((x for x in trained if x["recipe"] != UNQUANTIZED), None)
    bf = next((x for x in trained if x["recipe"] == UNQUANTIZED), None)
    kept = next((x for x in t["layers"] if x["layer"] == "trained" and not x.get("copies", True)), None)
    step_ms = 1e3 / q["baseline_tok_s"] if q and q["baseline_tok_s"] else float("nan")
    out += ["", "Greedy output identical with and without drafts, the trained drafter's included (drafts accepted, "
            f"and rolled back where rejected): **{'met' if t['greedy_identical'] else 'MISSED'}**.", "",
            f"The tok/s ratio is this tiny model's own: one decode step of it is a single kernel call of "
            f"{step_ms:.2f} ms, and a draft and a verify each add Python bookkeeping of that order (the caches' "
            "trails and rewinds), so the ratio weighs per-call costs more than the weights a "
            "step reads, unlike the real model's. What carries over is the acceptance."]
    if q and bf:
        out[-1] += (" The layer learned from the bf16 model; quantized, the main model's greedy tokens may differ "
                    f"from those: with one draft, acceptance {q['rows'][0]['acceptance']:.2f} quantized against "
                    f"{bf['rows'][0]['acceptance']:.2f} unquantized.")
    if q and kept:
        out += ["", "The runtime holds the MTP layer's int8 or bf16 fc, attention and shared expert as int4 copies "
                "(checkpoint/draft.py `layer_copy_spec`: the layer only drafts, and those matrices are most of what a draft "
                "reads besides its head); the row marked \"as stored\" drafts with them as the checkpoint stores them. "
                "With one draft, acceptance " + " against ".join(
                    f"{x['rows'][0]['accepted']} / {x['rows'][0]['drafted']} ({x['rows'][0]['acceptance']:.3f}) "
                    + ("as int4" if x is q else "as stored") for x in (q, kept))
                + "; with two, " + " against ".join(
                    f"{x['rows'][1]['acceptance']:.3f}" for x in (q, kept)) + "."]
    if oracle and q:
        est = [(r["draft"], r["acceptance"], oracle_speedup(oracle, r["draft"], r["acceptance"])) for r in q["rows"]]
        parts = [f"{k} draft{'s' if k > 1 else ''} at {a:.2f}: " + (f"{e:.2f}x" if e is not None else "outside them")
                 for k, a, e in est]
        out += ["", "At these acceptances (the trained layer, quantized), the realistic-shape oracle rows above give, "
                "interpolated over their accepted / drafted: " + "; ".join(parts) + " (an estimate: the oracle's "
                "rejections are spread evenly, a real layer's fall where the text is hard)."]
    return out + [""]


def cli(
    reports: Path = shared("reports", Path("reports")),
    workdir: Path = shared("workdir", Path("/tmp/quantkit-bench")),
    layers: int = shared("layers", 4),
    experts: int = shared("experts", 64),
    vocab: int = shared("vocab", 248320),
    new_tokens: int = shared("new_tokens", NEW_TOKENS),
    reps: int = shared("reps", 2),
    rounds: int = shared("rounds", 2),
    threads: int = shared("threads", None),
    draft_vocab: int = typer.Option(None, "--draft-vocab", min=0, max=MAX_COUNT, show_default=False,
                                    help="ids the draft head scores besides the top ones (Qwen3.5's most frequent "
                                         "at the default, else the lowest), 0: all (default: the runtime's)"),
    part: str = typer.Option("all", "--part", help="all; oracle: the realistic-shape checkpoint with an oracle "
                             "drafter; trained: a tiny model whose MTP layer is trained first (a real acceptance). "
                             "A part not run keeps its rows from the report already there"),
) -> None:
    """MTP speculative decoding: decode tok/s against draft acceptance (an oracle drafter), a verify's cost, and the
    acceptance of an MTP layer trained on its own model (a tiny one)."""
    if part not in ("all", *PARTS):
        raise QuantkitError(f"--part {part!r}: use all, {', '.join(PARTS)}")
    guard_reports(reports, "mtp")
    n = resolve_threads(threads)
    d = run(reports, workdir, layers, experts, vocab, new_tokens=new_tokens, reps=reps, rounds=rounds, threads=n,
            parts=PARTS if part == "all" else (part,), **({} if draft_vocab is None else {"draft_vocab": draft_vocab}))
    for x in d.get("trained", {}).get("layers", []) if part != "oracle" else []:
        print(f"{x['layer']} MTP layer, {weights_label(x)}: acceptance "
              + ", ".join(f"{r['acceptance']:.2f} ({r['draft']} draft{'s' if r['draft'] > 1 else ''})"
                          for r in x["rows"]))
    secs = (d["seconds"] if part != "trained" else 0) + (d["trained"]["seconds"] if part != "oracle" else 0)
    print(f"wrote {reports / 'bench-mtp.md'} ({secs:.0f} s)")


def main(argv: list[str] | None = None) -> int:
    return run_command(cli, argv, "mtp")


if __name__ == "__main__":
    sys.exit(main())
