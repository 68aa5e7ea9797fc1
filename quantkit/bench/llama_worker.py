"""llama.cpp's decode and logits for the benches (`llama_decode`, `llama_logits`), and the same from another
build of its library, in a process of its own (for `bench engines --llama-build`).

llama-cpp-python loads its shared library once per process (`LLAMA_CPP_LIB_PATH`, read at import), so a
second build (say one compiled for AVX2 only, what an AVX2 CPU's own build runs) needs a fresh interpreter.
`run_build` starts `python -m quantkit.bench.llama_worker` with that variable set; the worker reads its job
as JSON on stdin, runs the same `llama_decode` / `llama_logits` as the in-process rows and writes
`decode.json` and `logits.npy` into the job's folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from quantkit.errors import QuantkitError


def library_dir(path: Path) -> Path:
    """The folder holding a llama.cpp build's libllama.so: the folder itself or its llama_cpp/lib."""
    for d in (path, path / "llama_cpp" / "lib"):
        if (d / "libllama.so").is_file():
            return d
    raise QuantkitError(f"{path}: no libllama.so here or in llama_cpp/lib; build one with "
                        "`bash scripts/build-llama-cpp.sh avx2` and pass the folder it prints")


def run_build(lib: Path, gguf: Path, prompt: list[int], new_tokens: int, threads: int, reps: int,
              probe: torch.Tensor | None) -> tuple[dict[str, Any], np.ndarray | None]:
    """llama.cpp's decode (and the probe's logits when given) with the library in `lib`."""
    with tempfile.TemporaryDirectory(prefix="qk-llama-") as tmp:
        job = {"gguf": str(gguf), "prompt": prompt, "new_tokens": new_tokens, "threads": threads, "reps": reps,
               "probe": probe.tolist() if probe is not None else None, "out": tmp}
        env = {**os.environ, "LLAMA_CPP_LIB_PATH": str(library_dir(lib))}
        p = subprocess.run([sys.executable, "-m", "quantkit.bench.llama_worker"], input=json.dumps(job),
                           env=env, capture_output=True, text=True, timeout=3600)
        if p.returncode:
            tail = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise QuantkitError(f"llama.cpp build in {lib} failed: {tail}")
        decode = json.loads(Path(tmp, "decode.json").read_text())
        logits = np.load(Path(tmp, "logits.npy"), allow_pickle=False) if probe is not None else None
    return decode, logits


def open_llama(path: Path, threads: int, n_ctx: int, logits_all: bool) -> Any:
    import llama_cpp

    return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=min(n_ctx, 512), n_threads=threads,
                           n_threads_batch=threads, logits_all=logits_all, verbose=False)


def last_logits(llm: Any) -> np.ndarray:
    """The last evaluated token's logits. Without logits_all, llama-cpp-python 0.3.36 leaves `llm.scores`
    unwritten (sampling happens in llama.cpp), so they are read from the context itself."""
    return np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(llm.n_vocab(),))


def llama_decode(path: Path, prompt: list[int], new_tokens: int, threads: int, reps: int) -> dict[str, Any]:
    llm = open_llama(path, threads, len(prompt) + new_tokens + 8, False)
    best = None
    try:
        for _ in range(reps):
            llm.reset()
            t0 = time.perf_counter()
            llm.eval(prompt)
            t1 = time.perf_counter()
            toks = []
            for _i in range(new_tokens):
                tok = int(np.argmax(last_logits(llm)))
                toks.append(tok)
                llm.eval([tok])
            t2 = time.perf_counter()
            r = {"prefill_tps": len(prompt) / (t1 - t0), "decode_tps": new_tokens / (t2 - t1), "tokens": toks}
            if best is None or r["decode_tps"] > best["decode_tps"]:
                best = r
    finally:
        llm.close()
    return best


def llama_logits(path: Path, ids: torch.Tensor, threads: int) -> np.ndarray:
    llm = open_llama(path, threads, ids.shape[1] + 8, True)
    out = []
    try:
        for row in ids.tolist():
            llm.reset()
            llm.eval(row)
            out.append(np.array(llm.scores[: len(row)], dtype=np.float32))
    finally:
        llm.close()
    return np.stack(out)


def main() -> None:
    job = json.loads(sys.stdin.read())
    out, gguf = Path(job["out"]), Path(job["gguf"])
    d = llama_decode(gguf, job["prompt"], job["new_tokens"], job["threads"], job["reps"])
    (out / "decode.json").write_text(json.dumps(d))
    if job["probe"] is not None:
        np.save(out / "logits.npy", llama_logits(gguf, torch.tensor(job["probe"]), job["threads"]))


if __name__ == "__main__":
    main()
