"""The MTP draft's vocabulary on Qwen3.5's 248,320 ids (quantkit/checkpoint/draft.py, runtime/model/draft_head.py):
the shipped frequency ranking is read with its checks, a draft scores its ids through an int4 copy of their
rows (for every head format), falls back to the lowest ids in place without that copy, and greedy decoding
with it drafts ids from all over the ranking and changes no token."""

from __future__ import annotations

import zlib

import pytest
import torch

from quantkit.checkpoint import draft
from quantkit.checkpoint.draft import (
    DRAFT_ROWS,
    RANKED_VOCAB,
    copy_bytes,
    draft_ids,
    draft_span,
    load_ranking,
    ranked_ids,
)
from quantkit.errors import QuantkitError
from quantkit.formats import QuantSpec, get_format
from quantkit.kernels import cpu as cpu_kernel
from quantkit.runtime import load_model
from quantkit.runtime.kernels import prepare
from quantkit.runtime.model.draft_head import DraftHead, compact_copy

from helpers.mtp import MTP_ROUTES, generate_tokens
from helpers.runtime import quantized

V = RANKED_VOCAB
ROWS, TAIL = draft_span(V)
kernel_only = pytest.mark.skipif(not cpu_kernel.available(), reason="the CPU kernel is not built on this machine")


def test_the_shipped_ranking_is_distinct_ids_below_the_special_tokens():
    ids = ranked_ids()
    assert len(ids) == DRAFT_ROWS and len(set(ids)) == len(ids) and max(ids) < TAIL
    assert sum(i >= DRAFT_ROWS for i in ids) > 4096  # not the id prefix: Qwen3.5's Chinese ids sit above 64k
    got = draft_ids(V)
    assert got == sorted(got) and len(got) == ROWS + V - TAIL
    assert set(got[:ROWS]) == set(ids) and got[ROWS:] == list(range(TAIL, V))
    more = draft_ids(V, DRAFT_ROWS + 64)  # past the ranking: the lowest ids it does not hold
    assert set(ids) < set(more) and len(more) == len(got) + 64
    assert draft_ids(V, by_rank=False) == [*range(ROWS), *range(TAIL, V)]
    assert draft_ids(1000, 200) == [*range(192), *range(704, 1000)]  # another vocabulary: the lowest ids
    assert draft_ids(V, 0) is None and draft_ids(V, TAIL) is None


def test_the_copy_is_budgeted_for_every_head_format_on_the_ranked_vocabulary():
    want = 33056 * 2048 // 2 + 33056 * 16 * 2
    assert copy_bytes(V, 2048, "int4") == copy_bytes(V, 2048, "int8") == copy_bytes(V, 2048, "bf16") == want
    assert copy_bytes(1000, 256, "int4", 200) == 0 and copy_bytes(1000, 256, "int8", 200) > 0  # an id prefix: in place
    assert copy_bytes(V, 96, "int8") == 0  # a width the copy's groups do not divide


@pytest.mark.parametrize(("data", "says"), [
    (b"not zlib", "not a zlib stream"),
    (zlib.compress(b"\x01\x00\x00\x00" * 2), "distinct"),
    (zlib.compress((TAIL).to_bytes(4, "little")), "below 248032"),
    (zlib.compress(b"\x01\x00\x00"), "distinct"),
    (zlib.compress(bytes(4 * 40)), "distinct"),
])
def test_a_bad_ranking_file_is_one_line_naming_it(tmp_path, data, says):
    bad = tmp_path / "ids.bin"
    bad.write_bytes(data)
    with pytest.raises(QuantkitError) as e:
        load_ranking(bad)
    msg = str(e.value)
    assert str(bad) in msg and says in msg and "scripts/draft_vocab.py" in msg and "\n" not in msg


def test_a_ranking_that_inflates_past_its_bound_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(draft, "IDS_LIMIT", 4096)
    big = tmp_path / "ids.bin"
    big.write_bytes(zlib.compress(b"".join(i.to_bytes(4, "little") for i in range(2048))))  # 8 KB inflated
    with pytest.raises(QuantkitError, match="not a ranking"):
        load_ranking(big)
    assert load_ranking(_write(tmp_path / "ok.bin", [5, 3, 9])) == (5, 3, 9)


def _write(path, ids):
    path.write_bytes(zlib.compress(b"".join(i.to_bytes(4, "little") for i in ids)))
    return path


@kernel_only
@pytest.mark.parametrize("spec", [QuantSpec("int8"), QuantSpec("int4", 32), None], ids=["int8", "int4", "bf16"])
def test_a_ranked_draft_scores_its_ids_from_their_int4_copy(spec):
    """The copy holds the ranked ids' rows in id order; the draft's logits are the copy's outputs at those ids
    and -inf elsewhere, its argmax their vocabulary id; without the copy it scores the lowest ids in place."""
    h = 128
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(V, h, generator=g) * 0.05).to(torch.bfloat16)
    parts = get_format(spec.format).quantize(w, spec) if spec else w
    head = prepare(parts, spec, (V, h))
    copy = compact_copy(parts, spec, (V, h))
    assert copy is not None and copy.out_features == ROWS + V - TAIL
    d = DraftHead(head, compact=copy)
    assert d.reduced and d.ranked and d.compact is copy
    ids = torch.tensor(draft_ids(V))
    x = torch.randn(1, h, generator=g).to(torch.bfloat16)
    stored = get_format(spec.format).dequantize(parts, spec, (V, h), torch.float32) if spec else w.float()
    cs = QuantSpec("int4", 128)
    want = prepare(get_format("int4").quantize(stored[ids], cs), cs, (len(ids), h))(x).view(-1)
    got = d(x)
    assert torch.equal(got[ids], want)
    scored = torch.zeros(V, dtype=torch.bool)
    scored[ids] = True
    assert bool((got[~scored] == float("-inf")).all())
    outs = cpu_kernel.module().linear_many(x.contiguous(), d.table)
    assert d.argmax(outs) == int(torch.argmax(got)) == int(ids[int(torch.argmax(want))])
    plain = DraftHead(head)  # no copy: the lowest ids, read from the head's own tiles
    assert plain.reduced and not plain.ranked and plain.compact is None
    full = head(x).view(-1)
    y = plain(x)
    assert torch.equal(y[:ROWS], full[:ROWS]) and torch.equal(y[TAIL:], full[TAIL:])


@pytest.fixture(scope="module")
def qwen_vocab_model(tmp_path_factory):
    """A tiny MTP checkpoint with Qwen3.5's vocabulary size (the width the copy's groups of 128 divide)."""
    from quantkit.testing.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "v248k", layers=4, experts=8, top_k=2, hidden=128,
                           intermediate=32, vocab=V, mtp=True, seed=1)


@pytest.mark.parametrize("route", MTP_ROUTES)
@pytest.mark.parametrize("recipe", ["int4", "quality"])
def test_greedy_decoding_with_the_ranked_draft_drafts_across_it_and_changes_no_token(qwen_vocab_model, recipe, route,
                                                                                     one_thread):
    rt = load_model(quantized(qwen_vocab_model, recipe), forced_route=route)
    m, mtp = rt.model, rt.model.mtp
    head = mtp.head(m)
    assert head.reduced == head.ranked == (cpu_kernel.module() is not None)
    want, _ = generate_tokens(rt, 0, n=24)
    got, stats = generate_tokens(rt, 1, n=24)
    assert got == want and stats["drafted"] > 0
    if not head.ranked:
        return
    g = torch.Generator().manual_seed(2)
    toks = torch.randint(0, V, (16,), generator=g).tolist()
    hid = torch.randn(16, m.cfg.text.hidden_size, generator=g).to(torch.bfloat16)
    a, b = mtp.new_cache(32), mtp.new_cache(32)
    drafted = []
    for i in range(16):
        logits, _ = mtp.forward(m, [toks[i]], hid[i:i + 1], a)
        tok, _ = mtp.draft(m, [toks[i]], hid[i:i + 1], b)
        assert tok == int(torch.argmax(logits)) and logits[tok] > float("-inf")
        drafted.append(tok)
    ranked = set(ranked_ids())
    assert all(t in ranked or t >= TAIL for t in drafted) and any(DRAFT_ROWS <= t < TAIL for t in drafted)
