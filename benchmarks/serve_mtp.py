"""`python -m benchmarks.serve_mtp`: MTP drafts inside the server's batch (issue 52, "MTP per slot").

The oracle setup of `bench mtp` (benchmarks/mtp.py): its realistic-shape checkpoint with an MTP layer, loaded with
the default recipe, greedy decoding, the real MTP layer run for every draft (its cost paid) and its draft replaced
by the model's own continuation, wrong on a share 1 - acceptance (`OracleDrafter`, one per row, matched to its row
by its prompt). The server runs in this process (uvicorn on a loopback port, `create_app` as `quantkit serve` builds
it, the prompt cache off so every request prefills alike) and is asked over HTTP with streamed completions, each
client its own process:
- one client on a default server (`--parallel` chosen as `serve` chooses it, MTP at its default) against `generate`
  with its default MTP (`Runtime.generate_ids`, the runtime's `DraftPlan`, warmed before the rounds) and with the
  count that default keeps here on a quiet host (FIXED; the plan's timing can settle elsewhere when other work
  shares the cores), decode tok/s of each measured the same way:
  (tokens - 1) / seconds from the first token to the last, in the thread that generates (the server's timings);
- two clients at once on `--parallel 2`, MTP at its default against `--mtp 0`: the tokens of both after each
  one's first / seconds from the first token either got to the last (the server's timings, on this clock).
Rounds alternate the two sides of each comparison; the best round of each side is reported with the others beside
it, and every run's tokens are checked equal to the greedy tokens without drafts. Writes reports/bench-serve-mtp.json
and a section of reports/bench-serve.md.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.cli import command_line, guard_reports, run_command, shared, write_json
from benchmarks.cli import threads as check_threads
from benchmarks.mtp import NEW_TOKENS, OracleDrafter, checkpoint
from quantkit.bench import write_section
from quantkit.bench.machine import machine_info

SECTION = ("<!-- serve mtp: begin -->", "<!-- serve mtp: end -->")
ACCEPTANCE = 0.88
PROMPT_TOKENS = (64, 66)  # two prompts, told apart by their length (the oracle matches a row to its own)
TARGET_ONE = 0.95  # one client on a default server against generate
TARGET_TWO = 1.2  # two slots with drafts against without
FIXED = 3  # the count generate's default keeps at 0.88 on a quiet host (reports/bench-mtp.md): the peer it should be


class RowOracles:
    """`MTP.draft` for every row: an `OracleDrafter` per MTP cache, on the reference sequence of the prompt whose
    length puts its first draft where it is (pair i carries the token at position i + 1)."""

    def __init__(self, real: Any, seqs: dict[int, list[int]], acceptance: float, seed: int):
        self.real, self.seqs, self.acceptance, self.seed = real, seqs, acceptance, seed
        self.by: dict[int, OracleDrafter] = {}

    def __call__(self, model: Any, tokens: list[int], hidden: torch.Tensor, cache: Any) -> tuple[int, Any]:
        o = self.by.get(cache.serial)
        if o is None:  # the first draft of this row: its MTP cache holds the prompt's pairs, n - 1 of them
            o = self.by[cache.serial] = OracleDrafter(self.real, self.seqs[cache.n + 1], self.acceptance, self.seed)
        return o(model, tokens, hidden, cache)


class Server:
    """uvicorn serving `app` on a thread, on a loopback socket bound to a free port."""

    def __init__(self, app: Any):
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> Server:
        self.thread.start()
        deadline = time.monotonic() + 120
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


CLIENT = """
import json, sys, time
import httpx
url, n, prompts = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
def one(ids):
    body = {"model": "m", "prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    text, count, timings = "", 0, None
    sent = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=900) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                d = json.loads(line[6:])
                timings = d.get("timings") or timings
                count = (d.get("usage") or {}).get("completion_tokens", count)
                text += "".join(c.get("text") or "" for c in d.get("choices", []))
    return {"sent": sent, "timings": timings, "text": text, "count": count}
print(json.dumps(one(prompts[0])))
"""


def clients(url: str, prompts: list[list[int]], n: int) -> list[dict[str, Any]]:
    """A streamed /v1/completions of each prompt (token ids), all at once, each from its own client process (as
    a server's clients are: their HTTP work takes no turn in this one), greedy, `n` tokens: its text, its token
    count, the server's timings and when its first and last token were made (the time it was sent plus the
    server's queue, prompt and decode times; perf_counter is the machine's monotonic clock in both processes)."""
    procs = [subprocess.Popen([sys.executable, "-c", CLIENT, url, str(n), json.dumps([ids])], stdout=subprocess.PIPE,
                              text=True) for ids in prompts]
    out = []
    for p in procs:
        stdout, _ = p.communicate(timeout=1800)
        if p.returncode:
            raise RuntimeError(f"a client exited with {p.returncode}")
        r = json.loads(stdout)
        t = r["timings"]
        r["first"] = r["sent"] + (t["queue_ms"] + t["prompt_ms"]) / 1e3
        r["last"] = r["first"] + t["predicted_ms"] / 1e3
        out.append(r)
    return out


def measure(model_dir: Path | None, workdir: Path, n_threads: int, rounds: int, new_tokens: int) -> dict[str, Any]:
    """Both comparisons on a worker thread (the server's worker steps its slots on one too)."""
    out: dict[str, Any] = {}
    errors: list[BaseException] = []

    def work() -> None:
        try:
            out.update(_measure(model_dir, workdir, n_threads, rounds, new_tokens))
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            errors.append(e)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    if errors:
        raise errors[0]
    return out


def _measure(model_dir: Path | None, workdir: Path, n_threads: int, rounds: int, new_tokens: int) -> dict[str, Any]:
    from quantkit.recipe import build_recipe
    from quantkit.runtime import SamplingParams, load_model
    from quantkit.runtime.batch_drafts import DraftPlan
    from quantkit.server.app import ServerConfig, create_app
    from quantkit.server.parallel import choose_parallel
    from quantkit.server.runtime_backend import RuntimeBackend

    torch.set_num_threads(n_threads)
    src = model_dir or checkpoint(workdir, 4, 64, 248320, print)
    rec = build_recipe()
    rt = load_model(src, recipe=rec.name, verify="quick")
    if rt.model.mtp is None:
        raise RuntimeError(f"{src} has no MTP layer")
    real = rt.model.mtp.draft
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 700, (n,), generator=g).tolist() for n in PROMPT_TOKENS]
    sp = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    rt.set_mtp(0)
    runs = [[e for e in rt.generate_ids(p, sp, thinking=False, stop_ids=set()) if e.token is not None]
            for p in prompts]
    refs = [[e.token for e in run] for run in runs]
    texts = ["".join(e.text for e in run) for run in runs]  # what a client gets of them
    seqs = {len(p): p + r for p, r in zip(prompts, refs, strict=True)}
    plan = DraftPlan()

    def generate_once(rnd: int, draft: int | None = None) -> dict[str, Any]:
        rt.model.mtp.draft = RowOracles(real, seqs, ACCEPTANCE, rnd)
        rt.set_mtp(draft)
        if draft is None:
            rt.draft_plan = plan  # the default, what it measured kept across runs as a session keeps it
        times, toks, resp = [], [], None
        for e in rt.generate_ids(prompts[0], sp, thinking=False, stop_ids=set()):
            if e.token is not None:
                times.append(time.perf_counter())
                toks.append(e.token)
            resp = e.response or resp
        assert resp is not None
        return {"tok_s": (len(toks) - 1) / (times[-1] - times[0]), "same": toks == refs[0], "mtp": resp.mtp,
                "generation_tps": resp.generation_tps}

    for rnd in range(3):  # generate's default measures its shapes first, as it keeps them across runs
        generate_once(rnd)
    backend = RuntimeBackend(rt, "m")
    slots = choose_parallel(rt, None, backend.max_context)
    one: dict[str, list[dict[str, Any]]] = {"generate": [], "generate_fixed": [], "serve": []}
    with Server(create_app(backend, ServerConfig(parallel=slots))) as s:
        for rnd in range(rounds + 1):  # the first round warms up (and lets the plans measure)
            g1 = generate_once(rnd)
            g3 = generate_once(rnd, FIXED)
            rt.model.mtp.draft = RowOracles(real, seqs, ACCEPTANCE, rnd)
            rt.draft_plan = DraftPlan()  # the server's default: drafts left to quantkit, measured afresh
            r = clients(s.url, prompts[:1], new_tokens)[0]
            t = r["timings"]
            r1 = {"tok_s": (t["predicted_n"] - 1) / (t["predicted_ms"] / 1e3), "same": r["text"] == texts[0]
                  and r["count"] == new_tokens, "drafts": [t.get("draft_n"), t.get("draft_n_accepted")]}
            print(f"round {rnd}: generate {g1['tok_s']:.1f} tok/s (--mtp {FIXED}: {g3['tok_s']:.1f}), one client "
                  f"on serve --parallel {slots} {r1['tok_s']:.1f} tok/s")
            if rnd:
                one["generate"].append(g1)
                one["generate_fixed"].append(g3)
                one["serve"].append(r1)
    two: dict[str, list[dict[str, Any]]] = {"drafts": [], "no_drafts": []}
    with Server(create_app(backend, ServerConfig(parallel=2))) as s:
        for rnd in range(rounds + 1):
            for side in ("drafts", "no_drafts"):
                rt.model.mtp.draft = RowOracles(real, seqs, ACCEPTANCE, rnd)
                if side == "drafts":
                    rt.draft_plan = DraftPlan()
                else:
                    rt.set_mtp(0)
                got = clients(s.url, prompts, new_tokens)
                span = max(x["last"] for x in got) - min(x["first"] for x in got)
                res = {"tok_s": (sum(x["count"] for x in got) - len(got)) / span,
                       "same": [x["text"] for x in got] == texts and all(x["count"] == new_tokens for x in got),
                       "drafts": [[x["timings"].get("draft_n"), x["timings"].get("draft_n_accepted")] for x in got]}
                print(f"round {rnd}: 2 slots, {side}: {res['tok_s']:.1f} tok/s")
                if rnd:
                    two[side].append(res)
    rt.model.mtp.draft = real
    return {"route": rt.route()["name"], "slots_default": slots, "recipe": rec.name,
            "one": one, "two": two,
            "generate_default": plan.line(),
            "same_tokens": all(x["same"] for side in [*one.values(), *two.values()] for x in side)}


def summarise(d: dict[str, Any]) -> dict[str, Any]:
    def best(xs: list[dict[str, Any]]) -> float:
        return max(x["tok_s"] for x in xs)

    def med(xs: list[dict[str, Any]]) -> float:
        return statistics.median(x["tok_s"] for x in xs)

    m = d["measured"]
    one, two = m["one"], m["two"]
    return {
        "one_client": {"generate_tok_s": best(one["generate"]), "generate_fixed_tok_s": best(one["generate_fixed"]),
                       "serve_tok_s": best(one["serve"]),
                       "ratio": best(one["serve"]) / best(one["generate"]),
                       "ratio_median": med(one["serve"]) / med(one["generate"]),
                       "ratio_fixed": best(one["serve"]) / best(one["generate_fixed"]),
                       "ratio_fixed_median": med(one["serve"]) / med(one["generate_fixed"]), "target": TARGET_ONE},
        "two_slots": {"drafts_tok_s": best(two["drafts"]), "no_drafts_tok_s": best(two["no_drafts"]),
                      "ratio": best(two["drafts"]) / best(two["no_drafts"]),
                      "ratio_median": med(two["drafts"]) / med(two["no_drafts"]), "target": TARGET_TWO},
    }


def write_report(reports: Path, d: dict[str, Any]) -> None:
    reports.mkdir(parents=True, exist_ok=True)
    write_json(reports / "bench-serve-mtp.json", d)
    m, s, mm = d["machine"], d["summary"], d["measured"]
    one, two = s["one_client"], s["two_slots"]

    def rounds(xs: list[dict[str, Any]]) -> str:
        return ", ".join(f"{x['tok_s']:.1f}" for x in xs)

    lines = [SECTION[0], "## MTP drafts inside the batch (one engine for every call)", "",
             f"Command: `{d['command']}`. Machine: {m.get('cpu', '?')}, {m.get('logical_cores', '?')} logical cores, "
             f"{d['threads']} threads, load average at start {m.get('load_avg_at_start')}, at end "
             f"{d['load_avg_at_end']} (above the core count, other work shared the machine). `bench mtp`'s oracle "
             f"setup: its realistic-shape checkpoint with an MTP layer ({mm['recipe']} recipe, route {mm['route']}), "
             f"greedy, {d['new_tokens']} tokens, drafts accepted at {ACCEPTANCE} (the real MTP layer runs, the "
             "oracle picks the token). The server in process over HTTP, each client its own process (streamed "
             "/v1/completions, prompt cache off); rounds alternated, the best of each side, every round listed.", "",
             "| comparison | quantkit | peer | ratio (best) | ratio (medians) | target |", "|---|---:|---:|---:|---:|---:|",
             f"| one client on a default `serve` (--parallel {mm['slots_default']}) vs `generate`, default MTP both "
             f"| {one['serve_tok_s']:.1f} | {one['generate_tok_s']:.1f} | {one['ratio']:.2f}x | "
             f"{one['ratio_median']:.2f}x | >= {one['target']}x |",
             f"| the same against `generate --mtp {FIXED}` (what its default keeps at 0.88 on a quiet host) | "
             f"{one['serve_tok_s']:.1f} | {one['generate_fixed_tok_s']:.1f} | {one['ratio_fixed']:.2f}x | "
             f"{one['ratio_fixed_median']:.2f}x | >= {one['target']}x |",
             f"| 2 slots, 2 clients: MTP default vs --mtp 0 | {two['drafts_tok_s']:.1f} | {two['no_drafts_tok_s']:.1f} "
             f"| {two['ratio']:.2f}x | {two['ratio_median']:.2f}x | >= {two['target']}x |", "",
             f"Rounds (tok/s): generate {rounds(mm['one']['generate'])} (its default: {mm['generate_default']}), "
             f"--mtp {FIXED} {rounds(mm['one']['generate_fixed'])}; one client on serve "
             f"{rounds(mm['one']['serve'])}; 2 slots with drafts {rounds(mm['two']['drafts'])}, without "
             f"{rounds(mm['two']['no_drafts'])}. Drafted / accepted per request: serve "
             f"{[x['drafts'] for x in mm['one']['serve']]}, 2 slots {[x['drafts'] for x in mm['two']['drafts']]}; "
             f"generate {[x['mtp'] for x in mm['one']['generate']][-1]}. Greedy tokens equal to decoding without "
             f"drafts in every run: {mm['same_tokens']}.", "",
             "Decode tok/s: one client, (tokens - 1) / seconds from its first token to its last in the thread that "
             "generates (`generate`: its token events; the server: its timings); two clients, the tokens of both "
             "after each one's first / seconds from the first token either got to the last (sent time plus the "
             "server's timings). `generate`'s plan measured in three runs before the rounds; the server's plan "
             "measured in the warm-up round.", SECTION[1]]
    write_section(reports / "bench-serve.md", "\n".join(lines) + "\n", SECTION)


def cli(
    reports: Path = shared("reports", Path("reports")),
    workdir: Path = shared("workdir", Path("/tmp/quantkit-bench-mtp")),
    model: Path = shared("model", None),
    threads: int = shared("threads", None),
    rounds: int = shared("rounds", 3),
    new_tokens: int = shared("new_tokens", NEW_TOKENS),
) -> None:
    """One client on a default server against generate, and 2 slots with and without drafts, MTP at 0.88
    acceptance (bench mtp's oracle). Writes bench-serve-mtp.json and its section of bench-serve.md."""
    guard_reports(reports, "serve-mtp")
    n = check_threads(threads)
    d: dict[str, Any] = {"command": command_line("serve_mtp", sys.argv[1:]), "machine": machine_info(),
                         "threads": n, "rounds": rounds, "new_tokens": new_tokens}
    d["measured"] = measure(model, workdir, n, rounds, new_tokens)
    d["summary"] = summarise(d)
    d["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    write_report(reports, d)
    s = d["summary"]
    print(f"one client: {s['one_client']['ratio']:.2f}x generate; 2 slots: {s['two_slots']['ratio']:.2f}x no drafts")
    print(f"wrote {reports / 'bench-serve.md'}")


def main(argv: list[str] | None = None) -> int:
    return run_command(cli, argv, "serve_mtp")


if __name__ == "__main__":
    sys.exit(main())
