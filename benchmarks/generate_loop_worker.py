"""The worker of `python -m benchmarks.generate_loop`: one quantkit tree's `Runtime.generate_ids`, timed on request.

Run by path with the tree's root on PYTHONPATH (`python benchmarks/generate_loop_worker.py MODEL THREADS PROMPT NEW`),
so it imports only the standard library and that tree's public quantkit API (`load_model`, `generate_ids`,
`SamplingParams`, `set_mtp`), which every tree compared has. It loads MODEL (the prompt cache off, MTP off),
prints one JSON line {"ready": ..., "route": ...}, then answers each line `R` on stdin with one greedy generation
of NEW tokens after PROMPT random tokens and the token R (every round a prompt of its own, the same in every tree):
{"ttft": seconds from the call to the first token's event, "prompt_tps", "decode_tps" (the response's), "digest":
sha256 of the token ids}, until `quit` or the end of its input.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time


def run(argv: list[str]) -> None:
    import torch

    from quantkit.runtime import SamplingParams, load_model

    model, threads, prompt, new = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    torch.set_num_threads(threads)
    rt = load_model(model, verify="quick")
    rt.set_mtp(0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, min(200_000, rt.model.vocab), (prompt,), generator=g).tolist()
    print(json.dumps({"ready": True, "route": rt.route()["name"]}), flush=True)
    for line in sys.stdin:
        if line.strip() in ("", "quit"):
            break
        sp = SamplingParams(temperature=0, max_new_tokens=new, ignore_eos=True)
        t0 = time.perf_counter()
        first, resp = None, None
        for e in rt.generate_ids([*ids, int(line)], sp, thinking=False, stop_ids=set()):
            if first is None and e.token is not None:
                first = time.perf_counter() - t0
            resp = e.response or resp
        digest = hashlib.sha256(json.dumps(resp.token_ids).encode()).hexdigest()[:16]
        print(json.dumps({"ttft": first, "prompt_tps": resp.prompt_tps, "decode_tps": resp.generation_tps,
                          "digest": digest}), flush=True)


if __name__ == "__main__":
    run(sys.argv[1:])
