"""The decoding loop and `quantkit generate`: channels, stops, sampling, streaming text, cancellation."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from quantkit.runtime import SamplingParams, load_model
from quantkit.runtime.batch import BatchGenerator
from quantkit.runtime.channels import StreamingDetokenizer
from quantkit.runtime.engine import load_tokenizer
from quantkit.runtime.generate import sample
from quantkit.runtime.model.qwen3_5_moe import Out
from quantkit.runtime.state_cache import PrefixCache

from helpers.cli import run_cli  # noqa: F401
from helpers.runtime import quantized

pytestmark = pytest.mark.usefixtures("one_thread")


class _Count:
    """A cache that only counts tokens (what the loop reads of one)."""

    n = capacity = 0

    def snapshots(self, _ids, taken):
        assert not taken
        return []


class Scripted:
    """Stands in for the model in loop tests: its logits force a given token sequence."""

    mtp = None  # no MTP layer to draft with

    def __init__(self, script: list[int], vocab: int):
        self.script, self.vocab, self.step = script, vocab, 0

    def new_cache(self, capacity: int = 0) -> _Count:
        return _Count()

    def forward(self, ids, cache, all_logits=False, keep_positions=False):
        logits = torch.full((self.vocab,), -10.0)
        logits[self.script[min(self.step, len(self.script) - 1)]] = 10.0
        self.step += 1
        cache.n += len(ids)
        return logits

    def forward_batch(self, batch, hidden=False):
        assert len(batch) == 1 and not hidden and batch[0].kind in ("decode", "prompt")
        return [Out(self.forward(batch[0].ids, batch[0].cache).view(1, -1))]


class ScriptedRuntime:
    """What the batch engine reads of a runtime, around a `Scripted` model."""

    def __init__(self, model: Scripted, tok):
        v = tok.get_vocab()
        self.model, self.tokenizer, self.think_ids = model, tok, (v["<think>"], v["</think>"])
        self.prompt_cache, self.boundary_ids, self.context = PrefixCache(0), frozenset(), 4096
        self.stop_ids, self.draft_plan, self.mtp, self._lock = {v["<|im_end|>"]}, None, 0, threading.Lock()
        self.prefill = "tokens"

    def sampling(self, sampling, **overrides):
        return sampling

    def _io_devices(self):
        return ["cpu"]


def run_script(tok, text_think: str, text_answer: str, stop: bool = True, **kw):
    v = tok.get_vocab()
    ids = tok.encode(text_think, add_special_tokens=False) + [v["</think>"]] + \
        tok.encode(text_answer, add_special_tokens=False) + ([v["<|im_end|>"]] if stop else [])
    model = Scripted(ids, len(v))
    sp = SamplingParams(temperature=0, max_new_tokens=kw.pop("max_new_tokens", 200))
    batch = BatchGenerator(ScriptedRuntime(model, tok))
    batch.add(ids=[1, 2, 3], sampling=sp, **kw)
    return [e for _row, e in batch.run()], ids


def test_thinking_and_answer_channels_and_stop(tiny_model):
    tok = load_tokenizer(tiny_model)
    events, ids = run_script(tok, "first the state, then the file", "\n\nhello world: done 42")
    resp = events[-1].response
    assert resp.thinking == "first the state, then the file"
    assert resp.text == "hello world: done 42"
    assert resp.finish_reason == "stop" and resp.generation_tokens == len(ids) and resp.token_ids == ids
    assert {e.channel for e in events[:-1] if e.text} == {"thinking", "answer"}
    assert "".join(e.text for e in events if e.channel == "answer") == "hello world: done 42"


def test_length_and_cancel(tiny_model):
    tok = load_tokenizer(tiny_model)
    events, _ = run_script(tok, "a b c d e f g", "h", max_new_tokens=3)
    assert events[-1].response.finish_reason == "length" and events[-1].response.generation_tokens == 3
    stop = threading.Event()
    stop.set()
    events, _ = run_script(tok, "a b c", "d", cancel=stop)
    assert events[-1].response.finish_reason == "cancelled" and events[-1].response.generation_tokens == 0


def test_streaming_detokenizer_equals_one_shot_decode(tiny_model):
    tok = load_tokenizer(tiny_model)
    text = "Héllo wörld — ünïcode ✓ and plain ascii, $ ls -la /tmp\n日本語 " * 3
    ids = tok.encode(text, add_special_tokens=False)
    d = StreamingDetokenizer(tok)
    assert "".join(d.add(i) for i in ids) == tok.decode(ids)


def test_sampling_rules():
    logits = torch.tensor([0.0, 5.0, 4.9, -1.0, 3.0])
    assert sample(logits, SamplingParams(temperature=0), None) == 1
    g = torch.Generator().manual_seed(0)
    seen = {sample(logits, SamplingParams(temperature=1.0, top_k=2, top_p=1.0), g) for _ in range(200)}
    assert seen == {1, 2}
    seen = {sample(logits, SamplingParams(temperature=1.0, top_k=0, top_p=0.4), g) for _ in range(200)}
    assert seen == {1}  # token 1 alone holds 49% of the mass
    with pytest.raises(ValueError, match="top_p=0"):
        SamplingParams(top_p=0).validate()


def test_draw_is_the_multinomial_distribution(monkeypatch):
    """`draw` picks index i with chance p_i / sum(p) (within 5 standard deviations over 40,000 seeded draws), never
    an index of probability 0, the same indices for the same seed, and refuses a total that is not positive."""
    from quantkit.runtime.generate import draw

    p = torch.tensor([0.1, 0.0, 0.3, 0.0, 0.6, 0.0]) * 7  # unnormalised, zeros inside and at the end
    g = torch.Generator().manual_seed(11)
    n = 40_000
    got = torch.bincount(torch.tensor([draw(p, g) for _ in range(n)]), minlength=6).double()
    want = p.double() / p.sum() * n
    assert got[1] == got[3] == got[5] == 0
    assert ((got - want).abs() <= 5 * (want * (1 - want / n)).sqrt()).all(), (got, want)
    a, b = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert [draw(p, a) for _ in range(50)] == [draw(p, b) for _ in range(50)]
    for bad in (torch.zeros(4), torch.tensor([0.5, float("nan")]), torch.tensor([float("inf"), 1.0])):
        with pytest.raises(ValueError, match="sampling: the probabilities sum to"):
            draw(bad, g)
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.ones(1, dtype=torch.float64))  # u rounded up to the total
    assert draw(p, g) == 4


@pytest.mark.parametrize("n", [248320, 248320 - 7, 3000])
def test_top_values_are_torchs_topk_values(n):
    """`top_values` (topk over the elements at or above the k-th largest chunk maximum) gives torch.topk's values
    bit for bit: a vocabulary, one with a partial last chunk, one with fewer chunks than k (torch.topk itself);
    ties at the k-th, -inf, the largest values in one chunk, a NaN."""
    from quantkit.runtime.generate import top_values

    g = torch.Generator().manual_seed(n)
    x = (torch.randn(n, generator=g) * 3).bfloat16().float()  # bf16 values: many ties
    cases = [x, x.abs().neg(), torch.zeros(n)]
    y = x.clone()
    y[:2000] = -float("inf")
    y[5000:5064] = 50.0  # the 64 largest in one chunk
    cases.append(y)
    y = x.clone()
    y[n - 1] = float("nan")
    cases.append(y)
    for c in cases:
        for k in (1, 20, 64, 200):
            torch.testing.assert_close(top_values(c, k), torch.topk(c, k).values, rtol=0, atol=0, equal_nan=True)


def _reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The sampling distribution over the whole vocabulary, by masking (the textbook way)."""
    x = logits.float() / p.temperature
    if p.top_k and p.top_k < x.numel():
        x = x.masked_fill(x < torch.topk(x, p.top_k).values[-1], float("-inf"))
    if p.top_p < 1.0:
        s, order = torch.sort(x, descending=True, stable=True)
        pr = torch.softmax(s, -1)
        x = torch.full_like(x, float("-inf")).scatter(0, order, s.masked_fill(pr.cumsum(-1) - pr > p.top_p, float("-inf")))
    return torch.softmax(x, -1)


@pytest.mark.parametrize("top_k,top_p,spread", [(20, 0.95, 3), (20, 1.0, 3), (1, 0.5, 3), (0, 0.9, 3), (5, 0.3, 3),
                                                (0, 0.9, 1), (0, 0.95, 8), (0, 0.5, 20), (0, 0.999, 0.1),
                                                (0, 1.0, 200), (0, 0.999, 200)])
def test_candidates_are_the_masked_distribution(top_k, top_p, spread):
    """Flat logits (spread 1) make the nucleus most of the vocabulary, peaked ones a few tokens."""
    from quantkit.runtime.generate import candidates

    g = torch.Generator().manual_seed(int(top_k + 10 * spread))
    logits = (torch.randn(5000, generator=g) * spread).to(torch.bfloat16)  # bf16: many exact ties
    logits[100:104] = logits.max()  # a tie at the top
    p = SamplingParams(temperature=0.6, top_k=top_k, top_p=top_p)
    ids, probs = candidates(logits, p)
    full = torch.zeros(5000)
    full[ids if ids is not None else slice(None)] = probs
    assert torch.allclose(full, _reference_probs(logits, p), atol=1e-6)
    if top_k:
        assert ids is not None and len(ids) >= top_k  # the subset, ties with the k-th included
    elif top_p < 1.0:  # peaked: a few hundred candidates found without a sort; nearly flat: the whole vocabulary
        assert (ids is None) == (spread < 1) and (spread < 8 or len(ids) < 512)


def test_runtime_stop_from_another_thread(tiny_model):
    rt = load_model(quantized(tiny_model, "quality"))
    msgs = [{"role": "user", "content": "hello"}]
    n = 0
    for ev in rt.generate_stream(msgs, temperature=0, max_new_tokens=50):
        if ev.response is None:
            n += 1
            if n == 3:
                threading.Thread(target=rt.stop).start()
        else:
            resp = ev.response
    assert resp.finish_reason == "cancelled" and 3 <= resp.generation_tokens < 50


def test_seeded_sampling_is_reproducible_and_greedy_matches_transformers(tiny_model):
    rt = load_model(quantized(tiny_model, "int8"))
    msgs = [{"role": "user", "content": "list the files"}]
    a = rt.generate(msgs, seed=7, max_new_tokens=12)
    b = rt.generate(msgs, seed=7, max_new_tokens=12)
    assert a.token_ids == b.token_ids and a.generation_tokens == 12 and a.finish_reason == "length"
    from quantkit.testing.tiny import load_reference_model

    ref = load_reference_model(tiny_model, torch.bfloat16)
    ids = rt.encode(rt.render(msgs))
    with torch.no_grad():
        want = ref.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(ids):].tolist()
    got = rt.generate(msgs, temperature=0, max_new_tokens=12).token_ids
    assert got == want


def test_generate_cli_plain_json_and_stdin(tiny_model, capsys, monkeypatch):
    q = quantized(tiny_model, "quality")
    code, out, err = run_cli(["generate", q, "--prompt", "hello", "--max-new-tokens", "16", "--seed", "0"],
                             capsys, monkeypatch)
    assert code == 0, err
    assert "thinking:" in err and "tok/s" in err  # the thinking apart, on stderr; the answer alone on stdout
    assert out.strip() or "went to thinking" in err
    code, out, err = run_cli(["generate", q, "--prompt", "hello", "--max-new-tokens", "5", "--json", "--no-think",
                              "--temperature", "0"], capsys, monkeypatch)
    assert code == 0, err
    d = json.loads(out)
    assert d["generation_tokens"] == 5 and d["finish_reason"] == "length" and d["prompt_tokens"] > 5
    assert d["thinking"] == "" and isinstance(d["text"], str)
    assert d["generation_tps"] > 0 and d["prompt_tps"] > 0 and d["peak_memory"]["cpu"] > 0
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("hello from stdin"))
    code, out, err = run_cli(["generate", q, "--max-new-tokens", "3", "--json"], capsys, monkeypatch)
    assert code == 0, err
    assert json.loads(out)["generation_tokens"] == 3


def test_world_prompt(tiny_model):
    from quantkit.errors import QuantkitError
    from quantkit.runtime.worlds import WORLDS, world_prompt

    assert set(WORLDS) == {"mcp", "search", "terminal", "swe", "android", "web", "os"}
    for w in WORLDS:
        assert "<predicted_observation>" in world_prompt(w)
    with pytest.raises(QuantkitError, match="unknown domain"):
        world_prompt("minecraft")


def test_a_sampling_hook_that_raises_reaches_the_caller(tiny_model):
    """A logits hook (a grammar, a penalty) that raises ends the generation with its own exception at the caller,
    after the tokens before it; the runtime serves the next generation."""
    class Boom(RuntimeError):
        pass

    class Hook:
        def __init__(self):
            self.n = 0

        def process(self, logits):
            self.n += 1
            if self.n == 3:
                raise Boom("the grammar has no way on")
            return logits

        def accept(self, tok):
            return None

    rt = load_model(quantized(tiny_model, "int4"))
    ids = rt.render_ids([{"role": "user", "content": "hello"}])[1]
    got = []
    with pytest.raises(Boom, match="no way on"):
        for e in rt.generate_ids(ids, SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True, hook=Hook()),
                                 stop_ids=set()):
            got.append(e)
    assert [e.token is not None for e in got] == [True, True]
    resp = [e.response for e in rt.generate_ids(ids, SamplingParams(temperature=0, max_new_tokens=4), stop_ids=set())
            if e.response is not None][0]
    assert resp.generation_tokens == 4
