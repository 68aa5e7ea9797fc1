"""The checkpoint `quantkit bench serve --clients` serves: realistic shapes, the real vocabulary and its tokenizer.

Random weights draw token ids from the whole vocabulary, so the folder carries the real Qwen3.5 tokenizer with
every one of the 248,320 rows given text (quantkit.testing.qwen_tokenizer): each generated token then reaches
a client as its own chunk in both servers and can be timed. The random bf16 checkpoint (`quantkit tiny-model
--realistic`, in the shape `quantkit bench engines` uses: hidden 2048, 4 layers of 64 experts, top-8, no MTP
layer) is quantized by `quantkit quantize` with that bench's recipe, the one the GGUF `mixed` export writes bit
for bit (experts int4 sym g32 = Q4_0, int8 rest). Not generated directly in the stored format: that draws each
row from a pool of 256, so the lm_head's rows repeat, greedy decoding meets ties and picks the lowest id (byte
tokens, half of them a lone part of a UTF-8 character that a server holds back), where llama.cpp breaks ties
otherwise.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from quantkit.checkpoint.spec import Role
from quantkit.formats import QuantSpec
from quantkit.recipe import INT8, Recipe

LAYERS, EXPERTS, TOP_K = 4, 64, 8
SOURCE = f"qwen-vocab-L{LAYERS}-E{EXPERTS}-k{TOP_K}-bf16"
FOLDER = f"qwen-vocab-L{LAYERS}-E{EXPERTS}-k{TOP_K}-int4g32"
DONE = "qwen-tokenizer.done"  # written last into the source: a folder without it was interrupted


def recipe() -> Recipe:
    return Recipe("bench-engines", {Role.ROUTED_EXPERT: QuantSpec("int4", 32, True), Role.ATTENTION: INT8,
                                    Role.LINEAR_ATTENTION: INT8, Role.SHARED_EXPERT: INT8, Role.LM_HEAD: INT8},
                  description="experts int4 sym g32 (= Q4_0), attention/linear/shared/lm_head int8")


def config(vocab: int) -> dict[str, Any]:
    """config.json of the realistic shape, its token ids the real tokenizer's."""
    from quantkit.testing.qwen_tokenizer import special_ids
    from quantkit.testing.tiny import TinyOptions, full_config, text_config

    ids = special_ids()
    cfg = full_config({**text_config(TinyOptions(LAYERS, EXPERTS, TOP_K, vocab=vocab, realistic=True)),
                       "eos_token_id": ids["<|endoftext|>"]})
    for key, tok in (("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
                     ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>")):
        cfg[key] = ids[tok]
    return cfg


def prepare(workdir: Path, log: Callable[[str], None] = print) -> Path:
    """The quantized folder in `workdir` (made once: a finished one, its manifest written, is reused; so is the
    bf16 source with the Qwen tokenizer)."""
    from quantkit.checkpoint.reader import Checkpoint
    from quantkit.quantize.run import QuantizeOptions, run_quantize
    from quantkit.testing.qwen_tokenizer import VOCAB, special_ids, write_qwen_tokenizer
    from quantkit.testing.tiny import make_tiny_model

    src, out = workdir / SOURCE, workdir / FOLDER
    if (out / "quantkit-manifest.json").is_file():
        return out
    if not (src / DONE).is_file():
        log(f"generating {src} (random bf16, realistic shape) with the Qwen tokenizer")
        make_tiny_model(src, realistic=True, layers=LAYERS, experts=EXPERTS, top_k=TOP_K, vocab=VOCAB, overwrite=True)
        write_qwen_tokenizer(src, VOCAB)
        ids = special_ids()
        (src / "config.json").write_text(json.dumps(config(VOCAB), indent=2) + "\n")
        gen = {"bos_token_id": None, "eos_token_id": [ids["<|endoftext|>"], ids["<|im_end|>"]],
               "pad_token_id": ids["<|endoftext|>"], "do_sample": True, "temperature": 0.6, "top_p": 0.95,
               "top_k": 20}
        (src / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        (src / DONE).write_text("the tokenizer and token ids are the real Qwen3.5 ones\n")
    log(f"quantizing {src} to {out} ({recipe().description})")
    run_quantize(Checkpoint.open(src), out, QuantizeOptions(recipe(), mode="overwrite"))
    return out
