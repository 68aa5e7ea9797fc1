"""The streaming quantizer's stages (quantize/stream.py): bytes that do not depend on the thread count or on a
kill, bounded memory, error figures measured inside the format, and its refusals."""

from __future__ import annotations

import errno
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import quantkit.quantize.shards as shards_mod
from quantkit.checkpoint.reader import Checkpoint
from quantkit.errors import QuantkitError
from quantkit.formats import QuantSpec, get_format
from quantkit.quantize.manifest import JOURNAL_NAME, MANIFEST_NAME
from quantkit.quantize.run import QuantizeOptions, run_quantize
from quantkit.recipe import build_recipe

from helpers.cli import one_line_error, run_main, sigkill_mid_run


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if not p.name.startswith("quantkit-report")}


def _cmd(src: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "quantkit", "quantize", str(src), "--out", str(out), "--bits", "4", "--uniform",
            "--max-shard-size", "60KB", *extra]


@pytest.mark.slow
def test_thread_counts_and_a_kill_give_the_same_bytes(tiny_model, tmp_path):
    ref = tmp_path / "ref"
    subprocess.run(_cmd(tiny_model, ref, "--threads", "1"), check=True, capture_output=True)
    two = tmp_path / "two"
    subprocess.run(_cmd(tiny_model, two, "--threads", "2"), check=True, capture_output=True)
    assert _files(two) == _files(ref)
    out = tmp_path / "out"
    if not sigkill_mid_run(_cmd(tiny_model, out, "--threads", "2"), out, "model-00002-*.safetensors", 6, 0.03):
        pytest.skip("the run finished before it could be killed")
    r = subprocess.run(_cmd(tiny_model, out, "--threads", "2", "--resume"), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert _files(out) == _files(ref)


@pytest.mark.parametrize("n", ["0", "4096"])
def test_bad_thread_count_is_one_line(tiny_model, tmp_path, n):
    out = tmp_path / "o"
    r = run_main("quantize", tiny_model, "--out", out, "--threads", n)
    one_line_error(r.returncode, r.stdout, r.stderr, f"--threads {n}")
    assert not out.exists()


@pytest.mark.parametrize("cmd", [["stats"], ["export", "gguf"], ["export", "vllm"]])
def test_stats_and_exporters_check_threads_first(tiny_model, tmp_path, cmd):
    out = tmp_path / "o"
    args = [*cmd, tiny_model, *(["--out"] if cmd == ["stats"] else []), out, "--threads", "0"]
    r = run_main(*args)
    one_line_error(r.returncode, r.stdout, r.stderr, "--threads 0")
    assert not out.exists()


def test_full_disk_mid_run_is_one_line_and_resumes(tiny_model, tmp_path, monkeypatch):
    recipe = build_recipe(4, uniform=True)
    ref = tmp_path / "ref"
    run_quantize(Checkpoint.open(tiny_model), ref, QuantizeOptions(recipe, max_shard_size=60_000))
    real, calls = shards_mod.os.pwrite, {"n": 0}

    def pwrite(fd, data, off):
        calls["n"] += 1
        if calls["n"] == 60:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, off)

    monkeypatch.setattr(shards_mod.os, "pwrite", pwrite)
    out = tmp_path / "out"
    with pytest.raises(QuantkitError) as e:
        run_quantize(Checkpoint.open(tiny_model), out, QuantizeOptions(recipe, max_shard_size=60_000))
    assert "No space left on device" in str(e.value) and "--resume" in str(e.value) and "\n" not in str(e.value)
    assert not list(out.glob(".*.tmp")) and not (out / MANIFEST_NAME).exists()
    assert json.loads((out / JOURNAL_NAME).read_text())["done"]  # shards finished before the failure stay
    monkeypatch.setattr(shards_mod.os, "pwrite", real)
    run_quantize(Checkpoint.open(tiny_model), out, QuantizeOptions(recipe, max_shard_size=60_000, mode="resume"))
    assert _files(out) == _files(ref)


@pytest.mark.parametrize("bits,fmt,group", [(4, "int", 32), (4, "int", 128), (8, "int", None)])
def test_report_error_is_the_stored_weights_error(tiny_model, tmp_path, bits, fmt, group):
    """The error measured inside the format's chunks equals the error of the stored weights, dequantized."""
    out = tmp_path / "q"
    res = run_quantize(Checkpoint.open(tiny_model), out,
                       QuantizeOptions(build_recipe(bits, fmt, group, True, [], None), max_shard_size=60_000))
    qc = json.loads((out / "config.json").read_text())["quantization_config"]["tensors"]
    stored = {}
    for f in sorted(out.glob("model-*.safetensors")):
        stored.update(load_file(f))
    ck = Checkpoint.open(tiny_model)
    checked = 0
    for st in res.stats:
        if st.name not in qc:
            continue
        spec = QuantSpec.from_dict(qc[st.name])
        parts = {k[len(st.name) + 1:]: v for k, v in stored.items() if k.startswith(st.name + ".")}
        w = ck.load(st.name).float()
        deq = get_format(spec.format).dequantize(parts, spec, tuple(w.shape), torch.float32)
        err = float((deq.double() - w.double()).pow(2).sum())
        assert st.sq_err == pytest.approx(err, rel=1e-4, abs=1e-12), st.name
        assert st.sq_ref == pytest.approx(float(w.double().pow(2).sum()), rel=1e-5), st.name
        checked += 1
    assert checked > 10


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads VmHWM from /proc")
def test_memory_stays_under_the_bound(tmp_path):
    """A model whose expert stacks are 128x the slab: the run's growth in RSS stays under peak_bound (2 input
    blocks + 2 output arenas + threads x chunk temporaries + the stages' own objects)."""
    from quantkit.testing.tiny import make_tiny_model

    src = make_tiny_model(tmp_path / "m", layers=1, experts=64, hidden=1024, intermediate=512, seed=1)
    code = textwrap.dedent(f"""
        import json, torch
        from pathlib import Path
        from quantkit.checkpoint.reader import Checkpoint
        from quantkit.quantize.run import QuantizeOptions, run_quantize, block_sizes, make_plan, peak_bound
        from quantkit.recipe import build_recipe
        from quantkit.formats import QuantSpec, get_format
        get_format("int4").quantize(torch.randn(64, 1024).bfloat16(), QuantSpec("int4", 32))  # warm the pools
        ck = Checkpoint.open({str(src)!r})
        opts = QuantizeOptions(build_recipe(4, "int", 32, True, [], None), slab_bytes=1 << 20, threads=2)
        plan = make_plan(list(ck.canonical()), opts.recipe)
        b_in, b_out = block_sizes(plan, plan.shard_names, [], opts.slab_bytes)
        rss0 = int(open("/proc/self/statm").read().split()[1]) * 4096
        run_quantize(ck, Path({str(tmp_path / "q")!r}), opts)
        # VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the (larger) pytest process across exec
        peak = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")) * 1024
        largest = max(t.in_bytes for t in plan.tensors)
        print(json.dumps({{"grew": peak - rss0, "bound": peak_bound(b_in, b_out, 2), "largest": largest}}))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    d = json.loads(r.stdout.strip().splitlines()[-1])
    assert d["largest"] > 2 * d["bound"]  # reading one stack whole (and its fp32 copy) would break the bound
    assert d["grew"] <= d["bound"], d
