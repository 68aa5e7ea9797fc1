"""One configuration's decode polled between streaming reads, for `quantkit bench decode --spells S`.

Runs in the configuration's own process (`python -m quantkit.bench.spell_poll FOLDER SECONDS PROMPT DECODE
THREADS` prints its samples as JSON); quantkit.bench.spells groups them by the bandwidth beside them.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from quantkit.bench import read_bandwidth_gbs
from quantkit.bench.decode import decode_bytes, text_config, timed
from quantkit.bench.spells import READ_GIB
from quantkit.runtime import load_model


def poll(folder: Path, seconds: float, prompt_len: int, decode: int, threads: int | None = None) -> dict[str, Any]:
    """Samples (read before, read after, decode tok/s) from `seconds` of decoding the quantkit checkpoint
    at `folder` as generation decodes it (quantkit's model on the route chosen at load), and the bytes one
    step reads."""
    if threads:
        torch.set_num_threads(threads)
    model = load_model(folder, verify="quick").model
    cfg = text_config(model)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, min(cfg.vocab_size, 768), (prompt_len,), generator=g).tolist()
    timed(model, prompt, decode)  # warm-up
    samples = []
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        before = read_bandwidth_gbs(gib=READ_GIB, reps=3)
        _, steps, _ = timed(model, prompt, decode)
        after = read_bandwidth_gbs(gib=READ_GIB, reps=3)
        samples.append({"read_before_gbs": round(before, 2), "read_after_gbs": round(after, 2),
                        "decode_tok_s": round(len(steps) / sum(steps), 2)})
    return {"seconds": seconds, "step_bytes": sum(decode_bytes(model, prompt_len, decode)), "samples": samples}


if __name__ == "__main__":
    if len(sys.argv) != 6:
        print("usage: python -m quantkit.bench.spell_poll FOLDER SECONDS PROMPT DECODE THREADS (internal to "
              "quantkit bench decode)", file=sys.stderr)
        sys.exit(2)
    folder, seconds, prompt, dec, threads = sys.argv[1:]
    print(json.dumps(poll(Path(folder), float(seconds), int(prompt), int(dec), int(threads) or None)))
