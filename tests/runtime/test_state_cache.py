"""Prefix reuse of the hybrid cache: logits and greedy output with reuse equal a full re-prefill, bit for
bit, over 10+ turns (thinking on and off, tools, eviction, an edited history), on the decisive tiny model in
bf16 and 4-bit; the boundary-aligned prefill stays within a stated bound of a one-shot prefill."""

from __future__ import annotations

import pytest
import torch

from quantkit.runtime import SamplingParams, load_model
from quantkit.runtime.generate import prefill
from quantkit.runtime.state_cache import PrefixCache, Snapshot, prefill_plan, snapshot_points

from helpers.runtime import quantized

pytestmark = pytest.mark.usefixtures("one_thread")

TOOLS = [{"type": "function", "function": {"name": "run", "description": "run a shell command",
                                           "parameters": {"type": "object",
                                                          "properties": {"cmd": {"type": "string"}}}}}]
WORDS = "ls cat grep file state output error the a of and to in is it that".split()


def observation(turn: int, n: int = 12) -> str:
    return " ".join(WORDS[(turn * 7 + i * 3) % len(WORDS)] for i in range(n))


@pytest.fixture(scope="module", params=["bf16", "int4"])
def rt(request, tiny_model):
    r = load_model(tiny_model, recipe="bf16") if request.param == "bf16" else load_model(quantized(tiny_model,
                                                                                                     "int4"))
    return r


def conversation(turns: int, tools: bool) -> list[list[dict]]:
    """The message lists a client sends, turn by turn (each assistant reply canned so both runs agree)."""
    msgs: list[dict] = [{"role": "system", "content": "You are a terminal. Answer with the output."}]
    out = []
    for t in range(turns):
        msgs.append({"role": "user", "content": f"$ step {t} " + observation(t, 6 + t % 5)})
        out.append(list(msgs))
        reply = {"role": "assistant", "content": observation(t + 100, 10 + 3 * (t % 4)),
                 "reasoning_content": "think " + observation(t + 50, 5)}
        if tools and t % 3 == 1:
            reply["tool_calls"] = [{"type": "function", "function": {"name": "run", "arguments": {"cmd": "ls"}}}]
            msgs.append(reply)
            msgs.append({"role": "tool", "content": observation(t + 200, 15)})
        else:
            msgs.append(reply)
    return out


@pytest.mark.parametrize("thinking,tools", [(True, False), (False, True)])
def test_reuse_equals_full_prefill_over_turns(rt, thinking, tools):
    cache = PrefixCache(1 << 30)
    reused = []
    for t, msgs in enumerate(conversation(11, tools)):
        ids = rt.encode(rt.render(msgs, TOOLS if tools else None, thinking))
        with torch.inference_mode():
            warm = prefill(rt.model, ids, prefix_cache=cache, boundary_ids=rt.boundary_ids)
            cold = prefill(rt.model, ids, boundary_ids=rt.boundary_ids)
        assert torch.equal(warm.logits, cold.logits), f"turn {t}: logits differ"
        reused.append(warm.cached_tokens)
        if t:  # everything up to the start of the last answer comes from the cache
            prev = rt.encode(rt.render(conversation(11, tools)[t - 1], TOOLS if tools else None, thinking))
            last_boundary = snapshot_points(prev, 0, rt.boundary_ids, 1)[0]
            assert warm.cached_tokens >= last_boundary
            assert ids[:warm.cached_tokens] == prev[:warm.cached_tokens]
    assert reused[0] == 0 and all(r > 0 for r in reused[1:])
    assert cache.stats.hits == 10 and cache.stats.lookups == 11


def greedy_turns(rt, max_bytes: int, edit_at: int | None = None) -> list:
    """A 10-turn chat through Runtime.generate_stream; returns the responses."""
    rt.set_prompt_cache(max_bytes)
    sp = SamplingParams(temperature=0, max_new_tokens=6)
    msgs: list[dict] = [{"role": "system", "content": "be brief"}]
    out = []
    for t in range(10):
        if edit_at is not None and t == edit_at:  # the client rewrites an earlier message
            msgs[1] = {"role": "user", "content": "an edited first question " + observation(99)}
        msgs.append({"role": "user", "content": observation(t)})
        resp = rt.generate(msgs, sampling=sp, enable_thinking=t % 2 == 0)
        out.append(resp)
        msgs.append({"role": "assistant", "content": resp.text, "reasoning_content": resp.thinking})
    rt.set_prompt_cache(0)
    return out


def test_greedy_output_with_reuse_eviction_and_edits(rt):
    ref = greedy_turns(rt, 0)
    assert all(r.cached_tokens == 0 for r in ref)
    big = greedy_turns(rt, 1 << 30)
    assert [r.token_ids for r in big] == [r.token_ids for r in ref]
    assert all(r.cached_tokens > 0 for r in big[1:])
    assert all(r.prefilled_tokens < r.prompt_tokens / 2 for r in big[3:])  # only the new part is read
    # a limit of about one snapshot: older ones are evicted, answers unchanged
    one = PrefixCache(1 << 30)
    with torch.inference_mode():
        ids = rt.encode(rt.render([{"role": "user", "content": "x"}]))
        prefill(rt.model, ids, prefix_cache=one, boundary_ids=rt.boundary_ids)
    small = greedy_turns(rt, int(one.nbytes * 1.5) + 40_000)
    assert [r.token_ids for r in small] == [r.token_ids for r in ref]
    # an edited first message: a miss (answered as without reuse), then reuse resumes
    edited_ref = greedy_turns(rt, 0, edit_at=5)
    edited = greedy_turns(rt, 1 << 30, edit_at=5)
    assert [r.token_ids for r in edited] == [r.token_ids for r in edited_ref]
    assert edited[5].cached_tokens < edited[4].prompt_tokens // 4  # at most the system prompt survives
    assert edited[6].cached_tokens > edited[5].prompt_tokens // 2


def test_snapshots_are_never_written_by_generation(rt):
    """Generations from one snapshot (one of them stopped midway) leave it as it was, and agree."""
    rt.set_prompt_cache(1 << 30)
    sp = SamplingParams(temperature=0, max_new_tokens=8)
    msgs = [{"role": "user", "content": observation(1)}, {"role": "assistant", "content": observation(2)},
            {"role": "user", "content": observation(3)}]
    rt.generate(msgs[:1], sampling=sp)
    before = {s.ids: {k: t.clone() for k, t in s.tensors().items()} for s in rt.prompt_cache.snapshots()}
    for i, ev in enumerate(rt.generate_stream(msgs, sampling=sp)):
        if i == 2:
            rt.stop()
        stopped = ev.response
    assert stopped.finish_reason == "cancelled"
    a = rt.generate(msgs, sampling=sp)
    b = rt.generate(msgs, sampling=sp)
    assert a.token_ids == b.token_ids and b.cached_tokens >= a.cached_tokens > 0
    after = {s.ids: s.tensors() for s in rt.prompt_cache.snapshots()}
    assert before and before.keys() <= after.keys()
    for ids, tensors in before.items():
        assert all(torch.equal(t, after[ids][k]) for k, t in tensors.items())
    rt.set_prompt_cache(0)


def test_boundary_prefill_within_bound_of_one_shot(rt):
    """Cutting the prefill at message boundaries changes the chunked DeltaNet arithmetic: the logits stay within
    2e-2 of a single-chunk prefill (fp32 accumulation; measured ~1e-3) and the greedy token is the same."""
    msgs = conversation(6, True)[-1]
    ids = rt.encode(rt.render(msgs, TOOLS, True))
    assert len(prefill_plan(ids, 0, rt.boundary_ids, 512)) > 5
    with torch.inference_mode():
        cut = prefill(rt.model, ids, boundary_ids=rt.boundary_ids).logits.float()
        whole = prefill(rt.model, ids).logits.float()
    assert int(cut.argmax()) == int(whole.argmax())
    assert (cut - whole).abs().max() / whole.abs().max() < 2e-2


def test_prefill_plan_cuts_at_boundaries_and_chunks():
    ids = [5, 1, 2, 9, 3, 4, 5, 6, 9, 7]
    assert prefill_plan(ids, 0, frozenset({9}), 2) == [(0, 2), (2, 3), (3, 5), (5, 7), (7, 8), (8, 10)]
    assert prefill_plan(ids, 3, frozenset({9}), 512) == [(3, 8), (8, 10)]
    assert snapshot_points(ids, 0, frozenset({9})) == [3, 8]
    assert snapshot_points(ids, 3, frozenset({9}), 1) == [8]


def test_prefix_cache_lru_bytes_and_proper_prefix():
    def snap(ids, n=10):
        kv = torch.zeros(1, 1, 64, 4)
        return Snapshot(tuple(ids), [("linear", torch.zeros(n), torch.zeros(n)), ("kv", kv[..., :len(ids), :],
                                                                                  kv[..., :len(ids), :])])
    c = PrefixCache(3000)
    assert c.put(snap([1, 2])) and c.nbytes == 80 + 1024
    assert c.put(snap([1, 2, 3])) and c.nbytes == 80 * 2 + 2048  # a storage of its own
    assert c.lookup([1, 2, 3]).ids == (1, 2)  # a proper prefix only: one token must be prefilled
    assert c.lookup([1, 2, 3, 4]).ids == (1, 2, 3)
    assert c.lookup([2, 2, 3]) is None
    c.put(snap([7]))  # over 3000 bytes: the least recently used, (1, 2), goes
    assert [s.ids for s in c.snapshots()] == [(1, 2, 3), (7,)] and c.stats.evictions == 1
    assert not c.put(snap([8], n=10_000))  # larger than the whole cache
    assert PrefixCache(0).lookup([1, 2]) is None and not PrefixCache(0).put(snap([1]))
    s = c.summary()
    assert s["entries"] == 2 and s["hits"] == 2 and s["lookups"] == 3 and s["bytes"] == c.nbytes


def test_a_whole_prompt_is_restored_only_as_itself_and_evicted_first():
    """A whole prompt's snapshot (its last logits with it) serves only the same ids, never as a prefix, and enters
    as the least recently used: room for another snapshot is taken from it first, never from a prefix."""
    def snap(ids, logits=None):
        return Snapshot(tuple(ids), [("linear", torch.zeros(10), torch.zeros(10))], logits)
    c = PrefixCache(3 * 80 + 20)
    assert c.put(snap([1, 2])) and c.put(snap([1, 2, 3], torch.ones(5)))
    assert c.lookup([1, 2, 3, 4]).ids == (1, 2) and c.peek([1, 2, 3, 4]).ids == (1, 2)
    assert c.whole([1, 2]) is None and c.whole([1, 2, 3, 4]) is None
    assert torch.equal(c.whole([1, 2, 3]).logits, torch.ones(5))
    assert c.put(snap([5, 6])) and c.put(snap([1, 2, 3], torch.ones(5)))  # a new whole: it goes first
    assert c.put(snap([7, 8])) and c.whole([1, 2, 3]) is None
    assert {s.ids for s in c.snapshots()} == {(1, 2), (5, 6), (7, 8)} and c.stats.evictions == 1


def test_a_prompts_earlier_points_go_before_the_point_its_next_turn_continues_from(rt):
    """`spare` entries enter as the least recently used; a prefill stores its points before the last as spare, so
    a full cache gives up the start of a prompt's last message (and its whole-prompt entry) before the start of
    the generation prompt, where the next turn of that conversation continues."""
    def snap(ids):
        return Snapshot(tuple(ids), [("linear", torch.zeros(10), torch.zeros(10))])
    c = PrefixCache(3 * 80 + 20)
    assert c.put(snap([1, 2]), spare=True) and c.put(snap([1, 2, 3]))
    assert c.put(snap([5, 6])) and c.put(snap([7, 8]))  # room for three: the spare goes, not the older point
    assert {s.ids for s in c.snapshots()} == {(1, 2, 3), (5, 6), (7, 8)} and c.stats.evictions == 1
    store = PrefixCache(1 << 30)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "list the files"}]
    with torch.inference_mode():
        ids = rt.encode(rt.render(msgs))
        prefill(rt.model, ids, prefix_cache=store, boundary_ids=rt.boundary_ids)
    points = [p for p in range(1, len(ids)) if ids[p] in rt.boundary_ids][-2:]
    assert len(points) == 2
    order = [(len(s.ids), s.logits is not None) for s in store.snapshots()]  # least recently used first
    assert order == [(len(ids), True), (points[0], False), (points[1], False)]


def test_planned_snapshot_bytes_match_the_cache(rt):
    """The plan's prompt-cache budget (3 snapshots = one conversation: two boundaries and the whole prompt with
    its logits, their KV shared, up to the context) is what the runtime's cache holds when the longest snapshot
    fills the context."""
    from quantkit.checkpoint.spec import parse_text_config, spec_from_config
    from quantkit.planner.budget import RunSettings, compute_budget
    from quantkit.recipe import get_recipe

    cache = PrefixCache(1 << 30)
    msgs = conversation(3, False)[-1]
    ids = rt.encode(rt.render(msgs))
    with torch.inference_mode():
        prefill(rt.model, ids, prefix_cache=cache, boundary_ids=rt.boundary_ids)
    assert len(cache) == 3 and sum(s.logits is not None for s in cache.snapshots()) == 1
    longest = max(s.length for s in cache.snapshots())
    spec = spec_from_config(rt.config)
    b = compute_budget(spec, get_recipe("bf16"), RunSettings(context=longest, prompt_cache_snapshots=3))
    assert b.prompt_cache == cache.nbytes
    from quantkit.planner.budget import snapshot_bytes
    c = parse_text_config(rt.config)
    by_whole = {s.logits is not None: s.nbytes() for s in cache.snapshots()}
    assert snapshot_bytes(c, longest) == by_whole[False] == by_whole[True] - 2 * c.vocab_size
