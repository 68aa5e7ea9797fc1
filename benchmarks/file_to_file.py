"""File to file: `quantkit quantize` against llama.cpp's own quantizer on the same weights, alternated.

Each engine runs as its own process under `/usr/bin/time` (wall, user, system, peak RSS of that process
alone; `os.wait4` where /usr/bin/time is missing): quantkit from the bf16 safetensors folder, llama.cpp
(`llama_model_quantize` from llama-cpp-python, the library the `llama-quantize` tool wraps) from the bf16
GGUF of the same weights, which quantkit's exporter writes first. Runs alternate quantkit, llama.cpp,
quantkit, ... so load from other work on the machine falls on both; the best of the repetitions is
compared. A last quantkit run in process records where its time goes (quantize/stream.StageTimes), and
py-spy's samples per function where py-spy is installed.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# (label, quantkit quantize options, llama.cpp ftype name, its LLAMA_FTYPE value)
CASES: list[tuple[str, list[str], str, int]] = [
    ("int4 g32", ["--bits", "4", "--format", "int", "--group-size", "32", "--uniform"], "Q4_0", 2),
    ("int8", ["--bits", "8", "--uniform"], "Q8_0", 7),
]

_LLAMA = """
import ctypes, sys
import llama_cpp as L
p = L.llama_model_quantize_default_params()
p.ftype, p.nthread = int(sys.argv[3]), int(sys.argv[4])
sys.exit(L.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(p)))
"""

_STAGES = """
import json, sys, time
t0 = time.perf_counter()
from pathlib import Path
from quantkit.checkpoint.reader import Checkpoint
from quantkit.quantize.run import QuantizeOptions, run_quantize
from quantkit.recipe import build_recipe
bits, group, threads = int(sys.argv[3]), (int(sys.argv[4]) or None), int(sys.argv[5])
t1 = time.perf_counter()
r = run_quantize(Checkpoint.open(sys.argv[1]), Path(sys.argv[2]),
                 QuantizeOptions(build_recipe(bits, "int", group, True, [], None), threads=threads))
print(json.dumps({"imports": t1 - t0, "run": r.seconds, "stages": r.stages}))
"""


def timed(cmd: list[str]) -> dict[str, Any]:
    """Run `cmd`; its wall, user and system seconds and peak RSS (bytes), measured on that process alone."""
    tool = shutil.which("time", path="/usr/bin")
    if tool:
        with tempfile.NamedTemporaryFile("r", suffix=".time") as f:
            proc = subprocess.run([tool, "-f", "%e %U %S %M", "-o", f.name, *cmd], capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd[:4])} failed: {proc.stderr.strip()[-1500:]}")
            wall, user, sys_s, rss_kb = f.read().split()[-4:]
        return {"wall": float(wall), "user": float(user), "sys": float(sys_s), "peak_rss": int(rss_kb) * 1024}
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, ru = os.wait4(p.pid, 0)
    if status != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} failed (status {status})")
    return {"wall": time.perf_counter() - t0, "user": ru.ru_utime, "sys": ru.ru_stime, "peak_rss": ru.ru_maxrss * 1024}


def _remove(p: Path) -> None:
    if p.is_dir():
        shutil.rmtree(p)
    else:
        p.unlink(missing_ok=True)


def bf16_gguf(src: Path, workdir: Path, log: Any = print) -> Path:
    """The bf16 GGUF of `src` (written once by quantkit's exporter; llama.cpp's quantizer reads GGUF only)."""
    from quantkit.export.gguf import export_gguf

    out = workdir / f"{src.name}-bf16.gguf"
    if not out.is_file():
        log(f"writing {out} (the bf16 GGUF llama.cpp's quantizer reads) ...")
        export_gguf(src, out, "bf16", overwrite=True)
    return out


def run(src: Path, workdir: Path, threads: int, reps: int = 3, log: Any = print) -> dict[str, Any]:
    """Both engines on both cases, alternated, `reps` times each; the stage profile of one more run each."""
    gguf_src = bf16_gguf(src, workdir, log)
    rows = []
    for label, opts, ftype_name, ftype in CASES:
        q_out, l_out = workdir / "f2f-quantkit", workdir / f"f2f-llama-{ftype_name}.gguf"
        qk_cmd = [sys.executable, "-m", "quantkit", "quantize", str(src), "--out", str(q_out), *opts,
                  "--threads", str(threads)]
        ll_cmd = [sys.executable, "-c", _LLAMA, str(gguf_src), str(l_out), str(ftype), str(threads)]
        runs: dict[str, list[dict[str, Any]]] = {"quantkit": [], "llama.cpp": []}
        sizes = {}
        for i in range(reps):
            for who, cmd, out in (("quantkit", qk_cmd, q_out), ("llama.cpp", ll_cmd, l_out)):
                _remove(out)
                load = os.getloadavg()[0]
                r = timed(cmd)
                r["load"] = load
                sizes[who] = sum(p.stat().st_size for p in out.rglob("*") if p.is_file()) if out.is_dir() \
                    else out.stat().st_size
                _remove(out)
                runs[who].append(r)
                log(f"  {label} {who} #{i + 1}: {r['wall']:.1f} s wall, {r['user']:.1f} user, {r['sys']:.1f} sys, "
                    f"{r['peak_rss'] / 1e9:.2f} GB (load {load:.1f})")
        best = {who: min(rs, key=lambda r: r["wall"]) for who, rs in runs.items()}
        group = opts[opts.index("--group-size") + 1] if "--group-size" in opts else "0"
        prof = _profile(src, q_out, opts, group, threads)
        rows.append({
            "case": label, "quantkit_options": " ".join(opts), "llama_type": ftype_name, "runs": runs, "best": best,
            "out_bytes": sizes, "speed_ratio": best["llama.cpp"]["wall"] / best["quantkit"]["wall"],
            "rss_ratio": best["quantkit"]["peak_rss"] / best["llama.cpp"]["peak_rss"],
            "profile": prof,
            "quantkit_cmd": f"quantkit quantize {src} --out {q_out} {' '.join(opts)} --threads {threads}",
            "llama_cmd": f"llama_model_quantize({gguf_src.name}, out, ftype={ftype_name}, nthread={threads})",
        })
    return {"source": str(src), "source_bytes": _size(src), "gguf_bytes": gguf_src.stat().st_size,
            "threads": threads, "reps": reps, "cases": rows}


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def _profile(src: Path, out: Path, opts: list[str], group: str, threads: int) -> dict[str, Any]:
    """One more quantkit run: the seconds of each stage and, with py-spy, the samples per function."""
    bits = opts[opts.index("--bits") + 1]
    _remove(out)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _STAGES, str(src), str(out), bits, group, str(threads)],
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    _remove(out)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip()[-500:]}
    d = json.loads(proc.stdout.strip().splitlines()[-1])
    d["wall"] = wall
    d["py_spy"] = _py_spy(src, out, opts, threads)
    return d


def _py_spy(src: Path, out: Path, opts: list[str], threads: int, top: int = 12) -> list[tuple[str, float]] | None:
    """Share of py-spy's samples (every thread) by innermost Python function, or None without py-spy."""
    spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if not spy:
        return None
    with tempfile.TemporaryDirectory() as d:
        raw = Path(d) / "prof.txt"
        cmd = [spy, "record", "-r", "100", "-f", "raw", "-o", str(raw), "--nonblocking", "--", sys.executable,
               "-m", "quantkit", "quantize", str(src), "--out", str(out), *opts, "--threads", str(threads)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        _remove(out)
        if proc.returncode != 0 or not raw.is_file():
            return None
        return summarize_samples(raw.read_text(), top)


def summarize_samples(text: str, top: int = 12) -> list[tuple[str, float]]:
    """Collapsed stacks ("a (file:1);b (file:2) COUNT" per line) -> [(innermost function (file), share)]."""
    count: collections.Counter[str] = collections.Counter()
    total = 0
    for line in text.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        leaf = stack.split(";")[-1]
        name, _, where = leaf.partition(" (")
        file = where.split(":")[0].rstrip(")")
        short = "/".join(Path(file).parts[-2:]) if file else ""
        count[f"{name} ({short})" if short else name] += int(n)
        total += int(n)
    return [(k, v / total) for k, v in count.most_common(top)] if total else []
