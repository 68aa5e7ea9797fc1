"""`python -m benchmarks.kernel` on a small layer: every route runs on the same draws and the report holds them
side by side (the timings themselves belong to reports/, not to tests)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import kernel as bk
from quantkit.kernels import cpu as cpu_kernel


def test_small_run_writes_every_route(tmp_path, monkeypatch):
    monkeypatch.setitem(bk.DEFAULTS, "hidden", 256)
    monkeypatch.setitem(bk.DEFAULTS, "inter", 64)
    monkeypatch.setitem(bk.DEFAULTS, "experts", 8)
    monkeypatch.setitem(bk.DEFAULTS, "top_k", 2)
    monkeypatch.setattr(bk, "read_gbps", lambda threads: 10.0)  # the 512 MB read is for real runs
    threads = torch.get_num_threads()
    d = bk.run(tmp_path, 1, layers=2, tokens=2, reps=1, log=lambda *_: None)
    torch.set_num_threads(threads)
    saved = json.loads((tmp_path / "bench-kernel.json").read_text())
    assert saved["rows"] == d["rows"]
    routes = {(r["format"], r["route"]) for r in d["rows"]}
    want = {"torch packed ops, per expert", "ggml mul_mat_id graph"}
    if cpu_kernel.available():
        want |= {"quantkit qk, fused (one call per layer)", "quantkit qk, per expert"}
    assert routes == {(f, r) for f in ("int4", "int8", "bf16") for r in want}
    for r in d["rows"]:
        if r["route"] == "ggml mul_mat_id graph" and "error" in r:
            pytest.importorskip("llama_cpp")  # ggml may be missing; where it is installed it must run
            raise AssertionError(r["error"])
        assert r["ms"] > 0 and r["bound_ms_ref"] > 0, r
    md = (tmp_path / "bench-kernel.md").read_text()
    assert "| int4 | quantkit qk, fused" in md or not cpu_kernel.available()
    # bytes of the k experts: int4 g32 = 4.5 bits per weight, int8 = 8 bits + a bf16 scale per row
    assert bk._layer_bytes("int4", 2048, 512, 8) == 8 * 3 * 2048 * 512 * 9 // 16
    assert bk._layer_bytes("bf16", 2048, 512, 8) == 8 * 3 * 2048 * 512 * 2


@pytest.mark.parametrize("fmt", ["int4", "int8", "bf16"])
def test_ggml_graph_computes_the_same_layer(fmt):
    """The ggml row times real work: its graph's output for one layer matches quantkit's fused route on
    the same codes (both quantize activations to 8 bits per block of 32 for int4/int8: a few 1e-3 apart)."""
    pytest.importorskip("llama_cpp")
    cfg = {**bk.DEFAULTS, "hidden": 256, "inter": 64, "experts": 8, "top_k": 2, "reps": 1}
    g = torch.Generator().manual_seed(0)
    layer = (bk._parts(fmt, 8, 128, 256, g), bk._parts(fmt, 8, 256, 64, g))
    draws = torch.tensor([[[5, 2]]])
    wts = torch.tensor([[[0.7, 0.3]]])
    probe: dict = {}
    bk.time_ggml([layer], fmt, draws, wts, cfg, 1, probe)
    q = bk._quantexperts(layer, fmt, None, cfg)
    x = torch.from_numpy(probe["x"])[None]
    want = q(x, draws[0, 0][None], wts[0, 0][None])[0]
    got = torch.from_numpy(probe["out"])
    assert float((got - want).norm() / want.norm()) < 2e-2
