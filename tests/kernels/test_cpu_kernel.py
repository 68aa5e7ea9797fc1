"""quantkit's C++ CPU kernel (kernels/csrc/qk_cpu.cpp; built and loaded by kernels/, repacked and called by
runtime/cpu_kernel.py): every path on every op table (generic, AVX2, AVX512, AVX512-BF16: the `kernel_table`
fixture) against the fp32 reference, the fused MoE decode against the per-expert route, the forced instruction
set, and the fallbacks (switched off, a unit or the whole build failing, a corrupt or foreign cached module)
each costing one line.

Error bound: activations are rounded to int8 per block of 32 (scale = the block's largest magnitude /
127): about 0.6% rms per element on Gaussian inputs, so a matmul lands within ~0.6% of the fp32 result
of the same dequantized weights; 2e-2 relative (Frobenius) leaves room for short rows, and the bf16
torch route is held to 1e-2 in test_runtime_kernels.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from quantkit.formats import QuantSpec, get_format
from quantkit.kernels import build as kernel_build
from quantkit.kernels import cpu as kernel_cpu
from quantkit.runtime import cpu_kernel
from quantkit.runtime.kernels import DenseKernel, Projections, QBf16Kernel, QKernel, prepare, reference_matmul
from quantkit.runtime.qexperts import ExpertGroup, QuantExperts

from helpers.kernels import ISA_VALUES, forced_isa_table

pytestmark = pytest.mark.skipif(not kernel_cpu.available(), reason="the CPU kernel is not built on this machine")

TOL = 2e-2
SPECS = [QuantSpec("int4", 32), QuantSpec("int4", 64, symmetric=False), QuantSpec("int4", 128), QuantSpec("int8")]
SPEC_IDS = ["int4-g32", "int4-g64-asym", "int4-g128", "int8"]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def isa(kernel_table):
    return kernel_table


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
@pytest.mark.parametrize("shape", [(16, 128), (40, 256), (200, 2048)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_linear_matches_fp32_reference(isa, spec, shape):
    g = torch.Generator().manual_seed(shape[0] + shape[1])
    w = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
    parts = get_format(spec.format).quantize(w, spec)
    k = prepare(parts, spec, shape)
    assert isinstance(k, QKernel)
    for m in (1, 3, 5, 70):  # 70 rows: chunks of 4 (1 generic) and a remainder
        x = torch.randn(m, shape[1], generator=g)
        y = k(x)
        assert y.shape == (m, shape[0]) and y.dtype == torch.float32
        assert rel(y, reference_matmul(x, parts, spec, shape)) < TOL, (m, k.route)


@pytest.mark.parametrize("spec", [*SPECS, None], ids=[*SPEC_IDS, "bf16"])
def test_a_row_gets_the_same_bits_in_any_batch(isa, spec):
    """Rows go through a tile in chunks of up to 8 (4 on AVX2, 1 on generic; bf16: 8 with AVX512-BF16, 4 on
    AVX512, 2 on AVX2) and the remainder in a smaller chunk; whichever chunk a row lands in, its sums are those of
    the one-row (decode) tile, bit for bit, through the kernel's own call and through `rows` (a decode batch: bf16
    too, where the call hands a prefill's count to torch). 40 outputs leave a partial second tile; 19 rows are two
    chunks of 8 and a remainder."""
    shape = (40, 256)
    g = torch.Generator().manual_seed(11)
    w = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
    parts = get_format(spec.format).quantize(w, spec) if spec else w
    k = prepare(parts, spec, shape)
    assert isinstance(k, QKernel if spec else QBf16Kernel)
    x = torch.randn(19, shape[1], generator=g)
    alone = torch.cat([k(x[i:i + 1]) for i in range(len(x))])
    for m in range(2, len(x) + 1):
        assert torch.equal(k.rows(x[:m]), alone[:m]), m
        if spec is not None or m <= QBf16Kernel.MAX_ROWS:
            assert torch.equal(k(x[:m]), alone[:m]), m
    if spec is None:  # bf16 activations, fp32 sums
        assert rel(alone, reference_matmul(x.to(torch.bfloat16).float(), parts, spec, shape)) < 1e-5
    else:
        assert rel(alone, reference_matmul(x, parts, spec, shape)) < TOL


@pytest.mark.parametrize("spec", [*SPECS, None], ids=[*SPEC_IDS, "bf16"])
def test_bf16_activations_in_and_out_without_torch_casts(isa, spec):
    """A bf16 x gives a bf16 y from the kernel itself, bit-equal to the fp32 route rounded by torch
    (the widening and the rounding happen inside the call, not as separate torch ops)."""
    shape = (40, 256)
    g = torch.Generator().manual_seed(7)
    w = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
    parts = get_format(spec.format).quantize(w, spec) if spec else w
    k = prepare(parts, spec, shape)
    for m in (1, 3):
        x = torch.randn(m, shape[1], generator=g).to(torch.bfloat16)
        raw = k._mod.linear_bf16(x, k.w) if spec is None else k._mod.linear(
            x, k.qw, k.scales, k.zeros, k.fmt_bits, k.group, k.out_features)
        assert raw.dtype == torch.bfloat16
        assert torch.equal(raw, k(x.float()).to(torch.bfloat16)) and torch.equal(k(x), raw)
        assert torch.equal(k(x.to(torch.float16)), k(x.float()).to(torch.float16))  # other dtypes via torch


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_projections_on_one_input_equal_their_kernels(isa, dtype):
    """A layer's projections of one hidden state in one `linear_many` call (every format, bf16 kept
    matrices among them, odd row counts): each output equals its own kernel's,
    bit for bit; a kernel the call cannot take sends the whole group through the kernels one by one."""
    g = torch.Generator().manual_seed(3)
    k_in = 256
    specs = [*SPECS, None]
    kernels = []
    for i, spec in enumerate(specs):
        w = (torch.randn(24 + 40 * i, k_in, generator=g) * 0.02).to(torch.bfloat16)
        kernels.append(prepare(get_format(spec.format).quantize(w, spec) if spec else w, spec, tuple(w.shape)))
    proj = Projections(kernels)
    assert proj.fused
    for m in (1, 3):
        x = torch.randn(m, k_in, generator=g).to(dtype)
        got = proj(x)
        assert len(got) == len(kernels)
        for y, k in zip(got, kernels, strict=True):
            assert y.dtype == k(x).dtype and torch.equal(y, k(x))
    # a decode batch of any count in one call: each row the bits of its own call
    x = torch.randn(13, k_in, generator=g).to(dtype)
    for m in (5, 8, 13):
        for y, k in zip(proj.rows(x[:m]), kernels, strict=True):
            assert y.dtype == x.dtype and torch.equal(y, torch.cat([k(x[i:i + 1]) for i in range(m)])), m
    odd = Projections([kernels[0], DenseKernel(torch.randn(8, k_in).to(torch.bfloat16))])
    assert not odd.fused
    x = torch.randn(1, k_in, generator=g).to(dtype)
    assert torch.equal(odd(x)[0], kernels[0](x))


def test_outliers_and_zero_blocks(isa):
    """A block of zeros (scale 0) gives exact zeros; a large outlier only coarsens its own block."""
    shape = (32, 256)
    spec = QuantSpec("int4", 32)
    w = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    parts = get_format("int4").quantize(w, spec)
    k = prepare(parts, spec, shape)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(1))
    x[:, :32] = 0
    x[0, 100] = 1e4
    assert rel(k(x), reference_matmul(x, parts, spec, shape)) < TOL
    assert torch.count_nonzero(k(torch.zeros(1, 256))) == 0


def test_an_int8_code_of_minus_128_is_read_as_minus_127_in_any_batch(isa):
    """quantkit writes int8 codes in -127..127; a foreign -128 is read as -127 on every table, so a row gets the
    same bits alone (the AVX2 one-row tile, |x| against sign(w, x)) and in a batch (|w| against sign(x, w))."""
    spec, shape = QuantSpec("int8"), (32, 256)
    g = torch.Generator().manual_seed(5)
    parts = get_format("int8").quantize((torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16), spec)
    q = parts["qweight"]
    q[::3, ::5] = -128
    clamped = {**parts, "qweight": q.clamp(min=-127)}
    x = torch.randn(5, shape[1], generator=g)
    k, want = prepare(parts, spec, shape), prepare(clamped, spec, shape)
    alone = torch.cat([k(x[i:i + 1]) for i in range(len(x))])
    assert torch.equal(alone, torch.cat([want(x[i:i + 1]) for i in range(len(x))]))
    for m in range(2, len(x) + 1):
        assert torch.equal(k(x[:m]), alone[:m]), m


E, H, INTER, TOPK = 8, 256, 128, 4


def experts(spec: QuantSpec | None, route: str | None = None, groups: list[list[int]] | None = None,
            seed: int = 0) -> tuple[QuantExperts, list, list]:
    """spec None: bf16 experts (their parts are the bf16 tensors)."""
    g = torch.Generator().manual_seed(seed)
    gu = [(torch.randn(2 * INTER, H, generator=g) * 0.05).to(torch.bfloat16) for _ in range(E)]
    dn = [(torch.randn(H, INTER, generator=g) * 0.05).to(torch.bfloat16) for _ in range(E)]
    if spec is None:
        gu_p, dn_p = gu, dn
    else:
        fmt = get_format(spec.format)
        gu_p, dn_p = [fmt.quantize(w, spec) for w in gu], [fmt.quantize(w, spec) for w in dn]
    out = []
    for ids in groups or [list(range(E))]:
        grp = ExpertGroup(torch.device("cpu"), list(ids))
        for e in ids:
            grp.gate_up.append(prepare(gu_p[e], spec, (2 * INTER, H), route=route))
            grp.down.append(prepare(dn_p[e], spec, (H, INTER), route=route))
        out.append(grp)
    return QuantExperts(E, H, INTER, out), gu_p, dn_p


def reference(spec, gu_p, dn_p, x, idx, w) -> torch.Tensor:
    y = torch.zeros(H)
    for slot, e in enumerate(idx[0].tolist()):
        h = reference_matmul(x.float(), gu_p[e], spec, (2 * INTER, H))
        a = torch.nn.functional.silu(h[:, :INTER]) * h[:, INTER:]
        y += float(w[0, slot]) * reference_matmul(a, dn_p[e], spec, (H, INTER))[0]
    return y[None]


def routing(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, H, generator=g)
    w, idx = torch.softmax(torch.randn(1, E, generator=g), -1).topk(TOPK, dim=-1)
    return x, idx, w / w.sum(-1, keepdim=True)


@pytest.mark.parametrize("spec", [*SPECS, None], ids=[*SPEC_IDS, "bf16"])
def test_fused_moe_decode_matches_reference_and_torch_route(isa, spec):
    q, gu_p, dn_p = experts(spec)
    qt, _, _ = experts(spec, route="torch")
    for seed in range(3):
        x, idx, w = routing(seed)
        got = q(x, idx, w)
        assert q._fused_table() is not None
        want = reference(spec, gu_p, dn_p, x, idx, w)
        assert got.shape == (1, H) and got.dtype == x.dtype
        assert rel(got, want) < TOL
        assert rel(got, qt(x.bfloat16(), idx, w.bfloat16())) < TOL


@pytest.mark.parametrize("shape", [(7, 64), (40, 256), (200, 2048)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_bf16_linear_is_exact_fp32_accumulation(isa, shape):
    """bf16 x bf16 products summed in fp32: the fp32 matmul of the bf16-rounded inputs, to fp32 rounding;
    above MAX_ROWS rows the same tensor goes through F.linear."""
    g = torch.Generator().manual_seed(shape[0])
    w = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
    k = prepare(w, None, shape)
    assert isinstance(k, QBf16Kernel) and isinstance(k, DenseKernel)
    for m in (1, 2, QBf16Kernel.MAX_ROWS, 9):
        x = torch.randn(m, shape[1], generator=g)
        ref = x.to(torch.bfloat16).float() @ w.float().t()
        assert rel(k(x), ref) < (1e-5 if m <= QBf16Kernel.MAX_ROWS else 1e-2), m
    assert isinstance(prepare(w, None, shape, route="torch"), DenseKernel)
    assert not isinstance(prepare(w, None, shape, route="torch"), QBf16Kernel)


class CountingModule:
    def __init__(self, mod):
        self.mod, self.calls = mod, 0

    def moe(self, *args):
        self.calls += 1
        return self.mod.moe(*args)


@pytest.mark.usefixtures("isa")
def test_decode_is_one_call_and_independent_of_the_split():
    spec = QuantSpec("int4", 32)
    whole, _, _ = experts(spec)
    x, idx, w = routing(5)
    want = whole(x, idx, w)
    mod, table, ok = whole._fused_table()
    counting = CountingModule(mod)
    whole._fused = (counting, table, ok)
    assert torch.equal(whole(x, idx, w), want) and counting.calls == 1
    for groups in ([[0, 1, 2, 3], [4, 5, 6, 7]], [[1, 3, 5, 7], [0, 2, 4, 6]]):
        split, _, _ = experts(spec, groups=groups)
        assert torch.equal(split(x, idx, w), want), groups


@pytest.mark.parametrize("spec", [QuantSpec("int4", 32), QuantSpec("int8"), None], ids=["int4-g32", "int8", "bf16"])
@pytest.mark.usefixtures("isa")
def test_fused_moe_is_the_same_on_any_thread_count(spec):
    """The gate_up phase reads runs of tiles whose length follows the thread count (whole experts on few
    threads, halved runs on many); every length gives the same sums, bit for bit."""
    q, gu_p, dn_p = experts(spec)
    before = torch.get_num_threads()
    try:
        for seed in range(2):
            x, idx, w = routing(seed)
            got = []
            for n in (1, 2, 3, 8):  # INTER 128, top-4: runs of 8 tiles on 1 and 2 threads, 4 on 3, 2 on 8
                torch.set_num_threads(n)
                got.append(q(x, idx, w))
            assert all(torch.equal(g, got[0]) for g in got[1:])
            assert rel(got[0], reference(spec, gu_p, dn_p, x, idx, w)) < TOL
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("spec", [*SPECS, None], ids=[*SPEC_IDS, "bf16"])
def test_moe_of_rows_is_moe_row_by_row_bit_for_bit(isa, spec):
    """qk.moe of T rows (a verify's or a batch's, each expert of the rows' union read once) gives each row the
    sums qk.moe gives it alone, bit for bit: rows sharing experts, rows with none in common, an expert in different
    slots of different rows, and threads splitting the work unevenly."""
    q, _gu, _dn = experts(spec)
    mod, table, _ok = q._fused_table()
    g = torch.Generator().manual_seed(5)
    before = torch.get_num_threads()
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            for t in (1, 2, 3, 4):
                x = torch.randn(t, H, generator=g).to(torch.bfloat16)
                ids = torch.stack([torch.randperm(E, generator=g)[:TOPK] for _ in range(t)])
                if t > 1:
                    ids[1] = ids[0].flip(0)  # the same experts in other slots
                wts = torch.softmax(torch.randn(t, TOPK, generator=g), -1)
                got = mod.moe(x, table, ids, wts)
                want = torch.cat([mod.moe(x[j], table, ids[j], wts[j]) for j in range(t)])
                assert got.shape == (t, H) and torch.equal(got, want), (threads, t)
    finally:
        torch.set_num_threads(before)
    with pytest.raises(RuntimeError, match="qk_moe: expert id out of range"):
        mod.moe(x, table, torch.full((t, TOPK), E), wts)


@pytest.mark.usefixtures("isa")
def test_mixed_fused_and_unfused_experts():
    """Experts the kernel cannot take (here: forced onto torch's route) run beside one fused call."""
    spec = QuantSpec("int8")
    q, gu_p, dn_p = experts(spec)
    qt, _, _ = experts(spec, route="torch")
    for i in (1, 4, 6):  # these experts keep torch's kernels
        q.groups[0].gate_up[i], q.groups[0].down[i] = qt.groups[0].gate_up[i], qt.groups[0].down[i]
    x, idx, w = routing(2)
    idx[0, :3] = torch.tensor([1, 2, 4])
    assert rel(q(x, idx, w), reference(spec, gu_p, dn_p, x, idx, w)) < TOL
    assert q._fused_table()[2] == [i not in (1, 4, 6) for i in range(E)]


@pytest.mark.usefixtures("isa")
def test_prefill_uses_the_same_kernels():
    spec = QuantSpec("int4", 32)
    q, gu_p, dn_p = experts(spec)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(6, H, generator=g)
    w, idx = torch.softmax(torch.randn(6, E, generator=g), -1).topk(TOPK, dim=-1)
    got = q(x, idx, w)
    want = torch.cat([reference(spec, gu_p, dn_p, x[t:t + 1], idx[t:t + 1], w[t:t + 1]) for t in range(6)])
    assert rel(got, want) < TOL


def test_bad_arguments_are_errors_not_crashes():
    mod = kernel_cpu.module()
    qw, s, _ = cpu_kernel.repack_int4(torch.zeros(16, 64, dtype=torch.uint8), torch.ones(16, 2), None)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        mod.linear(torch.zeros(1, 48), qw, s, None, 4, 32, 16)
    with pytest.raises(RuntimeError, match="wrong size"):
        mod.linear(torch.zeros(1, 96), qw, s, None, 4, 32, 16)
    table = torch.zeros(2, 2, 8, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="no fused kernel"):
        mod.moe(torch.zeros(H), table, torch.tensor([0]), torch.ones(1))
    with pytest.raises(RuntimeError, match="out of range"):
        mod.moe(torch.zeros(H), table, torch.tensor([5]), torch.ones(1))
    with pytest.raises(RuntimeError, match="does not take this input"):
        mod.linear_many(torch.zeros(1, 64), torch.zeros(1, 8, dtype=torch.int64))
    k = prepare(get_format("int8").quantize(torch.randn(16, 64).bfloat16(), QuantSpec("int8")), QuantSpec("int8"), (16, 64))
    with pytest.raises(RuntimeError, match="does not take this input"):
        mod.linear_many(torch.zeros(1, 96), torch.tensor([k.descriptor()]))


# ---------------------------------------------------------------- fallbacks, in fresh processes

PROBE = (
    "import torch\n"
    "from quantkit.formats import QuantSpec, get_format\n"
    "from quantkit.runtime.kernels import prepare, reference_matmul\n"
    "s = QuantSpec('int4', 32); w = torch.randn(32, 64).bfloat16(); p = get_format('int4').quantize(w, s)\n"
    "k = prepare(p, s, (32, 64)); x = torch.randn(2, 64)\n"
    "e = float((k(x).float() - reference_matmul(x, p, s, (32, 64))).norm() / reference_matmul(x, p, s, (32, 64)).norm())\n"
    "print('ROUTE', k.route, e < 2e-2)\n"
)


def run_probe(env: dict[str, str | None]) -> subprocess.CompletedProcess:
    """Run PROBE in a fresh interpreter with env on top of ours (a None value removes that variable)."""
    full = {k: v for k, v in {**os.environ, "PYTHONPATH": str(ROOT), **env}.items() if v is not None}
    return subprocess.run([sys.executable, "-c", PROBE], env=full, capture_output=True, text=True, timeout=600)


def route_line(p: subprocess.CompletedProcess) -> str:
    assert p.returncode == 0, p.stderr
    assert "Traceback" not in p.stderr, p.stderr
    return next(ln for ln in p.stdout.splitlines() if ln.startswith("ROUTE"))


def test_switched_off_keeps_torch_route_quietly():
    p = run_probe({"QUANTKIT_CPU_ISA": "none"})
    assert route_line(p) == "ROUTE torch _weight_int4pack_mm_for_cpu True"
    assert p.stderr.strip() == ""


def _levels() -> list[str]:
    """The levels this CPU and build can run, best first."""
    best = kernel_cpu.module().detect_isa()
    return [kernel_cpu.ISA_NAMES[i] for i in range(best, -1, -1)]


BF16_PROBE = ("import torch\nfrom quantkit.runtime.kernels import prepare\n"
              "print('ROUTE', prepare(torch.zeros(32, 64, dtype=torch.bfloat16), None, (32, 64)).route)\n")


@pytest.mark.parametrize("level", ISA_VALUES)
def test_forced_isa_runs_that_table_quietly(level):
    """QUANTKIT_CPU_ISA=LEVEL runs that level's table (LEVEL-plain: without its extension) for every matrix,
    bf16 included, with nothing on stderr."""
    table = forced_isa_table(level)  # avx2vnni for avx2 where the CPU has AVX-VNNI
    p = run_probe({"QUANTKIT_CPU_ISA": level})
    assert route_line(p) == f"ROUTE quantkit qk int4 ({table}, int8 activations) True"
    assert p.stderr.strip() == ""
    p = subprocess.run([sys.executable, "-c", BF16_PROBE], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "QUANTKIT_CPU_ISA": level})
    assert route_line(p) == f"ROUTE quantkit qk bf16 ({table}) at decode, F.linear above 4 rows"


@pytest.mark.parametrize("value,best,want,why", [
    ("avx9", 2, 2, "is not one of generic, avx2, avx512"), ("avx512", 1, 1, "cannot run it; using avx2"),
    ("avx2", 0, 0, "cannot run it; using generic"), (" AVX2 ", 2, 1, None), ("generic", 1, 0, None)])
def test_isa_switch_values(monkeypatch, capsys, value, best, want, why):
    """QUANTKIT_CPU_ISA against what the CPU has (`best`, as a CPU without AVX2 or AVX512 reports it): a level
    at or below it is taken as asked; an unknown one or one above it costs one line and runs the best."""
    monkeypatch.setenv("QUANTKIT_CPU_ISA", value)
    monkeypatch.setattr(kernel_build, "_notice_given", set())
    assert kernel_cpu.chosen_level(best) == want
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [] if why is None else (len(err) == 1 and err[0].startswith("quantkit: ") and why in err[0])


def test_bad_isa_switch_in_a_fresh_process():
    """End to end: one line on stderr, no traceback, and the kernel still runs at the best level."""
    p = run_probe({"QUANTKIT_CPU_ISA": "avx9"})
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "is not one of" in lines[0], p.stderr
    assert route_line(p) == f"ROUTE quantkit qk int4 ({kernel_cpu.best_table(_levels()[0])}, int8 activations) True"


def test_foreign_compiler_gets_its_own_cache(tmp_path, monkeypatch):
    """The cache folder is keyed by the compiler (its path and version) and the units' flags: a module
    another compiler built is never loaded, it is rebuilt in a folder of its own."""
    here = kernel_build.cache_dir()
    fake = tmp_path / "c++"
    fake.write_text("#!/bin/sh\n[ \"$1\" = --version ] && echo 'c++ (Other) 99.1' && exit 0\nexec g++ \"$@\"\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    assert kernel_build.cache_dir() != here
    monkeypatch.delenv("CXX")
    monkeypatch.setattr(kernel_build, "UNIT_CFLAGS", (*kernel_build.UNIT_CFLAGS, "-DQK_OTHER=1"))
    assert kernel_build.cache_dir() != here


def test_any_edited_added_or_removed_source_changes_the_cache_folder(tmp_path, monkeypatch):
    """The cache folder is keyed by every file in csrc/ (the quantizer's header as much as the decode ops'):
    a module built from other sources is never loaded."""
    csrc = tmp_path / "csrc"
    shutil.copytree(kernel_build.CSRC, csrc)
    monkeypatch.setattr(kernel_build, "CSRC", csrc)
    seen = {kernel_build.cache_dir()}
    impl = csrc / "qk_quant_impl.h"
    impl.write_text(impl.read_text() + "\n")
    seen.add(kernel_build.cache_dir())
    (csrc / "qk_new.h").write_text("#pragma once\n")
    seen.add(kernel_build.cache_dir())
    (csrc / "qk_new.h").rename(csrc / "qk_renamed.h")
    seen.add(kernel_build.cache_dir())
    (csrc / "qk_renamed.h").unlink()
    seen.add(kernel_build.cache_dir())  # the edited header alone: the folder of the step before the new file
    assert len(seen) == 4


@pytest.mark.slow
def test_a_unit_the_compiler_cannot_build_is_left_out(tmp_path):
    """A unit the compiler refuses is left out with one line naming it; the module still loads and runs the
    units that built (here: the generic one alone, under a compiler that refuses every other unit)."""
    cxx = tmp_path / "c++"
    cxx.write_text("#!/bin/sh\ncase \"$*\" in *qk_ops_avx*) echo 'error: this compiler refuses the unit' >&2; "
                   "exit 1;; esac\nexec g++ \"$@\"\n")
    cxx.chmod(0o755)
    p = run_probe({"QUANTKIT_KERNEL_CACHE": str(tmp_path / "cache"), "CXX": str(cxx),
                   "QUANTKIT_CPU_ISA": None})  # a forced-ISA leg would add its own line about the missing table
    assert route_line(p) == "ROUTE quantkit qk int4 (generic, int8 activations) True"
    lines = [ln for ln in p.stderr.splitlines() if ln.strip() and "building the CPU kernel" not in ln]
    named = sorted(ln.split("the ")[1].split(" unit")[0] for ln in lines)
    assert named == sorted(u for u in kernel_build.units() if u != "generic"), p.stderr
    assert all(ln.startswith("quantkit: CPU kernel: the ") and "did not build" in ln for ln in lines), p.stderr


def copy_cache(tmp_path: Path) -> Path:
    """A copy of the built cache (ninja's logs included, so ninja sees it up to date)."""
    src = kernel_build.cache_dir()
    dst = tmp_path / "cache" / src.name
    shutil.copytree(src, dst)
    return dst


def test_failed_build_is_one_line_and_torch_route(tmp_path):
    """No compiler (CXX points at `false`), empty cache: one notice line, torch's kernels, no traceback."""
    p = run_probe({"QUANTKIT_KERNEL_CACHE": str(tmp_path), "CXX": "false"})
    assert route_line(p) == "ROUTE torch _weight_int4pack_mm_for_cpu True"
    notices = [ln for ln in p.stderr.splitlines() if ln.strip() and "building the CPU kernel" not in ln]
    # one line, though the probe both quantizes and multiplies: the quantizer's ops are the same module's
    assert len(notices) == 1 and "CPU kernel unavailable" in notices[0], p.stderr
    assert notices[0].startswith("quantkit: "), p.stderr
    build = subprocess.run([sys.executable, "-m", "quantkit.kernels.cpu", "build"], capture_output=True,
                           text=True, env={**os.environ, "PYTHONPATH": str(ROOT), "QUANTKIT_KERNEL_CACHE": str(tmp_path),
                                           "CXX": "false"}, timeout=600)
    assert build.returncode == 0 and "Traceback" not in build.stderr


def test_corrupt_cached_module_is_rebuilt_or_falls_back(tmp_path):
    d = copy_cache(tmp_path)
    so = d / f"quantkit_{d.name.replace('-', '_')}.so"
    so.write_bytes(b"not an ELF file")
    # the rebuild fails too (no compiler): one line, torch's kernels
    p = run_probe({"QUANTKIT_KERNEL_CACHE": str(d.parent), "CXX": "false"})
    assert route_line(p) == "ROUTE torch _weight_int4pack_mm_for_cpu True"
    assert "CPU kernel unavailable" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.slow
def test_corrupt_cached_module_is_rebuilt(tmp_path):
    d = copy_cache(tmp_path)
    so = d / f"quantkit_{d.name.replace('-', '_')}.so"
    so.write_bytes(so.read_bytes()[:4096])  # truncated
    p = run_probe({"QUANTKIT_KERNEL_CACHE": str(d.parent)})
    assert route_line(p).startswith("ROUTE quantkit qk int4") and route_line(p).endswith("True")
    assert "CPU kernel unavailable" not in p.stderr


@pytest.mark.parametrize("spec", SPECS, ids=SPEC_IDS)
def test_repack_in_chunks_matches_one_piece(monkeypatch, spec):
    """Large matrices (the lm_head) are repacked a few thousand rows at a time: chunk edges that fall
    inside the padding or mid-matrix give the same tiles."""
    w = (torch.randn(100, 256, generator=torch.Generator().manual_seed(2)) * 0.02).to(torch.bfloat16)
    parts = get_format(spec.format).quantize(w, spec)
    whole = prepare(parts, spec, (100, 256))
    monkeypatch.setattr(cpu_kernel, "_REPACK_ROWS", 32)
    chunked = prepare(parts, spec, (100, 256))
    for a, b in zip(whole.tensors(), chunked.tensors(), strict=True):
        assert torch.equal(a, b)


def test_unwritable_cache_is_one_line_and_torch_route(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    p = run_probe({"QUANTKIT_KERNEL_CACHE": str(blocker / "kernels")})
    assert route_line(p) == "ROUTE torch _weight_int4pack_mm_for_cpu True"
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    # one line for the decode ops and the quantizer's alike (one module), naming the folder and the way out
    assert len(lines) == 1 and lines[0].startswith(f"quantkit: kernel cache {blocker / 'kernels'}"), p.stderr
    assert "QUANTKIT_KERNEL_CACHE" in lines[0]


@pytest.mark.usefixtures("isa")
def test_bf16_weight_read_at_any_offset_is_used_in_place():
    """A bf16 tensor read from a shard is a view at any byte offset: the kernel uses it as it is (no
    copy that would double the resident bytes)."""
    w = (torch.randn(48, 128, generator=torch.Generator().manual_seed(5)) * 0.02).to(torch.bfloat16)
    buf = torch.zeros(w.numel() * 2 + 6, dtype=torch.uint8)
    buf[6:] = w.view(-1).view(torch.uint8)
    shifted = buf[6:].view(torch.bfloat16).view(48, 128)
    assert shifted.data_ptr() % 64 == 6 % 64
    k = prepare(shifted, None, (48, 128))
    assert isinstance(k, QBf16Kernel) and k.w.data_ptr() == shifted.data_ptr()
    x = torch.randn(1, 128)
    assert rel(k(x), x.to(torch.bfloat16).float() @ w.float().t()) < 1e-5


def test_denormals_flushed_on_every_thread_inside_the_block_only():
    """`denormals_flushed` sets FTZ/DAZ on the threads torch's parallel ops run on, and clears it after."""
    tiny = torch.full((1 << 20,), 1e-30)  # large enough for torch to split the product over its threads

    def denormal_products() -> int:
        return int(((tiny * 1e-10) != 0).sum())  # 1e-40: a denormal, or zero when flushed

    assert denormal_products() == tiny.numel()
    with cpu_kernel.denormals_flushed():
        assert denormal_products() == 0
        with cpu_kernel.denormals_flushed():  # nested: the inner block leaves the outer one's setting
            pass
        assert denormal_products() == 0
    assert denormal_products() == tiny.numel()
