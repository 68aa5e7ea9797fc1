"""Weights the decode kernels stream live on memory advised for 2 MiB pages (runtime/hugepages.py)."""

from __future__ import annotations

import copy
import gc
import mmap
import sys

import pytest
import torch

from quantkit.kernels import cpu as kernel_cpu
from quantkit.runtime import cpu_kernel, hugepages
from quantkit.runtime.kernels import prepare

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"),
                                reason="MADV_HUGEPAGE is Linux's")


def advised(t: torch.Tensor) -> bool:
    """Whether the mapping holding t's first byte carries the kernel's MADV_HUGEPAGE flag ("hg")."""
    addr = t.data_ptr()
    lines = open("/proc/self/smaps").read().splitlines()
    inside = False
    for ln in lines:
        head = ln.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= addr < hi
        elif inside and ln.startswith("VmFlags:"):
            return "hg" in ln.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


def test_large_tensors_are_advised_small_ones_are_not():
    big = hugepages.empty((1 << 20,), torch.uint8)
    small = hugepages.empty((1024,), torch.float32)
    assert advised(big) and not advised(small)
    assert big.is_contiguous() and big.numel() == 1 << 20


def test_switched_off_keeps_torchs_allocator():
    with hugepages.off():
        assert not hugepages.enabled()
        assert not advised(hugepages.empty((1 << 20,), torch.uint8))
        t = torch.ones(1 << 20)
        assert hugepages.copy(t) is t
    assert hugepages.enabled() == hasattr(__import__("mmap"), "MADV_HUGEPAGE")


def test_chunk_slices_are_disjoint_and_outlive_their_neighbours():
    ts = [hugepages.empty((300_000 + 4096 * i,), torch.uint8) for i in range(8)]
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel()) for t in ts)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))
    for i, t in enumerate(ts):
        t.fill_(i)
    keep = ts[3]
    del ts
    gc.collect()
    hugepages.empty((1 << 20,), torch.uint8).fill_(255)  # reuse of freed memory would show here
    assert int(keep.min()) == int(keep.max()) == 3


def test_each_tensor_is_its_own_storage():
    """A deep copy (calibrate clones kernels) or a save takes a tensor's bytes, not its chunk's."""
    t = hugepages.empty((300_000,), torch.uint8)
    assert t.untyped_storage().nbytes() == 300_000
    assert copy.deepcopy(t).untyped_storage().nbytes() == 300_000


def rss_file_kb() -> int:
    return int(next(ln for ln in open("/proc/self/status") if ln.startswith("RssFile:")).split()[1])


def test_a_mapped_file_is_copied_and_its_pages_let_go(tmp_path):
    """A tensor over a mapped file (a safetensors shard read lazily) is copied and the file's pages leave
    this process's resident set (they stay cached); the mapped tensor still reads the file's values."""
    from safetensors.torch import safe_open, save_file

    w = torch.randn(2048, 2048).to(torch.bfloat16)  # 8 MiB
    save_file({"w": w}, str(tmp_path / "m.safetensors"))
    with safe_open(str(tmp_path / "m.safetensors"), framework="pt") as f:
        mapped = f.get_tensor("w")
    assert hugepages.file_backed(mapped) and not hugepages.file_backed(w)
    float(mapped.float().sum())  # fault every page in
    before = rss_file_kb()
    moved = hugepages.copy(mapped)
    assert advised(moved) and torch.equal(moved, w)
    assert rss_file_kb() < before - 6 * 1024  # most of the 8 MiB no longer counted
    assert torch.equal(mapped, w)  # faulted back in from the file


def test_off_block_keeps_torchs_allocator():
    with hugepages.off():
        assert not hugepages.enabled() and not advised(hugepages.empty((1 << 20,), torch.uint8))
    assert hugepages.enabled()


def test_repacked_codes_are_advised_and_compute_the_same():
    if not kernel_cpu.available():
        pytest.skip("the CPU kernel is not built")
    g = torch.Generator().manual_seed(0)
    n, k = 1024, 512
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    s = torch.rand(n, generator=g) * 1e-2
    x = torch.randn(2, k, generator=g)
    qw, sc = cpu_kernel.repack_int8(q, s)
    with hugepages.off():
        qw0, sc0 = cpu_kernel.repack_int8(q, s)
    assert advised(qw) and not advised(qw0)
    mod = kernel_cpu.module()
    assert torch.equal(mod.linear(x, qw, sc, None, 8, 32, n), mod.linear(x, qw0, sc0, None, 8, 32, n))


def test_bf16_kernel_copies_unless_shared():
    if not kernel_cpu.available():
        pytest.skip("the CPU kernel is not built on this machine")
    w = torch.randn(512, 1024).to(torch.bfloat16)
    x = torch.randn(1, 1024)
    own = prepare(w, None, tuple(w.shape))
    tied = prepare(w, None, tuple(w.shape), shared=True)
    assert own.w is not w and advised(own.w) and torch.equal(own.w, w)
    assert tied.w is w
    assert torch.equal(own(x), tied(x))
