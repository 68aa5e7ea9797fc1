"""The worker of `python -m benchmarks.step_rows`: one quantkit tree's `Model.step_batch`, timed on request.

Run by path with the tree's root on PYTHONPATH (`python benchmarks/step_rows_worker.py MODEL THREADS ROWS PROMPT`),
so it imports only the standard library and that tree's public quantkit API (`load_model`, `step_batch`,
`new_cache`, `forward`), which every tree compared has. It loads MODEL, prefills ROWS caches with PROMPT random
tokens each (the same tokens in every tree), prints one JSON line {"ready": ..., "route": ...}, then answers each
line `B` on stdin with {"s": seconds of one step_batch over caches 0..B-1, "digest": sha256 of the logits' bytes}
(every round steps from the same position; two trees that compute the same bits give the same digests) until
`quit` or the end of its input. The timing runs on a worker thread, as the server steps its slots.
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading
import time


def run(argv: list[str]) -> None:
    import torch

    from quantkit.runtime import load_model

    model, threads, rows, prompt = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    torch.set_num_threads(threads)
    rt = load_model(model, verify="quick")
    m = rt.model
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, min(200_000, m.vocab), (rows, prompt), generator=g).tolist()
    with torch.inference_mode():
        caches = []
        for row in ids:
            c = m.new_cache(prompt + 8)
            m.forward(row, c)
            caches.append(c)
        print(json.dumps({"ready": True, "route": rt.route()["name"]}), flush=True)
        for line in sys.stdin:
            if line.strip() in ("", "quit"):
                break
            b = int(line)
            for c in caches[:b]:
                c.n = prompt
            t0 = time.perf_counter()
            logits = m.step_batch([ids[j][-1] for j in range(b)], caches[:b])
            s = time.perf_counter() - t0
            digest = hashlib.sha256(logits.float().numpy().tobytes()).hexdigest()[:16]
            print(json.dumps({"s": s, "digest": digest}), flush=True)


def work_loop(argv: list[str]) -> int:
    errors: list[BaseException] = []

    def work() -> None:
        try:
            run(argv)
        except BaseException as e:  # noqa: BLE001 - re-raised on the main thread
            errors.append(e)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    if errors:
        raise errors[0]
    return 0


if __name__ == "__main__":
    sys.exit(work_loop(sys.argv[1:]))
