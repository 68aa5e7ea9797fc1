"""The lean decode step (quantkit/runtime/decode_step.py) against transformers' forward, on the tiny
decisive checkpoint of the real architecture (3 Gated DeltaNet layers + 1 gated attention layer).

Bounds: with transformers' eager attention the lean step's torch route (`fused_ops=False`) is bit-equal
(logits and every cache state). Its default route on an AVX512 CPU, the kernel's fused ops
(csrc/qk_step.cpp), keeps the same roundings with fp32 sums in another order: against eager transformers
every step picks the same token, logits within `FUSED_LOGIT_BOUND` and cache states within
`FUSED_STATE_BOUND` (relative), and a layer fed transformers' input with the expert choice held fixed
within `FUSED_LAYER_BOUND`. Against the loader's SDPA attention, per layer with the expert choice held
fixed, the relative error of a layer's update stays under `SDPA_LAYER_BOUND` (SDPA keeps the scores in
fp32, eager rounds them to bf16, as the lean step does), and the argmax of every step's logits is the same.
"""

from __future__ import annotations

import pytest
import torch

from quantkit.runtime import cpu_kernel, decode_step, load_model
from quantkit.runtime.decode_step import GatheredExperts, LeanDecoder
from quantkit.runtime.generate import _forward, lean_decoder, prefill
from quantkit.runtime.loader import Placement

from test_runtime_common import one_thread, quantized  # noqa: F401

PROMPT = [{"role": "user", "content": "list the files in this folder, then count them"}]
STEPS = 10
SDPA_LAYER_BOUND = 0.04  # measured 0.008 (bf16), 0.010 (int8), 0.016 (int4): bf16 vs fp32 attention scores
# the fused ops, measured when written: logits and layers bit-equal, cache states 9e-8 (fp32 recurrent
# state, sums in another order); the bounds allow one bf16 step of the largest logit / of a layer's update
FUSED_LOGIT_BOUND = FUSED_LAYER_BOUND = 2.0 ** -7
FUSED_STATE_BOUND = 1e-6


def _load(tiny_model, recipe: str, **kw):
    return load_model(tiny_model if recipe == "bf16" else quantized(tiny_model, recipe), **kw)


def _tokens(n: int = STEPS) -> list[int]:
    g = torch.Generator().manual_seed(3)
    return [int(t) for t in torch.randint(0, 700, (n,), generator=g)]


def _prefilled(rt):
    ids = rt.encode(rt.render(PROMPT))
    return ids, prefill(rt.model, ids, torch.device("cpu")).cache


def _begun(rt, **kw):
    """(prompt ids, a prefilled reference cache, a LeanDecoder begun on a second prefilled cache)."""
    ids, ref = _prefilled(rt)
    _, cache = _prefilled(rt)
    dec = LeanDecoder(rt.model, **kw)
    dec.begin(cache, len(ids) + STEPS + 1)
    return ids, ref, dec


def _caches_equal(a, b) -> bool:
    for x, y in zip(a.layers, b.layers, strict=True):
        if hasattr(x, "recurrent_states"):
            if not (torch.equal(x.conv_states[0], y.conv_states[0])
                    and torch.equal(x.recurrent_states[0], y.recurrent_states[0])):
                return False
        elif not (torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)):
            return False
    return True


def fused_available() -> bool:
    return cpu_kernel.available()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _cache_err(a, b) -> float:
    """The worst relative difference over every layer's conv and recurrent states, keys and values."""
    worst = 0.0
    for x, y in zip(a.layers, b.layers, strict=True):
        pairs = ([(x.conv_states[0], y.conv_states[0]), (x.recurrent_states[0], y.recurrent_states[0])]
                 if hasattr(x, "recurrent_states") else [(x.keys, y.keys), (x.values, y.values)])
        worst = max([worst] + [_rel(p, q) for p, q in pairs])
    return worst


@pytest.mark.parametrize("static_kv", [False, True])
@pytest.mark.parametrize("recipe", ["bf16", "int8", "int4"])
def test_bit_equal_to_transformers_eager(tiny_model, recipe, static_kv, one_thread):  # noqa: F811
    rt = _load(tiny_model, recipe)
    rt.model.config._attn_implementation = "eager"
    with torch.inference_mode():
        ids, ref, dec = _begun(rt, static_kv=static_kv, fused_ops=False)
        assert dec.step_ops is None
        # where the kernel is built the router runs on its bf16 matrices (any table), and is still bit-equal
        assert all((L.moe.router_kernel is not None) == cpu_kernel.available() for L in dec.layers)
        assert (dec.attend_kernel is not None) == (cpu_kernel.available() and not static_kv)
        cache = dec.cache
        for t in _tokens():
            tok = torch.tensor([[t]])
            assert torch.equal(dec.step(tok), _forward(rt.model, tok, ref))
        dec.sync()
    assert cache.get_seq_length() == ref.get_seq_length() == len(ids) + STEPS
    assert _caches_equal(cache, ref)


@pytest.mark.skipif(not fused_available(), reason="the CPU kernel is not built on this machine")
@pytest.mark.parametrize("recipe", ["bf16", "int8", "int4"])
def test_fused_ops_track_transformers_eager(tiny_model, recipe, one_thread):  # noqa: F811
    rt = _load(tiny_model, recipe)
    rt.model.config._attn_implementation = "eager"
    worst = 0.0
    with torch.inference_mode():
        ids, ref, dec = _begun(rt)
        assert dec.step_ops is not None  # the default route on this CPU
        cache = dec.cache
        for t in _tokens():
            tok = torch.tensor([[t]])
            got, want = dec.step(tok), _forward(rt.model, tok, ref)
            assert int(got.argmax()) == int(want.argmax())
            worst = max(worst, float((got - want).abs().max() / want.abs().max()))
        dec.sync()
    assert worst <= FUSED_LOGIT_BOUND, worst
    assert _cache_err(cache, ref) <= FUSED_STATE_BOUND, _cache_err(cache, ref)


@pytest.mark.skipif(not cpu_kernel.available(), reason="the CPU kernel is not built on this machine")
@pytest.mark.parametrize("recipe", ["bf16", "int8", "int4"])
def test_one_call_stack_equals_the_per_layer_route(tiny_model, recipe, one_thread):  # noqa: F811
    """`qk.Layers` (the whole stack in one call) makes the per-layer fused route's logits and cache states,
    bit for bit, and takes every step of the default decoder on this CPU; a token id given as an int
    embeds as its tensor does."""
    rt = _load(tiny_model, recipe)
    with torch.inference_mode():
        ids, _, per_layer = _begun(rt, one_call=False)
        _, _, stacked = _begun(rt)
        assert per_layer.stack is None and stacked.stack is not None and len(stacked.stack) == len(stacked.layers)
        assert stacked.stack_head and not per_layer.stack_head
        calls = []
        stacked._layer = lambda *a: calls.append(a)  # the Python loop must not run
        stacked.head = lambda *a: calls.append(a)  # nor the Python head: the stack runs the norm and the head
        for t in _tokens():
            # the id as an int on one side (generation passes it so), the [1, 1] tensor on the other
            assert torch.equal(stacked.step(t), per_layer.step(torch.tensor([[t]])))
        assert not calls
        per_layer.sync()
        stacked.sync()
    assert _caches_equal(stacked.cache, per_layer.cache)
    assert stacked.cache.get_seq_length() == len(ids) + STEPS


def test_one_call_stack_falls_back_per_layer(tiny_model, one_thread):  # noqa: F811
    """A layer the stack cannot take (here: its experts left to QuantExperts' own decode) sends the whole
    step through the per-layer route, with the same logits as a decoder built without the stack."""
    rt = _load(tiny_model, "int8")
    with torch.inference_mode():
        _, _, want = _begun(rt, one_call=False)
        ids, cache = _prefilled(rt)
        dec = LeanDecoder(rt.model)
        dec.layers[1].moe.cpu_fused_all = False
        want.layers[1].moe.cpu_fused_all = False
        dec.begin(cache, len(ids) + STEPS + 1)
        assert dec.stack is None
        for t in _tokens(3):
            tok = torch.tensor([[t]])
            assert torch.equal(dec.step(tok), want.step(tok))


def test_one_call_stack_leaves_a_head_off_the_kernel_to_python(tiny_model, one_thread):  # noqa: F811
    """A head that is not one of quantkit's CPU kernels: the stack runs the layers and Python the final
    norm and the head, with the per-layer route's logits."""
    rt = _load(tiny_model, "int8")
    with torch.inference_mode():
        _, _, want = _begun(rt, one_call=False)
        ids, cache = _prefilled(rt)
        dec = LeanDecoder(rt.model)
        head = dec.head
        dec.head = lambda x: head(x)  # the same matrix behind a callable the stack cannot read
        dec.begin(cache, len(ids) + STEPS + 1)
        assert dec.stack is not None and not dec.stack_head
        for t in _tokens(3):
            tok = torch.tensor([[t]])
            assert torch.equal(dec.step(tok), want.step(tok))


def _hf_step_layers(model, tok, cache):
    """transformers' step on `cache`: per layer (input, output, router weights, router ids)."""
    rec = [{} for _ in model.model.layers]
    hooks = []
    for i, layer in enumerate(model.model.layers):
        hooks.append(layer.register_forward_pre_hook(
            lambda _m, args, kw, i=i: rec[i].__setitem__("in", (args[0] if args else kw["hidden_states"]).clone()),
            with_kwargs=True))
        hooks.append(layer.register_forward_hook(lambda _m, _a, out, i=i: rec[i].__setitem__("out", out.clone())))
        hooks.append(layer.mlp.gate.register_forward_hook(
            lambda _m, _a, out, i=i: rec[i].__setitem__("route", (out[1].reshape(-1).float(), out[2].reshape(-1)))))
    try:
        logits = _forward(model, tok, cache)
    finally:
        for h in hooks:
            h.remove()
    return logits, rec


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("recipe", ["bf16", "int8", "int4"])
def test_layers_match_transformers_with_expert_choice_fixed(tiny_model, recipe, fused, one_thread):  # noqa: F811
    """Each layer fed transformers' own input and routed to transformers' experts (loader default: SDPA
    attention): its update within SDPA_LAYER_BOUND of transformers'; the linear layers bit-equal on the
    torch route, within FUSED_LAYER_BOUND on the fused ops."""
    if fused and not fused_available():
        pytest.skip("the fused step ops need quantkit's kernel with AVX512")
    rt = _load(tiny_model, recipe)
    worst = {"linear_attention": 0.0, "full_attention": 0.0}
    kinds = rt.model.config.layer_types
    with torch.inference_mode():
        ids, ref, dec = _begun(rt, fused_ops=fused)
        for t in _tokens():
            _, rec = _hf_step_layers(rt.model, torch.tensor([[t]]), ref)
            cos, sin = dec._rotary(torch.bfloat16)
            for L, r in zip(dec.layers, rec, strict=True):
                L.moe.route = lambda _h, r=r: r["route"]
                x = r["in"].view(1, -1)
                got = dec._layer(L, x, cos, sin)
                del L.moe.route
                d_ref, d_got = (r["out"].view(1, -1) - x).float(), (got - x).float()
                err = float((d_got - d_ref).norm() / d_ref.norm())
                worst[kinds[L.index]] = max(worst[kinds[L.index]], err)
            dec.n += 1  # what `step` does after `forward`
    assert worst["linear_attention"] <= (FUSED_LAYER_BOUND if fused else 0.0), worst
    assert worst["full_attention"] < SDPA_LAYER_BOUND, worst


@pytest.mark.parametrize("recipe", ["bf16", "int8"])
def test_steps_pick_transformers_tokens(tiny_model, recipe, one_thread):  # noqa: F811
    """Free-running steps on teacher-forced tokens: the same argmax as transformers' (SDPA) forward at
    every step, logits within bf16 rounding."""
    rt = _load(tiny_model, recipe)
    with torch.inference_mode():
        ids, ref, dec = _begun(rt)
        for t in _tokens():
            tok = torch.tensor([[t]])
            want, got = _forward(rt.model, tok, ref).float(), dec.step(tok).float()
            assert int(got.argmax()) == int(want.argmax())
            assert float((got - want).abs().max()) <= 0.02 * float(want.abs().max())


@pytest.mark.parametrize("recipe", ["bf16", "int8"])
def test_greedy_generation_identical(tiny_model, recipe, one_thread):  # noqa: F811
    rt = _load(tiny_model, recipe)
    prompts = [PROMPT, [{"role": "user", "content": "write a haiku about rivers"}]]
    for msgs in prompts:
        rt.lean_decode = False
        want = rt.generate(msgs, temperature=0, max_new_tokens=16, ignore_eos=True).token_ids
        rt.lean_decode = True
        got = rt.generate(msgs, temperature=0, max_new_tokens=16, ignore_eos=True).token_ids
        assert got == want and len(got) == 16
        dec = rt.model._quantkit_lean  # the decoder generation used let go of its cache and buffers
        assert dec.cache is None and not dec.kv and not dec.conv


def test_prompt_cache_second_turn(tiny_model, one_thread):  # noqa: F811
    """Turn 2 restores turn 1's snapshot and continues with lean decode exactly as a cold transformers run;
    the lean steps never write into a snapshot."""
    rt = _load(tiny_model, "int8")
    rt.set_prompt_cache(64 << 20)
    first = rt.generate(PROMPT, temperature=0, max_new_tokens=6)
    turn2 = [*PROMPT, {"role": "assistant", "content": first.text or "ok"},
             {"role": "user", "content": "and the hidden ones?"}]
    ids2 = rt.render_ids(turn2)[1]
    snap = rt.prompt_cache.lookup(ids2)
    assert snap is not None
    before = snap.tensors()
    second = rt.generate(turn2, temperature=0, max_new_tokens=8, ignore_eos=True)
    assert second.cached_tokens == snap.length > 0
    after = snap.tensors()  # the same snapshot object, after lean decoding from it
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    rt.set_prompt_cache(0)
    rt.lean_decode = False
    cold = rt.generate(turn2, temperature=0, max_new_tokens=8, ignore_eos=True)
    assert second.token_ids == cold.token_ids


def _split_placement(n_layers: int = 4) -> Placement:
    """Two expert groups per layer, both on the CPU: the tests run group 0 as a device group would run."""
    return Placement(["cpu"] * n_layers, [[("cpu", [0, 1, 2, 3]), ("cpu", [4, 5, 6, 7])] for _ in range(n_layers)],
                     "cpu", "cpu", 256, "test split")


@pytest.mark.parametrize("recipe", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("gather", [frozenset({0}), frozenset({0, 1})])
def test_gathered_experts_and_split(tiny_model, recipe, gather, one_thread):  # noqa: F811
    """GatheredExperts (the device path: experts gathered by the routed ids, no host read) for group 0
    with group 1 handed to the CPU path ({0}), or for every group ({0, 1}): same tokens as the fused CPU
    path, logits within fp32 summation order (then bf16 rounding)."""
    rt = _load(tiny_model, recipe, placement=_split_placement(), route="torch")
    with torch.inference_mode():
        ids, ref_cache = _prefilled(rt)
        _, cache = _prefilled(rt)
        ref = LeanDecoder(rt.model)
        ref.begin(ref_cache, len(ids) + STEPS + 1)
        want = [ref.step(torch.tensor([[t]])).float() for t in _tokens()]
        dec = LeanDecoder(rt.model, gather_groups=gather)
        assert all(len(L.moe.gathered) == len(gather) and L.moe.has_cpu == (len(gather) == 1) for L in dec.layers)
        dec.begin(cache, len(ids) + STEPS + 1)
        got = [dec.step(torch.tensor([[t]])).float() for t in _tokens()]
    for w, g in zip(want, got, strict=True):
        assert int(w.argmax()) == int(g.argmax())
        assert float((w - g).abs().max()) <= 0.02 * float(w.abs().max())


@pytest.mark.parametrize("recipe", ["bf16", "int4"])
def test_gathered_experts_equal_the_per_expert_path(tiny_model, recipe):
    """One group's gathered computation against QuantExperts' own per-expert decode on random routes
    (int4: tinygemm's kernel on the gathered packed tiles, as on a GPU)."""
    rt = _load(tiny_model, recipe, placement=_split_placement(), route="torch")
    ex = rt.model.model.layers[0].mlp.experts
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        h = torch.randn(1, ex.hidden_dim, generator=g).to(torch.bfloat16)
        want = []
        cases = [torch.randperm(8, generator=g)[:2] for _ in range(6)]
        wts = [torch.rand(2, generator=g) for _ in range(6)]
        for ids, w in zip(cases, wts, strict=True):
            want.append(ex._forward_one(h, ids.tolist(), w.view(1, -1)).float())
        both = [GatheredExperts(ex, 0), GatheredExperts(ex, 1)]
        for ids, w, y in zip(cases, wts, want, strict=True):
            got = both[0](h, ids, w) + both[1](h, ids, w)
            torch.testing.assert_close(got, y, rtol=2e-2, atol=2e-3)


class _NoHostReads:
    """Within the block, reading a tensor's values on the host raises (what a device sync would be)."""

    NAMES = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy")

    def __enter__(self):
        self.saved = {n: getattr(torch.Tensor, n) for n in self.NAMES}

        def refuse(*_a, **_k):
            raise AssertionError("host read of a tensor inside the decode step")

        for n in self.NAMES:
            setattr(torch.Tensor, n, refuse)
        return self

    def __exit__(self, *exc):
        for n, f in self.saved.items():
            setattr(torch.Tensor, n, f)


@pytest.mark.parametrize(("recipe", "static_kv"), [("bf16", False), ("bf16", True), ("int4", True)])
def test_device_path_reads_nothing_back(tiny_model, recipe, static_kv, one_thread):  # noqa: F811
    """With every expert group on the gathered (device) path, a whole step reads no tensor value on the
    host: routing, experts, KV, rotary and states stay on the device."""
    rt = _load(tiny_model, recipe, placement=_split_placement(), route="torch")
    with torch.inference_mode():
        ids, cache = _prefilled(rt)
        dec = LeanDecoder(rt.model, gather_groups=frozenset({0, 1}), static_kv=static_kv)
        dec.begin(cache, len(ids) + STEPS + 1)
        tok = torch.tensor([[5]])
        with _NoHostReads():
            for _ in range(3):
                dec.step(tok)


def test_fused_cpu_path_reads_nothing_back(tiny_model, one_thread):  # noqa: F811
    """The fused CPU experts take the routed ids as a tensor: no `.tolist()` either."""
    rt = _load(tiny_model, "int8")
    with torch.inference_mode():
        ids, cache = _prefilled(rt)
        dec = LeanDecoder(rt.model)
        if not all(L.moe.cpu_fused_all for L in dec.layers):
            pytest.skip("quantkit's CPU kernel is not built here")
        dec.begin(cache, len(ids) + 4)
        # the one host read an all-CPU step makes is the token id, the key of the quantized embedding's rows
        # (a CPU tensor: no device sync); without that cache, nothing at all
        assert dec._cache_rows
        dec._cache_rows = False
        with _NoHostReads():
            dec.step(torch.tensor([[5]]))


def test_switches(tiny_model, monkeypatch):
    rt = _load(tiny_model, "int8")
    assert rt.lean_decode is True and lean_decoder(rt.model, None) is lean_decoder(rt.model, True) is not None
    assert lean_decoder(rt.model, False) is None
    monkeypatch.setenv(decode_step.ENV, "0")
    assert lean_decoder(rt.model, None) is None and not decode_step.enabled_by_env()
    assert lean_decoder(object(), True) is None  # anything but a Qwen3.5-MoE causal LM: transformers' path
    monkeypatch.setenv(decode_step.GRAPHS_ENV, "1")
    assert not decode_step.graphs_by_env(rt.model)  # a CPU model never captures a CUDA graph


def test_cuda_graphs_switch_on_cpu(tiny_model, one_thread):  # noqa: F811
    """`cuda_graphs=True` implies static KV; on a CPU model no graph is captured (and one cannot be)."""
    rt = _load(tiny_model, "int8")
    with torch.inference_mode():
        ids, cache = _prefilled(rt)
        dec = LeanDecoder(rt.model, cuda_graphs=True)
        dec.begin(cache, len(ids) + 4)
        assert dec.static_kv and dec.graph is None
        dec.step(torch.tensor([[5]]))
        with pytest.raises(ValueError, match="one CUDA device"):
            decode_step.CudaGraphStep(dec)


def test_cuda_graphs_switch_off_a_cuda_device_is_refused_in_one_line(tiny_model):
    """`load_model(..., cuda_graphs=True)` is the switch bench gpu turns on; a CPU placement cannot take it."""
    from quantkit.errors import QuantkitError

    rt = load_model(tiny_model, cuda_graphs=True)
    assert rt.cuda_graphs is True
    with pytest.raises(QuantkitError, match="CUDA-graph decode needs the model on a CUDA device"):
        rt.generate([{"role": "user", "content": "hi"}], temperature=0, max_new_tokens=4)
    rt.cuda_graphs = None  # the environment switch (off): the same runtime generates
    assert rt.generate([{"role": "user", "content": "hi"}], temperature=0, max_new_tokens=4).generation_tokens >= 1


def test_rotary_table_rows_equal_the_per_position_rows(tiny_model):
    rt = _load(tiny_model, "bf16")
    dec = LeanDecoder(rt.model)
    for n in (0, 1, 255, 256, 257, 1000):
        dec.n = n
        cos, sin = dec._rotary(torch.bfloat16)
        want = dec._rope_rows(torch.tensor([n]), torch.bfloat16)
        assert cos.shape == want[0].shape and torch.equal(cos, want[0]) and torch.equal(sin, want[1])


def test_quantized_embedding_rows_are_kept_and_bounded(tiny_model, monkeypatch):
    rt = _load(tiny_model, "int4")
    dec = LeanDecoder(rt.model)
    assert dec._cache_rows  # int4 quantizes the embedding table
    monkeypatch.setattr(decode_step, "EMBED_ROWS", 3)
    for t in (5, 7, 5, 9, 11):
        tok = torch.tensor([[t]])
        assert torch.equal(dec._embed(tok), rt.model.model.embed_tokens(tok))
    assert list(dec._rows) == [5, 9, 11]  # 7 was the least recently used
