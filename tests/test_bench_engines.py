"""`quantkit bench engines`' bandwidth bound for llama.cpp: the bytes one decode step reads from a GGUF."""

from __future__ import annotations

from quantkit.bench.engines import gguf_step_bytes
from quantkit.export.gguf import export_gguf
from quantkit.model.gguf_file import read_gguf


def test_gguf_step_bytes_reads_top_k_of_the_experts_and_one_embedding_row(tiny_model, tmp_path):
    path = export_gguf(tiny_model, tmp_path / "t.gguf", "bf16").path
    tensors = read_gguf(path).tensors
    emb = next(t for t in tensors if t.name == "token_embd.weight")
    experts = [t for t in tensors if "_exps." in t.name]
    n_exp = experts[0].shape[0]
    assert experts and all(t.shape[0] == n_exp for t in experts)
    everything = sum(t.nbytes for t in tensors) - emb.nbytes + emb.nbytes // emb.shape[0]
    assert gguf_step_bytes(path, n_exp) == everything  # every expert: the whole file but the embedding
    exp_bytes = sum(t.nbytes for t in experts)
    assert gguf_step_bytes(path, 2) == everything - exp_bytes + sum(t.nbytes * 2 // n_exp for t in experts)
