"""How llama.cpp's `qwen35moe` architecture wants Qwen3.5-MoE tensors: names, shapes and values.

Read from llama.cpp's loader (src/models/qwen35moe.cpp) and its converter (convert_hf_to_gguf.py, shipped in
the llama-cpp-python sdist), implemented here on our canonical tensors:
- RMSNorm weights are stored zero-centred (the model computes x * (1 + w)); llama.cpp multiplies by the
  weight, so every norm gets + 1, except `linear_attn.norm` (a gated norm that already multiplies by w);
- `A_log` becomes `ssm_a = -exp(A_log)` and `dt_bias` becomes `ssm_dt.bias`;
- `conv1d.weight` [C, 1, K] is squeezed to [C, K];
- linear attention with fewer key heads than value heads: value heads are stored grouped by key head
  ([k0v0, k0v1, k1v0, k1v1]); ggml broadcasts key heads tiled, so value heads are reordered to
  [k0v0, k1v0, k0v1, k1v1] in every tensor indexed by them (the v rows of in_proj_qkv, in_proj_z,
  in_proj_a/b, A_log, dt_bias, the v channels of conv1d, the columns of out_proj);
- fused routed experts `gate_up_proj` [E, 2I, H] are split into `ffn_gate_exps` and `ffn_up_exps`
  (numpy [E, I, H] = ggml {H, I, E}); `down_proj` [E, H, I] is `ffn_down_exps` as it is;
- the MTP layer is llama.cpp's NextN block, as the converter writes it (conversion/qwen.py `_QwenMtpMixin`):
  block index num_hidden_layers + k for `mtp.layers.k.*` (the standard per-block names; its per-expert
  tensors stacked into `ffn_{gate,up,down}_exps`, as the converter merges them), and on that first MTP block
  `mtp.fc` -> `nextn.eh_proj`, `mtp.pre_fc_norm_embedding` -> `nextn.enorm`, `mtp.pre_fc_norm_hidden` ->
  `nextn.hnorm`, `mtp.norm` -> `nextn.shared_head_norm` (these norms + 1 as well). Nothing is reordered:
  `fc` takes concat(normed embedding, normed hidden), the order llama.cpp's MTP graph
  (src/models/qwen35moe.cpp) feeds `eh_proj`; the head and the embedding are the model's own (Qwen3.5 has
  no `nextn.embed_tokens` / `shared_head_head`).
Shapes here are numpy order (GGUF reverses them into ggml's ne).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from quantkit.checkpoint.spec import TextConfig

# Kept in F32 whatever the file type, as llama.cpp's own converter does (its kernels take these in F32).
F32_SUFFIXES = ("_norm.weight", "ssm_norm.weight", "ssm_a", "ssm_dt.bias", "ssm_conv1d.weight",
                "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")


def is_f32_only(name: str, shape: tuple[int, ...]) -> bool:
    return name.endswith(F32_SUFFIXES) or len(shape) < 2


_LAYER = re.compile(r"^model\.language_model\.layers\.(\d+)\.(.+)$")
_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
_MTP_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
# the MTP layer's own tensors outside its decoder block -> NextN names on the first MTP block
MTP_NEXTN = {
    "mtp.fc.weight": "nextn.eh_proj.weight",
    "mtp.pre_fc_norm_embedding.weight": "nextn.enorm.weight",
    "mtp.pre_fc_norm_hidden.weight": "nextn.hnorm.weight",
    "mtp.norm.weight": "nextn.shared_head_norm.weight",
}
# what llama.cpp's qwen35moe loader requires of an MTP block (load_block_mtp; the rest is optional)
MTP_REQUIRED = (
    "attn_norm.weight", "post_attention_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
    "attn_output.weight", "attn_q_norm.weight", "attn_k_norm.weight", "ffn_gate_inp.weight",
    "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight", "ffn_gate_inp_shexp.weight",
    "ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight", "nextn.eh_proj.weight",
    "nextn.enorm.weight", "nextn.hnorm.weight",
)

# canonical suffix inside a layer -> GGUF name inside blk.N
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
}
_GLOBAL_NAMES = {
    "model.language_model.embed_tokens.weight": "token_embd.weight",
    "model.language_model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


@dataclass(frozen=True)
class Piece:
    """One GGUF tensor made from one canonical tensor (a fused gate_up gives two pieces)."""

    gguf_name: str
    source: str  # canonical name
    rows: slice | None  # for split expert stacks: the rows of dim 1 this piece takes
    shape: tuple[int, ...]  # numpy order, after conversion
    value: str  # "" or a conversion: "norm+1", "-exp", ...
    row_perm: torch.Tensor | None = None  # permutation of dim -2 (rows), applied after `rows`
    col_perm: torch.Tensor | None = None  # permutation of dim -1 (columns)
    col_unit: int = 1  # the permutation moves whole runs of this many columns (head dim)
    expert: int | None = None  # one expert matrix of a stack: its index along dim 0 of `shape` (MTP experts)

    @property
    def f32_only(self) -> bool:
        return is_f32_only(self.gguf_name, self.shape)


def v_head_perm(n_k: int, n_v: int, unit: int) -> torch.Tensor | None:
    """Index that takes value heads from grouped-by-key-head to tiled order ([k][r][d] -> [r][k][d]),
    each head `unit` wide; None when there is nothing to reorder."""
    if n_k <= 0 or n_v <= 0 or n_k == n_v:
        return None
    if n_v % n_k:
        raise ValueError(f"value heads {n_v} are not a multiple of key heads {n_k}")
    return torch.arange(n_v * unit).reshape(n_k, n_v // n_k, unit).permute(1, 0, 2).reshape(-1)


def pieces_for(name: str, shape: tuple[int, ...], c: TextConfig) -> list[Piece]:
    """The GGUF tensors for canonical tensor `name` (empty for tensors llama.cpp does not take: vision).
    An MTP expert matrix is one `expert` of a stacked piece: the exporter gathers the stack."""
    if name in _GLOBAL_NAMES:
        value = "norm+1" if name.endswith("norm.weight") else ""
        return [Piece(_GLOBAL_NAMES[name], name, None, tuple(shape), value)]
    if name in MTP_NEXTN:  # the three norms (pre_fc_norm_* included) + 1, as the converter does by GGUF name
        value = "norm+1" if MTP_NEXTN[name].endswith("norm.weight") else ""
        return [Piece(f"blk.{c.num_hidden_layers}.{MTP_NEXTN[name]}", name, None, tuple(shape), value)]
    m = _LAYER.match(name) or _MTP_LAYER.match(name)
    if not m:
        return []
    layer, rest = int(m.group(1)), m.group(2)
    if name.startswith("mtp."):
        layer += c.num_hidden_layers
        e = _MTP_EXPERT.match(rest)
        if e:
            out, inner = tuple(shape)
            return [Piece(f"blk.{layer}.ffn_{e.group(2)}_exps.weight", name, None, (c.num_experts, out, inner), "",
                          expert=int(e.group(1)))]
    blk = f"blk.{layer}."
    if rest == "mlp.experts.gate_up_proj":
        e, two_i, h = shape
        i = two_i // 2
        return [Piece(blk + "ffn_gate_exps.weight", name, slice(0, i), (e, i, h), ""),
                Piece(blk + "ffn_up_exps.weight", name, slice(i, two_i), (e, i, h), "")]
    if rest not in _LAYER_NAMES:
        return []
    g = blk + _LAYER_NAMES[rest]
    nk, nv = c.linear_num_key_heads, c.linear_num_value_heads
    dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
    shape = tuple(shape)
    value = ""
    row_perm = col_perm = None
    col_unit = 1
    if rest.endswith("norm.weight") and rest != "linear_attn.norm.weight":
        value = "norm+1"
    elif rest == "linear_attn.A_log":
        value = "-exp"
        row_perm = v_head_perm(nk, nv, 1)
    elif rest == "linear_attn.dt_bias":
        row_perm = v_head_perm(nk, nv, 1)
    elif rest == "linear_attn.conv1d.weight":
        value = "squeeze"
        shape = (shape[0], shape[-1])
        row_perm = _keep_prefix(v_head_perm(nk, nv, dv), 2 * nk * dk)
    elif rest == "linear_attn.in_proj_qkv.weight":
        row_perm = _keep_prefix(v_head_perm(nk, nv, dv), 2 * nk * dk)
    elif rest == "linear_attn.in_proj_z.weight":
        row_perm = v_head_perm(nk, nv, dv)
    elif rest in ("linear_attn.in_proj_a.weight", "linear_attn.in_proj_b.weight"):
        row_perm = v_head_perm(nk, nv, 1)
    elif rest == "linear_attn.out_proj.weight":
        col_perm = v_head_perm(nk, nv, dv)
        col_unit = dv
    return [Piece(g, name, None, shape, value, row_perm, col_perm, col_unit)]


def _keep_prefix(perm: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """A permutation of the rows after the first `n` (the q and k rows stay in place)."""
    if perm is None:
        return None
    return torch.cat([torch.arange(n), perm + n])


def convert(piece: Piece, w: torch.Tensor) -> torch.Tensor:
    """Apply the piece's conversion to a dense fp32 slab (leading expert dim allowed)."""
    if piece.rows is not None:
        w = w[..., piece.rows, :]
    if piece.value == "squeeze":
        w = w.reshape(w.shape[0], w.shape[-1])
    if piece.row_perm is not None:
        w = w.index_select(0 if w.dim() == 1 else w.dim() - 2, piece.row_perm)
    if piece.col_perm is not None:
        w = w.index_select(w.dim() - 1, piece.col_perm)
    if piece.value == "norm+1":
        w = w + 1
    elif piece.value == "-exp":
        w = -torch.exp(w)
    return w.contiguous()


def permute_blocks(piece: Piece, rows_bytes: torch.Tensor, block: int, block_bytes: int) -> torch.Tensor | None:
    """Apply the piece's row/column permutation to already-encoded GGUF rows (uint8 [..., out, nbytes]);
    None when a column permutation would split a block (head dim not a multiple of the block size)."""
    if piece.rows is not None:
        rows_bytes = rows_bytes[..., piece.rows, :]
    if piece.row_perm is not None:
        rows_bytes = rows_bytes.index_select(rows_bytes.dim() - 2, piece.row_perm)
    if piece.col_perm is not None:
        if piece.col_unit % block:
            return None
        nb = rows_bytes.shape[-1] // block_bytes
        bperm = piece.col_perm.reshape(-1, piece.col_unit)[:, ::block].reshape(-1) // block
        assert bperm.numel() == nb
        blocks = rows_bytes.reshape(*rows_bytes.shape[:-1], nb, block_bytes)
        rows_bytes = blocks.index_select(blocks.dim() - 2, bperm).reshape(rows_bytes.shape)
    return rows_bytes.contiguous()

