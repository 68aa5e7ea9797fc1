"""Speculative decoding with the model's MTP layer (quantkit/runtime/speculative.py, runtime/model/qwen3_5_moe.py)
on the tiny checkpoint with an MTP layer: greedy output identical to decoding without drafts for 1-3 drafts, with the
layer's own (random, rarely accepted) drafts and with an oracle drafter that proposes the model's own
continuation and is wrong at a set rate (so drafts are accepted, rejected and rolled back); sampling keeps the
target's distribution, and a seed gives the same tokens with and without drafts; bad --mtp values and a folder
without the layer get one line."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest
import torch

from quantkit.formats import QuantSpec, get_format
from quantkit.kernels import cpu as kernel_cpu
from quantkit.runtime import SamplingParams, load_model
from quantkit.runtime.kernels import prepare
from quantkit.runtime.model.draft_head import DraftHead, compact_copy

from helpers.cli import run_cli
from helpers.mtp import MTP_ROUTES, PROMPT, PricedPlan, generate_events, generate_tokens
from helpers.runtime import quantized


class Oracle:
    """Stands in for the MTP layer's greedy draft (`MTP.draft`): drafts the reference continuation `seq` (the
    whole token sequence of a run without drafts), a wrong token instead every `wrong_every`-th draft."""

    def __init__(self, seq: list[int], wrong_every: int):
        self.seq, self.wrong_every, self.calls = seq, wrong_every, 0

    def __call__(self, model, tokens, hidden, cache):
        cache.n += len(tokens)  # pair i carries the token at position i + 1: it predicts position n + 1
        want = self.seq[cache.n + 1] if cache.n + 1 < len(self.seq) else 0
        self.calls += 1
        if self.wrong_every and self.calls % self.wrong_every == 0:
            want = (want + 1) % model.vocab
        return want, hidden[-1:]


@pytest.mark.parametrize("route", MTP_ROUTES)
@pytest.mark.parametrize("recipe", ["bf16", "int4"])
def test_greedy_output_is_identical_with_the_layers_own_drafts(tiny_model_mtp, recipe, route, one_thread):
    rt = load_model(tiny_model_mtp if recipe == "bf16" else quantized(tiny_model_mtp, recipe), forced_route=route)
    assert rt.model.mtp is not None and rt.draft_plan is not None  # auto unless asked for
    want, none = generate_tokens(rt, 0)
    assert none is None and len(want) == 40
    for draft in (1, 2, 3):
        got, stats = generate_tokens(rt, draft)
        assert got == want
        assert stats["draft"] == draft and 0 <= stats["accepted"] <= stats["drafted"] <= draft * 39


def _mtp_dense(rt) -> dict[str, object]:
    m = rt.model.mtp
    a, e = m.layer.mixer, m.layer.moe
    return {"fc": m.fc, "q": a.q, "k": a.k, "v": a.v, "o": a.o, "gate": e.shared_gate, "up": e.shared_up,
            "down": e.shared_down}


@pytest.mark.parametrize("recipe", ["quality", "bf16", "int4"])
def test_the_mtp_layer_holds_its_dense_matrices_as_int4(tiny_model_mtp, recipe, one_thread):
    """The MTP layer only drafts, so it holds its int8 or bf16 fc, attention and shared expert as int4 copies
    (checkpoint/draft.py), close to the stored matrices; `mtp_copies=False` holds them as stored, and 4-bit ones are
    held as stored either way. The drafts change a little, the greedy output not at all."""
    folder = tiny_model_mtp if recipe == "bf16" else quantized(tiny_model_mtp, recipe)
    held, stored = (load_model(folder, mtp_copies=c) for c in (True, False))
    want = {"quality": "int8", "bf16": "bf16", "int4": "int4"}[recipe]
    g = torch.Generator().manual_seed(5)
    for name, k in _mtp_dense(held).items():
        s = _mtp_dense(stored)[name]
        assert (k.format, s.format) == ("int4" if want != "int4" else want, want), name
        assert (k.nbytes < s.nbytes) == (want != "int4"), name
        x = torch.randn(4, k.in_features, generator=g).to(torch.bfloat16)
        err = float((k(x).float() - s(x).float()).norm() / s(x).float().norm())
        assert (err == 0) == (want == "int4") and err < 0.15, (name, err)
    assert held.model.mtp.layer.moe.experts.format == stored.model.mtp.layer.moe.experts.format
    ref, _ = generate_tokens(held, 0)
    for rt in (held, stored):
        got, stats = generate_tokens(rt, 2)
        assert got == ref and stats["drafted"] > 0


@pytest.mark.parametrize("route", MTP_ROUTES)
@pytest.mark.parametrize("pairs", [2, 3, 4])
def test_a_draft_from_several_pairs_skips_only_what_nothing_reads(tiny_model_mtp, route, pairs, one_thread):
    """The MTP layer's forward of a few pairs (after accepted drafts) runs the MoE block on the last row alone:
    its logits, the hidden it chains on and the K/V every pair leaves are those of the whole layer on every row."""
    rt = load_model(quantized(tiny_model_mtp, "int4"), forced_route=route)
    m, mtp = rt.model, rt.model.mtp
    mtp.use_stack = False  # the Python path (the kernel's one call is held to it below)
    g = torch.Generator().manual_seed(pairs)
    toks = torch.randint(0, m.vocab, (8 + pairs,), generator=g).tolist()
    hid = torch.randn(8 + pairs, m.cfg.text.hidden_size, generator=g).to(torch.bfloat16)
    layer_call = type(mtp.layer).__call__

    def run(last_only: bool) -> tuple[torch.Tensor, ...]:
        cache, moe_rows = mtp.new_cache(32), []
        mtp.forward(m, toks[:8], hid[:8], cache)  # a prompt's pairs first, as mtp_prefill writes them
        steps = mtp.layer.moe.steps
        type(mtp.layer).__call__ = lambda self, x, p: layer_call(self, x, replace(p, last_only=last_only))
        mtp.layer.moe.steps = lambda x, h, ops: moe_rows.append(x.shape[0]) or steps(x, h, ops)
        try:
            logits, h = mtp.forward(m, toks[8:], hid[8:], cache)
        finally:
            type(mtp.layer).__call__ = layer_call
            del mtp.layer.moe.steps
        assert sum(moe_rows) == (1 if last_only else pairs)
        return logits, h, cache.keys[0][:, :cache.n].clone(), cache.values[0][:, :cache.n].clone()

    runs = [run(True), run(False)]
    for got, want in zip(runs[0], runs[1], strict=True):
        assert torch.equal(got, want)


@pytest.mark.skipif(not kernel_cpu.available(), reason="the CPU kernel is not built on this machine")
@pytest.mark.parametrize("rows", [0, 64])
def test_the_kernels_one_call_draft_is_the_python_path_bit_for_bit(tiny_model_mtp, rows, one_thread):
    """On the stack route a draft of 1-4 pairs is one kernel call (`Layers.draft`): the logits, the hidden it
    chains on and the K/V every pair leaves equal the Python path's on the kernel's ops, chained over a run of
    drafts; more pairs than that (a prompt) take the Python path."""
    rt = load_model(quantized(tiny_model_mtp, "int4"), forced_route="stack")
    m, mtp = rt.model, rt.model.mtp
    mtp.draft_rows = rows
    g = torch.Generator().manual_seed(5)
    toks = torch.randint(0, m.vocab, (40,), generator=g).tolist()
    hid = torch.randn(40, m.cfg.text.hidden_size, generator=g).to(torch.bfloat16)
    calls = []

    def run(stack: bool) -> list[torch.Tensor]:
        mtp.use_stack, cache, out = stack, mtp.new_cache(64), []
        mtp.forward(m, toks[:9], hid[:9], cache)
        a = 9
        for t in (1, 2, 4, 3, 1, 1, 2):
            logits, h = mtp.forward(m, toks[a:a + t], hid[a:a + t], cache)
            out += [logits, h]
            a += t
            logits, h = mtp.forward(m, [int(logits.argmax())], h, cache)  # a chained second draft
            out += [logits, h]
        return out + [cache.keys[0][:, :cache.n].clone(), cache.values[0][:, :cache.n].clone()]

    stack_draft = type(mtp.stack.bind(mtp.new_cache(8), m))
    real = stack_draft.draft
    want = run(False)
    stack_draft.draft = lambda self, *a: calls.append(a[0].shape[0]) or real(self, *a)
    try:
        got = run(True)
    finally:
        stack_draft.draft = real
    assert calls == [1, 1, 2, 1, 4, 1, 3, 1, 1, 1, 1, 1, 2, 1]
    assert mtp.head(m).reduced == bool(rows)
    for x, y in zip(got, want, strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("route", MTP_ROUTES)
@pytest.mark.parametrize("rows", [0, 64])
def test_a_greedy_draft_is_the_argmax_of_the_drafts_logits(tiny_model_mtp, route, rows, one_thread):
    """`MTP.draft` (what speculative decoding calls) gives the first maximum of `forward`'s logits and the same
    hidden, chained, with the whole head and with the draft's part of it (ids from both of its ends); a hidden of
    more rows than tokens pairs its first rows (a verify's hidden rows, passed whole)."""
    rt = load_model(quantized(tiny_model_mtp, "int4"), forced_route=route)
    m, mtp = rt.model, rt.model.mtp
    mtp.draft_rows = rows
    g = torch.Generator().manual_seed(11)
    toks = torch.randint(0, m.vocab, (48,), generator=g).tolist()
    hid = torch.randn(48, m.cfg.text.hidden_size, generator=g).to(torch.bfloat16)
    a, b = mtp.new_cache(64), mtp.new_cache(64)
    mtp.forward(m, toks[:8], hid[:8], a)
    mtp.forward(m, toks[:8], hid[:8], b)
    got, h_a, h_b = [], hid[8:9], hid[8:9]
    for i in range(8, 48):
        logits, h_a = mtp.forward(m, [toks[i]], h_a if i % 2 else hid[i:i + 1 + i % 4 // 2], a)
        tok, h_b = mtp.draft(m, [toks[i]], h_b if i % 2 else hid[i:i + 1 + i % 4 // 2], b)
        assert tok == int(torch.argmax(logits)) and torch.equal(h_a, h_b)
        got.append(tok)
    if rows:
        tail = mtp.head(m).tail
        assert any(t < rows for t in got) and any(t >= tail for t in got)


@pytest.mark.skipif(not kernel_cpu.available(), reason="the CPU kernel is not built on this machine")
@pytest.mark.parametrize("chunk", [4096, 64])
@pytest.mark.parametrize("spec", [QuantSpec("int8"), None, QuantSpec("int4", 32)], ids=["int8", "bf16", "int4"])
def test_the_compact_draft_copy_is_the_heads_rows_in_int4(spec, chunk, monkeypatch):
    """An int8 or bf16 head's draft rows get an int4 g128 copy (its logits those of the rows quantized to int4,
    -inf elsewhere; made a chunk of rows at a time, the same codes); a 4-bit head has none (its own tiles are
    read)."""
    from quantkit.runtime.model import draft_head

    monkeypatch.setattr(draft_head, "COPY_CHUNK", chunk)
    v, h = 1000, 256
    g = torch.Generator().manual_seed(4)
    w = (torch.randn(v, h, generator=g) * 0.05).to(torch.bfloat16)
    parts = get_format(spec.format).quantize(w, spec) if spec else w
    head = prepare(parts, spec, (v, h))
    copy = compact_copy(parts, spec, (v, h), rows=200)
    if spec is not None and spec.format == "int4":
        assert copy is None
        return
    assert copy is not None and copy.fmt_bits == 4 and copy.group == 128 and copy.out_features == 192 + 296
    d = DraftHead(head, rows=200, compact=copy)
    assert d.compact is copy and d.reduced
    x = torch.randn(1, h, generator=g).to(torch.bfloat16)
    stored = get_format(spec.format).dequantize(parts, spec, (v, h), torch.float32) if spec else w.float()
    rows = torch.cat([stored[:192], stored[704:]])
    want = prepare(get_format("int4").quantize(rows, QuantSpec("int4", 128)), QuantSpec("int4", 128), (488, h))(x)
    got = d(x)
    assert torch.equal(got[:192], want.view(-1)[:192]) and torch.equal(got[704:], want.view(-1)[192:])
    assert bool((got[192:704] == float("-inf")).all())
    full = head(x).view(-1).float()  # int4 rows stay close to the head's own
    assert float((got[:192].float() - full[:192]).norm() / full[:192].norm()) < 0.15
    assert DraftHead(head, rows=200, compact=compact_copy(parts, spec, (v, h), rows=100)).compact is None  # not its rows
    narrow = w[:, :96].contiguous()  # a width the copy's groups of 128 do not divide: no copy, no error
    assert compact_copy(get_format(spec.format).quantize(narrow, spec) if spec else narrow, spec, (v, 96), rows=200) is None


@pytest.mark.skipif(not kernel_cpu.available(), reason="the CPU kernel is not built on this machine")
@pytest.mark.parametrize("spec", [QuantSpec("int4", 32), QuantSpec("int4", 64, symmetric=False), QuantSpec("int8"),
                                  None], ids=["int4-g32", "int4-g64-asym", "int8", "bf16"])
def test_the_draft_head_scores_its_rows_as_the_whole_head_does(spec):
    """The draft's head (the first rows and the top of the vocabulary, model/draft_head.py) gives those ids the
    whole head's logits bit for bit and -inf to the rest; rows 0 or past the top part: the whole head."""
    v, h = 1000, 256
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(v, h, generator=g) * 0.05).to(torch.bfloat16)
    head = prepare(get_format(spec.format).quantize(w, spec) if spec else w, spec, (v, h))
    x = torch.randn(1, h, generator=g).to(torch.bfloat16)
    full = head(x).view(-1)
    d = DraftHead(head, rows=200)  # 192: whole tiles
    assert d.reduced and d.rows == 192 and d.tail == 704
    got = d(x)
    assert got.shape == full.shape and got.dtype == full.dtype
    assert torch.equal(got[:192], full[:192]) and torch.equal(got[704:], full[704:])
    assert bool((got[192:704] == float("-inf")).all())
    for rows in (0, 704, 4096):
        whole = DraftHead(head, rows=rows)
        assert not whole.reduced and torch.equal(whole(x), full)


@pytest.mark.parametrize("route", MTP_ROUTES)
def test_greedy_output_is_identical_with_a_reduced_draft_head(tiny_model_mtp, route, one_thread):
    """Drafts over 64 ids of the tiny vocabulary (and its top): rejected more often, the output unchanged."""
    rt = load_model(quantized(tiny_model_mtp, "int4"), forced_route=route)
    want, _ = generate_tokens(rt, 0)
    rt.model.mtp.draft_rows = 64
    for draft in (1, 3):
        got, stats = generate_tokens(rt, draft)
        assert got == want and stats["accepted"] <= stats["drafted"]
    assert rt.model.mtp.head(rt.model).reduced == (kernel_cpu.module() is not None)  # int4: the head is the kernel's


@pytest.mark.parametrize("route", MTP_ROUTES)
@pytest.mark.parametrize(("draft", "wrong_every"), [(1, 0), (1, 3), (2, 4), (3, 2), (3, 7)])
def test_oracle_drafts_are_accepted_rolled_back_and_change_nothing(tiny_model_mtp, route, draft, wrong_every,
                                                                   one_thread, monkeypatch):
    rt = load_model(quantized(tiny_model_mtp, "int4"), forced_route=route)
    want, _ = generate_tokens(rt, 0)
    ids = rt.render_ids(PROMPT)[1]
    oracle = Oracle(ids + want, wrong_every)
    monkeypatch.setattr(rt.model.mtp, "draft", oracle)
    got, stats = generate_tokens(rt, draft)
    assert got == want
    assert 0 < stats["accepted"] <= stats["drafted"]
    if wrong_every == 0:  # every draft right: each verify keeps all its drafts and one token of its own
        assert stats["accepted"] == stats["drafted"]
        assert stats["drafted"] >= draft * ((len(want) - 1) // (draft + 1))
        if draft == 1:  # 19 verifies of 2 tokens, then a step: no draft for a token past the budget
            assert stats["drafted"] == (len(want) - 1) // 2
    else:
        assert stats["accepted"] < stats["drafted"]


@pytest.mark.parametrize(("draft", "wrong_every"), [(1, 3), (2, 4), (3, 2)])
def test_seeded_sampling_gives_the_tokens_of_decoding_without_drafts(tiny_model_mtp, draft, wrong_every,
                                                                    one_thread, monkeypatch):
    """Each row's token is drawn as without drafts, one draw per token kept, so a seed gives the same tokens with
    and without drafts (the oracle drafts the seeded run's own tokens, a wrong one every `wrong_every`-th)."""
    rt = load_model(quantized(tiny_model_mtp, "int4"))
    kw = {"temperature": 1.0, "top_k": 8, "top_p": 0.95, "seed": 7}
    want, _ = generate_tokens(rt, 0, n=60, **kw)
    assert want != generate_tokens(rt, 0, n=60, **{**kw, "seed": 8})[0]  # the seed decides the tokens
    monkeypatch.setattr(rt.model.mtp, "draft", Oracle(rt.render_ids(PROMPT)[1] + want, wrong_every))
    got, stats = generate_tokens(rt, draft, n=60, **kw)
    assert got == want
    assert 0 < stats["accepted"] < stats["drafted"]


def test_a_stop_token_inside_an_accepted_run_ends_the_generation_there(tiny_model_mtp, one_thread, monkeypatch):
    rt = load_model(quantized(tiny_model_mtp, "int4"))
    want, _ = generate_tokens(rt, 0)
    stop = want[10]
    first = want.index(stop)
    ids = rt.render_ids(PROMPT)[1]
    monkeypatch.setattr(rt.model.mtp, "draft", Oracle(ids + want, 0))
    sp = SamplingParams(temperature=0, max_new_tokens=40)
    resp = generate_events(rt, ids, sp, 3, {stop})[-1].response
    assert resp.finish_reason == "stop" and resp.token_ids == want[:first + 1]


def test_sampling_keeps_the_targets_distribution(tiny_model_mtp, one_thread, monkeypatch):
    """The second token (the first a verify decides) drawn 600 times with and without drafts of a fixed token:
    the same distribution (total variation under 0.1; drafts kept whenever offered would put all the mass on
    the drafted token)."""
    rt = load_model(quantized(tiny_model_mtp, "int4"))
    kw = {"temperature": 1.0, "top_k": 4, "top_p": 1.0}
    ids = rt.render_ids(PROMPT)[1]
    probe = [t for t in generate_tokens(rt, 0, n=2, seed=0, **kw)[0]]
    draft_tok = probe[1]

    def fixed(model, tokens, hidden, cache):
        cache.n += len(tokens)
        return draft_tok, hidden[-1:]

    def second_tokens(draft: int) -> torch.Tensor:
        counts = torch.zeros(rt.model.vocab)
        for seed in range(600):
            sp = SamplingParams(temperature=1.0, top_k=4, top_p=1.0, seed=seed, max_new_tokens=2, ignore_eos=True)
            toks = [e.token for e in generate_events(rt, ids, sp, draft) if e.token is not None]
            counts[toks[1]] += 1
        return counts / counts.sum()

    without = second_tokens(0)
    monkeypatch.setattr(rt.model.mtp, "draft", fixed)
    with_drafts = second_tokens(1)
    tv = 0.5 * float((without - with_drafts).abs().sum())
    assert tv < 0.1, tv
    assert 0.0 < float(with_drafts[draft_tok]) < 1.0


def test_generate_json_reports_the_counts(tiny_model_mtp, capsys, monkeypatch):
    q = quantized(tiny_model_mtp, "int4")
    code, out, err = run_cli(["generate", q, "--prompt", "hi", "--mtp", "2", "--json", "--temperature", "0",
                              "--max-tokens", "8"], capsys, monkeypatch)
    assert code == 0, err
    d = json.loads(out)
    assert d["mtp"]["draft"] == 2 and 0 <= d["mtp"]["accepted"] <= d["mtp"]["drafted"]
    code, out, err = run_cli(["generate", q, "--prompt", "hi", "--mtp", "0", "--json", "--temperature", "0",
                              "--max-tokens", "8"], capsys, monkeypatch)
    assert code == 0, err
    assert json.loads(out)["mtp"] is None


def test_generate_with_a_seed_says_the_same_with_and_without_drafts(tiny_model_mtp, capsys, monkeypatch):
    q = quantized(tiny_model_mtp, "int4")
    texts = []
    for mtp in (["--mtp", "2"], [], ["--mtp", "0"]):
        code, out, err = run_cli(["generate", q, "--prompt", "hi", *mtp, "--json", "--temperature", "1",
                                  "--seed", "3", "--max-tokens", "24"], capsys, monkeypatch)
        assert code == 0, err
        d = json.loads(out)
        texts.append((d["thinking"], d["text"], d["generation_tokens"]))
        assert (d["mtp"] is None) == (mtp == ["--mtp", "0"])
    assert texts[0] == texts[1] == texts[2]


@pytest.mark.parametrize("route", MTP_ROUTES)
def test_auto_drafting_stops_on_a_layer_that_is_never_right_and_changes_no_token(tiny_model_mtp, route, one_thread):
    """The default (no --mtp): the tiny model's random MTP layer is almost never accepted, so once the plan has
    measured that (its steps priced by shape: `PricedPlan`), decoding goes on without drafts, in this generation
    and the next; the tokens are those of decoding without drafts, and the counts say auto."""
    rt = load_model(quantized(tiny_model_mtp, "int4"), forced_route=route)
    want, _ = generate_tokens(rt, 0)
    rt.draft_plan = PricedPlan()
    drafted = []
    for _gen in range(2):
        resp = None
        for e in rt.generate_ids(rt.render_ids(PROMPT)[1], SamplingParams(temperature=0, max_new_tokens=40,
                                                                            ignore_eos=True), stop_ids=set()):
            resp = e.response or resp
        assert resp.token_ids == want and resp.mtp["auto"] is True
        drafted.append(resp.mtp["drafted"])
    assert rt.draft_plan.off() and drafted[0] > 0 and drafted[1] == 0
    assert rt.mtp_line().startswith("MTP: auto, off: drafting measured no faster")


@pytest.mark.parametrize("route", MTP_ROUTES)
def test_auto_drafting_that_pays_drafts_more_and_changes_no_token(tiny_model_mtp, route, one_thread, monkeypatch):
    """With drafts that pay (the oracle's, right 4 times in 5, a verify priced little above a step), the plan tries
    counts upward within a generation and ends at 3 drafts a step; the tokens are those of decoding without
    drafts."""
    rt = load_model(quantized(tiny_model_mtp, "int4"), forced_route=route)
    want, _ = generate_tokens(rt, 0, n=120)
    ids = rt.render_ids(PROMPT)[1]
    monkeypatch.setattr(rt.model.mtp, "draft", Oracle(ids + want, wrong_every=5))
    rt.draft_plan = PricedPlan(verify=0.1, draft=0.05)
    resp = None
    for e in rt.generate_ids(ids, SamplingParams(temperature=0, max_new_tokens=120, ignore_eos=True),
                             stop_ids=set()):
        resp = e.response or resp
    assert resp.token_ids == want
    assert rt.draft_plan.tried() == [1, 2, 3] and rt.draft_plan.lone() == 3
    assert resp.mtp["auto"] and resp.mtp["accepted"] > resp.generation_tokens // 2
    assert rt.mtp_line().startswith("MTP: auto: 3 drafts per step for one conversation now")


def test_decode_seconds_count_the_rewinds_of_rejected_drafts(tiny_model_mtp, one_thread, monkeypatch):
    """Generation tok/s divides by the time of the forwards and of the rewinds a rejected draft needs (a replay of
    the kept tokens' recurrent states is decode work): with each rewind made to take 50 ms, the decode seconds are
    at least the rewinds' sum."""
    from quantkit.runtime.model.cache import HybridCache

    rt = load_model(quantized(tiny_model_mtp, "int4"))
    want, _ = generate_tokens(rt, 0)
    monkeypatch.setattr(rt.model.mtp, "draft", Oracle(rt.render_ids(PROMPT)[1] + want, wrong_every=2))
    slept = []
    rewind = HybridCache.rewind

    def slow_rewind(self, n):
        if n != self.n:
            time.sleep(0.05)
            slept.append(0.05)
        return rewind(self, n)

    monkeypatch.setattr(HybridCache, "rewind", slow_rewind)
    sp = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    resp = generate_events(rt, rt.render_ids(PROMPT)[1], sp, 1)[-1].response
    assert resp.token_ids == want and len(slept) >= 5
    assert resp.decode_seconds >= sum(slept)


def test_mtp_on_a_folder_without_the_layer_is_one_line_and_decodes(tiny_model, capsys, monkeypatch):
    code, out, err = run_cli(["generate", quantized(tiny_model, "int4"), "--prompt", "hi", "--mtp", "2", "--json",
                              "--max-tokens", "4"], capsys, monkeypatch)
    assert code == 0, err
    assert "has no MTP layer; decoding without drafts" in err and json.loads(out)["generation_tokens"] >= 1


@pytest.mark.parametrize("value", ["4", "-1", "1.5", "two"])
def test_bad_draft_counts_are_one_line(tiny_model_mtp, capsys, monkeypatch, value):
    code, _out, err = run_cli(["generate", tiny_model_mtp, "--prompt", "hi", "--mtp", value], capsys, monkeypatch)
    assert code != 0 and "--mtp" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_runtime_set_mtp(tiny_model_mtp, tiny_model):
    rt = load_model(tiny_model_mtp)
    assert rt.draft_plan is not None and rt.mtp_line().startswith("MTP: auto: drafts 1-3 tokens per step")
    assert rt.set_mtp(None) is None and rt.draft_plan is not None  # no --mtp: auto stays
    assert rt.set_mtp(3) is None and rt.mtp == 3 and rt.draft_plan is None
    assert rt.mtp_line() == "MTP: drafting 3 tokens per step"
    assert rt.set_mtp(0) is None and rt.mtp_line().startswith("MTP: off")
    plain = load_model(tiny_model)
    assert plain.mtp == 0 and "has no MTP layer" in plain.set_mtp(1) and plain.mtp_line() == "MTP: none in this model"


def test_server_timings_carry_the_draft_counts(tiny_model_mtp):
    """llama-server's `draft_n` / `draft_n_accepted` in the timings of a chat completion; a server with drafts
    off leaves them out."""
    import openai

    from quantkit.server.app import ServerConfig, create_app
    from quantkit.server.runtime_backend import load_backend

    from helpers.server import ServerThread

    backend = load_backend(quantized(tiny_model_mtp, "int4"), max_context=512)
    rt = backend.runtime
    msgs = [{"role": "user", "content": "hi"}]
    rt.set_mtp(2)
    with ServerThread(create_app(backend, ServerConfig(max_queue=1, max_body_bytes=1 << 20))) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        r = client.chat.completions.create(model=backend.model_id, messages=msgs, max_tokens=12, temperature=0,
                                           extra_body={"ignore_eos": True})
        t = r.model_extra["timings"]
        assert t["draft_n"] >= 2 and 0 <= t["draft_n_accepted"] <= t["draft_n"]
        rt.set_mtp(0)
        r = client.chat.completions.create(model=backend.model_id, messages=msgs, max_tokens=4, temperature=0)
        assert r.model_extra["timings"].get("draft_n") is None


@pytest.mark.parametrize("acceptance", [0.5, 0.88, 0.95, 1.0])
def test_the_benchs_oracle_gets_the_share_it_is_set_to(acceptance):
    """bench mtp's oracle drafter proposes the reference token and a wrong one on a share 1 - acceptance of its
    drafts: on the set share after every 50 drafts (within one where 50 (1 - acceptance) is not whole; random
    draws drift as sqrt(n)), and with no period a verify of two drafts could fall in step with: a pair of drafts
    is all right about acceptance^2 of the time, as with independent draws."""
    from types import SimpleNamespace

    from benchmarks.mtp import OracleDrafter

    seq = list(range(100, 1200))
    cache = SimpleNamespace(n=0)
    for seed in (0, 1, 2):
        oracle = OracleDrafter(lambda m, t, h, c: (0, h), seq, acceptance, seed=seed)
        right, pairs = [], 0
        for n in range(1, 1001):
            cache.n = n
            tok, _ = oracle(SimpleNamespace(vocab=5000), [1], torch.zeros(1, 4), cache)
            right.append(tok == seq[n + 1])
            if n % 50 == 0:
                assert abs(sum(right) - acceptance * n) < 1.0
                if (50 * acceptance) % 1 == 0:
                    assert sum(right) == round(acceptance * n)
            if n % 2 == 0:
                pairs += right[-1] and right[-2]
        assert abs(pairs / 500 - acceptance ** 2) < 0.06, pairs


def test_chat_says_what_the_mtp_layer_does_on_its_first_line_and_in_stats(tiny_model_mtp, tiny_model, one_thread):
    """The chat's opening line says the MTP mode (auto, until it has measured); /stats says what it decided (the
    plan's steps priced by shape, `PricedPlan`, so a loaded machine cannot decide); a model without the layer says
    nothing of it on the first line."""
    import io

    from rich.console import Console

    from quantkit.runtime.chat import Chat, ChatSession

    def run(folder, lines):
        rt, feed, out = load_model(folder), iter(lines), io.StringIO()
        if rt.draft_plan is not None:
            rt.draft_plan = PricedPlan()

        def read(_p: str) -> str:
            try:
                return next(feed)
            except StopIteration:
                raise EOFError from None
        Chat(rt, ChatSession(), SamplingParams(temperature=0, max_new_tokens=24), Console(file=out, width=400),
             read).run()
        return out.getvalue().splitlines()

    lines = run(tiny_model_mtp, ["tell me about rivers", "tell me more", "/stats"])
    assert "; MTP: auto: drafts 1-3 tokens per step where that measures faster than without" in lines[0]
    assert any(line.startswith("MTP: auto, off: drafting measured no faster than decoding without") for line in lines)
    assert "MTP" not in run(tiny_model, [])[0]
