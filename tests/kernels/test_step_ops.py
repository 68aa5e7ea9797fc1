"""The model's fused ops (csrc/qk_step.cpp), on every op table the CPU can run (generic, AVX2,
AVX512, AVX512-BF16: conftest.kernel_table), against the torch ops they replace (runtime/model/ops.py
`TorchOps`), at the real model's sizes (hidden 2048, Gated DeltaNet 16 k-heads / 32 v-heads x 128 with a
4-tap conv, 16 q / 2 kv heads x 256 with a quarter of each head rotated, 256 experts, top 8).

Bounds: the ops keep torch's dtypes and bf16 roundings; their fp32 sums run in another order and their
exp is the kernel's own, so a result may differ from torch's by one bf16 step where an fp32 value sits on
a bf16 rounding boundary. `_close` allows that on at most `SHARE` of the elements (one of the router's
8 weights); on these inputs every result was bit-equal when the tests were written. The router's choice
and order of experts is exact where no two probabilities tie.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from quantkit.kernels import cpu as cpu_kernel
from quantkit.runtime.model.ops import TorchOps, rms
from quantkit.runtime.model.qwen3_5_moe import Attention, DeltaNet

pytestmark = pytest.mark.skipif(not cpu_kernel.available(), reason="the CPU kernel is not built on this machine")

H = 2048
ONE_STEP = 2.0 ** -7  # a bf16 step relative to the value (the kernel's bound per differing element)
SHARE = 0.005


@pytest.fixture
def qk(kernel_table):
    """The kernel module with each op table forced in turn (conftest.kernel_table)."""
    return cpu_kernel.module()


def _bf16(*shape: int, scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)


def _close(got: torch.Tensor, want: torch.Tensor, share: float) -> None:
    """Equal except on at most `share` of the elements, and those within one bf16 step."""
    assert got.shape == want.shape and got.dtype == want.dtype
    g, w = got.float(), want.float()
    diff = (g - w).abs()
    off = diff > 0
    assert float(off.float().mean()) <= share, f"{int(off.sum())} of {off.numel()} elements differ"
    if off.any():
        rel = diff[off] / w.abs()[off].clamp_min(1e-30)
        assert float(rel.max()) <= ONE_STEP, float(rel.max())


def test_rms_and_add_rms(qk):
    x, a = _bf16(1, H, seed=1), _bf16(1, H, scale=0.3, seed=2)
    scale = 1.0 + _bf16(H, scale=0.1, seed=3).float()
    _close(qk.rms(x, scale, 1e-6), rms(x, scale, 1e-6), SHARE)
    s, y = qk.add_rms(x, a, scale, 1e-6)
    assert torch.equal(s, x + a)  # the residual add is one rounding, exactly torch's
    _close(y, rms(x + a, scale, 1e-6), SHARE)
    rows = _bf16(18, 256, seed=4)  # several rows, each its own norm
    sc = 1.0 + _bf16(256, scale=0.1, seed=5).float()
    _close(qk.rms(rows, sc, 1e-6), rms(rows, sc, 1e-6), SHARE)


def test_add_rms_and_moe_out_take_rows_each_as_alone(qk):
    """A step's rows in one call: row j bit for bit the call on row j alone."""
    r = 5
    x, a = _bf16(r, H, seed=12), _bf16(r, H, scale=0.3, seed=13)
    shared, sg = _bf16(r, H, scale=0.2, seed=14), _bf16(r, 1, seed=15)
    routed = torch.randn(r, H, generator=torch.Generator().manual_seed(16)) * 0.2
    scale = 1.0 + _bf16(H, scale=0.1, seed=17).float()
    s, y = qk.add_rms(x, a, scale, 1e-6)
    out = qk.moe_out(x, routed.view(-1), shared, sg)
    for j in range(r):
        s1, y1 = qk.add_rms(x[j:j + 1], a[j:j + 1], scale, 1e-6)
        assert torch.equal(s[j:j + 1], s1) and torch.equal(y[j:j + 1], y1)
        assert torch.equal(out[j:j + 1], qk.moe_out(x[j:j + 1], routed[j], shared[j:j + 1], sg[j:j + 1]))
    with pytest.raises(RuntimeError, match="qk_moe_out: shapes do not match"):
        qk.moe_out(x, routed.view(-1), shared, sg[:1])


def test_silu_mul_and_moe_out(qk):
    g, u = _bf16(1, 512, scale=2, seed=6), _bf16(1, 512, seed=7)
    _close(qk.silu_mul(g, u), F.silu(g) * u, SHARE)
    x, shared, sg = _bf16(1, H, seed=8), _bf16(1, H, scale=0.2, seed=9), _bf16(1, 1, seed=10)
    routed = torch.randn(H, generator=torch.Generator().manual_seed(11)) * 0.2
    want = x + (routed.to(torch.bfloat16).view(1, -1) + torch.sigmoid(sg) * shared)
    _close(qk.moe_out(x, routed, shared, sg), want, SHARE)


@pytest.mark.parametrize("experts", [256, 64, 20])
def test_route(qk, experts):
    logits = _bf16(1, experts, scale=2, seed=experts)
    wts, ids = qk.route(logits, 8)
    assert wts.shape == ids.shape == (1, 8)
    wts, ids = wts.view(-1), ids.view(-1)
    probs = torch.softmax(logits, dtype=torch.float, dim=-1)
    top, want_ids = torch.topk(probs, 8, dim=-1)
    want = (top / top.sum(dim=-1, keepdim=True)).to(torch.bfloat16).reshape(-1).float()
    assert ids.dtype == torch.long and torch.equal(ids, want_ids.reshape(-1))
    _close(wts, want, 1 / 8)


def _gdn_one(qk, m: DeltaNet, qkv, z, b, a, conv, state) -> torch.Tensor:
    """One token through `gdn_rows` (a step: one row, no states kept between)."""
    return qk.gdn_rows(qkv, z, b, a, conv, m.conv_taps, m.neg_a, m.dt_bias, m.norm_wf, True, state, torch.empty(0),
                       m.hk, 1e-6)


def _linear_layer(seed: int) -> tuple[DeltaNet, dict[str, torch.Tensor]]:
    hk, hv, dk, dv, taps = 16, 32, 128, 128, 4
    g = torch.Generator().manual_seed(seed)
    c = 2 * hk * dk + hv * dv
    w = torch.randn(c, taps, generator=g) * 0.5
    m = DeltaNet(None, None, None, None, None, w.t().contiguous(), -torch.rand(hv, generator=g) * 4 - 0.1,
                 (torch.rand(hv, generator=g) + 0.5).to(torch.bfloat16).float(),
                 (1 + torch.randn(dv, generator=g) * 0.1).to(torch.bfloat16), hk, hv, dk, dv, 1e-6)
    inputs = {"qkv": _bf16(1, c, seed=seed + 1), "z": _bf16(1, hv * dv, seed=seed + 2),
              "b": _bf16(1, hv, seed=seed + 3), "a": _bf16(1, hv, seed=seed + 4),
              "conv": _bf16(1, c, taps, scale=0.5, seed=seed + 5),
              "state": torch.randn(1, hv, dk, dv, generator=g) * 0.05}
    return m, inputs


def test_gdn_one_row_matches_the_torch_route(qk):
    m, inp = _linear_layer(20)
    state_t, state_k = inp["state"][0].clone(), inp["state"][0].clone()
    conv_t, conv_k = inp["conv"][0].t().contiguous(), inp["conv"][0].t().contiguous()  # [K, C], as the cache holds it
    for step in range(3):  # the conv window and the state carry over between tokens
        qkv, z, b, a = (_bf16(*inp[k].shape, seed=100 * step + i) for i, k in enumerate(("qkv", "z", "b", "a")))
        want, _ = m.core(qkv, z, b, a, conv_t, state_t)
        got = _gdn_one(qk, m, qkv, z, b, a, conv_k, state_k)
        assert torch.equal(conv_k, conv_t)  # the window shift is exact
        _close(got, want, SHARE)
        err = float((state_k - state_t).norm() / state_t.norm())
        assert err < 1e-5, err  # fp32 state: sums in another order only


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("t", [2, 3, 4, 9])
def test_gdn_rows_are_one_row_calls_bit_for_bit(qk, t, keep):
    """A verify's or a prompt chunk's T tokens through a Gated DeltaNet core (`gdn_rows`: each head's state carried
    through the T tokens while it is in cache) give T one-row calls' outputs, conv window and states, bit for bit; with
    no states kept between (empty `states`), each block of a head's columns goes through up to 4 tokens at once."""
    m, inp = _linear_layer(30 + t)
    c, hv = inp["qkv"].shape[1], m.hv
    qkv, z, b, a = _bf16(t, c, seed=1), _bf16(t, hv * m.dv, seed=2), _bf16(t, hv, seed=3), _bf16(t, hv, seed=4)
    state_s, conv_s = inp["state"][0].clone(), inp["conv"][0].t().contiguous()
    state_r, conv_r = state_s.clone(), conv_s.clone()
    want, kept_want = [], []
    for j in range(t):
        want.append(_gdn_one(qk, m, qkv[j:j + 1], z[j:j + 1], b[j:j + 1], a[j:j + 1], conv_s, state_s))
        kept_want.append(state_s.clone())
    kept = torch.full((t - 1, hv, m.dk, m.dv), float("nan")) if keep else torch.empty(0)
    got = qk.gdn_rows(qkv, z, b, a, conv_r, m.conv_taps, m.neg_a, m.dt_bias, m.norm_wf, True, state_r, kept, m.hk, 1e-6)
    assert torch.equal(got, torch.cat(want)) and torch.equal(conv_r, conv_s) and torch.equal(state_r, state_s)
    assert not keep or torch.equal(kept, torch.stack(kept_want[:-1]))


@pytest.mark.parametrize("rows", [1, 3, 5])
def test_gdn_batch_is_each_rows_own_call_bit_for_bit(qk, rows):
    """A decode batch's rows through a Gated DeltaNet core in one call (`gdn_batch`), each row on its own conv
    window and state, give each row's `gdn_rows` alone: output, window and state, bit for bit, over steps that carry
    the windows and states on."""
    m, inp = _linear_layer(50 + rows)
    c, hv = inp["qkv"].shape[1], m.hv
    g = torch.Generator().manual_seed(rows)
    states = [inp["state"][0] + torch.randn(inp["state"][0].shape, generator=g) * 0.01 for _ in range(rows)]
    convs = [_bf16(m.conv_taps.shape[0], c, scale=0.5, seed=60 + j) for j in range(rows)]
    states_b, convs_b = [s.clone() for s in states], [w.clone() for w in convs]
    for step in range(2):
        qkv, z = _bf16(rows, c, seed=10 * step + 1), _bf16(rows, hv * m.dv, seed=10 * step + 2)
        b, a = _bf16(rows, hv, seed=10 * step + 3), _bf16(rows, hv, seed=10 * step + 4)
        want = torch.cat([_gdn_one(qk, m, qkv[j:j + 1], z[j:j + 1], b[j:j + 1], a[j:j + 1], convs[j], states[j])
                          for j in range(rows)])
        got = qk.gdn_batch(qkv, z, b, a, convs_b, m.conv_taps, m.neg_a, m.dt_bias, m.norm_wf, True, states_b, m.hk,
                           1e-6)
        assert torch.equal(got, want)
        for j in range(rows):
            assert torch.equal(convs_b[j], convs[j]) and torch.equal(states_b[j], states[j]), (step, j)
    if rows > 1:
        with pytest.raises(RuntimeError, match="qk_gdn_batch: rows 0 and 1 share a cache"):
            qk.gdn_batch(qkv, z, b, a, [convs_b[0]] * rows, m.conv_taps, m.neg_a, m.dt_bias, m.norm_wf, True,
                         [states_b[0]] * rows, m.hk, 1e-6)


def test_route_of_rows_is_each_rows_route(qk):
    logits = _bf16(6, 256, scale=2, seed=70)
    wts, ids = qk.route(logits, 8)
    assert wts.shape == ids.shape == (6, 8)
    for j in range(6):
        w1, i1 = qk.route(logits[j], 8)
        assert torch.equal(wts[j:j + 1], w1) and torch.equal(ids[j:j + 1], i1)
    with pytest.raises(RuntimeError, match="qk_route: logits must be"):
        qk.route(logits.view(2, 3, 256), 8)


@pytest.mark.parametrize("heads,kv,hd,n", [(16, 2, 256, 0), (16, 2, 256, 70), (16, 2, 256, 1500), (4, 2, 16, 9),
                                           (3, 3, 32, 17), (32, 2, 128, 64), (6, 1, 48, 5), (32, 1, 64, 40)])
def test_attn_rows_of_one_row_matches_the_torch_route(qk, heads, kv, hd, n):
    """One token through `attn_rows` against the model's torch route (transformers' eager roundings) at position n
    of larger K/V buffers: equal but for the order of fp32 sums (one bf16 step on a few outputs); the positions
    after n never count, and only position n is written."""
    rot = max(2, hd // 4)
    qo, ko, vo = _bf16(1, heads * 2 * hd, seed=30), _bf16(1, kv * hd, seed=31), _bf16(1, kv * hd, seed=32)
    qk_scale = 1.0 + _bf16(heads + kv, hd, scale=0.1, seed=33).float()
    freqs = torch.arange(rot // 2).float() * 0.37
    cos, sin = torch.cat([freqs.cos()] * 2).to(torch.bfloat16), torch.cat([freqs.sin()] * 2).to(torch.bfloat16)
    cap = n + 7
    keys, values = _bf16(kv, cap, hd, seed=34), _bf16(kv, cap, hd, seed=35)
    keys[:, n + 1:], values[:, n + 1:] = 1e4, 1e4  # positions past n must not count
    kc, vc = keys.clone(), values.clone()
    got = qk.attn_rows(qo, ko, vo, qk_scale, cos.view(1, -1), sin.view(1, -1), kc, vc, n, hd ** -0.5, 1e-6)
    m = Attention(None, None, None, None, qk_scale, heads, kv, hd, rot, 1e-6)
    want = TorchOps().attention(m, qo, ko, vo, keys, values, n, cos.view(1, -1), sin.view(1, -1))  # the torch route
    _close(kc[:, n], keys[:, n], SHARE)  # normalised and rotated k
    assert torch.equal(vc, values) and torch.equal(kc[:, n + 1:], keys[:, n + 1:])
    _close(got, want, SHARE)


def _attn_rows_inputs(rows: int, n: int, heads: int, kv: int, hd: int, rot: int, seed: int) -> tuple:
    """A gated attention layer's projections of `rows` tokens at positions n.., its constants, the rotary of
    those positions and K/V buffers with room for them (filled with noise, as a cache's unwritten tail may be)."""
    qo, ko, vo = _bf16(rows, heads * 2 * hd, seed=seed), _bf16(rows, kv * hd, seed=seed + 1), _bf16(rows, kv * hd,
                                                                                                       seed=seed + 2)
    qk_scale = 1.0 + _bf16(heads + kv, hd, scale=0.1, seed=seed + 3).float()
    freqs = torch.arange(n, n + rows).float().view(-1, 1) * (10000.0 ** -(torch.arange(rot // 2).float() / rot * 2))
    cos, sin = torch.cat([freqs.cos()] * 2, 1).to(torch.bfloat16), torch.cat([freqs.sin()] * 2, 1).to(torch.bfloat16)
    cap = n + rows + 3
    return qo, ko, vo, qk_scale, cos, sin, _bf16(kv, cap, hd, seed=seed + 4), _bf16(kv, cap, hd, seed=seed + 5)


@pytest.mark.parametrize("shape", [(16, 2, 256, 64), (4, 2, 16, 4), (6, 2, 32, 8)], ids=["real", "tiny", "odd-group"])
@pytest.mark.parametrize("n", [0, 100])
@pytest.mark.parametrize("rows", [1, 3, 17, 64])
def test_attn_rows_are_one_row_calls_bit_for_bit(qk, rows, n, shape):
    """R consecutive tokens of one cache through a gated attention layer in one call (`attn_rows`: each block of keys
    and values read once for a tile of rows) give R one-row calls, each after the rows before it: outputs and K/V
    buffers bit for bit, at the real model's heads (8 query heads per kv head, 256 wide), the tiny models' (2 per
    kv head, 16 wide) and an odd group (3 per kv head); from position 0 and past several blocks of keys."""
    heads, kv, hd, rot = shape
    qo, ko, vo, qk_scale, cos, sin, keys, values = _attn_rows_inputs(rows, n, heads, kv, hd, rot, seed=rows + n)
    ks, vs, kr, vr = keys.clone(), values.clone(), keys.clone(), values.clone()
    want = torch.cat([qk.attn_rows(qo[j:j + 1], ko[j:j + 1], vo[j:j + 1], qk_scale, cos[j:j + 1], sin[j:j + 1], ks,
                                   vs, n + j, hd ** -0.5, 1e-6) for j in range(rows)])
    got = qk.attn_rows(qo, ko, vo, qk_scale, cos, sin, kr, vr, n, hd ** -0.5, 1e-6)
    assert torch.equal(got, want)
    assert torch.equal(kr, ks) and torch.equal(vr, vs)
    assert torch.equal(kr[:, n + rows:], keys[:, n + rows:])  # nothing written past the last row


def test_bad_inputs_are_one_line_errors(qk):
    m, inp = _linear_layer(40)
    st = inp["state"].view(m.hv, m.dk, m.dv)
    with pytest.raises(RuntimeError, match="qk_gdn: shapes do not match the layer"):
        _gdn_one(qk, m, inp["qkv"][:, :-16], inp["z"], inp["b"], inp["a"], inp["conv"][0].t().contiguous(), st)
    with pytest.raises(RuntimeError, match="qk_rms: scale must be contiguous fp32 with 2048 values"):
        qk.rms(_bf16(1, H), torch.ones(H - 1), 1e-6)
    with pytest.raises(RuntimeError, match="qk_add_rms: x must be a contiguous bf16 CPU tensor"):
        qk.add_rms(torch.ones(1, H), _bf16(1, H), torch.ones(H), 1e-6)
    with pytest.raises(RuntimeError, match="qk_route: top_k must be in 1..64"):
        qk.route(_bf16(1, 64), 65)
    with pytest.raises(RuntimeError, match="qk_attn_rows: shapes do not fit"):
        k = _bf16(2, 8, 256)
        qk.attn_rows(_bf16(1, 16 * 512), _bf16(1, 512), _bf16(1, 512), torch.ones(18, 256), _bf16(1, 64),
                     _bf16(1, 64), k, k.clone(), 8, 0.06, 1e-6)
    qo, ko, vo, qk_scale, cos, sin, keys, values = _attn_rows_inputs(5, 10, 4, 2, 16, 4, seed=0)
    with pytest.raises(RuntimeError, match=r"qk_attn_rows: shapes do not fit \(rotary width 4, positions 14..18 of a "
                                           r"capacity of 18\)"):
        qk.attn_rows(qo, ko, vo, qk_scale, cos, sin, keys, values, 14, 0.25, 1e-6)
    with pytest.raises(RuntimeError, match="qk_attn_rows: q .R, heads . 2 hd. with cos and sin .R, rot."):
        qk.attn_rows(qo, ko, vo, qk_scale, cos[:4], sin[:4], keys, values, 10, 0.25, 1e-6)


def _table(*rows: tuple[torch.Tensor, int]) -> torch.Tensor:
    """A descriptor table of bf16 matrices (format 16): each row the first n rows of a row-major tensor."""
    return torch.tensor([[w.data_ptr(), 0, 0, 16, 0, n, w.shape[1], 0] for w, n in rows], dtype=torch.int64)


def test_layer_stack_misuse_is_one_line_errors(qk):
    """qk.Layers (the one-call stack; its results are checked against the per-layer route in
    tests/runtime/test_model_forward.py): wrong tables, shapes that do not fit and a layer without its MoE block are
    errors, not crashes."""
    m, inp = _linear_layer(41)
    st = inp["state"].view(m.hv, m.dk, m.dv)
    conv = inp["conv"][0].t().contiguous()
    zeros = torch.zeros(1, 8, dtype=torch.int64)
    w = _bf16(32, H, seed=42)
    rot = _bf16(4, 64, seed=43)
    stack = qk.Layers()
    with pytest.raises(RuntimeError, match="step before set_head"):
        stack.step(_bf16(1, H), rot, rot, 0, 0)
    with pytest.raises(RuntimeError, match=r"the head's table must be an int64 \[1, 8\]"):
        stack.set_head(torch.ones(H), 1e-6, torch.zeros(2, 8, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="matrix 0 of the head's table is not a kernel matrix"):
        stack.set_head(torch.ones(H), 1e-6, zeros)
    head = _table((w, 32))
    stack.set_head(torch.ones(H), 1e-6, head)
    x = _bf16(1, H, seed=44)  # a stack of no layers is the final norm and the head
    assert torch.equal(stack.step(x, rot, rot, 0, 0), qk.linear_many(qk.rms(x, torch.ones(H), 1e-6), head)[0].view(-1))
    with pytest.raises(RuntimeError, match=r"rows 4..4 are not in the rotary tables"):
        stack.step(x, rot, rot, 4, 0)
    with pytest.raises(RuntimeError, match="verify takes 1..4 rows"):
        stack.verify(_bf16(5, H), rot, rot, 0, 0)
    with pytest.raises(RuntimeError, match="token ids before set_embed"):
        stack.step_ids([3], rot, rot, 0, 0)
    table = _bf16(10, H, seed=45)
    stack.set_embed(table)  # token ids read their rows from it: the same logits as the rows given
    assert torch.equal(stack.step_ids([3], rot, rot, 1, 0), stack.step(table[3:4].clone(), rot, rot, 1, 0))
    with pytest.raises(RuntimeError, match="token id 10 is outside the vocabulary of 10"):
        stack.verify_ids([2, 10], rot, rot, 0, 0)
    with pytest.raises(RuntimeError, match="set_moe before any layer"):
        stack.set_moe(torch.zeros(4, 8, dtype=torch.int64), zeros, torch.zeros(4, 2, 8, dtype=torch.int64), 2)
    with pytest.raises(RuntimeError, match=r"in_proj table must be an int64 \[4, 8\]"):
        stack.add_gdn(torch.ones(H), torch.ones(H), 1e-6, zeros, zeros, conv, m.conv_taps, m.neg_a, m.dt_bias,
                      m.norm_wf, True, st, m.hk)
    with pytest.raises(RuntimeError, match="matrix 0 of a Gated DeltaNet layer's in_proj table is not a kernel matrix"):
        stack.add_gdn(torch.ones(H), torch.ones(H), 1e-6, torch.zeros(4, 8, dtype=torch.int64), zeros, conv,
                      m.conv_taps, m.neg_a, m.dt_bias, m.norm_wf, True, st, m.hk)
    qkv = torch.zeros(2 * m.hk * m.dk + m.hv * m.dv, H, dtype=torch.bfloat16)  # the layer's shapes, zero weights
    out = torch.zeros(H, m.hv * m.dv, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="projections do not match its state"):
        stack.add_gdn(torch.ones(H), torch.ones(H), 1e-6, _table((w, 32), (w, 32), (w, 32), (w, 32)), _table((out, H)),
                      conv, m.conv_taps, m.neg_a, m.dt_bias, m.norm_wf, True, st, m.hk)
    stack.add_gdn(torch.ones(H), torch.ones(H), 1e-6, _table((qkv, qkv.shape[0]), (qkv, m.hv * m.dv), (qkv, m.hv),
                                                             (qkv, m.hv)), _table((out, H)),
                  conv, m.conv_taps, m.neg_a, m.dt_bias, m.norm_wf, True, st, m.hk)
    with pytest.raises(RuntimeError, match="a layer has no MoE block"):
        stack.step(x, rot, rot, 0, 0)
    with pytest.raises(RuntimeError, match="top_k must be in 1..4"):
        stack.set_moe(torch.zeros(4, 8, dtype=torch.int64), zeros, torch.zeros(4, 2, 8, dtype=torch.int64), 5)
    with pytest.raises(RuntimeError, match="draft before set_draft"):
        stack.draft(x, x, rot, rot, 0, 0, head)
    with pytest.raises(RuntimeError, match=r"the MTP fc table must be an int64 \[1, 8\]"):
        stack.set_draft(torch.ones(H), torch.ones(H), torch.ones(H), 1e-6, torch.zeros(2, 8, dtype=torch.int64))
    fc = torch.zeros(H, 2 * H, dtype=torch.bfloat16)
    stack.set_draft(torch.ones(H), torch.ones(H), torch.ones(H), 1e-6, _table((fc, H)))
    with pytest.raises(RuntimeError, match="draft runs a one-layer attention stack"):
        stack.draft(x, x, rot, rot, 0, 0, head)  # a Gated DeltaNet layer is not the MTP layer


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_argmax_is_torchs(qk, dtype):
    """qk.argmax is torch.argmax on logits-sized rows and the edge cases: ties (the first), -0 beside 0, all
    negative, a NaN (it wins, the first one), infinities, a maximum in the last partial chunk."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(248320, generator=g).to(dtype)
    cases = [x, -x.abs(), x.round(), torch.zeros(9000, dtype=dtype), x[:4097].contiguous()]
    z = torch.zeros(5000, dtype=dtype) - 1
    z[4100], z[4200] = -0.0, 0.0  # -0 first: equal to 0, so it is the answer
    cases.append(z)
    for where in (0, 4095, 4096, 248319):
        y = x.clone()
        y[where] = float("nan")
        y[where // 2 + 7] = float("nan")
        cases += [y, -y]
        y = x.clone()
        y[where] = float("inf")
        cases.append(y)
        y = -x.abs()
        y[where] = float("-inf")
        cases.append(y)
    top = x.clone()
    top[248000], top[248319] = 100, 100
    cases.append(top)
    for c in cases:
        assert qk.argmax(c) == int(torch.argmax(c))
    with pytest.raises(RuntimeError, match="qk_argmax: x must be a non-empty contiguous bf16 or fp32 tensor"):
        qk.argmax(torch.zeros(4, 3, dtype=dtype).t())


def test_logsumexp_is_the_float64_one(qk):
    """qk.logsumexp of bf16 logits [B, V] or [V] is log(sum(exp(x))) within fp32's rounding at every spread (torch's
    exp leaves each element far below the max to a scalar route; the table's clamps it), -inf elements add nothing,
    and a row whose max is not finite gives that max."""
    g = torch.Generator().manual_seed(3)
    for scale in (0.5, 3.0, 30.0, 300.0):
        x = (torch.randn(3, 248320, generator=g) * scale).bfloat16()
        want = torch.logsumexp(x.double(), -1)
        torch.testing.assert_close(qk.logsumexp(x).double(), want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(qk.logsumexp(x[1]).double(), want[1:2], rtol=1e-6, atol=1e-6)
    rows = torch.zeros(5, 4099).bfloat16()  # a last partial chunk
    rows[0], rows[1, 3], rows[2, 4098], rows[3, :4000] = float("-inf"), float("nan"), float("inf"), float("-inf")
    got = qk.logsumexp(rows)
    assert got[0] == float("-inf") and torch.isnan(got[1]) and got[2] == float("inf")
    assert math.isclose(float(got[3]), math.log(99), rel_tol=1e-6) and math.isclose(float(got[4]), math.log(4099),
                                                                                      rel_tol=1e-6)
    with pytest.raises(RuntimeError, match="qk_logsumexp: x must be a contiguous bf16 CPU tensor"):
        qk.logsumexp(torch.zeros(4, 3).bfloat16().t())
