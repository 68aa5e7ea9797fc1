"""Accuracy of the quantized runtime on the session's decisive tiny model (real architecture).

(a) Layer by layer, with the reference's expert choice held fixed (quantkit.runtime.evaluate): relative
    error of each decoder layer's update against transformers' fp32 model. The bf16 row is the runtime
    without quantization: bf16 activations alone cost ~3% on this model, so a format's figure includes
    that. Bounds are the measured values (reports/bench-decode.md lists them) plus ~15%.
(b) End to end against transformers' bf16 model over 320 positions (4 probe sequences x 80): top-1
    agreement, KL(ref || runtime), greedy continuations of 2 prompts x 24 tokens. The decisive model's
    next-token distributions are peaked by construction (a bigram term on lm_head), so its KL values are
    far below what a trained model shows; the floors say what THIS model gives, nothing more.

Measured on the build machine (CPU, torch 2.13): max layer error / top-1 / mean KL / greedy tokens identical before the first divergence (of 48)
  bf16 0.034 / 1.000 / <1e-5 / 48     int8 0.036 / 1.000 / <1e-5 / 48   quality 0.108 / 1.000 / <1e-5 / 48
  int4 0.190 / 0.994 / 4.5e-4 / 25     nf4 0.191 / 0.994 / 2.7e-4 / 48   fp4 0.242 / 0.981 / 6.8e-4 / 25
  mxfp4 0.230 / 0.988 / 3.2e-4 / 25    (uniform recipes: every matrix, embedding and lm_head included)
"""

from __future__ import annotations

import pytest
import torch

from quantkit.runtime import SamplingParams, load_model
from quantkit.runtime.evaluate import layer_errors, logit_agreement
from quantkit.testing.tiny import load_reference_model, probe_ids

from helpers.runtime import quantized

# recipe: (max layer error, min top-1 agreement, max mean KL, min greedy tokens identical to the reference
# before the first divergence, summed over the 2 prompts x GEN). int4, fp4 and mxfp4 follow the first prompt
# all the way and leave the second at its first token, where the reference's top two are nearly tied.
BOUNDS = {
    "bf16": (0.04, 1.0, 1e-5, 48),
    "int8": (0.042, 0.99, 1e-5, 48),
    "quality": (0.125, 0.99, 1e-4, 48),
    "int4": (0.22, 0.98, 1e-3, 24),
    "nf4": (0.22, 0.98, 6e-4, 48),
    "fp4": (0.28, 0.97, 1.5e-3, 24),
    "mxfp4": (0.265, 0.975, 8e-4, 24),
}
GEN = 24
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def refs(tiny_model):
    ref32 = load_reference_model(tiny_model, torch.float32)
    ref16 = load_reference_model(tiny_model, torch.bfloat16)
    ids = probe_ids()
    with torch.no_grad():
        logits16 = ref16(ids).logits.float()
        greedy = [ref16.generate(row[None], max_new_tokens=GEN, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)[0, 16:].tolist() for row in ids[:2, :16]]
    return {"ref32": ref32, "ids": ids, "logits16": logits16, "greedy": greedy}


def runtime_for(tiny_model, recipe: str):
    return load_model(tiny_model, recipe="bf16") if recipe == "bf16" else load_model(quantized(tiny_model, recipe))


def greedy_tokens(rt, prompt: list[int]) -> list[int]:
    sp = SamplingParams(temperature=0, max_new_tokens=GEN)
    return [e.token for e in rt.generate_ids(prompt, sp, thinking=False) if e.response is None]


@pytest.mark.parametrize("recipe", list(BOUNDS))
def test_accuracy_per_format(recipe, tiny_model, refs):
    max_layer, min_top1, max_kl, min_greedy = BOUNDS[recipe]
    rt = runtime_for(tiny_model, recipe)
    errs = layer_errors(rt.model, refs["ref32"], refs["ids"])
    assert len(errs) == 4 and max(errs) < max_layer, errs
    a = logit_agreement(rt.logits(refs["ids"]), refs["logits16"])
    assert a["positions"] == 320
    assert a["top1_agreement"] >= min_top1, a
    assert a["kl_mean"] <= max_kl, a
    agreed = 0
    for row, want in zip(refs["ids"][:2, :16], refs["greedy"], strict=True):
        got = greedy_tokens(rt, row.tolist())
        agreed += next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), len(want))
    assert agreed >= min_greedy, agreed


def test_int8_is_closer_than_4_bit(tiny_model, refs):
    """The ordering the formats' bits imply holds layer by layer."""
    e8 = layer_errors(runtime_for(tiny_model, "int8").model, refs["ref32"], refs["ids"])
    e4 = layer_errors(runtime_for(tiny_model, "int4").model, refs["ref32"], refs["ids"])
    assert all(a < b for a, b in zip(e8, e4, strict=True))


def test_on_the_fly_quantization_equals_the_quantized_folder(tiny_model, refs):
    """load_model(bf16 folder, recipe=R) quantizes with the same formats as `quantkit quantize`."""
    a = runtime_for(tiny_model, "int4").logits(refs["ids"][:1])
    b = load_model(tiny_model, recipe="int4").logits(refs["ids"][:1])
    assert torch.equal(a, b)
