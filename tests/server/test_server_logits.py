"""The server's logits hook and grammars without a model: penalty arithmetic against a hand computation,
min_p, logit_bias, logprobs of the raw distribution, token bytes, and grammars that hold under random logits
(whatever a model prefers, the masked output parses and matches the schema)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from quantkit.server.logits import LogitsHook, Penalties, TokenPieces
from quantkit.server.parsing import parse_tool_calls


def test_penalties_match_the_documented_arithmetic():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])
    hook = LogitsHook([1], penalties=Penalties(presence=0.5, frequency=0.25, repetition=2.0))
    hook.process(logits)
    for t in (3, 3, 2):  # generated: 3 twice, 2 once
        hook.accept(t)
    got = hook.process(logits)
    want = logits.clone()
    seen = {1, 2, 3}  # prompt + generated (repetition penalty)
    for t in seen:
        want[t] = want[t] / 2 if want[t] > 0 else want[t] * 2
    counts = {3: 2, 2: 1}
    for t, c in counts.items():
        want[t] -= 0.5 + 0.25 * c
    assert torch.allclose(got, want)
    assert torch.equal(logits, torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0]))  # the model's logits are not touched


def test_min_p_keeps_tokens_within_the_ratio_at_the_temperature():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    for temp, keep in ((1.0, 3), (0.5, 2)):  # p/p_max >= 0.2: 1, 0.6, 0.3 | 1, 0.36 (0.09 dropped)
        out = LogitsHook([], penalties=Penalties(min_p=0.2), temperature=temp).process(logits)
        assert int(torch.isfinite(out).sum()) == keep, (temp, out)
    assert torch.isfinite(LogitsHook([], penalties=Penalties(min_p=0.9), temperature=0).process(logits)).all()


def test_logit_bias_and_logprobs_of_the_raw_distribution():
    logits = torch.tensor([1.0, 2.0, 3.0, 0.0])
    hook = LogitsHook([], penalties=Penalties(logit_bias={0: 100.0}), top_logprobs=2)
    out = hook.process(logits)
    assert int(torch.argmax(out)) == 0
    lp = hook.accept(0)
    raw = torch.log_softmax(logits, -1)
    assert lp.token == 0 and math.isclose(lp.logprob, float(raw[0]), rel_tol=1e-6)
    assert [t for t, _ in lp.top] == [2, 1] and math.isclose(lp.top[0][1], float(raw[2]), rel_tol=1e-6)
    assert LogitsHook([], top_logprobs=None).accept(0) is None


def test_logprobs_of_bf16_logits_over_a_vocabulary_spread_wide():
    """The runtime's bf16 logits: their logprobs are the float64 log-softmax's within fp32 rounding however far the
    logits spread (quantkit.runtime.cpu_kernel.logsumexp), and with nothing to change the hook hands sampling the
    logits themselves, not a copy."""
    g = torch.Generator().manual_seed(5)
    for scale in (1.0, 40.0):
        logits = (torch.randn(1, 248320, generator=g) * scale).bfloat16()
        hook = LogitsHook([], top_logprobs=3)
        out = hook.process(logits[0])
        assert out.data_ptr() == logits.data_ptr() and out.dtype == torch.bfloat16
        tok = int(torch.argmax(out))
        lp = hook.accept(tok)
        want = torch.log_softmax(logits[0].double(), -1)
        assert math.isclose(lp.logprob, float(want[tok]), rel_tol=1e-6, abs_tol=1e-5)
        assert [t for t, _ in lp.top][0] == tok
        assert all(math.isclose(v, float(want[t]), rel_tol=1e-6, abs_tol=1e-5) for t, v in lp.top)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoTokenizer

    from quantkit.testing.tokenizer import write_tokenizer

    out = tmp_path_factory.mktemp("tok")
    write_tokenizer(Path(out))
    return AutoTokenizer.from_pretrained(out)


def test_token_pieces_are_the_bytes_each_token_stands_for(tokenizer):
    pieces = TokenPieces(tokenizer)
    text = "héllo wörld <tool_call> ✓"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert bytes(b for t in ids for b in pieces(t)[1]).decode() == text
    assert pieces(tokenizer.convert_tokens_to_ids("<|im_end|>"))[0] == "<|im_end|>"


def _sample(grammars, grammar: str, tokenizer, seed: int, steps: int = 400) -> str:
    """Random logits (a model with no opinion), masked by the grammar, until the grammar lets it stop."""
    g = torch.Generator().manual_seed(seed)
    c = grammars.constraint(grammar, opens_reasoning=False)
    stop = {tokenizer.convert_tokens_to_ids("<|im_end|>")}
    out = []
    for _ in range(steps):
        x = torch.randn(len(tokenizer), generator=g) * 3
        c.mask(x)
        t = int(torch.multinomial(torch.softmax(x, -1), 1, generator=g))
        if t in stop:
            return tokenizer.decode(out)
        c.accept(t)
        out.append(t)
    raise AssertionError(f"the grammar did not end within {steps} tokens: {tokenizer.decode(out)[:200]!r}")


@pytest.fixture(scope="module")
def grammars(tokenizer):
    from quantkit.server.grammar import Grammars

    return Grammars(tokenizer, [tokenizer.convert_tokens_to_ids("<|im_end|>")],
                    tokenizer.convert_tokens_to_ids("</think>"))


SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1, "maximum": 9},
    "unit": {"type": "string", "enum": ["c", "f"]}, "ok": {"type": "boolean"}},
    "required": ["city", "days", "unit", "ok"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}]


@pytest.mark.parametrize("seed", range(4))
def test_json_schema_output_is_valid_under_random_logits(grammars, tokenizer, seed):
    obj = json.loads(_sample(grammars, grammars.json(SCHEMA), tokenizer, seed))
    assert set(obj) == {"city", "days", "unit", "ok"} and len(obj["city"]) <= 12
    assert isinstance(obj["days"], int) and 1 <= obj["days"] <= 9 and obj["unit"] in ("c", "f")
    assert isinstance(obj["ok"], bool)


@pytest.mark.parametrize("seed", range(4))
def test_a_forced_tool_call_parses_and_matches_the_schema(grammars, tokenizer, seed):
    text = _sample(grammars, grammars.tool_calls(TOOLS, "get_weather"), tokenizer, seed)
    content, calls = parse_tool_calls(text, TOOLS)
    assert content.strip() == "" and len(calls) == 1 and calls[0].name == "get_weather", text
    args = json.loads(calls[0].arguments)
    assert set(args) == {"city", "days", "unit", "ok"} and isinstance(args["days"], int) and 1 <= args["days"] <= 9
    assert args["unit"] in ("c", "f") and isinstance(args["ok"], bool) and len(args["city"]) <= 12


def test_required_calls_any_tool_and_thinking_is_left_free(grammars, tokenizer):
    names = set()
    for seed in range(6):
        _, calls = parse_tool_calls(_sample(grammars, grammars.tool_calls(TOOLS, None), tokenizer, seed, 1500), TOOLS)
        assert calls
        names |= {c.name for c in calls}
    assert names <= {"get_weather", "ping"}
    c = grammars.constraint(grammars.json(None), opens_reasoning=True)
    x = torch.zeros(len(tokenizer))
    c.mask(x)
    assert torch.isfinite(x).all()  # still thinking: nothing masked
    c.accept(tokenizer.convert_tokens_to_ids("</think>"))
    c.mask(x)
    allowed = torch.isfinite(x).nonzero().flatten().tolist()
    assert allowed and all(tokenizer.decode([t]).lstrip().startswith("{") for t in allowed)


@pytest.mark.parametrize("schema,needle", [
    ({"type": "string", "pattern": "(?<=a)b"}, "look-around"),
    ({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}, "nowhere"),
])
def test_a_schema_the_engine_cannot_compile_is_one_line_naming_it(grammars, schema, needle):
    from quantkit.server.grammar import GrammarError

    with pytest.raises(GrammarError) as e:
        grammars.json(schema)
    assert needle in str(e.value) and "\n" not in str(e.value)
