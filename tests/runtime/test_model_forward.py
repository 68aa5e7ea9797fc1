"""quantkit's own model (quantkit/runtime/model/) against transformers' eager forward over the same weights
(quantkit/testing/hf_reference.py), on the tiny decisive checkpoint of the real architecture (3 Gated DeltaNet
layers + 1 gated attention layer), and its routes against each other.

Bounds, measured when written. With the reference's conv weights in fp32 (transformers then computes the
causal conv in fp32, as quantkit does) every decode step's logits and every key and value are bit-equal, the
recurrent states within 1e-7 (fp32 sums in another order); the prompt's logits differ by up to 0.4% of the
largest, as quantkit's T-token path scores attention in fp32 (SDPA) where eager rounds to bf16. Against plain
transformers (its conv in bf16) logits differ by up to 0.8% and states by 0.8%, and every step still picks
transformers' token. The routes (one-call stack, per-layer fused ops, torch) make the same
logits bit for bit on this model; the stack and the fused ops the same states, the torch route states within
FUSED_STATE_BOUND of theirs (the kernel's fp32 sums in another order).
"""

from __future__ import annotations

import pytest
import torch

from quantkit.errors import QuantkitError
from quantkit.kernels import cpu as cpu_kernel
from quantkit.runtime import load_model
from quantkit.runtime.generate import prefill
from quantkit.runtime.loader import Placement
from quantkit.runtime.model import qwen3_5_moe as model_mod
from quantkit.runtime.model.config import model_config
from quantkit.runtime.model.route import ENV
from quantkit.testing.hf_reference import reference_model

from helpers.runtime import quantized

PROMPT = [{"role": "user", "content": "list the files in this folder, then count them"}]
STEPS = 10
LOGIT_BOUND = 0.02  # of the largest logit (measured at most 0.008)
STATE_BOUND = 0.02  # relative, per layer state (measured at most 0.008)
FUSED_STATE_BOUND = 1e-6  # relative (measured about 1e-7)
ROUTES = ["stack", "fused", "torch"]
kernel = pytest.mark.skipif(not cpu_kernel.available(), reason="the CPU kernel is not built on this machine")


def _load(tiny_model, recipe: str, **kw):
    return load_model(tiny_model if recipe == "bf16" else quantized(tiny_model, recipe), **kw)


def _tokens(n: int = STEPS) -> list[int]:
    g = torch.Generator().manual_seed(3)
    return [int(t) for t in torch.randint(0, 700, (n,), generator=g)]


def _prompt(rt) -> list[int]:
    return rt.encode(rt.render(PROMPT))


def _run(rt, ids: list[int], steps: list[int]):
    """(prefill logits then one per step [1 + len(steps), V] in fp32, the cache after them)."""
    with torch.inference_mode():
        cache = rt.model.new_cache(len(ids) + len(steps) + 1)
        out = [rt.model.forward(ids, cache).float()]
        out += [rt.model.forward([t], cache).float() for t in steps]
    return torch.stack(out), cache


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _hf(ref, ids: list[int], steps: list[int]):
    from transformers import DynamicCache

    with torch.inference_mode():
        cache = DynamicCache(config=ref.config)
        out = [ref(input_ids=torch.tensor([ids]), cache=cache, use_cache=True).logits[0, -1].float()]
        out += [ref(input_ids=torch.tensor([[t]]), cache=cache, use_cache=True).logits[0, -1].float() for t in steps]
    return torch.stack(out), cache


@pytest.mark.parametrize("route", ["stack", "torch"])
@pytest.mark.parametrize("recipe", ["bf16", "int8", "int4"])
@pytest.mark.usefixtures("each_table")
def test_bit_equal_to_transformers_eager_with_the_conv_in_fp32(tiny_model, recipe, route, one_thread):
    if route == "stack" and not cpu_kernel.available():
        pytest.skip("the CPU kernel is not built on this machine")
    rt = _load(tiny_model, recipe, forced_route=route)
    ref = reference_model(tiny_model if recipe == "bf16" else quantized(tiny_model, recipe), fp32_conv=True)
    ids = _prompt(rt)
    got, cache = _run(rt, ids, _tokens())
    want, hc = _hf(ref, ids, _tokens())
    assert torch.equal(got[1:], want[1:])
    assert float((got[0] - want[0]).abs().max() / want[0].abs().max()) <= LOGIT_BOUND
    assert cache.n == len(ids) + STEPS == int(hc.get_seq_length())
    for i, kind in enumerate(cache.kinds):
        layer = hc.layers[i]
        if kind == "linear":
            assert _rel(cache.state[i], layer.recurrent_states[0][0]) <= FUSED_STATE_BOUND
            assert torch.equal(cache.conv[i].t(), layer.conv_states[0][0])
        else:
            assert torch.equal(cache.keys[i][:, :cache.n], layer.keys[0])
            assert torch.equal(cache.values[i][:, :cache.n], layer.values[0])


@pytest.mark.parametrize("recipe", ["bf16", "int4"])
@pytest.mark.usefixtures("each_table")
def test_tracks_plain_transformers_eager(tiny_model, recipe, one_thread):
    rt = _load(tiny_model, recipe)
    ref = reference_model(tiny_model if recipe == "bf16" else quantized(tiny_model, recipe))
    ids = _prompt(rt)
    got, cache = _run(rt, ids, _tokens())
    want, hc = _hf(ref, ids, _tokens())
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert float(((got - want).abs().max(-1).values / want.abs().max(-1).values).max()) <= LOGIT_BOUND
    for i in cache.state:
        assert _rel(cache.state[i], hc.layers[i].recurrent_states[0][0]) <= STATE_BOUND


@kernel
@pytest.mark.parametrize("recipe", ["bf16", "int8", "int4"])
@pytest.mark.usefixtures("kernel_table")
def test_routes_agree_bit_for_bit(tiny_model, recipe, one_thread):
    """The one-call stack, the per-layer fused ops and the torch route: the same logits; the same cache states
    on the kernel's two routes, within FUSED_STATE_BOUND on torch's."""
    runs = {}
    for route in ROUTES:
        rt = _load(tiny_model, recipe, forced_route=route)
        assert rt.model.route.kind == route and rt.route()["name"] == rt.model.route.name
        runs[route] = _run(rt, _prompt(rt), _tokens())
    want, wc = runs["stack"]
    for route, (got, cache) in runs.items():
        assert torch.equal(got, want)
        for i in wc.conv:
            assert torch.equal(cache.conv[i], wc.conv[i])
            if route == "torch":
                assert _rel(cache.state[i], wc.state[i]) <= FUSED_STATE_BOUND
            else:
                assert torch.equal(cache.state[i], wc.state[i])
        for i in wc.keys:
            assert torch.equal(cache.keys[i][:, :wc.n], wc.keys[i][:, :wc.n])


@kernel
def test_stack_runs_no_python_layer(tiny_model, one_thread):
    """On the stack route a step calls no layer from Python; a prompt still goes through them."""
    rt = _load(tiny_model, "int8")
    assert rt.model.route.kind == "stack" and rt.route()["one_call"]
    calls = []
    for L in rt.model.layers:
        L.moe.routed = lambda *a, _f=L.moe.routed: calls.append(1) or _f(*a)
    _run(rt, _prompt(rt), _tokens(3))
    n_prompt = len(calls)
    assert n_prompt == len(rt.model.layers)  # the prompt's forward: once per layer, no step after it


@pytest.mark.parametrize("route", ["fused", "torch"])
@pytest.mark.usefixtures("each_table")
def test_layers_match_transformers_with_expert_choice_fixed(tiny_model, route, one_thread):
    """Each layer fed transformers' own input (its conv in fp32) and routed to transformers' experts: the same
    output, bit for bit."""
    if route == "fused" and not cpu_kernel.available():
        pytest.skip("the CPU kernel is not built on this machine")
    from transformers import DynamicCache

    rt = _load(tiny_model, "int8", forced_route=route)
    ref = reference_model(quantized(tiny_model, "int8"), fp32_conv=True)
    ids = _prompt(rt)
    ops = rt.model.ops
    same = 0
    with torch.inference_mode():
        hc = DynamicCache(config=ref.config)
        ref(input_ids=torch.tensor([ids]), cache=hc, use_cache=True)
        cache = rt.model.new_cache(len(ids) + STEPS + 1)
        rt.model.forward(ids, cache)
        for t in _tokens():
            rec = [{} for _ in ref.model.layers]
            hooks = []
            for i, layer in enumerate(ref.model.layers):
                r = rec[i]
                hooks.append(layer.register_forward_pre_hook(
                    lambda _m, a, kw, r=r: r.__setitem__("in", (a[0] if a else kw["hidden_states"]).clone()),
                    with_kwargs=True))
                hooks.append(layer.register_forward_hook(lambda _m, _a, o, r=r: r.__setitem__("out", o.clone())))
                hooks.append(layer.mlp.gate.register_forward_hook(
                    lambda _m, _a, o, r=r: r.__setitem__("route", (o[1].view(1, -1).float(), o[2].view(1, -1)))))
            try:
                ref(input_ids=torch.tensor([[t]]), cache=hc, use_cache=True)
            finally:
                for h in hooks:
                    h.remove()
            cos, sin = rt.model.rope_rows(torch.tensor([cache.n]), torch.bfloat16)
            for L, r in zip(rt.model.layers, rec, strict=True):
                L.moe.route = lambda _h, _ops, r=r: r["route"]
                x = r["in"].view(1, -1)
                got = L(x, model_mod.Steps([(cache, cache.n)], cos, sin, ops))
                del L.moe.route
                assert torch.equal(got, r["out"].view(1, -1)), (L.index, _rel(got, r["out"].view(1, -1)))
                same += 1
            cache.n += 1
    assert same == STEPS * len(rt.model.layers)


@pytest.mark.parametrize("recipe", ["bf16", "int8"])
@pytest.mark.usefixtures("each_table")
def test_chunked_prompt_equals_one_forward(tiny_model, recipe, one_thread):
    """A prompt in two chunks makes the state one forward of it makes (the chunked delta rule carries its
    state across chunks; attention reads the cached keys), up to SDPA's summation order."""
    rt = _load(tiny_model, recipe)
    ids = _prompt(rt)
    with torch.inference_mode():
        one = rt.model.new_cache(len(ids))
        a = rt.model.forward(ids, one).float()
        two = rt.model.new_cache(len(ids))
        rt.model.forward(ids[:7], two)
        b = rt.model.forward(ids[7:], two).float()
    assert two.n == one.n == len(ids)
    assert int(a.argmax()) == int(b.argmax()) and float((a - b).abs().max()) <= 1e-2 * float(a.abs().max())
    for i in one.state:
        assert _rel(two.state[i], one.state[i]) <= 1e-2
        assert torch.equal(two.conv[i], one.conv[i]) or _rel(two.conv[i], one.conv[i]) <= 1e-2


def _not_called(*_a, **_k):
    raise AssertionError("the stack route's verify ran the layers' Python verify")


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("recipe", ["bf16", "int4"])
@pytest.mark.usefixtures("each_table")
def test_a_verify_equals_one_token_steps_and_rewinds_to_any_position(tiny_model, recipe, route, one_thread,
                                                                      monkeypatch):
    """A 4-token forward that keeps its positions (a speculative verify) gives the logits and states of 4 one-token
    steps, bit for bit; rewound to any of its positions, the next step equals a cache that only ever saw the
    tokens up to there."""
    if route != "torch" and not cpu_kernel.available():
        pytest.skip("the CPU kernel is not built on this machine")
    rt = _load(tiny_model, recipe, forced_route=route)
    m = rt.model
    if route == "stack" and rt.route()["name"].endswith("-stack"):  # the kernel's verify, not the layers' own
        monkeypatch.setattr(model_mod.Layer, "steps", _not_called)
    ids = _prompt(rt)
    toks = _tokens(5)
    with torch.inference_mode():
        ref = m.new_cache(len(ids) + 8)
        m.forward(ids, ref)
        steps = torch.stack([m.forward([t], ref) for t in toks[:4]])
        for t in (2, 3):  # the shorter verifies (1 and 2 drafts)
            cache = m.new_cache(len(ids) + 8)
            m.forward(ids, cache)
            assert torch.equal(m.forward(toks[:t], cache, all_logits=True, keep_positions=True), steps[:t])
        for keep in (1, 2, 3, 4):
            cache = m.new_cache(len(ids) + 8)
            m.forward(ids, cache)
            n0 = cache.n
            got = m.forward(toks[:4], cache, all_logits=True, keep_positions=True)
            assert torch.equal(got, steps)
            if keep == 4:
                assert all(torch.equal(cache.state[i], ref.state[i]) for i in ref.state)
            assert set(cache.trail) == set(cache.conv)
            cache.rewind(n0 + keep)
            assert cache.n == n0 + keep and not cache.trail
            fresh = m.new_cache(len(ids) + 8)
            m.forward(ids, fresh)
            for t in toks[:keep]:
                m.forward([t], fresh)
            assert all(torch.equal(cache.state[i], fresh.state[i]) and torch.equal(cache.conv[i], fresh.conv[i])
                       for i in fresh.state)
            assert torch.equal(m.forward([toks[4]], cache), m.forward([toks[4]], fresh))
    with pytest.raises(ValueError, match="without the positions kept"):
        cache.rewind(n0)


@pytest.mark.parametrize("recipe", ["bf16", "int8"])
@pytest.mark.usefixtures("each_table")
def test_greedy_generation_identical_across_routes(tiny_model, recipe, one_thread):
    prompts = [PROMPT, [{"role": "user", "content": "write a haiku about rivers"}]]
    got = {}
    for route in ROUTES if cpu_kernel.available() else ["torch"]:
        rt = _load(tiny_model, recipe, forced_route=route)
        got[route] = [rt.generate(m, temperature=0, max_new_tokens=16, ignore_eos=True).token_ids for m in prompts]
    first = next(iter(got.values()))
    assert all(v == first for v in got.values()) and all(len(t) == 16 for t in first)


@pytest.mark.usefixtures("each_table")
def test_prompt_cache_second_turn(tiny_model, one_thread):
    """Turn 2 restores turn 1's snapshot and continues exactly as a cold run; decoding never writes into a
    snapshot."""
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
    after = snap.tensors()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    rt.set_prompt_cache(0)
    cold = rt.generate(turn2, temperature=0, max_new_tokens=8, ignore_eos=True)
    assert second.token_ids == cold.token_ids


@pytest.mark.usefixtures("each_table")
def test_prefill_restores_a_snapshot_into_a_cache_of_its_own(tiny_model, one_thread):
    rt = _load(tiny_model, "bf16")
    rt.set_prompt_cache(64 << 20)
    ids = _prompt(rt)
    with torch.inference_mode():
        cold = prefill(rt.model, ids, prefix_cache=rt.prompt_cache, boundary_ids=rt.boundary_ids)
        warm = prefill(rt.model, ids + [5, 6], prefix_cache=rt.prompt_cache, boundary_ids=rt.boundary_ids)
    assert warm.cached_tokens > 0 and warm.cache is not cold.cache
    assert all(warm.cache.state[i].data_ptr() != s.data_ptr() for i, s in cold.cache.state.items())


def _split_placement(n_layers: int = 4) -> Placement:
    """Two expert groups per layer, both on the CPU: the tests run group 0 as a device group would run."""
    return Placement(["cpu"] * n_layers, [[("cpu", [0, 1, 2, 3]), ("cpu", [4, 5, 6, 7])] for _ in range(n_layers)],
                     "cpu", "cpu", 256, "test split")


@pytest.mark.parametrize("recipe", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("gather", [frozenset({0}), frozenset({0, 1})])
@pytest.mark.usefixtures("each_table")
def test_gathered_experts_and_split(tiny_model, recipe, gather, one_thread):
    """Experts gathered by the routed ids (the device path) for group 0 with group 1 on the CPU path ({0}),
    or for every group: the same tokens as the plain CPU path, logits within fp32 summation order."""
    plain = _load(tiny_model, recipe, placement=_split_placement(), route="torch", forced_route="torch")
    rt = _load(tiny_model, recipe, placement=_split_placement(), route="torch", forced_route="torch", gather=gather)
    assert all(len(L.moe.gathered) == len(gather) and bool(L.moe.cpu_groups) == (len(gather) == 1)
               for L in rt.model.layers)
    want, _ = _run(plain, _prompt(plain), _tokens())
    got, _ = _run(rt, _prompt(rt), _tokens())
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert float((got - want).abs().max()) <= 0.02 * float(want.abs().max())


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


def test_device_path_reads_nothing_back(tiny_model, one_thread):
    """With every expert group on the gathered (device) path, a step reads no tensor value on the host."""
    rt = _load(tiny_model, "bf16", placement=_split_placement(), route="torch", forced_route="torch",
               gather=frozenset({0, 1}))
    ids = _prompt(rt)
    with torch.inference_mode():
        cache = rt.model.new_cache(len(ids) + 4)
        rt.model.forward(ids, cache)
        with _NoHostReads():
            for _ in range(3):
                rt.model.forward([5], cache)


def test_forced_route_switch(tiny_model, monkeypatch):
    monkeypatch.setenv(ENV, "torch")
    rt = _load(tiny_model, "int8")
    assert rt.model.route.kind == "torch" and rt.route()["fused_ops"] is False
    monkeypatch.setenv(ENV, "warp-drive")
    rt = _load(tiny_model, "int8")
    best = "stack" if cpu_kernel.available() else "torch"
    assert rt.model.route.kind == best
    assert rt.report.notes == [f"{ENV}=warp-drive: not one of stack, fused, torch, cuda-graph; using {best}"]


@kernel
def test_a_route_the_model_cannot_take_falls_back_in_one_line(tiny_model):
    rt = _load(tiny_model, "nf4", forced_route="stack")  # nf4 experts are not on the fused MoE call
    assert rt.model.route.kind == "fused"
    assert rt.report.notes == ["route 'stack': this model and machine cannot run it; using fused"]


def test_the_graph_executor_captures_once_per_cache_and_buffers(monkeypatch):
    """The cuda-graph route's executor replays the graph it captured for the cache in use and captures again
    for another cache or moved buffers (the capture itself needs a CUDA device: a stand-in records it)."""
    from types import SimpleNamespace

    from quantkit.runtime.model import graph

    captured = []

    class Capture:
        def __init__(self, model, cache):
            self.cache, self.version = cache, cache.version
            captured.append(cache)

        def replay(self, token, n):
            return torch.tensor([float(token), float(n)])

    monkeypatch.setattr(graph, "CudaGraphStep", Capture)
    ex = graph.GraphExecutor(SimpleNamespace())
    a, b = SimpleNamespace(n=0, version=0), SimpleNamespace(n=0, version=0)
    assert ex.step([5], a).tolist() == [5.0, 0.0] and ex.step([6], a).tolist() == [6.0, 1.0] and a.n == 2
    assert captured == [a]
    ex.step([7], b)
    a.version += 1  # its buffers moved
    ex.step([8], a)
    assert captured == [a, b, a] and ex.verify([1, 2], a) is None


def test_cuda_graphs_refuse_a_placement_off_one_cuda_device_in_one_line(tiny_model):
    rt = _load(tiny_model, "int8", forced_route="cuda-graph")
    best = "stack" if cpu_kernel.available() else "torch"
    assert rt.model.route.kind == best
    assert rt.report.notes == ["route 'cuda-graph': needs every layer, expert, the embedding and the head on one "
                               f"CUDA device, experts in a format it can gather (bf16, int8, int4); using {best}"]


@pytest.mark.parametrize("recipe", ["bf16", "int4"])
@pytest.mark.usefixtures("each_table")
def test_the_static_step_a_cuda_graph_captures_tracks_the_dynamic_step(tiny_model, recipe, one_thread):
    """`Model.static_step` (K/V written by a device-side index, attention over the whole buffer masked; what
    the cuda-graph route captures) on the CPU, experts gathered by routed id: the same tokens as the dynamic
    torch step, logits within the summation order of the longer masked attention."""
    rt = _load(tiny_model, recipe, placement=_split_placement(), route="torch", forced_route="torch",
               gather=frozenset({0, 1}))
    ids = _prompt(rt)
    m = rt.model
    with torch.inference_mode():
        want, _ = _run(rt, ids, _tokens())
        cache = m.new_cache(len(ids) + STEPS + 40)  # a buffer longer than the filled part: masked positions
        got = [m.forward(ids, cache).float()]
        for t in _tokens():
            cache.pos = torch.tensor([cache.n])
            with _NoHostReads():
                logits = m.static_step(torch.tensor([t]), cache)
            cache.n += 1
            got.append(logits.float())
    g = torch.stack(got)
    assert torch.equal(g.argmax(-1), want.argmax(-1))
    assert float((g - want).abs().max()) <= 0.02 * float(want.abs().max())


def test_rotary_table_rows_equal_the_per_position_rows(tiny_model):
    m = _load(tiny_model, "bf16").model
    for n in (0, 1, 255, 256, 257, 1000):
        cos, sin, row = m.rope_table(n)
        want = m.rope_rows(torch.tensor([n]), torch.bfloat16)
        assert torch.equal(cos[row:row + 1], want[0]) and torch.equal(sin[row:row + 1], want[1])


def test_quantized_embedding_rows_are_kept_and_bounded(tiny_model, monkeypatch):
    m = _load(tiny_model, "int4").model
    assert m.keep_rows  # int4 quantizes the embedding table
    monkeypatch.setattr(model_mod, "EMBED_ROWS", 3)
    for t in (5, 7, 5, 9, 11):
        assert torch.equal(m.embed_tokens([t]), m.embed(torch.tensor([t])))
    assert list(m._rows) == [5, 9, 11]  # 7 was the least recently used


@pytest.mark.parametrize(("field", "value", "says"), [
    ("hidden_act", "gelu", "'text_config.hidden_act' is 'gelu'"),
    ("attention_bias", True, "'text_config.attention_bias' is true"),
    ("attn_output_gate", False, "'text_config.attn_output_gate' is false"),
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e6}, "'text_config.rope_parameters.rope_type' is 'yarn'"),
])
def test_an_unsupported_config_is_refused_naming_the_field(tiny_model, field, value, says):
    import json

    cfg = json.loads((tiny_model / "config.json").read_text())
    cfg["text_config"][field] = value
    with pytest.raises(QuantkitError, match=f"x.json: field {says}"):
        model_config(cfg, "x.json")
