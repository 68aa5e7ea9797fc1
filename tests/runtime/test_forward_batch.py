"""`Model.forward_batch` (quantkit/runtime/model/qwen3_5_moe.py, docs/engine.md "One forward"): a batch of segments
(decode steps, verifies, prompt chunks on several caches) in one forward. Every segment's logits and its cache's
state are bit for bit what the same segment gives alone, and a prompt chunk computes its tokens as one-token steps
do, so a prompt cut anywhere (a snapshot restored at any token) gives exactly a prompt prefilled in one chunk: on
the tiny decisive checkpoint, every route, every forced op table of the CPU kernel."""

from __future__ import annotations

import pytest
import torch
from test_batch_decode import ROUTES, _ids, _load

from quantkit.runtime.model.qwen3_5_moe import Segment

from helpers.states import random_tokens, same_state

PROMPTS = ["list the files in this folder, then count them", "write a haiku about rivers", "name three colours"]


def _cache(m, ids: list[int], room: int = 0):
    c = m.new_cache(len(ids) + room)
    if ids:
        m.forward_batch([Segment(c, ids, "prefill")])
    return c


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("recipe", ["bf16", "int4"])
def test_a_chunk_cut_anywhere_equals_the_prompt_in_one_chunk(tiny_model, recipe, route, one_thread):
    rt = _load(tiny_model, recipe, route)
    m = rt.model
    with torch.inference_mode():
        ids = _ids(rt, PROMPTS[0]) + random_tokens(23, 1)
        whole = m.new_cache(len(ids))
        want = m.forward_batch([Segment(whole, ids, "prefill")])[0].logits
        assert want.shape == (1, m.vocab)
        for cut in (1, 5, len(ids) // 2, len(ids) - 1):
            c = m.new_cache(len(ids))
            m.forward_batch([Segment(c, ids[:cut], "prefill")])
            got = m.forward_batch([Segment(c, ids[cut:], "prefill")])[0].logits
            assert torch.equal(got, want), f"cut at {cut}"
            assert same_state(c, whole)


@pytest.mark.parametrize("route", ROUTES)
def test_a_chunk_computes_its_tokens_as_steps_do(tiny_model, route, one_thread):
    rt = _load(tiny_model, "int4", route)
    m = rt.model
    with torch.inference_mode():
        ids = _ids(rt, PROMPTS[1])
        steps = m.new_cache(len(ids))
        for t in ids:
            want = m.forward([t], steps)
        c = m.new_cache(len(ids))
        got = m.forward_batch([Segment(c, ids, "prefill")])[0].logits[0]
        assert torch.equal(got, want)
        assert same_state(c, steps)


def test_the_t_token_path_differs_only_within_rounding(tiny_model, one_thread):
    """The chunk's row arithmetic is not the T-token path's (transformers' eager) arithmetic, but agrees with it
    to bf16 rounding: the same greedy choice on the decisive checkpoint."""
    rt = _load(tiny_model, "int4")
    m = rt.model
    with torch.inference_mode():
        ids = _ids(rt, PROMPTS[2]) + random_tokens(40, 3)
        rows = m.forward_batch([Segment(m.new_cache(len(ids)), ids, "prefill")])[0].logits[0]
        tokens = m.forward(ids, m.new_cache(len(ids)))
        assert int(rows.argmax()) == int(tokens.argmax())
        assert torch.allclose(rows.float(), tokens.float(), atol=0.15, rtol=0.05)


@pytest.mark.parametrize("route", ROUTES)
def test_a_mixed_batch_gives_each_segment_its_result_alone(tiny_model, route, one_thread, each_table):
    rt = _load(tiny_model, "int4", route)
    m = rt.model
    with torch.inference_mode():
        base = [_ids(rt, p) for p in PROMPTS]
        chunk = random_tokens(9, 7)
        batch_caches = [_cache(m, base[0], 16), _cache(m, base[1], 16), _cache(m, base[2], 16), m.new_cache(20)]
        alone_caches = [_cache(m, base[0], 16), _cache(m, base[1], 16), _cache(m, base[2], 16), m.new_cache(20)]
        shapes = [([5], "decode"), ([6, 7, 8], "verify"), (chunk, "prefill"), (random_tokens(12, 8), "prefill")]
        got = m.forward_batch([Segment(c, ids, kind) for c, (ids, kind) in zip(batch_caches, shapes, strict=True)],
                              hidden=True)
        for j, (c, (ids, kind)) in enumerate(zip(alone_caches, shapes, strict=True)):
            want = m.forward_batch([Segment(c, ids, kind)], hidden=True)[0]
            assert torch.equal(got[j].logits, want.logits), f"segment {j} ({kind})"
            assert got[j].hidden is not None and want.hidden is not None
            assert torch.equal(got[j].hidden, want.hidden), f"segment {j} ({kind}) hidden"
            assert got[j].hidden.shape[0] == len(ids)
            assert same_state(batch_caches[j], c)
        # the verify's states kept: rewound to one token, it is the decode of that token
        batch_caches[1].rewind(batch_caches[1].n - 2)
        alone_caches[1].rewind(alone_caches[1].n - 2)
        assert same_state(batch_caches[1], alone_caches[1])


def test_a_batch_refuses_a_cache_twice_and_bad_segments(tiny_model):
    rt = _load(tiny_model, "int4")
    m = rt.model
    c = m.new_cache(8)
    with pytest.raises(ValueError, match="appears twice"):
        m.forward_batch([Segment(c, [1], "decode"), Segment(c, [2], "decode")])
    with pytest.raises(ValueError, match="segment kind"):
        Segment(c, [1], "bogus")
    with pytest.raises(ValueError, match="decode segment of 2"):
        Segment(c, [1, 2], "decode")
    with pytest.raises(ValueError, match="no segments"):
        m.forward_batch([])
