"""`python -m benchmarks.full_size`: the whole 35B shape on this machine's CPU, against the plan and llama.cpp.

Steps, each heavy one in its own process (so its memory goes back before the next starts; the quantkit runtime
and llama.cpp need not both fit in RAM at once):
1. the folder: `quantkit tiny-model --full-size --quantized quality` (random weights in the stored format;
   skipped when `folder` is given or already finished in `workdir`), timed, its peak RSS read;
2. `quantkit verify` (every shard hashed), `quantkit profile-host` for the folder's recipe when this host has no
   runtime profile for the shape, then `quantkit plan --gpu none --json`: the plan's bytes in RAM, whether it
   fits and up to what context, its llama.cpp-grade decode/prefill and quantkit's calibrated decode estimate;
3. quantkit (a child process): load time, RSS after load and at the end (VmRSS) and peak (VmHWM), greedy decode
   from a short prompt, then a 2k-token chat prompt (TTFT, prefill tok/s, decode at 2k context) and the next
   turn through the prompt cache (TTFT, tokens prefilled vs restored); then `quantkit generate` as a user runs it;
4. the folder exported to GGUF `mixed` (a child process; routed experts Q4_0, the rest Q8_0: int4 g32 codes
   are copied, other groups are requantized, and the report says which), then llama.cpp (a child process) on
   the same prompts and threads: load, decode, TTFT of the 2k prompt and of the next turn (a full re-prefill:
   llama.cpp cannot roll a recurrent state back, bench session's note).
A parent thread samples each child's RSS every 0.2 s as a cross-check of its own VmHWM. Writes
reports/bench-full-size.{md,json}. `layers`/`experts`/`vocab` shrink the generated model (a trial run, and the
test); the report names the shape it ran.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import typer

from benchmarks.cli import child_env, guard_reports, llama_option, run_command, shared
from benchmarks.cli import threads as resolve_threads
from quantkit.bench import read_bandwidth_gbs, write_reports
from quantkit.bench.engines import describe_machine, gguf_step_bytes, quantkit_decode
from quantkit.bench.llama_worker import last_logits, llama_decode, open_llama
from quantkit.errors import QuantkitError

DEFAULTS = {"prompt_tokens": 2048, "short_prompt": 64, "new_tokens": 32, "reps": 4, "context": 4096}
READ_GIB = 0.25  # each bandwidth probe beside a decode: 256 MiB, well above the LLC, small beside the model
FOLDER_NAME = "qwen-agentworld-35b-a3b-quality"
# targets (issue 31): RSS within 5% of the plan's bytes, decode within 25% of the calibrated estimate, quantkit
# decode at least 1.2x llama.cpp's
RSS_TOLERANCE, SPEED_TOLERANCE, LLAMA_RATIO = 0.05, 0.25, 1.2


# ---- children ------------------------------------------------------------------------------------------

def _status_bytes(key: str) -> int:
    """VmRSS / VmHWM of this process, in bytes."""
    for ln in Path("/proc/self/status").read_text().splitlines():
        if ln.startswith(key + ":"):
            return int(ln.split()[1]) * 1024
    return 0


def _huge_bytes() -> int:
    """Bytes of this process's memory on transparent 2 MiB pages (the weights' TLB reach: runtime/hugepages.py)."""
    try:
        for ln in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if ln.startswith("AnonHugePages:"):
                return int(ln.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _memory() -> dict[str, int]:
    return {"rss": _status_bytes("VmRSS"), "hwm": _status_bytes("VmHWM"), "huge": _huge_bytes()}


def _timed_turn(gen: Any, ids: list[int], new_tokens: int) -> dict[str, Any]:
    """Run one generation (an iterator of token events); TTFT = the call until the first event."""
    t0 = time.perf_counter()
    ttft, resp = None, None
    for ev in gen(ids, new_tokens):
        if ttft is None:
            ttft = time.perf_counter() - t0
        resp = ev.response or resp
    return {"ttft_s": ttft, "prompt_tokens": resp.prompt_tokens, "prefilled": resp.prefilled_tokens,
            "reused": resp.cached_tokens, "prefill_tps": resp.prompt_tps, "decode_tps": resp.generation_tps,
            "tokens": list(resp.token_ids)}


def _decode_beside_reads(rt: Any, prompt: list[int], new_tokens: int, reps: int) -> dict[str, Any]:
    """The best of `reps` greedy decodes, each between two streaming reads: this machine's read bandwidth moves
    between spells, so each decode is reported with the bandwidth of its moment."""
    from quantkit.bench import read_bandwidth_gbs

    best, runs = None, []
    for _ in range(reps):
        before = read_bandwidth_gbs(READ_GIB)
        r = quantkit_decode(rt, prompt, new_tokens, 1)
        bw = (before + read_bandwidth_gbs(READ_GIB)) / 2
        runs.append({"decode_tps": r["decode_tps"], "read_gbs": round(bw, 1)})
        if best is None or r["decode_tps"] > best["decode_tps"]:
            best = {**r, "read_gbs": round(bw, 1)}
    return {**best, "runs": runs}


def quantkit_worker(a: dict[str, Any]) -> dict[str, Any]:
    """Load the folder, decode, the 2k prompt and its next turn (module docstring, step 3)."""
    import torch

    from quantkit.runtime import SamplingParams, load_model

    torch.set_num_threads(a["threads"])
    base = _memory()
    t0 = time.perf_counter()
    rt = load_model(a["folder"], context=a["context"])
    load_s = time.perf_counter() - t0
    rt.set_mtp(0)  # plain decode, as llama.cpp's beside it: the MTP layer's weights are random (bench mtp drafts)
    loaded = _memory()
    out: dict[str, Any] = {"load_s": load_s, "baseline": base, "after_load": loaded, "route": rt.route(),
                           "weights_bytes": sum(rt.memory().values()), "placement": rt.placement.source}
    out["short"] = _decode_beside_reads(rt, a["short"], a["new_tokens"], a["reps"])

    def gen(ids: list[int], n: int) -> Any:
        return rt.generate_ids(ids, sampling=SamplingParams(temperature=0.0, max_new_tokens=n), thinking=True,
                               stop_ids=set())

    rt.set_prompt_cache(a.get("prompt_cache_bytes"))  # the plan's budget (2 snapshots), not the runtime's default
    out["turn1"] = _timed_turn(gen, a["turn1"], a["new_tokens"])
    out["turn2"] = _timed_turn(gen, a["turn2"], a["new_tokens"])
    out["prompt_cache"] = rt.prompt_cache.summary()
    out["end"] = _memory()
    return out


def llama_worker(a: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp on the GGUF: load, decode, the 2k prompt and its next turn (a full re-prefill)."""
    import numpy as np

    base = _memory()
    out: dict[str, Any] = {"baseline": base, "short": llama_decode(Path(a["gguf"]), a["short"], a["new_tokens"],
                                                                    a["threads"], a["reps"])}
    t0 = time.perf_counter()
    llm = open_llama(Path(a["gguf"]), a["threads"], a["context"], False)
    out["load_s"] = time.perf_counter() - t0
    out["after_load"] = _memory()
    try:
        for key in ("turn1", "turn2"):
            ids = a[key]
            t0 = time.perf_counter()
            llm.reset()
            llm.eval(ids)
            tok = int(np.argmax(last_logits(llm)))
            t1 = time.perf_counter()
            toks = [tok]
            for _ in range(a["new_tokens"] - 1):
                llm.eval([tok])
                tok = int(np.argmax(last_logits(llm)))
                toks.append(tok)
            t2 = time.perf_counter()
            out[key] = {"ttft_s": t1 - t0, "prompt_tokens": len(ids), "prefilled": len(ids), "reused": 0,
                        "prefill_tps": len(ids) / (t1 - t0), "decode_tps": (a["new_tokens"] - 1) / (t2 - t1),
                        "tokens": toks}
        out["end"] = _memory()  # before close: the steady state with the model loaded
    finally:
        llm.close()
    return out


WORKERS = {"quantkit": quantkit_worker, "llama.cpp": llama_worker}


# ---- the parent ----------------------------------------------------------------------------------------

class _Sampler:
    """RSS of a child process (and its children) every `every` seconds, from outside."""

    def __init__(self, pid: int, every: float = 0.2):
        import psutil

        self.proc, self.every, self.peak, self.samples = psutil.Process(pid), every, 0, 0
        self.stop = threading.Event()
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self) -> None:
        import psutil

        while not self.stop.is_set():
            try:
                rss = self.proc.memory_info().rss + sum(c.memory_info().rss for c in self.proc.children(True))
            except psutil.Error:
                break
            self.peak, self.samples = max(self.peak, rss), self.samples + 1
            self.stop.wait(self.every)

    def close(self) -> int:
        self.stop.set()
        self.t.join()
        return self.peak


def _run(cmd: list[str], log: Any, what: str) -> dict[str, Any]:
    """Run a command, its RSS sampled; (seconds, peak RSS, stdout). A failure raises with its last line."""
    log(f"{what}: {' '.join(cmd)}")
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**child_env(), "COLUMNS": "200"})
    s = _Sampler(p.pid)
    stdout, stderr = p.communicate()
    peak = s.close()
    if p.returncode:
        last = (stderr.strip().splitlines() or stdout.strip().splitlines() or ["(no output)"])[-1]
        raise QuantkitError(f"{what} failed (exit {p.returncode}): {last}")
    return {"seconds": time.perf_counter() - t0, "peak_rss_sampled": peak, "stdout": stdout}


def _child(worker: str, args: dict[str, Any], workdir: Path, log: Any) -> dict[str, Any]:
    inp, out = workdir / f"{worker}-args.json", workdir / f"{worker}-result.json"
    inp.write_text(json.dumps(args))
    out.unlink(missing_ok=True)
    r = _run([sys.executable, "-m", "benchmarks.full_size", worker, str(inp), str(out)], log, worker)
    return {**json.loads(out.read_text()), "peak_rss_sampled": r["peak_rss_sampled"], "wall_s": r["seconds"]}


def _quantkit_cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "quantkit", *args]


def prompts(folder: Path, n_tokens: int, short: int) -> dict[str, list[int]]:
    """The token ids both engines run: a short prompt, a chat prompt of about `n_tokens` (the terminal world's
    system prompt and one large observation) and the next turn (that history, a reply, a new action)."""
    from benchmarks.session import observation
    from quantkit.runtime.engine import load_tokenizer
    from quantkit.runtime.worlds import world_prompt

    tok = load_tokenizer(folder)

    def ids(msgs: list[dict[str, str]]) -> list[int]:
        text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        return list(tok.encode(text, add_special_tokens=False))

    sys_msg = {"role": "system", "content": world_prompt("terminal")}
    head = len(ids([sys_msg, {"role": "user", "content": "$ cat build.log"}]))
    body = observation(0, max(16, n_tokens - head), lambda s: len(tok.encode(s, add_special_tokens=False)))
    msgs = [sys_msg, {"role": "user", "content": "$ cat build.log\n" + body}]
    turn1 = ids(msgs)
    msgs += [{"role": "assistant", "content": "<predicted_observation>\nbuild ok\n</predicted_observation>"},
             {"role": "user", "content": "$ ls -la"}]
    return {"short": turn1[-short:], "turn1": turn1, "turn2": ids(msgs)}


def _plan(folder: Path, context: int, profile: Path, bandwidth: float, log: Any) -> dict[str, Any]:
    """`quantkit plan` for this machine's free RAM, its measured read bandwidth and the calibration `profile`."""
    r = _run(_quantkit_cli("plan", "--model", str(folder), "--gpu", "none", "--context", str(context), "--profile",
                           str(profile), "--cpu-bandwidth", f"{bandwidth:.1f}", "--json"), log, "plan")
    d = json.loads(r["stdout"])
    s, pl = d["schemes"][0], d["plan"]
    cpu = next(dev for dev in pl["devices"] if dev["id"] == "cpu")
    return {"scheme": s["scheme"], "fits": s["fits"], "total_bytes": pl["total_bytes"], "ram_used": cpu["used"],
            "ram_capacity": cpu["capacity"], "ram_reserve": cpu["reserve"], "components_bytes": s["components_bytes"],
            "max_context": s["max_context"], "est_decode_tok_s": s["est_decode_tok_s"],
            "est_prefill_tok_s": s["est_prefill_tok_s"], "runtime_decode_tok_s": s.get("runtime_decode_tok_s"),
            "runtime_prefill_tok_s": s.get("runtime_prefill_tok_s"),
            "hardware": d["hardware"], "runtime_profile": d.get("runtime_profile"), "notes": d.get("notes", [])}


def ensure_folder(workdir: Path, folder: Path | None, shape: dict[str, int | None], log: Any) -> tuple[Path, dict]:
    """The quantized folder (generated once in `workdir` unless given) and how it was made."""
    if folder is not None:
        return folder, {"given": True}
    name = FOLDER_NAME + "".join(f"-{k[0].upper()}{v}" for k, v in shape.items() if v)
    out = workdir / name
    if (out / "quantkit-manifest.json").is_file():
        return out, {"given": False, "reused": True}
    args = ["tiny-model", str(out), "--full-size", "--quantized", "quality"]
    for k, v in shape.items():
        if v:
            args += [f"--{k}", str(v)]
    if out.exists():
        args.append("--resume")
    r = _run(_quantkit_cli(*args), log, "generate")
    return out, {"given": False, "reused": False, "command": "quantkit " + " ".join(args),
                 "seconds": r["seconds"], "peak_rss_sampled": r["peak_rss_sampled"]}


def run(reports: Path, workdir: Path, folder: Path | None = None, threads: int | None = None,
        layers: int | None = None, experts: int | None = None, vocab: int | None = None,
        prompt_tokens: int = DEFAULTS["prompt_tokens"], new_tokens: int = DEFAULTS["new_tokens"],
        reps: int = DEFAULTS["reps"], llama: bool = True, keep_gguf: bool = True, log: Any = print) -> dict[str, Any]:
    """The whole benchmark (module docstring); returns the report's data."""
    t_start = time.perf_counter()
    threads = threads or os.cpu_count() or 1
    workdir.mkdir(parents=True, exist_ok=True)
    reports.mkdir(parents=True, exist_ok=True)
    machine = describe_machine()
    bandwidth = read_bandwidth_gbs()
    folder, made = ensure_folder(workdir, folder, {"layers": layers, "experts": experts, "vocab": vocab}, log)
    folder_bytes = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    ver = _run(_quantkit_cli("verify", str(folder)), log, "verify")
    profile = workdir / (folder.name + "-runtime-profile.json")
    cal_read = read_bandwidth_gbs(READ_GIB)
    cal = _run(_quantkit_cli("profile-host", "--model", str(folder), "--out", str(profile)), log, "calibrate")
    cal_read = (cal_read + read_bandwidth_gbs(READ_GIB)) / 2
    context = max(DEFAULTS["context"], prompt_tokens + 4 * new_tokens + 256)
    plan = _plan(folder, context, profile, bandwidth, log)
    cfg = json.loads((folder / "config.json").read_text())
    tc = cfg.get("text_config", cfg)
    ids = prompts(folder, prompt_tokens, DEFAULTS["short_prompt"])
    args = {"folder": str(folder), "threads": threads, "context": context, "new_tokens": new_tokens,
            "reps": reps, "prompt_cache_bytes": plan["components_bytes"].get("prompt_cache"), **ids}
    rows: dict[str, Any] = {"quantkit": _child("quantkit", args, workdir, log)}
    g = _run(_quantkit_cli("generate", str(folder), "--prompt", "$ ls -la", "--max-tokens", "8", "--json"), log,
             "generate")
    cli = {"command": f"quantkit generate {folder} --prompt '$ ls -la' --max-tokens 8 --json", "wall_s": g["seconds"],
           "peak_rss_sampled": g["peak_rss_sampled"], **{k: v for k, v in json.loads(g["stdout"]).items()
                                                          if k in ("generation_tokens", "generation_tps",
                                                                   "prompt_tps", "finish_reason")}}
    gguf_info: dict[str, Any] | None = None
    if llama:
        gguf = workdir / (folder.name + "-mixed.gguf")
        record = gguf.with_suffix(".export.json")  # how the GGUF was made, for a later run that reuses it
        if not gguf.is_file():
            r = _run(_quantkit_cli("export", "gguf", str(folder), str(gguf), "--type", "mixed"), log, "export gguf")
            gguf_info = {"seconds": r["seconds"], "peak_rss_sampled": r["peak_rss_sampled"], "reused_file": False,
                         "summary": r["stdout"].strip().splitlines()[-3:]}
            record.write_text(json.dumps(gguf_info))
        else:
            gguf_info = {**(json.loads(record.read_text()) if record.is_file() else {}), "reused_file": True}
        gguf_info.update({"path": str(gguf), "bytes": gguf.stat().st_size,
                          "step_bytes": gguf_step_bytes(gguf, tc["num_experts_per_tok"])})
        rows["llama.cpp"] = _child("llama.cpp", {**args, "gguf": str(gguf)}, workdir, log)
        if not keep_gguf:
            gguf.unlink()
            record.unlink(missing_ok=True)
    data = {
        "command": f"python -m benchmarks.full_size --workdir {workdir}" + (f" --model {folder}" if made.get("given") else "")
        + "".join(f" --{k} {v}" for k, v in (("layers", layers), ("experts", experts), ("vocab", vocab)) if v)
        + (f" --threads {threads}" if threads != (os.cpu_count() or 1) else "")
        + ("" if llama else " --no-llama") + (" --drop-gguf" if not keep_gguf else ""),
        "machine": machine, "threads": threads, "read_bandwidth_gbs": round(bandwidth, 2),
        "folder": str(folder), "folder_bytes": folder_bytes, "made": made,
        "shape": {"layers": tc["num_hidden_layers"], "experts": tc["num_experts"], "top_k": tc["num_experts_per_tok"],
                  "hidden": tc["hidden_size"], "vocab": tc["vocab_size"]},
        "verify_s": ver["seconds"], "calibrate_s": cal["seconds"], "calibrate_read_gbs": round(cal_read, 1),
        "plan": plan, "context": context,
        "prompt_tokens": {k: len(v) for k, v in ids.items()}, "new_tokens": new_tokens, "reps": reps,
        "gguf": gguf_info, "generate_cli": cli, "rows": {k: {kk: vv for kk, vv in v.items()} for k, v in rows.items()},
        "seconds": time.perf_counter() - t_start,
    }
    data["targets"] = targets(data)
    write_reports(reports, "bench-full-size", data, render(data), indent=2)
    return data


def targets(d: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's bars, each with its measured ratio and whether it is met."""
    q, plan = d["rows"]["quantkit"], d["plan"]
    out = []
    for what, rss in (("steady RSS", q["end"]["rss"]), ("peak RSS", q["end"]["hwm"])):
        r = rss / plan["total_bytes"]
        net = (rss - q["baseline"]["rss"]) / plan["total_bytes"]
        out.append({"target": f"{what} within {RSS_TOLERANCE:.0%} of the plan's bytes", "ratio": r,
                    "met": abs(r - 1) <= RSS_TOLERANCE, "without_interpreter": net})
    est = plan.get("runtime_decode_tok_s")
    if est:
        r = q["short"]["decode_tps"] / est
        out.append({"target": f"decode within {SPEED_TOLERANCE:.0%} of the calibrated estimate", "ratio": r,
                    "met": abs(r - 1) <= SPEED_TOLERANCE})
    est = plan.get("runtime_prefill_tok_s")
    r = q["turn1"]["prefill_tps"] / (est or plan["est_prefill_tok_s"])
    what = "the calibrated estimate" if est else "the planner's llama.cpp-grade estimate (no calibrated prefill)"
    out.append({"target": f"prefill within {SPEED_TOLERANCE:.0%} of {what}", "ratio": r,
                "met": abs(r - 1) <= SPEED_TOLERANCE})
    ll = d["rows"].get("llama.cpp")
    if ll:
        r = q["short"]["decode_tps"] / ll["short"]["decode_tps"]
        out.append({"target": f"quantkit decode at least {LLAMA_RATIO}x llama.cpp's", "ratio": r, "met": r >= LLAMA_RATIO})
    return out


def _runs(q: dict[str, Any]) -> str:
    """quantkit's decode runs, each with the read bandwidth beside it."""
    runs = q["short"].get("runs")
    if not runs:
        return ""
    return " (quantkit's runs, tok/s at the read bandwidth beside each: " + ", ".join(
        f"{r['decode_tps']:.1f} at {r['read_gbs']} GB/s" for r in runs) + ")"


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def render(d: dict[str, Any]) -> str:
    m, s, p, q = d["machine"], d["shape"], d["plan"], d["rows"]["quantkit"]
    ll = d["rows"].get("llama.cpp")
    made = d["made"]
    how = ("given" if made.get("given") else "reused from an earlier run" if made.get("reused") else
           f"`{made['command']}` in {made['seconds']:.0f} s, peak RSS {_gb(made['peak_rss_sampled'])} GB")
    lines = [
        "# Full size: the 35B shape on this machine's CPU, against the plan and llama.cpp",
        "",
        f"Command: `{d['command']}` ({d['seconds'] / 60:.1f} min in all). Machine: {m['cpu']}, {m['cores']} cores, "
        f"{m['ram_gb']} GB RAM, instruction sets {m.get('isa', '?')}, torch {m['torch']}; {d['threads']} threads for "
        f"both engines; load average at start {m['load_avg_at_start']:.1f}; read bandwidth {d['read_bandwidth_gbs']} GB/s.",
        "",
        f"Model: layers {s['layers']}, experts {s['experts']} (top-{s['top_k']}), hidden {s['hidden']}, vocab "
        f"{s['vocab']:,}; random weights generated in the stored format (a test fixture: speed and memory are the "
        f"model's, outputs mean nothing); recipe {p['scheme']}; {_gb(d['folder_bytes'])} GB of shards. Folder: {how}; "
        f"`quantkit verify` (every shard hashed) {d['verify_s']:.0f} s; `quantkit profile-host` {d['calibrate_s']:.0f} s.",
        "",
        "## Plan (`quantkit plan --gpu none --cpu-bandwidth MEASURED --profile CALIBRATED`, this machine's free RAM)",
        "",
        f"Fits: **{'yes' if p['fits'] else 'no'}**, {_gb(p['total_bytes'])} GB in RAM at {d['context']:,} tokens of "
        f"context, up to {p['max_context']:,} tokens; estimates: decode {p['est_decode_tok_s']} tok/s and prefill "
        f"{p['est_prefill_tok_s']} tok/s (llama.cpp-grade), quantkit's calibrated decode "
        f"{p.get('runtime_decode_tok_s') or 'n/a'} tok/s and prefill {p.get('runtime_prefill_tok_s') or 'n/a'} tok/s "
        f"(calibrated at a read bandwidth of {d.get('calibrate_read_gbs', '?')} GB/s). Hardware as planned: "
        f"{p['hardware']}.",
        "",
        "## Measured",
        "",
        "| engine | load s | RSS after load GB | steady RSS GB | peak RSS GB (VmHWM) | peak sampled GB | decode tok/s "
        "(short prompt) | prefill tok/s (2k) | TTFT 2k s | TTFT next turn s | next turn prefilled / reused | decode tok/s at 2k |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for name, r in d["rows"].items():
        t1, t2 = r["turn1"], r["turn2"]
        lines.append(f"| {name} | {r['load_s']:.1f} | {_gb(r['after_load']['rss'])} | {_gb(r['end']['rss'])} | "
                     f"{_gb(r['end']['hwm'])} | {_gb(r['peak_rss_sampled'])} | {r['short']['decode_tps']:.2f} | "
                     f"{t1['prefill_tps']:.1f} | {t1['ttft_s']:.2f} | {t2['ttft_s']:.2f} | "
                     f"{t2['prefilled']} / {t2['reused']} | {t1['decode_tps']:.2f} |")
    lines += ["", f"Prompts: short {d['prompt_tokens']['short']} tokens, chat {d['prompt_tokens']['turn1']} tokens, next "
              f"turn {d['prompt_tokens']['turn2']} tokens; {d['new_tokens']} greedy tokens each; decode best of "
              f"{d['reps']}{_runs(q)}. quantkit's resident weights (loader): {_gb(q['weights_bytes'])} GB, of "
              f"which on 2 MiB pages after load {_gb(q['after_load'].get('huge', 0))} GB; interpreter "
              f"baseline before load {_gb(q['baseline']['rss'])} GB; route {q['route']}."]
    pc = q.get("prompt_cache")
    if pc:
        lines += ["", f"quantkit's prompt cache after the two turns: {pc['entries']} snapshots, {_gb(pc['bytes'])} GB "
                  f"(limit {_gb(pc['max_bytes'])} GB: the plan's budget of 2 snapshots, "
                  f"{_gb(d['plan']['components_bytes'].get('prompt_cache', 0))} GB; chat and serve default to a "
                  "quarter of the RAM free after load)."]
    c = d.get("generate_cli")
    if c:
        lines += ["", f"The command line: `{c['command']}` loaded and decoded {c['generation_tokens']} tokens "
                  f"({c['generation_tps']:.2f} tok/s, finish {c['finish_reason']}) in {c['wall_s']:.0f} s wall, peak "
                  f"RSS {_gb(c['peak_rss_sampled'])} GB."]
    g = d.get("gguf")
    if g:
        made_g = (f"exported in {g['seconds']:.0f} s at peak RSS {_gb(g['peak_rss_sampled'])} GB" if "seconds" in g
                  else "made before")
        if g.get("reused_file"):
            made_g += " (by an earlier run of this bench; this run reused the file)"
        lines += ["", f"GGUF `mixed` of the same folder: {_gb(g['bytes'])} GB, {made_g}; llama.cpp reads "
                  f"{_gb(g['step_bytes'])} GB of weights per token. Export: "
                  + "; ".join(" ".join(x.split()) for x in g.get("summary", []) if x.strip())]
    if ll:
        lines += ["", "llama.cpp's next turn re-prefills the whole history (it cannot roll a recurrent state back); "
                  "its RSS counts the GGUF's memory-mapped pages it touched."]
    lines += ["", "## Targets", ""]
    for t in d["targets"]:
        net = (f"; {t['without_interpreter']:.3f}x without the interpreter's own RSS before load (the plan keeps 3 GiB "
               "apart for the OS and Python)") if "without_interpreter" in t else ""
        lines.append(f"- {t['target']}: **{'met' if t['met'] else 'MISSED'}** ({t['ratio']:.3f}x{net}).")
    lines.append("")
    return "\n".join(lines)


def cli(
    reports: Path = shared("reports", Path("reports")),
    workdir: Path = shared("workdir", Path("/tmp/quantkit-bench-full-size")),
    model: Path = shared("model", None),
    threads: int = shared("threads", None),
    layers: int = shared("layers", None),
    experts: int = shared("experts", None),
    vocab: int = shared("vocab", None),
    prompt_tokens: int = shared("prompt_tokens", DEFAULTS["prompt_tokens"]),
    new_tokens: int = shared("new_tokens", DEFAULTS["new_tokens"]),
    reps: int = shared("reps", DEFAULTS["reps"]),
    llama: bool = llama_option(True),
    drop_gguf: bool = typer.Option(False, "--drop-gguf", help="delete the GGUF afterwards (disk)"),
) -> None:
    """The whole 35B shape on this CPU: generated, verified, planned, loaded and measured against the plan and
    llama.cpp, one engine process after the other.

    The generated folder and its GGUF (each tens of GB at full size) go in --workdir; --layers, --experts and
    --vocab shrink it for a trial run; --model: a quantized folder to run instead of generating one."""
    guard_reports(reports, "full-size")
    n = resolve_threads(threads)
    if model is not None and (layers or experts or vocab):
        raise QuantkitError("--model runs that folder: drop --layers/--experts/--vocab")
    d = run(reports, workdir, model, n, layers, experts, vocab, prompt_tokens, new_tokens, reps, llama,
            not drop_gguf)
    for t in d["targets"]:
        print(f"{'met' if t['met'] else 'MISSED'}: {t['target']} ({t['ratio']:.2f}x)")
    print(f"wrote {reports / 'bench-full-size.md'}")


def main(argv: list[str]) -> int:
    """`python -m benchmarks.full_size [OPTIONS]`: the bench; `python -m benchmarks.full_size WORKER ARGS.json
    OUT.json`: one of its children (`run` starts them)."""
    if argv and argv[0] in WORKERS:
        worker, inp, out = argv
        res = WORKERS[worker](json.loads(Path(inp).read_text()))
        Path(out).write_text(json.dumps(res))
        return 0
    return run_command(cli, argv, "full_size")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
