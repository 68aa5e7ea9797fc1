"""Tiny (and realistic-shape) random checkpoints of the REAL architecture, for tests and benchmarks.

`make_tiny_model` builds transformers' own `Qwen3_5MoeForCausalLM` from a small `Qwen3_5MoeTextConfig`
(3 linear-attention layers then 1 full-attention layer, partial rotary, gated attention, Gated
DeltaNet, shared + routed experts), initialises it with a fixed seed, and writes it:
- layout="published" (default): laid out as the published Qwen3.5 MoE checkpoints: a multimodal
  `qwen3_5_moe` config.json with `text_config`, tensors `model.language_model.*` with FUSED experts,
  `lm_head.weight`, optional `mtp.*` (per-expert experts), in several shards with an index;
- layout="transformers": exactly what `save_pretrained` writes (bare text config, `model.layers.*`,
  experts per expert).
Both come with a trained byte-level BPE tokenizer with Qwen's special tokens and chat template
(quantkit.testing.tokenizer) and a generation_config.json. transformers' `Qwen3_5MoeForCausalLM.
from_pretrained` loads both layouts directly (its qwen3_5_text conversion strips `language_model`).

RMSNorm weights are zero-centred (the layer computes x * (1 + w)) except `linear_attn.norm` (x * w):
they get small random values around 0 (resp. 1) so a converter that forgets the +1 breaks tests.

decisive=True makes routing and the top-1 token robust to quantization rounding (see `make_decisive`).
realistic=True writes real hidden/expert/head sizes with fewer layers and experts, streamed tensor by
tensor (never the whole model in memory), for benchmarks; `FULL_SIZE` (realistic with 40 layers, 256 experts,
top-8, vocab 248,320, MTP) is the published shape itself (tests compare it with profiles/models/).
quantized=RECIPE writes the quantized folder `quantkit quantize` would make of that checkpoint, generated
directly in the stored format (quantkit.testing.generated), never through bf16.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from quantkit.checkpoint.contract import INDEX_NAME
from quantkit.checkpoint.spec import dtype_bytes, spec_from_config
from quantkit.errors import QuantkitError
from quantkit.fileio import pid_temp_name, replace_folder
from quantkit.outputs import check_free, guard_output
from quantkit.progress import Progress
from quantkit.recipe import Recipe
from quantkit.testing import mtp_train
from quantkit.testing.generated import (
    BASE_BYTES,
    check_ram,
    disk_bytes,
    init_tensor,
    peak_bytes,
    plan_for,
    write_quantized,
)
from quantkit.testing.tokenizer import (
    BPE_VOCAB,
    N_TOKENS,
    build_tokenizer,
    special_ids,
    tiny_corpus,
    write_tokenizer,
)
from quantkit.threads import torch_threads

SIDECAR = "quantkit-tiny.json"


@dataclass(frozen=True)
class TinyOptions:
    layers: int = 4
    experts: int = 8
    top_k: int = 2
    hidden: int = 64
    intermediate: int = 32
    vocab: int | None = None
    layout: str = "published"
    mtp: bool = False
    decisive: bool = False
    realistic: bool = False
    seed: int = 0
    dtype: str = "bfloat16"
    max_shard_size: int | None = None


# the published Qwen-AgentWorld-35B-A3B shape (only the token ids differ: they are the test tokenizer's)
FULL_SIZE = {"realistic": True, "layers": 40, "experts": 256, "top_k": 8, "vocab": 248320, "mtp": True}


def layer_types(n: int) -> list[str]:
    """3 x linear_attention then 1 x full_attention, repeated; a model under 4 layers ends on full."""
    types = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(n)]
    if "full_attention" not in types:
        types[-1] = "full_attention"
    return types


def text_config(o: TinyOptions) -> dict[str, Any]:
    """The `text_config` dict (qwen3_5_moe_text) for the options."""
    vocab = o.vocab or (-(-N_TOKENS // 64) * 64)
    if vocab < N_TOKENS:
        raise QuantkitError(f"--vocab {vocab} is smaller than the tokenizer ({N_TOKENS} tokens)")
    if o.layers < 1 or o.experts < 1 or not (1 <= o.top_k <= o.experts):
        raise QuantkitError("need layers >= 1, experts >= 1 and 1 <= top-k <= experts")
    if o.realistic:
        h, heads, kv, hd = 2048, 16, 2, 256
        lk, lv, lkd, lvd = 16, 32, 128, 128
        inter = shared = 512
        mrope = [11, 11, 10]
    else:
        if o.hidden < 32 or o.hidden % 16:
            raise QuantkitError(f"--hidden {o.hidden}: must be a multiple of 16, at least 32")
        h, hd = o.hidden, 16
        heads, kv = h // 16, 2 if (h // 16) % 2 == 0 else 1
        lk, lv, lkd, lvd = 2, 4, 16, 16
        inter = shared = o.intermediate
        mrope = [1, 1, 0]  # partial rotary 0.25 of head_dim 16 = 4 rotary dims = 2 frequency pairs
    ids = special_ids(BPE_VOCAB)
    return {
        "model_type": "qwen3_5_moe_text",
        "vocab_size": vocab,
        "hidden_size": h,
        "num_hidden_layers": o.layers,
        "layer_types": layer_types(o.layers),
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": hd,
        "attn_output_gate": True,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "initializer_range": 0.02,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": lkd,
        "linear_value_head_dim": lvd,
        "linear_num_key_heads": lk,
        "linear_num_value_heads": lv,
        "num_experts": o.experts,
        "num_experts_per_tok": o.top_k,
        "moe_intermediate_size": inter,
        "shared_expert_intermediate_size": shared,
        "router_aux_loss_coef": 0.001,
        "output_router_logits": False,
        "mtp_num_hidden_layers": 1 if o.mtp else 0,
        "mtp_use_dedicated_embeddings": False,
        "max_position_embeddings": 262144,
        "tie_word_embeddings": False,
        "dtype": o.dtype,
        "use_cache": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                            "mrope_interleaved": True, "mrope_section": mrope},
        "bos_token_id": None,
        "eos_token_id": ids["<|endoftext|>"],
        "pad_token_id": None,
    }


def full_config(tc: dict[str, Any]) -> dict[str, Any]:
    """The multimodal config.json of the published checkpoints around `tc` (a small vision config, so
    Qwen3_5MoeForConditionalGeneration can be built cheaply too; the checkpoint holds no vision weights)."""
    ids = special_ids(BPE_VOCAB)
    import transformers

    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": tc,
        "vision_config": {"model_type": "qwen3_5_moe_vision", "depth": 1, "hidden_size": 32,
                          "hidden_act": "gelu_pytorch_tanh", "intermediate_size": 64, "num_heads": 2,
                          "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                          "out_hidden_size": tc["hidden_size"], "num_position_embeddings": 64},
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "tie_word_embeddings": False,
        "transformers_version": transformers.__version__,
    }


def estimate_bytes(o: TinyOptions) -> int:
    """Bytes of safetensors data the options will write (for progress bars and disk checks)."""

    spec = spec_from_config(full_config(text_config(o)), include_mtp=o.mtp)
    return spec.total_params * dtype_bytes(o.dtype)


def generation_config() -> dict[str, Any]:
    ids = special_ids(BPE_VOCAB)
    return {"bos_token_id": None, "eos_token_id": [ids["<|endoftext|>"], ids["<|im_end|>"]],
            "pad_token_id": ids["<|endoftext|>"], "do_sample": True, "temperature": 0.6, "top_p": 0.95,
            "top_k": 20}


# ---- building the in-memory model ----
def build_model(tc: dict[str, Any], seed: int = 0) -> Any:
    """transformers' Qwen3_5MoeForCausalLM (fp32) with a fixed-seed random init and random norms."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeRMSNorm, Qwen3_5MoeRMSNormGated

    cfg = Qwen3_5MoeTextConfig(**{k: v for k, v in tc.items() if k != "model_type"})
    torch.manual_seed(seed)
    model = Qwen3_5MoeForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, Qwen3_5MoeRMSNorm):
                mod.weight.copy_(torch.randn(mod.weight.shape, generator=g) * 0.05)
            elif isinstance(mod, Qwen3_5MoeRMSNormGated):
                mod.weight.copy_(1 + torch.randn(mod.weight.shape, generator=g) * 0.05)
    return model


_PROBE: dict[tuple[int, int], torch.Tensor] = {}


def cast_weights(model: Any, dtype: torch.dtype) -> Any:
    """Cast parameters only, as from_pretrained(dtype=...) leaves them: `model.to(dtype)` would also round
    the rotary inv_freq buffers, which changes bf16 logits by an ulp."""
    for p in model.parameters():
        p.data = p.data.to(dtype)
    return model


def probe_ids(n_seq: int = 4, length: int = 80) -> torch.Tensor:
    """A fixed [n_seq, length] batch of token ids from the tokenizer's corpus (chat-formatted)."""
    key = (n_seq, length)
    if key not in _PROBE:

        tok = build_tokenizer()
        lines = tiny_corpus(400, seed=7)
        rows = [tok.encode("<|im_start|>user\n" + "".join(lines[s * 50:(s + 1) * 50])).ids[:length]
                for s in range(n_seq)]
        _PROBE[key] = torch.tensor(rows)
    return _PROBE[key].clone()


@dataclass
class _Run:
    """One forward over the probe: router logits per layer, final hidden states, logits."""

    router: list[torch.Tensor]
    hidden: torch.Tensor
    logits: torch.Tensor


def _run(model: Any, ids: torch.Tensor) -> _Run:
    router: list[torch.Tensor] = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda _m, _i, out: router.append(out[0].detach().float()))
             for layer in model.model.layers]
    try:
        with torch.no_grad():
            hidden = model.model(ids).last_hidden_state
            logits = model.lm_head(hidden).float()
    finally:
        for hk in hooks:
            hk.remove()
    return _Run(router, hidden.float(), logits)


def make_decisive(model: Any, seed: int = 0) -> dict[str, Any]:
    """Make routing exact and the top-1 token robust, then check both. Returns the measured report.

    Construction: C = num_experts "code" dimensions of the residual stream carry a token code: the
    embedding of token t holds top_k positive values (in [1, 2] x kappa) on a token-specific subset of
    those dims and exact zeros on the others. Every projection that writes into the residual stream
    (o_proj, linear_attn.out_proj, routed and shared down_proj) gets zero rows there, so the code dims
    pass through all layers unchanged (the RMSNorms only rescale them by a positive factor). Router row
    e of layer l is alpha times a one-hot on code dim perm_l(e). The router logits are therefore
    positive for exactly top_k experts and exactly 0 for all others, whatever the context: expert choice
    cannot flip under any weight-only quantization that keeps zero rows zero (all formats here do).
    Routing weights still depend on context (through the norm's scale and 1 + w); expert choice depends
    on the current token only (and differs from layer to layer).
    For the output, lm_head gets a bigram term: for each code pattern P one designated next token
    gets gamma on P's dims, on top of the random context-dependent logits; gamma starts at 4 x the
    context logits' spread and is raised until noise at 2.5 x the int8 rounding error (2% of each row's
    RMS) keeps >= 99.5% of the probe's top-1 tokens and the greedy continuation.
    """
    c = model.config
    e, k, h = c.num_experts, c.num_experts_per_tok, c.hidden_size
    if e > h // 2:
        raise QuantkitError(f"decisive mode needs experts <= hidden/2 (experts {e}, hidden {h})")
    g = torch.Generator().manual_seed(seed + 2)
    code = torch.randperm(h, generator=g)[:e].sort().values
    kappa = 0.1
    lm = model.model
    ids = probe_ids()
    with torch.no_grad():
        emb = lm.embed_tokens.weight
        emb[:, code] = 0
        patterns: list[tuple[int, ...]] = []
        for t in range(emb.shape[0]):
            sel = torch.randperm(e, generator=g)[:k].sort().values
            emb[t, code[sel]] = (1 + torch.rand(k, generator=g)) * kappa
            patterns.append(tuple(sel.tolist()))
        for i, layer in enumerate(lm.layers):
            if hasattr(layer, "self_attn"):
                layer.self_attn.o_proj.weight[code, :] = 0
            else:
                layer.linear_attn.out_proj.weight[code, :] = 0
            mlp = layer.mlp
            mlp.experts.down_proj[:, code, :] = 0
            mlp.shared_expert.down_proj.weight[code, :] = 0
            perm = torch.randperm(e, generator=torch.Generator().manual_seed(seed + 100 + i))
            w = torch.zeros_like(mlp.gate.weight)
            w[torch.arange(e), code[perm]] = 1.0
            mlp.gate.weight.copy_(w)
        # Router scale: a moderately sharp softmax over the top_k (median selected logit 4).
        sel_logits = torch.cat([r.topk(k, -1).values.flatten() for r in _run(model, ids).router])
        alpha = 4.0 / max(float(sel_logits.median()), 1e-9)
        for layer in lm.layers:
            layer.mlp.gate.weight.mul_(alpha)
        model.lm_head.weight[:, code] = 0
    r0 = _run(model, ids)
    sigma = float(r0.logits.std(dim=-1).mean())
    raw = lm.embed_tokens.weight.detach()[ids][..., code]
    m = raw > 0
    s_code = float((r0.hidden[..., code][m] / raw[m]).mean())  # final norm's factor on the code dims
    distinct = sorted(set(patterns))
    order = torch.randperm(BPE_VOCAB, generator=g)
    bigram = torch.zeros(model.lm_head.weight.shape[0], e)
    for j, p in enumerate(distinct):
        bigram[int(order[j % BPE_VOCAB]), list(p)] = 1.0
    report: dict[str, Any] = {}
    gamma_rel = 4.0
    for _attempt in range(8):
        with torch.no_grad():
            model.lm_head.weight[:, code] = bigram * (gamma_rel * sigma / (s_code * kappa))
        check = perturbation_check(model, rel_noise=0.02, seed=seed)
        report = {"gamma_over_context_sigma": gamma_rel, "check_2pct": check}
        if check["top1_agreement"] >= 0.995 and check["greedy_identical"] and check["routing_identical"]:
            break
        gamma_rel *= 1.5
    else:
        raise QuantkitError("could not make the tiny model decisive (try another --seed)")
    base = _run(model, ids)
    report["check_10pct"] = perturbation_check(model, rel_noise=0.10, seed=seed, gen_tokens=0, base=base)
    report["router"] = router_margins(base.router, k)
    report["router_alpha"] = alpha
    report["code_dims"] = code.tolist()
    report["top1_margin"] = top1_margins(base.logits)
    return report


def router_margins(router: list[torch.Tensor], k: int) -> dict[str, Any]:
    """Per layer, the minimum over positions of (k-th - (k+1)-th router logit), absolute and relative
    to that position's largest |logit|."""
    gaps, rels = [], []
    for lg in router:
        top = lg.topk(min(k + 1, lg.shape[-1]), dim=-1).values
        gap = top[:, k - 1] - top[:, k] if top.shape[-1] > k else top[:, k - 1]
        gaps.append(float(gap.min()))
        rels.append(float((gap / lg.abs().amax(-1).clamp_min(1e-30)).min()))
    return {"positions": int(router[0].shape[0]), "min_gap_per_layer": gaps, "min_rel_gap_per_layer": rels}


def top1_margins(logits: torch.Tensor) -> dict[str, float]:
    """Top-1 minus top-2 logit over the per-position logit spread: min, 1st percentile, median."""
    lg = logits.flatten(0, -2)
    top = lg.topk(2, dim=-1).values
    gap = (top[:, 0] - top[:, 1]) / lg.std(dim=-1)
    return {"min_gap_over_sigma": float(gap.min()), "p01_gap_over_sigma": float(gap.quantile(0.01)),
            "median_gap_over_sigma": float(gap.median())}


def perturb_weights(model: Any, rel_noise: float, seed: int = 0) -> Any:
    """A deep copy of `model` with every quantizable matrix (not router, norms, conv) perturbed by
    Gaussian noise of `rel_noise` times its row's RMS: a stand-in for weight-only rounding error (int8
    per-channel rounding is ~0.8% of the row RMS). Zero rows stay zero, as under quantization."""
    import copy

    m = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed + 12345)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() < 2 or name.endswith("mlp.gate.weight") or "conv1d" in name:
                continue
            rms = p.float().pow(2).mean(-1, keepdim=True).sqrt()
            p.add_((torch.randn(p.shape, generator=g) * rms * rel_noise).to(p.dtype))
    return m


def perturbation_check(model: Any, rel_noise: float, seed: int = 0, gen_tokens: int = 16,
                       base: _Run | None = None) -> dict[str, Any]:
    """Top-1 agreement over the probe, routing identity, and greedy continuation identity under noise."""
    ids = probe_ids()
    r0 = base or _run(model, ids)
    pm = perturb_weights(model, rel_noise, seed)
    r1 = _run(pm, ids)
    k = model.config.num_experts_per_tok
    same_route = all(bool((a.topk(k, -1).indices.sort(-1).values == b.topk(k, -1).indices.sort(-1).values).all())
                     for a, b in zip(r0.router, r1.router, strict=True))
    out = {"rel_noise": rel_noise, "positions": int(ids.numel()),
           "top1_agreement": float((r0.logits.argmax(-1) == r1.logits.argmax(-1)).float().mean()),
           "routing_identical": same_route}
    if gen_tokens:
        prompt = ids[:2, :16]
        kw = {"max_new_tokens": gen_tokens, "do_sample": False, "eos_token_id": None, "pad_token_id": 0}
        with torch.no_grad():
            out["greedy_identical"] = bool(torch.equal(model.generate(prompt, **kw), pm.generate(prompt, **kw)))
        out["greedy_tokens"] = gen_tokens
    return out


# ---- writing ----
def _write_shards(folder: Path, tensors: Iterator[tuple[str, torch.Tensor]], max_shard: int) -> None:
    """Write `tensors` in order into shards of at most `max_shard` bytes (a larger tensor gets its own),
    named model-0000i-of-0000N.safetensors, plus the index."""
    from safetensors.torch import save_file

    tmp_names: list[tuple[str, list[str]]] = []
    cur: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        nonlocal cur, size
        if cur:
            n = f"shard-{len(tmp_names):05d}.tmp"
            save_file(cur, str(folder / n), metadata={"format": "pt"})
            tmp_names.append((n, list(cur)))
            cur, size = {}, 0

    for name, t in tensors:
        b = t.numel() * t.element_size()
        if cur and size + b > max_shard:
            flush()
        cur[name] = t.contiguous()
        size += b
        total += b
    flush()
    n_sh = len(tmp_names)
    weight_map: dict[str, str] = {}
    for i, (tmp, names) in enumerate(tmp_names):
        final = f"model-{i + 1:05d}-of-{n_sh:05d}.safetensors"
        os.replace(folder / tmp, folder / final)
        weight_map.update(dict.fromkeys(names, final))
    (folder / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                indent=2) + "\n")


def _published_tensors(model: Any, cfg: dict[str, Any], seed: int, dtype: torch.dtype,
                       mtp: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """The in-memory model's tensors under published names, in the config-derived spec order."""
    sd = model.state_dict()
    for t in spec_from_config(cfg, include_mtp=mtp).tensors:
        if t.name.startswith("mtp."):
            yield t.name, init_tensor(t.name, t.shape, seed, dtype)
            continue
        src = "model." + t.name[len("model.language_model."):] if t.name.startswith("model.language_model.") \
            else t.name
        w = sd[src]
        if tuple(w.shape) != tuple(t.shape):
            raise RuntimeError(f"{t.name}: model has {tuple(w.shape)}, spec says {t.shape}")
        yield t.name, w.detach().to(dtype)


def _streamed_tensors(cfg: dict[str, Any], seed: int, dtype: torch.dtype, mtp: bool,
                      on_tensor: Callable[[str, int], None] | None) -> Iterator[tuple[str, torch.Tensor]]:
    for t in spec_from_config(cfg, include_mtp=mtp).tensors:
        w = init_tensor(t.name, t.shape, seed, dtype)
        if on_tensor:
            on_tensor(t.name, w.numel() * w.element_size())
        yield t.name, w


_BUILT: dict[str, tuple[dict[str, torch.Tensor], dict[str, Any] | None]] = {}


def _built_model(tc: dict[str, Any], seed: int, decisive: bool) -> tuple[Any, dict[str, Any] | None]:
    """build_model (+ make_decisive), memoized per process: the same options give the same weights, so
    writing one model in both layouts (as the test fixtures do) pays for the decisive check once."""
    key = json.dumps([tc, seed, decisive], sort_keys=True)
    if key not in _BUILT:
        with torch_threads(1):  # tiny matmuls: thread hand-offs cost more than they save (8x on 2 busy cores)
            model = build_model(tc, seed)
            report = make_decisive(model, seed) if decisive else None
        _BUILT[key] = ({k: v.clone() for k, v in model.state_dict().items()}, report)
        return model, report
    sd, report = _BUILT[key]
    with torch_threads(1):
        model = build_model(tc, seed)
    model.load_state_dict(sd)
    return model, (json.loads(json.dumps(report)) if report is not None else None)


def _normal_permissions(folder: Path) -> None:
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for f in folder.iterdir():
        os.chmod(f, 0o666 & ~umask)


def make_tiny_model(out_dir: str | Path, *, layers: int = 4, experts: int = 8, top_k: int = 2, hidden: int = 64,
                    intermediate: int = 32, vocab: int | None = None, layout: str = "published", mtp: bool = False,
                    decisive: bool = False, realistic: bool = False, seed: int = 0, dtype: str = "bfloat16",
                    max_shard_size: int | None = None, overwrite: bool = False,
                    on_tensor: Callable[[str, int], None] | None = None, quantized: Recipe | None = None,
                    resume: bool = False, progress: Progress | None = None,
                    train_mtp: mtp_train.TrainOptions | None = None, on_train: mtp_train.OnStep | None = None) -> Path:
    """Write a random checkpoint of the real architecture to `out_dir` (atomically) and return it; with
    `quantized`, the quantized folder of it (`write_quantized`; `resume` continues an interrupted one); with
    `train_mtp`, its MTP layer trained on the model's own greedy continuations before the folder appears
    (quantkit.testing.mtp_train, `on_train` hearing of its progress; the report in the sidecar under "mtp_trained";
    realistic shapes want the `mtp_train.REALISTIC` budget)."""
    o = TinyOptions(layers, experts, top_k, hidden, intermediate, vocab, layout, mtp, decisive, realistic, seed,
                    dtype, max_shard_size)
    if layout not in ("published", "transformers"):
        raise QuantkitError(f"--layout {layout!r}: use 'published' or 'transformers'")
    if dtype not in ("bfloat16", "float16", "float32"):
        raise QuantkitError(f"--dtype {dtype!r}: use bfloat16, float16 or float32")
    if layout == "transformers" and mtp:
        raise QuantkitError("transformers' save_pretrained layout has no MTP weights; use --layout published")
    if realistic and (decisive or layout != "published"):
        raise QuantkitError("--realistic writes the published layout only, without --decisive")
    if train_mtp is not None and (not mtp or quantized is not None):
        raise QuantkitError("--train-mtp trains the MTP layer of a bf16 checkpoint: add --mtp-layer, drop --quantized")
    out = Path(out_dir)
    if quantized is not None:
        return _make_quantized(out, o, quantized, overwrite, resume, progress)
    if resume:
        raise QuantkitError("--resume continues a --quantized generation; a bf16 one is written whole again")
    shard_bound = max_shard_size or (1_000_000_000 if realistic else 256 * 1024)
    guard_output(out, kind="folder", overwrite=overwrite, create_parents=True,
                 need_bytes=estimate_bytes(o) + (16 << 20))
    check_ram(2 * shard_bound + BASE_BYTES, f"writing {out}")
    tc = text_config(o)
    tdt = getattr(torch, dtype)
    shard = max_shard_size or (1_000_000_000 if realistic else 256 * 1024)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = pid_temp_name(out)
    tmp.mkdir()
    try:
        info: dict[str, Any] = {"generator": "quantkit tiny-model", "options": asdict(o)}
        if realistic:
            cfg = full_config(tc)
            _write_shards(tmp, _streamed_tensors(cfg, seed, tdt, mtp, on_tensor), shard)
            (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        else:
            model, report = _built_model(tc, seed, decisive)
            if report is not None:
                info["decisive"] = report
            model = cast_weights(model, tdt)
            if layout == "published":
                cfg = full_config(tc)
                _write_shards(tmp, _published_tensors(model, cfg, seed, tdt, mtp), shard)
                (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
            else:
                model.save_pretrained(str(tmp), max_shard_size=shard)
        write_tokenizer(tmp)
        (tmp / "generation_config.json").write_text(json.dumps(generation_config(), indent=2) + "\n")
        info["files"] = sorted({f.name for f in tmp.iterdir()} | {SIDECAR})  # what --overwrite may delete
        (tmp / SIDECAR).write_text(json.dumps(info, indent=2) + "\n")
        if train_mtp is not None:
            mtp_train.train_mtp(tmp, train_mtp, on_train)
        _normal_permissions(tmp)  # mkdtemp makes 0700; the result should look like any written folder
        replace_folder(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _make_quantized(out: Path, o: TinyOptions, recipe: Recipe, overwrite: bool, resume: bool,
                    progress: Progress | None) -> Path:
    if o.decisive or o.layout != "published":
        raise QuantkitError("--quantized writes the published layout without --decisive")
    if resume and overwrite:
        raise QuantkitError("--resume and --overwrite exclude each other")
    cfg = full_config(text_config(o))
    plan = plan_for(cfg, recipe, o.max_shard_size or 2_000_000_000)
    if not (resume and out.is_dir()):  # a resumed run checks the disk for what is left to write
        check_free(out, disk_bytes(plan), "")
    check_ram(peak_bytes(plan), f"generating {out}")
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        write_tokenizer(d)
        (d / "generation_config.json").write_text(json.dumps(generation_config(), indent=2) + "\n")
        names = sorted({f.name for f in d.iterdir()} | {SIDECAR})
        info = {"generator": "quantkit tiny-model", "options": asdict(o), "quantized": recipe.to_dict(),
                "note": "random weights, a test fixture: shapes, bytes and speed are the model's, outputs mean nothing",
                "files": names}
        (d / SIDECAR).write_text(json.dumps(info, indent=2) + "\n")
        write_quantized(out, cfg, recipe, sorted(d.iterdir()), seed=o.seed,
                        mode="resume" if resume else "overwrite" if overwrite else "new",
                        max_shard_size=o.max_shard_size or 2_000_000_000, progress=progress)
    return out


def load_reference_model(path: str | Path, dtype: torch.dtype = torch.float32) -> Any:
    """The unquantized reference: transformers' Qwen3_5MoeForCausalLM loaded from a tiny checkpoint
    folder of either layout (transformers reads the published names and fused experts itself)."""
    import transformers
    from transformers import Qwen3_5MoeForCausalLM

    transformers.logging.set_verbosity_error()
    model = Qwen3_5MoeForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True)
    return model.eval()
