"""QuantExperts: same results as transformers' experts module, independent of how experts are split
across devices, only routed experts touched, weights never moved."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeExperts

from quantkit.formats import QuantSpec, get_format
from quantkit.kernels import cpu as cpu_kernel
from quantkit.runtime.kernels import prepare
from quantkit.runtime.qexperts import ExpertGroup, QuantExperts

E, H, INTER, K = 8, 64, 32, 2


def reference_experts(seed: int = 0) -> Qwen3_5MoeExperts:
    cfg = Qwen3_5MoeTextConfig(hidden_size=H, num_experts=E, moe_intermediate_size=INTER, num_experts_per_tok=K)
    m = Qwen3_5MoeExperts(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        m.gate_up_proj.copy_(torch.randn(m.gate_up_proj.shape, generator=g) * 0.1)
        m.down_proj.copy_(torch.randn(m.down_proj.shape, generator=g) * 0.1)
    return m.to(torch.bfloat16)


def build(ref: Qwen3_5MoeExperts, groups: list[tuple[str, list[int]]], spec: QuantSpec | None = None) -> QuantExperts:
    out = []
    for dev, ids in groups:
        g = ExpertGroup(torch.device(dev), list(ids))
        for e in ids:
            for w, dest in ((ref.gate_up_proj[e].detach(), g.gate_up), (ref.down_proj[e].detach(), g.down)):
                if spec is None:
                    dest.append(prepare(w.clone(), None, tuple(w.shape)))
                else:
                    dest.append(prepare(get_format(spec.format).quantize(w, spec), spec, tuple(w.shape)))
        out.append(g)
    return QuantExperts(E, H, INTER, out)


def routing(t: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, generator=g).to(torch.bfloat16)
    logits = torch.randn(t, E, generator=g)
    w, idx = torch.softmax(logits, -1).topk(K, dim=-1)
    return x, idx, (w / w.sum(-1, keepdim=True)).to(torch.bfloat16)


@pytest.mark.parametrize("t", [1, 13])
def test_bf16_experts_match_transformers(t):
    ref = reference_experts()
    q = build(ref, [("cpu", list(range(E)))])
    x, idx, w = routing(t)
    with torch.no_grad():
        want = ref(x, idx, w).float()
    got = q(x, idx, w).float()
    assert got.shape == want.shape
    # transformers accumulates the k expert outputs in bf16, QuantExperts in fp32: a rounding apart
    assert float((got - want).norm() / want.norm()) < 1e-2


SPLITS = [
    [("cpu", [0, 1, 2, 3]), ("cpu", [4, 5, 6, 7])],
    [("cpu", [1, 3, 5, 7]), ("cpu", [0, 2, 4, 6])],
    [("cpu", [0]), ("cpu", [1, 2, 3, 4, 5, 6]), ("cpu", [7])],
]


@pytest.mark.parametrize("spec", [None, QuantSpec("int4", 32), QuantSpec("nf4", 64)], ids=["bf16", "int4", "nf4"])
@pytest.mark.parametrize("t", [1, 2, 29])
def test_split_across_device_groups_is_bit_identical(spec, t):
    ref = reference_experts()
    whole = build(ref, [("cpu", list(range(E)))], spec)
    x, idx, w = routing(t, seed=t)
    want = whole(x, idx, w)
    for groups in SPLITS:
        got = build(ref, groups, spec)(x, idx, w)
        assert torch.equal(got, want), groups


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_and_cpu_groups_match_all_on_cpu():
    ref = reference_experts()
    x, idx, w = routing(17)
    want = build(ref, [("cpu", list(range(E)))])(x, idx, w)
    got = build(ref, [("cuda:0", [0, 1, 2, 3]), ("cpu", [4, 5, 6, 7])])(x, idx, w)
    assert float((got.float() - want.float()).norm() / want.float().norm()) < 1e-2


class Counting:
    def __init__(self, k):
        self.k, self.calls, self.rows = k, 0, 0
        self.route, self.device, self.nbytes = k.route, k.device, k.nbytes

    def __call__(self, x):
        self.calls += 1
        self.rows += x.shape[0]
        return self.k(x)


def test_decode_touches_only_routed_experts_and_prefill_groups_by_expert():
    ref = reference_experts()
    q = build(ref, [("cpu", [0, 1, 2, 3]), ("cpu", [4, 5, 6, 7])], QuantSpec("int4", 32))
    for g in q.groups:
        g.gate_up = [Counting(k) for k in g.gate_up]
        g.down = [Counting(k) for k in g.down]
    kern = {e: (g.gate_up[i], g.down[i]) for g in q.groups for i, e in enumerate(g.ids)}
    x, idx, w = routing(1)
    q(x, idx, w)
    hit = set(idx[0].tolist())
    for e, (gu, dn) in kern.items():
        assert (gu.calls, dn.calls) == ((1, 1) if e in hit else (0, 0)), e
    for gu, dn in kern.values():
        gu.calls = dn.calls = gu.rows = dn.rows = 0
    x, idx, w = routing(40, seed=5)
    q(x, idx, w)
    counts = torch.bincount(idx.reshape(-1), minlength=E).tolist()
    for e, (gu, dn) in kern.items():
        # one matmul per hit expert over all of its tokens
        assert gu.calls == (1 if counts[e] else 0) and gu.rows == counts[e] and dn.rows == counts[e]


def test_weights_never_move():
    ref = reference_experts()
    q = build(ref, [("cpu", list(range(E)))], QuantSpec("int4", 32))
    before = [(t.data_ptr(), t.device) for g in q.groups for k in g.gate_up + g.down for t in k.tensors()]
    for t in (1, 9):
        q(*routing(t))
    after = [(t.data_ptr(), t.device) for g in q.groups for k in g.gate_up + g.down for t in k.tensors()]
    assert before == after


def test_placement_errors():
    ref = reference_experts()
    with pytest.raises(ValueError, match="placed nowhere"):
        build(ref, [("cpu", [0, 1, 2])])
    with pytest.raises(ValueError, match="placed twice"):
        build(ref, [("cpu", list(range(E))), ("cpu", [3])])


@pytest.mark.skipif(cpu_kernel.module() is None, reason="quantkit's CPU kernel is not built here")
@pytest.mark.parametrize("spec", [QuantSpec("int4", 32), QuantSpec("int8")], ids=["int4", "int8"])
def test_fused_prefill_rows_are_decode_rows_bit_for_bit(spec):
    """Experts that are all CPU kernels run a prefill in one `qk.moe` call, and each of its rows is what
    a one-token decode of that row gives (the per-expert path rounded gate/up to bf16 and summed otherwise)."""
    q = build(reference_experts(), [("cpu", [0, 1, 2]), ("cpu", [3, 4, 5, 6, 7])], spec)
    assert q._rows_call() is not None
    x, idx, w = routing(37, seed=4)
    got = q(x, idx, w)
    want = torch.cat([q(x[r:r + 1], idx[r:r + 1], w[r:r + 1]) for r in range(x.shape[0])])
    assert got.dtype == x.dtype and torch.equal(got, want)
