"""vLLM's side of the vLLM check (benchmarks/vllm_check.py), run by path with the check venv's python:
`PYTHON benchmarks/vllm_worker.py JOB.json OUT.json`. It imports vLLM and the standard library only (quantkit is
not installed in that venv), loads one folder with the offline `LLM` API and answers the job.

Job (JSON): `model` (folder), `max_model_len`, `mtp` (draft tokens; 0: none), `prompts` (token-id lists),
`new_tokens`, `timed_runs` (per prompt, the fastest kept), `teacher` (token-id lists to score). The engine runs in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, set by the check) so a load failure is this process's exception, and with
prefix caching off: a prompt timed twice must be computed twice, and vLLM's CPU MTP path needs it off.

Answer (JSON, always written): `ok`; on failure `error` (the exception's message, its reasons kept) and
`stage`; else `load_seconds`, `vllm_version`, `tokens` (greedy continuation of each prompt, `new_tokens` each,
end-of-sequence ignored), `prefill_seconds` / `total_seconds` per prompt (a 1-token and an N-token run of the
same prompt, after an untimed 1-token run of it: decode time is their difference), `teacher` (per sequence, for
positions 1.. : the rank-1 token and the log-probability of the sequence's own token), `spec` (with `mtp`: draft
tokens and accepted tokens over the timed runs, in all and per prompt, from vLLM's own counters).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any

SPEC_COUNTERS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens": "accepted"}


def spec_counters(llm: Any) -> dict[str, int]:
    out = dict.fromkeys(SPEC_COUNTERS.values(), 0)
    for m in llm.get_metrics():
        if m.name in SPEC_COUNTERS and hasattr(m, "value"):
            out[SPEC_COUNTERS[m.name]] += int(m.value)
    return out


def greedy(llm: Any, sp: Any, ids: list[int], n: int) -> tuple[list[int], float]:
    t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": ids}], sp(temperature=0.0, max_tokens=n, ignore_eos=True),
                       use_tqdm=False)
    return list(out[0].outputs[0].token_ids), time.perf_counter() - t0


def score(llm: Any, sp: Any, seq: list[int]) -> dict[str, list[Any]]:
    """Teacher-forced: for each position i >= 1, vLLM's rank-1 token after seq[:i] and its log-probability of
    seq[i]."""
    out = llm.generate([{"prompt_token_ids": seq}], sp(temperature=0.0, max_tokens=1, prompt_logprobs=1),
                       use_tqdm=False)
    top1, logprob = [], []
    for i, entry in enumerate(out[0].prompt_logprobs[1:], start=1):
        top1.append(next(t for t, lp in entry.items() if lp.rank == 1))
        logprob.append(float(entry[seq[i]].logprob))
    return {"top1": top1, "logprob": logprob}


def run(job: dict[str, Any], res: dict[str, Any]) -> None:
    """Answer `job` into `res` (its `stage` says how far it got when an exception leaves)."""
    import vllm
    from vllm import LLM, SamplingParams

    res["vllm_version"] = vllm.__version__
    res["stage"] = "load"
    kw: dict[str, Any] = {}
    if job["mtp"]:
        kw["speculative_config"] = {"method": "mtp", "num_speculative_tokens": job["mtp"]}
    t0 = time.perf_counter()
    llm = LLM(model=job["model"], language_model_only=True, max_model_len=job["max_model_len"], dtype="bfloat16",
              enable_prefix_caching=False, disable_log_stats=not job["mtp"], seed=0, **kw)
    res["load_seconds"] = time.perf_counter() - t0
    res["stage"] = "generate"
    prompts, n = job["prompts"], job["new_tokens"]
    greedy(llm, SamplingParams, prompts[0], 4)  # warm-up: first-call costs are not the engine's speed
    res["tokens"], res["total_seconds"], res["prefill_seconds"] = [], [], []
    per_prompt = []
    for ids in prompts:
        greedy(llm, SamplingParams, ids, 1)  # a prompt length's first-call costs kept out, as on quantkit's side
        before = spec_counters(llm) if job["mtp"] else None
        toks, total = greedy(llm, SamplingParams, ids, n)
        if before is not None:  # the drafts of the first run: the later ones repeat it
            after = spec_counters(llm)
            per_prompt.append({"drafted": after["draft_tokens"] - before["draft_tokens"],
                               "accepted": after["accepted"] - before["accepted"]})
        prefill = greedy(llm, SamplingParams, ids, 1)[1]
        for _ in range(job.get("timed_runs", 1) - 1):  # the fastest of the runs is kept
            total = min(total, greedy(llm, SamplingParams, ids, n)[1])
            prefill = min(prefill, greedy(llm, SamplingParams, ids, 1)[1])
        res["tokens"].append(toks)
        res["total_seconds"].append(total)
        res["prefill_seconds"].append(prefill)
    if job["mtp"]:
        res["spec"] = {"drafted": sum(r["drafted"] for r in per_prompt),
                       "accepted": sum(r["accepted"] for r in per_prompt), "per_prompt": per_prompt}
    res["stage"] = "score"
    res["teacher"] = [score(llm, SamplingParams, seq) for seq in job.get("teacher", [])]
    res["ok"] = True
    res.pop("stage")


USAGE = ("usage: python -m benchmarks.vllm_worker JOB.json OUT.json (or PYTHON benchmarks/vllm_worker.py ...),\n"
         "with the vLLM check's venv python (.venv-vllm/bin/python); scripts/vllm-check.sh runs it. --help: this.")


def main(argv: list[str]) -> int:
    if argv in (["--help"], ["-h"]):
        print(USAGE)
        return 0
    if len(argv) != 2:
        print(USAGE, file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        job = json.load(f)
    res: dict[str, Any] = {"ok": False, "stage": "import"}
    try:
        run(job, res)
    except Exception as e:  # noqa: BLE001 (the check reports any failure as the layout's result)
        traceback.print_exc()
        res = {"ok": False, "stage": res["stage"], "error": f"{type(e).__name__}: {e}",
               "vllm_version": res.get("vllm_version")}
    with open(argv[1] + ".tmp", "w") as f:
        json.dump(res, f)
    os.replace(argv[1] + ".tmp", argv[1])
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
