"""`quantkit bench serve --agents 1,4,8`: the agent-rollout load, quantkit against llama-server and vLLM CPU.

N agents run at once, each a T-turn rollout (quantkit/bench/agent_texts.py): turn t sends the chat markup of the
shared system prompt (tools, about 700 words) and that agent's messages so far, with the assistant's turn open,
as one streamed `/v1/completions` request (`--turn-tokens` tokens, ignore_eos, temperature 0, usage included);
the agent appends the text it got and a tool result, and sends the next turn. An agent's turns run in sequence.

Per engine and N: total completion tokens / the round's wall time; time to first text (TTFT) p50/p95/max over
all requests; prompt tokens the engine counted and those it says it reused (`reused_tokens`: usage's
prompt_tokens_details.cached_tokens, else llama.cpp's timings.cache_n; None where neither comes back). Each
prompt is counted by the model's own tokenizer too, after the round: the engines' counts against it show the
three tokenize the same text alike.

Engines, each started with N slots, one at a time, alternated per N (quantkit, llama-server, vLLM):
- quantkit: `quantkit serve --parallel N` (serve_slots.quantkit_command) with its prompt cache at its default;
- llama-server: `-np N` on the GGUF `mixed` export of the same codes (serve_slots.llama_command; its prompt
  cache at its defaults);
- vLLM CPU (`--vllm PYTHON`, quantkit/bench/vllm_server.py): `quantkit export vllm --rest bf16` of the same
  folder (the experts' codes the same, the rest dequantized to bf16), prefix caching on; where the server fails
  with it on, off (the report says which and why).
A warm-up request first; `rounds` rounds per engine and N, each with agents of its own (their first messages
name the round), the best (total tok/s) kept. An engine that fails is a row with its error, the rest run on.

Figures go to reports/bench-serve-agents.json and a section of reports/bench-serve.md.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import httpx

from quantkit.bench import vllm_server, write_section
from quantkit.bench.agent_texts import Agent
from quantkit.bench.machine import machine_info
from quantkit.bench.serve import free_port, http
from quantkit.bench.serve_slots import (
    llama_command,
    parse_clients,
    parse_extra,
    quantkit_command,
    served_checkpoint,
    summary,
    together,
    wait_ready,
)
from quantkit.errors import QuantkitError
from quantkit.export.vllm_cpu import CPU_GROUP
from quantkit.fileio import atomic_write_json

SECTION = ("<!-- bench serve --agents: begin -->", "<!-- bench serve --agents: end -->")
TURNS = 3
TURN_TOKENS = 32
ROUNDS = 1
MAX_AGENTS = 16
ENGINES = ("quantkit", "llama-server", "vLLM")
# vLLM CPU 0.32's int4 MoE kernel (AMX) has no key for group 32 ("kernel does not support quantization scheme
# QuantKey(uint4b8, ... GroupShape(row=1, col=32))"), the group of llama.cpp's Q4_0 and of the serve checkpoint:
# its export regroups the experts to the group it loads (requantized from the same weights)
VLLM_GROUP = CPU_GROUP
TARGET = ("quantkit 8 agents / llama-server -np 8", 8, "llama-server", 3.0)  # issue 52's


def parse_agents(text: str) -> list[int]:
    """`1,4,8` as agent counts, or one clear error."""
    return parse_clients(text, MAX_AGENTS, flag="--agents")


# ---- one request, one agent, one round ----
def read_stream(lines: Iterable[str], clock: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """A completion's SSE lines: when (`clock`) its first text came, the text, and the last usage and timings
    objects they carried (a usage-only chunk, llama.cpp's timings on its last chunks). An error event raises."""
    first, parts, usage, timings = None, [], None, None
    for line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        ev = json.loads(line[6:])
        if "error" in ev:
            raise QuantkitError(f"error event in the stream: {str(ev['error'])[:300]}")
        usage = ev.get("usage") or usage
        timings = ev.get("timings") or timings
        for c in ev.get("choices") or []:
            if c.get("text"):
                first = first or clock()
                parts.append(c["text"])
    return {"first": first, "text": "".join(parts), "usage": usage, "timings": timings}


def stream_completion(url: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """One streamed /v1/completions request: when it was sent and ended, and what `read_stream` reads of it."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    with http().stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise QuantkitError(f"{url}: status {r.status_code}: {r.read()[:300]!r}")
        got = read_stream(r.iter_lines())
    return {"sent": sent, **got, "end": time.perf_counter()}


def reused_tokens(usage: dict[str, Any] | None, timings: dict[str, Any] | None) -> tuple[int | None, str | None]:
    """Prompt tokens the engine says it did not prefill, and which field said it."""
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is not None:
        return int(cached), "usage.prompt_tokens_details.cached_tokens"
    if (timings or {}).get("cache_n") is not None:
        return int(timings["cache_n"]), "timings.cache_n"  # type: ignore[index]
    return None, None


def record(raw: dict[str, Any], agent: int, turn: int, max_tokens: int) -> dict[str, Any]:
    """One request's figures from its stream (`stream_completion`)."""
    usage, timings = raw["usage"] or {}, raw["timings"] or {}
    reused, source = reused_tokens(raw["usage"], raw["timings"])
    prompt = usage.get("prompt_tokens")
    if prompt is None and timings.get("prompt_n") is not None:
        prompt = timings["prompt_n"] + (timings.get("cache_n") or 0)
    tokens = usage.get("completion_tokens", timings.get("predicted_n"))
    return {"agent": agent, "turn": turn, "ttft_s": None if raw["first"] is None else raw["first"] - raw["sent"],
            "seconds": raw["end"] - raw["sent"], "tokens": max_tokens if tokens is None else int(tokens),
            "tokens_counted": tokens is not None, "prompt_tokens": prompt, "reused_tokens": reused,
            "reused_from": source, "cache_n": timings.get("cache_n"), "answer_chars": len(raw["text"])}


def rollout(url: str, tag: str, index: int, turns: int, turn_tokens: int) -> tuple[list[dict[str, Any]], list[str]]:
    """One agent's turns in sequence: each request's figures and the prompts sent."""
    agent, out, prompts = Agent(tag, index), [], []
    for t in range(turns):
        prompts.append(agent.prompt())
        raw = stream_completion(url, prompts[-1], turn_tokens)
        out.append(record(raw, index, t, turn_tokens))
        agent.answered(raw["text"])
    return out, prompts


def figures(requests: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    """A round's totals over its requests: tok/s over `wall`, TTFT, prompt tokens and those reused."""
    tokens = sum(r["tokens"] for r in requests)
    prompt = [r["prompt_tokens"] for r in requests]
    reused = [r["reused_tokens"] for r in requests]
    sent = sum(prompt) if None not in prompt else None
    got = sum(reused) if requests and None not in reused else None  # type: ignore[arg-type]
    turns = sorted({r["turn"] for r in requests})
    return {"requests": len(requests), "wall_s": wall, "tokens": tokens,
            "tokens_counted": all(r["tokens_counted"] for r in requests),
            "tok_s": tokens / wall if wall > 0 else None,
            "ttft_s": summary([r["ttft_s"] for r in requests if r["ttft_s"] is not None]),
            "ttft_by_turn_s": {str(t): summary([r["ttft_s"] for r in requests if r["turn"] == t and
                                                r["ttft_s"] is not None]) for t in turns},
            "prompt_tokens": sent, "reused_tokens": got,
            # llama.cpp's own count beside usage's, where the engine sends timings
            "cache_n": sum(r["cache_n"] for r in requests) if requests and all(
                r["cache_n"] is not None for r in requests) else None,
            "reused_pct": 100.0 * got / sent if got is not None and sent else None,
            "reused_from": sorted({r["reused_from"] for r in requests if r["reused_from"]})}


def agent_round(url: str, agents: int, turns: int, turn_tokens: int, tag: str,
                count: Callable[[str], int] | None = None) -> dict[str, Any]:
    """`agents` rollouts at once (module docstring); `count` (the model's tokenizer) counts each prompt after."""
    t0 = time.perf_counter()
    got = together([lambda a=a: rollout(url, tag, a, turns, turn_tokens) for a in range(agents)])
    wall = time.perf_counter() - t0
    requests = [r for reqs, _ in got for r in reqs]
    out = {"agents": agents, "tag": tag, **figures(requests, wall), "per_request": requests}
    if count is not None:  # outside the timed round: tokenizing here would take the engines' cores
        local = [count(p) for _, prompts in got for p in prompts]
        out["prompt_tokens_local"] = sum(local)
        out["prompt_tokens_same"] = sum(r["prompt_tokens"] == n for r, n in zip(requests, local, strict=True))
    return out


# ---- the engines ----
def start(cmd: list[str], log: Path, env: dict[str, str] | None = None, timeout: float = 900
          ) -> tuple[subprocess.Popen, str]:
    """`cmd` (a server on 127.0.0.1 at the port it names) in a session of its own, up and answering /health."""
    port = cmd[cmd.index("--port") + 1]
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                stdin=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, proc, log, timeout)
    except BaseException:
        stop(proc)
        raise
    return proc, base


def stop(proc: subprocess.Popen, timeout: float = 60) -> None:
    """Ctrl-C the server as a user would, then kill what is left of its session (vLLM's engine process)."""
    for sig, wait in ((signal.SIGINT, timeout), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        if wait is not None:
            try:
                proc.wait(wait)
            except subprocess.TimeoutExpired:
                pass
    proc.wait()


def last_error(log: Path) -> str:
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if "Error" in ln or "error" in ln]
    return lines[-1][:300] if lines else "no error line in its log"


def _measure(name: str, cmd: list[str], env: dict[str, str] | None, log: Path, n: int, rounds: int, turns: int,
             turn_tokens: int, count: Callable[[str], int] | None, say: Callable[[str], None]) -> dict[str, Any]:
    say(f"{name} with {n} slots: {shlex.join(cmd)}")
    proc, base = start(cmd, log, env)
    try:
        stream_completion(base, "warm up", 2)  # first-request costs (lazy kernels, compiles) kept out
        got = [agent_round(base, n, turns, turn_tokens, f"{name}-{n}-{k}", count) for k in range(rounds)]
    finally:
        stop(proc)
    best = max(got, key=lambda r: r["tok_s"] or 0.0)
    return {"engine": name, **best, "tok_s_rounds": [r["tok_s"] for r in got]}


def run(reports: Path, model_dir: Path | None, workdir: Path, agents: list[int], turns: int, turn_tokens: int,
        context: int, threads: int | None, llama_server: Path | None, vllm: Path | None, rounds: int = ROUNDS,
        log: Callable[[str], None] = print, extra: str | None = None) -> dict[str, Any]:
    """Every agent count on every engine given (module docstring); the report written. `extra`: more `quantkit
    serve` arguments (--quantkit-args: a setting compared, e.g. `--prefill rows`)."""
    more = parse_extra(extra)
    if llama_server is not None and not llama_server.is_file():  # before anything is made
        raise QuantkitError(f"--llama-server {llama_server}: no such file; build one with scripts/build-llama-server.sh")
    if turns < 1 or turn_tokens < 1:
        raise QuantkitError(f"--turns {turns} --turn-tokens {turn_tokens}: give at least 1 of each")
    vllm_version = vllm_server.check_python(vllm) if vllm is not None else None
    machine = machine_info()
    model = served_checkpoint(model_dir, workdir, log)
    from quantkit.runtime.engine import load_tokenizer

    tok = load_tokenizer(model)

    def count(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False))

    makers: list[tuple[str, Callable[[int, int], tuple[list[str], dict[str, str] | None]]]] = [
        ("quantkit", lambda port, n: (quantkit_command(model, port, n, context, threads, prompt_cache=True) + more,
                                      None))]
    gguf = export = None
    export_notes: list[str] = []
    if llama_server is not None:
        from quantkit.export.gguf import export_gguf

        gguf = workdir / "serve-agents-mixed.gguf"
        log(f"exporting {model} to {gguf} (mixed: the same codes)")
        export_gguf(model, gguf, "mixed", overwrite=True)
        makers.append(("llama-server", lambda port, n: (llama_command(llama_server, gguf, port, n, context, threads),
                                                        None)))
    prefix = {"on": True, "note": None}
    if vllm is not None:
        from quantkit.export.compressed_tensors import export_vllm

        export = workdir / "serve-agents-vllm-bf16"
        log(f"exporting {model} to {export} (vLLM CPU's layout: experts int4 g{VLLM_GROUP}, the rest bf16)")
        export_notes = export_vllm(model, export, group_size=VLLM_GROUP, rest="bf16", overwrite=True).notes
        env = vllm_server.environment(workdir, threads)
        makers.append(("vLLM", lambda port, n: (vllm_server.command(vllm, export, port, n, context, prefix["on"]),
                                                env)))
    rows: list[dict[str, Any]] = []
    commands: dict[str, str] = {}
    for n in agents:
        for name, make in makers:  # one run, alternated: each engine at each count
            lf = workdir / f"agents-{name}-{n}.log"
            try:
                try:
                    cmd, env_ = make(free_port(), n)
                    commands[name] = shlex.join(cmd)
                    rows.append(_measure(name, cmd, env_, lf, n, rounds, turns, turn_tokens, count, log))
                except (QuantkitError, httpx.HTTPError) as e:
                    if name != "vLLM" or not prefix["on"]:
                        raise
                    # vLLM CPU's hybrid (Gated DeltaNet) prefix-cache path may be missing: the run goes on without
                    prefix.update(on=False, note=f"with prefix caching on it failed ({e}; log: {last_error(lf)})")
                    log(f"vLLM: {prefix['note']}; again with prefix caching off")
                    lf = workdir / f"agents-{name}-{n}-no-prefix-caching.log"
                    cmd, env_ = make(free_port(), n)
                    commands[name] = shlex.join(cmd)
                    rows.append(_measure(name, cmd, env_, lf, n, rounds, turns, turn_tokens, count, log))
            except (QuantkitError, httpx.HTTPError) as e:
                log(f"{name} with {n} slots failed: {e}")
                rows.append({"engine": name, "agents": n, "error": f"{e} (log: {lf}: {last_error(lf)})"})
    d = {"command": " ".join(["quantkit", *map(shlex.quote, sys.argv[1:])]) if sys.argv[1:] else "quantkit bench serve",
         "machine": machine, "load_avg_at_end": [round(x, 2) for x in os.getloadavg()], "model": str(model),
         "gguf": str(gguf) if gguf else None, "vllm_export": str(export) if export else None,
         "vllm_version": vllm_version, "vllm_export_notes": export_notes, "vllm_prefix_caching": (prefix["on"], prefix["note"]) if vllm else None,
         "settings": {"agents": agents, "turns": turns, "turn_tokens": turn_tokens, "context": context,
                      "threads": threads, "rounds": rounds, "quantkit_args": more},
         "engine_commands": commands, "rows": rows}
    write_report(reports, d)
    return d


# ---- the report ----
def row(d: dict[str, Any], engine: str, agents: int) -> dict[str, Any] | None:
    return next((r for r in d["rows"] if r["engine"] == engine and r["agents"] == agents and "tok_s" in r), None)


def ratio(d: dict[str, Any], a: str, b: str, agents: int) -> float | None:
    x, y = row(d, a, agents), row(d, b, agents)
    return x["tok_s"] / y["tok_s"] if x and y and x["tok_s"] and y["tok_s"] else None


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f}"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def cache_n_note(d: dict[str, Any]) -> str:
    """Where an engine sent llama.cpp's timings.cache_n beside usage's cached_tokens: whether the two agree."""
    both = [r for r in d["rows"] if r.get("cache_n") is not None and r.get("reused_tokens") is not None
            and r["reused_from"] == ["usage.prompt_tokens_details.cached_tokens"]]
    if not both:
        return ""
    engines = sorted({r["engine"] for r in both})
    same = all(r["cache_n"] == r["reused_tokens"] for r in both)
    return (f" {', '.join(engines)}: `timings.cache_n` " + ("equals usage's count in every row." if same else
            "differs from usage's count: " + "; ".join(f"{r['engine']} {r['agents']}: {r['cache_n']} against "
                                                       f"{r['reused_tokens']}" for r in both) + "."))


def write_report(reports: Path, d: dict[str, Any]) -> None:
    """bench-serve-agents.json, and the --agents section of bench-serve.md (replaced in place, the rest kept)."""
    reports.mkdir(parents=True, exist_ok=True)
    atomic_write_json(reports / "bench-serve-agents.json", d)
    m, st = d["machine"], d["settings"]
    engines = [e for e in ENGINES if any(r["engine"] == e for r in d["rows"])]
    cmds = "; ".join(f"{e}: `{c}`" for e, c in d["engine_commands"].items())
    vp = d.get("vllm_prefix_caching")
    notes = " ".join(f"Export: {x}." for x in d.get("vllm_export_notes") or [])
    vnote = "" if vp is None else (
        f" vLLM {d['vllm_version']} on `{d['vllm_export']}` (`export vllm --rest bf16 --group-size {VLLM_GROUP}`: "
        "the rest dequantized to bf16, the experts int4 at a group vLLM CPU's MoE kernel takes; it has no "
        f"group-32 scheme, the group of Q4_0 and of this checkpoint). {notes} Prefix caching "
        + ("on." if vp[0] else f"off: {vp[1]}."))
    lines = [SECTION[0], "## Agent rollouts (`--agents`)", "",
             f"Command: `{d['command']}`. Machine: {m.get('cpu', '?')}, {m.get('logical_cores', '?')} logical cores, "
             f"load average at start {m.get('load_avg_at_start')}, at end {d['load_avg_at_end']} (above the core "
             "count, other work shared the machine). "
             f"Model: `{d['model']}`. Load: N agents at once, each {st['turns']} turns in sequence over one shared "
             f"system prompt (tools, about 700 words) and its own growing history (its answers and a 100-200 word "
             f"tool result per turn), each turn a streamed `/v1/completions` of its chat markup, {st['turn_tokens']} "
             f"tokens (ignore_eos, greedy); {st['rounds']} round(s) per engine and N, the best (total tok/s) shown. "
             "TTFT: time to the first text, over every request, in ms. Prompt tokens: as each engine counted them "
             "(same: requests whose count equals the model tokenizer's); reused: the prompt tokens the engine "
             "says it did not prefill (usage `prompt_tokens_details.cached_tokens`, else llama.cpp's "
             "`timings.cache_n`)." + vnote + cache_n_note(d), "", f"Engines, each with N slots (the lines at N = "
             f"{st['agents'][-1]}): {cmds}.", ""]
    for n in st["agents"]:
        lines += [f"### {n} agent{'s' if n > 1 else ''}", "",
                  "| engine | total tok/s | TTFT p50 | TTFT p95 | TTFT max | prompt tokens | same | reused | reused % |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for e in engines:
            r = next((r for r in d["rows"] if r["engine"] == e and r["agents"] == n), None)
            if r is None:
                continue
            if "error" in r:
                lines.append(f"| {e} | failed: {r['error']} | | | | | | | |")
                continue
            ft = r["ttft_s"]
            same = f"{r['prompt_tokens_same']}/{r['requests']}" if "prompt_tokens_same" in r else "-"
            reused = "n/a" if r["reused_tokens"] is None else f"{r['reused_tokens']:,}"
            pct = "n/a" if r["reused_pct"] is None else f"{r['reused_pct']:.0f}%"
            sent = "-" if r["prompt_tokens"] is None else f"{r['prompt_tokens']:,}"
            lines.append(f"| {e} | {r['tok_s']:.1f} | {_ms(ft['p50'])} | {_ms(ft['p95'])} | {_ms(ft['max'])} | "
                         f"{sent} | {same} | {reused} | {pct} |")
        rs = [f"quantkit / {e}: {_x(ratio(d, 'quantkit', e, n))}" for e in engines if e != "quantkit"]
        lines += (["", "Total tok/s, " + "; ".join(rs) + "."] if rs else []) + [""]
    what, n, peer, want = TARGET
    v = ratio(d, "quantkit", peer, n)
    lines += [f"Target (issue 52): {what} >= {want}x in total tok/s: {_x(v)}, "
              + ("not measured (no such rows)." if v is None else "met." if v >= want else "missed."), SECTION[1]]
    write_section(reports / "bench-serve.md", "\n".join(lines) + "\n", SECTION)
