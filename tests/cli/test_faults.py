"""kill -9 at random points of every long-running writer (quantize, export gguf, export vllm, tiny-model,
chat --session),
then the same command again (issue 14): the result is byte-identical to an uninterrupted run, or the command
says exactly what to do (and doing it gives that result); no temporary file of the killed run survives.

Each writer runs in a child process; it is killed once its temporary output appears plus a random delay
(seeded: QK_FAULT_SEED, printed on failure), so most kills land mid-write and some during setup. The
reference and the reruns run in this process (no second import of torch)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.cli import run_cli
from helpers.probe import count, tree_digest

SEED = int(os.environ.get("QK_FAULT_SEED", "1414"))
REPORTS = ("quantkit-report.md", "quantkit-report.json")  # hold wall-clock seconds: not byte-stable


def _args(kind: str, src: Path, q: Path, out: Path) -> list:
    return {
        "quantize": ["quantize", src, "--out", out, "--max-shard-size", "60KB"],
        "gguf": ["export", "gguf", src, out],
        "vllm": ["export", "vllm", q, out],
        "tiny-model": ["tiny-model", out, "--layers", "2", "--hidden", "32", "--experts", "4"],
    }[kind]


def _digest(out: Path) -> dict[str, str]:
    if out.is_file():
        return tree_digest(out.parent) and {out.name: tree_digest(out.parent)[out.name]}
    return {k: v for k, v in tree_digest(out).items() if Path(k).name not in REPORTS}


def _started(out: Path) -> bool:
    """The writer has begun writing: its temporary (or, for quantize, its folder) exists."""
    return out.exists() or any(p.name.startswith(f".{out.name}.") for p in out.parent.iterdir())


def _kill_during(args: list, out: Path, delay: float, timeout: float = 120) -> int | None:
    env = {**os.environ, "COLUMNS": "200"}
    proc = subprocess.Popen([sys.executable, "-m", "quantkit", *map(str, args)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    while proc.poll() is None and not _started(out) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(delay)
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(30)
    return proc.returncode


@pytest.fixture(scope="module")
def q8(tiny_model: Path, tmp_path_factory) -> Path:
    from quantkit.checkpoint.reader import Checkpoint
    from quantkit.quantize.run import QuantizeOptions, run_quantize
    from quantkit.recipe import build_recipe

    out = tmp_path_factory.mktemp("faults-q") / "q"
    run_quantize(Checkpoint.open(tiny_model), out, QuantizeOptions(recipe=build_recipe(8, "int", None, False, [], None)))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["quantize", "gguf", "vllm", "tiny-model"])
def test_kill_9_then_rerun_gives_the_uninterrupted_result(kind, tiny_model, q8, tmp_path, capsys, monkeypatch):
    rng = random.Random(f"{SEED}-{kind}")
    name = "out.gguf" if kind == "gguf" else "out"
    ref = tmp_path / "ref" / name
    ref.parent.mkdir()
    code, _, err = run_cli(_args(kind, tiny_model, q8, ref), capsys, monkeypatch)
    assert code == 0, err
    want = _digest(ref)
    killed = 0
    for attempt in range(6):
        if attempt >= 2 and killed:
            break
        work = tmp_path / f"run{attempt}"
        work.mkdir()
        out = work / name
        # two kills at seeded delays; where the writer finished before both (a fast moment of the machine),
        # more with shorter delays, so a kill lands mid-write whatever the machine's speed
        delay = rng.uniform(0.0, 1.5 / 2 ** max(0, attempt - 1))
        rc = _kill_during(_args(kind, tiny_model, q8, out), out, delay)
        count()
        killed += rc == -signal.SIGKILL
        where = f"(seed {SEED}, kill {attempt} after {delay:.2f} s, exit {rc})"
        args = _args(kind, tiny_model, q8, out)
        code, _, err = run_cli([*args, "--resume" if kind == "quantize" else "--overwrite"], capsys, monkeypatch)
        if code != 0:  # the killed run had finished: the command says what to do; doing it must work
            assert "Traceback" not in err and len(err.strip().splitlines()) == 1, (where, err)
            assert kind == "quantize" and "quantkit verify" in err, (where, err)
            code, _, err = run_cli(["verify", out], capsys, monkeypatch)
            assert code == 0, (where, err)
        assert _digest(out) == want, f"rerun differs from the uninterrupted run {where}"
        leftovers = [p.name for p in work.iterdir() if p.name.startswith(".")]
        if out.is_dir():
            leftovers += [p.name for p in out.iterdir() if p.name.endswith(".tmp") or "progress" in p.name]
        assert leftovers == [], (where, leftovers)
    assert killed >= 1, "no kill landed before the writer finished: the test proved nothing"


@pytest.mark.parametrize("flag", [[], ["--resume"], ["--overwrite"]], ids=["new", "resume", "overwrite"])
def test_a_kill_before_the_journal_leaves_a_folder_any_rerun_takes(flag, tiny_model, tmp_path, capsys, monkeypatch):
    """Killed between making --out and renaming its journal into place, quantize leaves only the journal's
    temporary: the folder is as good as empty, so the rerun (new, --resume or --overwrite) writes the run's bytes
    (the random kills above land in that window only now and then)."""
    ref, out = tmp_path / "ref", tmp_path / "out"
    code, _, err = run_cli(_args("quantize", tiny_model, None, ref), capsys, monkeypatch)
    assert code == 0, err
    out.mkdir()
    (out / ".quantkit-progress.json.tmp").write_text('{"key": "cut sh')
    code, _, err = run_cli([*_args("quantize", tiny_model, None, out), *flag], capsys, monkeypatch)
    assert code == 0, err
    assert _digest(out) == _digest(ref)
    assert not any(p.name.endswith(".tmp") or "progress" in p.name for p in out.iterdir())


@pytest.mark.slow
def test_kill_9_during_a_chat_session_then_resume(tiny_model, tmp_path):
    """chat --session rewrites its file after every turn; killed at a random point of a scripted session, the
    next start resumes from the file (or ignores a damaged one with a notice), with one line and no traceback,
    and leaves no temporary behind."""
    rng = random.Random(f"{SEED}-chat")
    sess = tmp_path / "talk.qks"
    cmd = [sys.executable, "-m", "quantkit", "chat", str(tiny_model), "--session", str(sess), "--no-think",
           "--max-new-tokens", "4", "--temperature", "0"]
    env = {**os.environ, "COLUMNS": "200"}
    killed = 0
    for attempt in range(2):
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env=env)
        assert proc.stdin is not None
        proc.stdin.write("".join(f"turn {attempt}.{i}\n" for i in range(8)).encode())
        proc.stdin.flush()
        deadline = time.monotonic() + 120
        while proc.poll() is None and not _started(sess) and time.monotonic() < deadline:
            time.sleep(0.01)
        delay = rng.uniform(0.0, 1.0)
        time.sleep(delay)
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        count()
        killed += proc.returncode == -signal.SIGKILL
        where = f"(seed {SEED}, kill {attempt} after {delay:.2f} s, exit {proc.returncode})"
        saved = sess.exists()  # not when the kill landed inside the first save (its temporary is all there is)
        r = subprocess.run(cmd, input=b"/stats\n/exit\n", capture_output=True, env=env, timeout=300)
        err = r.stderr.decode()
        assert r.returncode == 0 and "Traceback" not in err, (where, err)
        assert ("resumed" in err or "damaged" in err) if saved else "resumed" not in err, (where, saved, err)
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == [], where
    assert killed >= 1, "no kill landed before the chat finished: the test proved nothing"
