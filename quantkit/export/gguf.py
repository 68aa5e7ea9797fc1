"""`quantkit export gguf`: a checkpoint (bf16 or a quantkit folder) as one GGUF file llama.cpp, Ollama
and LM Studio load, architecture `qwen35moe`.

Types written here (`--type`): f32, f16, bf16, q8_0, q4_0, mxfp4 on every matrix, or `mixed` (this function's
default; the CLI's when llama-cpp-python is missing, else q4_k_m, see quantkit.export.gguf_types), which mirrors
quantkit's 4-bit recipe: routed experts Q4_0 (MXFP4 when the source experts are stored MXFP4, reused
as they are), attention, linear attention, shared expert, lm_head and embedding Q8_0. Whatever the type,
norms, the router, the shared-expert gate, conv1d, A_log and dt_bias stay F32 as llama.cpp expects.
Q4_0 over MXFP4 for experts is measured, not assumed: through llama.cpp on the tiny decisive model,
mixed with Q4_0 experts has KL 3.7e-6 against the bf16 logits, with MXFP4 experts 4.7e-6 (expert weight
SQNR 21.3 vs 18.9 dB: Q4_0's fp16 scale fits each block, MXFP4's is a power of two);
tests/export/test_export_gguf.py re-measures it. `expert_type` (CLI `--expert-type`) overrides the choice.

Streaming: the tensor table is planned first (every type and byte size is known before a weight is
read), then each tensor is read alone (an expert stack one slab of experts at a time), converted,
quantized and appended to the file. The `gguf` package's `GGUFWriter` writes the header, metadata and
tensor table; its `write_tensor_data` takes only a whole array per tensor, so the data of each tensor
is appended here to the writer's own file handle, slab by slab, with the writer's alignment padding.
The file is written under a temporary name and renamed when complete.

K-quants and IQ types (`--type q4_k_m`, ... quantkit.export.gguf_types.LLAMA_TYPES) are written by llama.cpp's
own quantizer: this module streams the source to a hidden bf16 GGUF beside the output, then
quantkit.export.gguf_quantize runs llama.cpp on it with our recipe as per-tensor overrides and, with
`imatrix`, the importance data of a llama.cpp imatrix GGUF (validated by name and shape against this
model's tensors first). Free disk for both files is checked before anything is written; the bf16
intermediate and the partial output are removed on success, failure and Ctrl-C. The result lists each
tensor's type as llama.cpp wrote it, read back from the file, and every per-tensor fallback.

MTP: a source that keeps its MTP layer (`mtp.*`, as `quantkit quantize` does by default) exports it as llama.cpp's
NextN block, as llama.cpp's own converter writes it (quantkit.checkpoint.gguf_layout): block num_hidden_layers, its
per-expert experts stacked, `{arch}.nextn_predict_layers` 1, `block_count` counting the block and
`attention.recurrent_layers` marking it full attention. Its tensors take the recipe of the role each plays in a
decoder layer (quantkit.checkpoint.spec.mtp_subrole: experts as routed experts, `fc` and attention as attention), codes
reused where the types match. llama.cpp loads the block only when asked to draft with it (`llama-server
--spec-type draft-mtp`); otherwise its bytes stay on disk. `mtp=False` (`--no-mtp-layer`) leaves it out, as the
converter's --no-mtp does; an incomplete MTP layer is refused by name.

Reuse: codes already in a GGUF block format are copied, not requantized: a quantkit MXFP4 tensor to
MXFP4 (same bytes), symmetric int4 with group 32 to Q4_0 (same codes and scales). Other stored formats
(int8 per channel, int4 with another group or asymmetric, nf4/fp4) are dequantized and requantized;
the result lists every tensor as reused / converted / fallback. A matrix whose row length is not a
multiple of the block size (32) cannot take a block type; it falls back to F16 and the result says so.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from quantkit.checkpoint.gguf_file import read_gguf
from quantkit.checkpoint.gguf_layout import MTP_REQUIRED, Piece, convert, permute_blocks, pieces_for
from quantkit.checkpoint.quantized import StoredTensor
from quantkit.checkpoint.reader import check_finite
from quantkit.checkpoint.spec import Role, mtp_subrole
from quantkit.errors import QuantkitError
from quantkit.export.gguf_imatrix import load_imatrix
from quantkit.export.gguf_quantize import quantize_gguf, require_llama_cpp
from quantkit.export.gguf_tokenizer import add_tokenizer
from quantkit.export.gguf_types import LLAMA_TYPES, NATIVE_TYPES, check_type, tensor_bytes, tensor_type
from quantkit.export.source import ExportSource
from quantkit.fileio import pid_temp_name
from quantkit.formats import QuantSpec, get_format
from quantkit.formats.int4 import int4_to_q4_0_blocks
from quantkit.formats.mxfp4 import to_gguf_blocks
from quantkit.outputs import check_free, guard_output, has_magic
from quantkit.progress import NoProgress, Progress

ARCH = "qwen35moe"
TYPES = NATIVE_TYPES
MIXED_EXPERT_TYPE = "q4_0"
EXPERT_TYPES = ("q4_0", "mxfp4", "q8_0")
# fp32 bytes per slab of a converted tensor: the quantizers' numpy temporaries are about 3x that.
SLAB_BYTES = 128 << 20
F16_MAX = 65504.0


def _qt(name: str) -> Any:
    from gguf import GGMLQuantizationType as Q

    return {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0, "mxfp4": Q.MXFP4}[name]


@dataclass
class GgufTensor:
    """One planned GGUF tensor."""

    piece: Piece
    source: StoredTensor
    qtype: Any  # gguf.GGMLQuantizationType
    how: str  # "reused", "converted", "fallback"
    note: str
    nbytes: int
    stack: list[StoredTensor] = field(default_factory=list)  # the expert matrices a stacked tensor holds, in order

    @property
    def sources(self) -> list[StoredTensor]:
        return self.stack or [self.source]

    @property
    def name(self) -> str:
        return self.piece.gguf_name


@dataclass
class GgufResult:
    path: Path
    type: str
    tensors: list[GgufTensor]
    skipped: list[str]  # canonical tensors not exported (vision; MTP with mtp=False)
    tokenizer: dict[str, Any]
    nbytes: int
    seconds: float
    in_bytes: int
    notes: list[str] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.tensors:
            out[t.how] = out.get(t.how, 0) + 1
        return out

    def by_type(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.tensors:
            out[t.qtype.name] = out.get(t.qtype.name, 0) + 1
        return out


# ---- type decisions ---------------------------------------------------------------------------------

def _role(st: StoredTensor) -> Role:
    """The tensor's role, an MTP tensor's the one it plays in a decoder layer."""
    return mtp_subrole(st.name) if st.role == Role.MTP else st.role


def _target_type(ftype: str, st: StoredTensor, piece: Piece, expert_type: str | None) -> str:
    if piece.f32_only or len(piece.shape) < 2:
        return "f32"
    if ftype != "mixed":
        return ftype
    if _role(st) == Role.ROUTED_EXPERT:
        if expert_type:
            return expert_type
        return "mxfp4" if st.spec is not None and st.spec.format == "mxfp4" else MIXED_EXPERT_TYPE
    return "q8_0"


def _reusable(st: StoredTensor, target: str) -> bool:
    s = st.spec
    if s is None:
        return False
    if target == "mxfp4":
        return s.format == "mxfp4"
    if target == "q4_0":
        return s.format == "int4" and s.symmetric and (s.group_size or 128) == 32
    return False


def plan_tensors(src: ExportSource, ftype: str, expert_type: str | None = None,
                 mtp: bool = True) -> tuple[list[GgufTensor], list[str]]:
    """Every GGUF tensor with its type, provenance and byte size, in file order. `expert_type` (q4_0 or
    mxfp4) overrides mixed's choice for the routed experts; `mtp=False` leaves the MTP layer out."""
    import gguf

    if ftype not in TYPES:
        raise QuantkitError(f"--type {ftype!r}: use one of {', '.join(TYPES)}")
    if expert_type not in (None, *EXPERT_TYPES):
        raise QuantkitError(f"--expert-type {expert_type!r}: use one of {', '.join(EXPERT_TYPES)}")
    out: list[GgufTensor] = []
    skipped: list[str] = []
    stacks: dict[str, dict[int, StoredTensor]] = {}
    for st in src.tensors():
        pieces = [] if st.role == Role.MTP and not mtp else pieces_for(st.name, st.shape, src.text)
        if not pieces:
            skipped.append(st.name)
            continue
        for pc in pieces:
            if pc.expert is not None:  # one expert of a stacked tensor: planned once, when its stack is complete
                stack = stacks.setdefault(pc.gguf_name, {})
                if pc.expert in stack or pc.expert >= pc.shape[0]:
                    raise QuantkitError(f"{src.path}: {st.name} is expert {pc.expert} of {pc.gguf_name}, which "
                                        f"holds {pc.shape[0]} experts once each")
                stack[pc.expert] = st
                if len(stack) < pc.shape[0]:
                    continue
                st = _stack_source(src, pc, stack)
            target = _target_type(ftype, st, pc, expert_type)
            qt = _qt(target)
            block, _ = gguf.GGML_QUANT_SIZES[qt]
            how, note = "converted", ""
            if block > 1 and pc.shape[-1] % block:
                target, qt = "f16", _qt("f16")
                how = "fallback"
                note = (f"row length {pc.shape[-1]} is not a multiple of {block}, so {_qt_name(target, True)} "
                        "cannot hold it: F16 instead")
            elif _reusable(st, target) and _reuse_ok(pc, block):
                how = "reused"
                note = f"{st.spec.format} codes copied as {qt.name}"
            elif st.spec is not None:
                note = f"{st.spec.format} g{st.spec.group_size} dequantized, requantized to {qt.name}"
            else:
                note = f"{st.dtype} -> {qt.name}"
            nbytes = int(np.prod(gguf.quant_shape_to_byte_shape(pc.shape, qt)))
            stacked = [stacks[pc.gguf_name][e] for e in range(pc.shape[0])] if pc.expert is not None else []
            out.append(GgufTensor(pc, st, qt, how, note, nbytes, stacked))
    names = [t.name for t in out]
    if len(set(names)) != len(names):
        raise QuantkitError(f"{src.path}: two source tensors map to the same GGUF tensor")
    required = {"token_embd.weight", "output_norm.weight"}
    if not required <= set(names):
        raise QuantkitError(f"{src.path}: no embedding or final norm (model.language_model.embed_tokens / norm); "
                            "not a Qwen3.5-MoE checkpoint")
    for name, stack in stacks.items():
        if name not in names:
            raise QuantkitError(f"{src.path}: the MTP layer has {len(stack)} of the {src.text.num_experts} experts "
                                f"of {name}; export with --no-mtp-layer to leave it out")
    for blk in range(src.text.num_hidden_layers, src.text.num_hidden_layers + mtp_blocks(out)):
        missing = [n for n in MTP_REQUIRED if f"blk.{blk}.{n}" not in names]
        if missing:
            raise QuantkitError(f"{src.path}: the MTP layer is incomplete (nothing becomes blk.{blk}.{missing[0]}, "
                                "which llama.cpp requires); export with --no-mtp-layer to leave it out")
    return out, skipped


def mtp_blocks(tensors: list[GgufTensor]) -> int:
    """NextN blocks among the planned tensors (the blocks past the trunk's layers)."""
    return len({t.name.split(".")[1] for t in tensors if t.source.role == Role.MTP and t.name.startswith("blk.")})


def _stack_source(src: ExportSource, pc: Piece, stack: dict[int, StoredTensor]) -> StoredTensor:
    """The StoredTensor that stands for a stack of expert matrices: expert 0's, with the stacked shape; the
    experts must be stored alike (one type decision and one reuse path for all)."""
    first = stack[0]
    for st in stack.values():
        if st.shape != first.shape or st.dtype != first.dtype or st.spec != first.spec:
            raise QuantkitError(f"{src.path}: {st.name} is stored unlike {first.name} "
                                f"({list(st.shape)} {st.dtype} {st.spec} vs {list(first.shape)} {first.dtype} "
                                f"{first.spec}); the experts of {pc.gguf_name} must be stored alike")
    return first


def _qt_name(target: str, block_type: bool) -> str:
    return target.upper() if block_type else target


def _reuse_ok(pc: Piece, block: int) -> bool:
    return pc.col_perm is None or pc.col_unit % block == 0


# ---- metadata -----------------------------------------------------------------------------------------

def add_metadata(w: Any, src: ExportSource, ftype: str, n_mtp: int = 0) -> None:
    """The qwen35moe hyperparameters llama.cpp's loader reads (src/models/qwen35moe.cpp and the common
    loader), from the text config; `n_mtp` NextN blocks follow the trunk's layers (block_count counts them)."""
    import gguf

    c = src.text
    raw = src.config.get("text_config", src.config) if isinstance(src.config, dict) else {}
    rope = raw.get("rope_parameters") or {}
    a = ARCH
    w.add_name(src.path.name)
    w.add_type("model")
    w.add_block_count(c.num_hidden_layers + n_mtp)
    if n_mtp:
        w.add_nextn_predict_layers(n_mtp)
    w.add_context_length(int(raw.get("max_position_embeddings", 262144)))
    w.add_embedding_length(c.hidden_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(float(raw.get("rms_norm_eps", 1e-6)))
    w.add_rope_freq_base(float(rope.get("rope_theta", raw.get("rope_theta", 1e7))))
    partial = float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.25)))
    n_rot = int(c.head_dim * partial)
    w.add_rope_dimension_count(n_rot)
    sections = list(rope.get("mrope_section") or [11, 11, 10])
    sections = (sections + [0, 0, 0, 0])[:4]
    if 2 * sum(sections) != n_rot:
        raise QuantkitError(f"{src.path / 'config.json'}: mrope_section {sections[:3]} covers {2 * sum(sections)} "
                            f"rotary dims, the model rotates {n_rot}; llama.cpp needs them to agree")
    w.add_rope_dimension_sections(sections)
    w.add_expert_count(c.num_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    w.add_ssm_conv_kernel(int(raw.get("linear_conv_kernel_dim", 4)))
    w.add_ssm_state_size(c.linear_key_head_dim)
    w.add_ssm_group_count(c.linear_num_key_heads)
    w.add_ssm_time_step_rank(c.linear_num_value_heads)
    w.add_ssm_inner_size(c.linear_value_head_dim * c.linear_num_value_heads)
    if c.linear_key_head_dim != c.linear_value_head_dim:
        raise QuantkitError("llama.cpp's qwen35moe takes equal linear-attention key and value head dims "
                            f"(got {c.linear_key_head_dim} and {c.linear_value_head_dim})")
    recurrent = [t == "linear_attention" for t in c.layer_types] + [False] * n_mtp  # NextN blocks: attention
    # gguf 0.19 has no add_recurrent_layers; the key is llama.cpp's LLM_KV_ATTENTION_RECURRENT_LAYERS.
    w.add_array(f"{a}.attention.recurrent_layers", recurrent)
    w.add_full_attention_interval(int(raw.get("full_attention_interval", 4)))
    w.add_file_type(_file_type(ftype))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_string("quantkit.export.type", ftype)


def _file_type(ftype: str) -> int:
    from gguf import LlamaFileType as F

    return {"f32": F.ALL_F32, "f16": F.MOSTLY_F16, "bf16": F.MOSTLY_BF16, "q8_0": F.MOSTLY_Q8_0,
            "q4_0": F.MOSTLY_Q4_0, "mxfp4": F.MOSTLY_MXFP4_MOE, "mixed": F.MOSTLY_Q4_0}[ftype]


# ---- data ---------------------------------------------------------------------------------------------

def _encode(x: torch.Tensor, qt: Any, name: str) -> np.ndarray:
    """Dense fp32 slab -> GGUF bytes of type `qt` (uint8, rows along the last dim)."""
    import gguf

    if qt == gguf.GGMLQuantizationType.F32:
        return x.float().numpy().view(np.uint8)
    if qt == gguf.GGMLQuantizationType.F16:
        m = float(x.abs().max()) if x.numel() else 0.0
        if not m <= F16_MAX:
            raise QuantkitError(f"{name}: values up to {m:.3g} overflow F16 (the block-size fallback); "
                                "export with --type bf16")
        return x.half().numpy().view(np.uint8)
    if qt == gguf.GGMLQuantizationType.BF16:
        return x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint8)
    if qt == gguf.GGMLQuantizationType.MXFP4:
        # quantkit's MXFP4 is byte-identical to the gguf package's and runs in torch (several times faster
        # than gguf's numpy MXFP4 quantizer)

        return to_gguf_blocks(get_format("mxfp4").quantize(x, QuantSpec("mxfp4", 32)))
    return gguf.quants.quantize(x.float().numpy(), qt)


def _reuse_bytes(src: ExportSource, t: GgufTensor, experts: slice | None) -> np.ndarray:
    import gguf

    def blocks(parts: dict[str, torch.Tensor]) -> np.ndarray:
        if t.qtype == gguf.GGMLQuantizationType.MXFP4:
            return to_gguf_blocks(parts)
        return int4_to_q4_0_blocks(parts, t.source.spec)

    if t.stack:  # one expert matrix after another
        raw = np.stack([blocks(src.parts(st.name)) for st in t.stack[experts or slice(None)]])
    else:
        raw = blocks(src.parts(t.source.name, experts))
    block, bpb = gguf.GGML_QUANT_SIZES[t.qtype]
    out = permute_blocks(t.piece, torch.from_numpy(np.ascontiguousarray(raw)), block, bpb)
    assert out is not None  # plan_tensors checked block alignment
    return out.numpy()


def _slabs(t: GgufTensor, slab_bytes: int) -> list[slice | None]:
    shape = t.piece.shape if t.stack else t.source.shape
    if len(shape) == 3 and (t.stack or t.source.role == Role.ROUTED_EXPERT):
        per = math.prod(shape[1:]) * 4
        n = max(1, slab_bytes // max(per, 1))
        return [slice(e, min(e + n, shape[0])) for e in range(0, shape[0], n)]
    return [None]


def _row_chunks(x: torch.Tensor, slab_bytes: int) -> list[torch.Tensor]:
    if x.dim() < 2 or x.numel() * 4 <= slab_bytes:
        return [x]
    per = x[0].numel() * 4
    n = max(1, slab_bytes // per)
    return [x[i:i + n] for i in range(0, x.shape[0], n)]


def _write_tensor(fout: Any, src: ExportSource, t: GgufTensor, slab_bytes: int, progress: Progress,
                  reuse: bool) -> int:
    written = 0
    for sl in _slabs(t, slab_bytes):
        if t.how == "reused" and reuse:
            data = _reuse_bytes(src, t, sl)
            fout.write(memoryview(np.ascontiguousarray(data)).cast("B"))
            written += data.nbytes
            progress.advance(t.name, data.nbytes, False)
        else:
            pc = t.piece
            plain = not pc.value and pc.rows is None and pc.row_perm is None and pc.col_perm is None
            # a plain tensor stays in its stored dtype and is widened chunk by chunk (the real model's
            # embedding is 1 GB in bf16, 2 GB in fp32); converted ones are small or one slab
            if t.stack:
                w = torch.stack([src.dense(st.name, native=plain) for st in t.stack[sl or slice(None)]])
            else:
                w = src.dense(t.source.name, sl, native=plain)
            if not plain:
                w = convert(pc, w)
            for chunk in _row_chunks(w, slab_bytes):
                c = chunk.float()
                check_finite(t.source.name, c)
                data = _encode(c, t.qtype, t.source.name)
                fout.write(memoryview(np.ascontiguousarray(data)).cast("B"))
                written += data.nbytes
                progress.advance(t.name, data.nbytes, False)
            del w
    if written != t.nbytes:
        raise QuantkitError(f"internal: {t.name} wrote {written} bytes, planned {t.nbytes}")
    return written


def export_gguf(src_path: str | Path, out_path: str | Path, type: str = "mixed", overwrite: bool = False,
                progress: Progress | None = None, slab_bytes: int = SLAB_BYTES,
                reuse: bool = True, expert_type: str | None = None,
                imatrix: str | Path | None = None, mtp: bool = True) -> GgufResult:
    """Write `src_path` as a GGUF file at `out_path` (atomically). `reuse=False` requantizes from the
    dequantized weights even where codes could be copied (for tests and comparisons); `expert_type`
    sets the routed experts' type of `mixed`; `imatrix` (a llama.cpp imatrix GGUF) feeds llama.cpp's
    quantizer under a llama.cpp type; `mtp=False` leaves a kept MTP layer out (else it is the NextN block)."""
    import gguf

    t0 = time.perf_counter()
    out = Path(out_path)
    ftype = check_type(type)
    if imatrix is not None and ftype not in LLAMA_TYPES:
        raise QuantkitError(f"--imatrix applies to the types llama.cpp's quantizer writes "
                            f"({', '.join(LLAMA_TYPES)}), not --type {ftype}")
    if ftype in LLAMA_TYPES:

        require_llama_cpp(f"--type {ftype}")
        if expert_type is not None:
            raise QuantkitError(f"--expert-type applies to --type mixed only (got --type {ftype})")
        guard_output(out, sources=[Path(src_path)], kind="file", overwrite=overwrite, owned=has_magic(b"GGUF"))
        return _export_llama(Path(src_path), out, ftype, imatrix, progress or NoProgress(), slab_bytes, t0, mtp)
    src = ExportSource.open(src_path)
    guard_output(out, sources=[src.path], kind="file", overwrite=overwrite, owned=has_magic(b"GGUF"))
    progress = progress or NoProgress()
    try:
        if expert_type is not None and ftype != "mixed":
            raise QuantkitError(f"--expert-type applies to --type mixed only (got --type {ftype})")
        tensors, skipped = plan_tensors(src, ftype, expert_type, mtp)
        n_mtp = mtp_blocks(tensors)
        if not reuse:
            for t in tensors:
                if t.how == "reused":
                    t.how = "converted"
                    t.note = f"{t.source.spec.format} dequantized, requantized to {t.qtype.name} (reuse off)"
        check_free(out, sum(t.nbytes for t in tensors) + (16 << 20), "")
        tmp = pid_temp_name(out)
        w = gguf.GGUFWriter(None, ARCH)
        try:
            add_metadata(w, src, ftype, n_mtp)
            vocab = src.get("model.language_model.embed_tokens.weight").shape[0]
            tok = add_tokenizer_meta(w, src.path, vocab)
            for t in tensors:
                w.add_tensor_info(t.name, t.piece.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.qtype)
            w.write_header_to_file(path=tmp)
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
            fout = w.fout[0]
            in_bytes = sum(math.prod(s.shape) * 2 for s in {s.name: s for t in tensors for s in t.sources}.values())
            progress.start(len(tensors), sum(t.nbytes for t in tensors))
            for t in tensors:
                w.write_padding(fout, fout.tell())
                n = _write_tensor(fout, src, t, slab_bytes, progress, reuse)
                src.close()  # unmap the pages read, so RSS does not grow to the checkpoint's size
                w.write_padding(fout, n)
                progress.advance(t.name, 0, True)
            fout.flush()
            os.fsync(fout.fileno())
            w.close()
            os.replace(tmp, out)
        except BaseException:
            w.close()
            tmp.unlink(missing_ok=True)
            raise
    finally:
        src.close()
    return GgufResult(out, ftype, tensors, skipped, tok, out.stat().st_size, time.perf_counter() - t0, in_bytes,
                      mtp_notes(src.text.num_hidden_layers, n_mtp, skipped))


def mtp_notes(n_layer: int, n_mtp: int, skipped: list[str]) -> list[str]:
    """The result's line on the MTP layer: exported as which NextN block, or left out."""
    if n_mtp:
        return [f"MTP layer exported as llama.cpp's NextN block blk.{n_layer} (llama-server --spec-type draft-mtp "
                "drafts with it; without that flag llama.cpp does not load it)"]
    if any(n.startswith("mtp.") for n in skipped):
        return ["MTP layer not exported (--no-mtp-layer, as llama.cpp's converter with --no-mtp)"]
    return []


def add_tokenizer_meta(w: Any, folder: Path, vocab: int) -> dict[str, Any]:

    return add_tokenizer(w, folder, vocab)


# ---- llama.cpp types --------------------------------------------------------------------------------

def _export_llama(src_path: Path, out: Path, ftype: str, imatrix: str | Path | None, progress: Progress,
                  slab_bytes: int, t0: float, mtp: bool) -> GgufResult:
    """bf16 GGUF (streamed here) -> llama.cpp's quantizer with our recipe -> `out`, atomically."""
    import gguf


    src = ExportSource.open(src_path)
    try:
        planned, skipped = plan_tensors(src, "bf16", mtp=mtp)
    finally:
        src.close()
    want = {t.name: tensor_type(t.name, t.piece.shape, ftype) for t in planned}
    im = None
    if imatrix is not None:
        quantized = [t.name for t in planned if want[t.name][0] != t.qtype.name]
        im = load_imatrix(imatrix, {t.name: t.piece.shape for t in planned}, quantized)
    mid_bytes = sum(t.nbytes for t in planned)
    out_bytes = sum(tensor_bytes(t.piece.shape, want[t.name][0]) for t in planned)
    check_free(out, mid_bytes + out_bytes + (64 << 20), "")
    mid, tmp = pid_temp_name(out, "mid"), pid_temp_name(out)
    try:
        first = export_gguf(src_path, mid, "bf16", progress=progress, slab_bytes=slab_bytes, mtp=mtp)
        sizes = {t.name: tensor_bytes(t.piece.shape, want[t.name][0]) for t in planned}
        progress.start(len(planned), out_bytes)
        quantize_gguf(mid, tmp, ftype, im.data if im else None,
                      on_tensor=lambda n: progress.advance(n, sizes.get(n, 0), True),
                      threads=torch.get_num_threads())  # --threads (set on torch's pool by the CLI)
        got = {t.name: t.type for t in read_gguf(tmp).tensors}
        with tmp.open("rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, out)
    finally:
        mid.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)
    tensors, notes = [], []
    for t in planned:
        ty, note = want[t.name]
        actual = got.get(t.name, ty)
        if actual != ty:
            notes.append(f"{t.name}: llama.cpp wrote {actual} where {ty} was planned")
        how = "fallback" if note else ("llama.cpp" if actual != t.qtype.name else "kept")
        qt = gguf.GGMLQuantizationType[actual]
        tensors.append(GgufTensor(t.piece, t.source, qt, how, note or f"bf16 -> {actual} by llama.cpp",
                                  tensor_bytes(t.piece.shape, actual), t.stack))
    if im is not None:
        notes.append(f"importance matrix {im.path.name}: {len(im.data)} tensors"
                     + (f", {len(im.missing)} quantized without one (not in the file)" if im.missing else ""))
    notes += first.notes
    return GgufResult(out, ftype, tensors, skipped, first.tokenizer, out.stat().st_size,
                      time.perf_counter() - t0, first.in_bytes, notes)
