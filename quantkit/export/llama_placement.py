"""llama.cpp placement by the bytes of the GGUF it loads: the -ngl / --n-cpu-moe / -ot / --tensor-split
that fit each GPU, and the GPU bytes llama.cpp will allocate for them.

The model side (`LlamaModel`) is every GGUF tensor's bytes plus the shapes llama.cpp's buffers depend on,
either predicted for a `--type` from the model spec (quantkit.export.gguf_types, the same table the
exporter writes by, so the numbers are the file's) or read from an existing GGUF's header
(`model_from_gguf`, no weights loaded). The buffers are llama.cpp's own, as it reports them when it loads
a model (checked against the CPU build's report on a realistic-shape model in tests/export/test_llama_placement.py):
- KV cache: full-attention layers only, context x 2 (K, V) x kv heads x head dim at the cache type
  (-ctk/-ctv; f16, q8_0 = 34 bytes per 32, q4_0 = 18 per 32), on its layer's device;
- recurrent state, per Gated DeltaNet layer and parallel sequence: fp32 conv state (kernel - 1) x
  (inner + 2 x groups x state) and fp32 SSM state state x inner (2.09 MiB for this model);
- compute buffer of the device that holds the output layer: ubatch x (vocab x 4) logits, ubatch x
  hidden x COMPUTE_PER_TOKEN_HIDDEN for the layer intermediates (measured: 147.5 KB per token at hidden
  2048 with 8 routed experts, of which the logits of an 832-token vocabulary are 3.3 KB), and the f16
  attention mask context x ubatch x 2; other GPUs hold the intermediates and the mask only;
- output.weight and output_norm go with the last layer (llama.cpp offloads the output layer first);
  token_embd stays on the CPU (llama.cpp never offloads the input layer).
- the MTP layer (a NextN block after the trunk's layers, quantkit.export.gguf): llama.cpp loads it only to draft
  with it (`--spec-type draft-mtp`); then its weights, its own KV cache (one full-attention layer, in the draft
  context) and the draft context's compute buffer (counted as the main one's, logits included) go with the
  output layer, since llama.cpp counts the block among the layers -ngl offloads from the top; -ngl and
  --tensor-split here count it too, so the trunk layers on each card are the solver's either way.
The GPU budget is the card minus `reserve` (1 GiB by default, llama.cpp --fit's own margin). The solver
keeps every layer on the GPUs when it can and puts routed experts on the CPU from the first layer on
(--n-cpu-moe N: experts of layers 0..N-1), splitting layers over several GPUs by their budgets
(--tensor-split, -ot for the CPU experts of each GPU's first layers); only when the non-expert part does not
fit does it lower -ngl. llama.cpp's automatic fitting is off once these flags are given, so the line must fit
by itself: `gpu_bytes` is what the printed line asks of each card.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from quantkit.checkpoint.gguf_layout import pieces_for
from quantkit.checkpoint.spec import ModelSpec, Role
from quantkit.errors import QuantkitError
from quantkit.export.gguf_types import tensor_bytes, tensor_type

ARCH = "qwen35moe"
# bounds on a GGUF header's hyperparameters (as quantkit.checkpoint.spec bounds a config.json's)
MAX_LAYERS = 1024
MAX_DIM = 1 << 22
COMPUTE_PER_TOKEN_HIDDEN = 72  # bytes per ubatch token per hidden unit, besides the logits (measured: 70.4)
CACHE_BLOCKS = {"f16": (2, 1), "bf16": (2, 1), "q8_0": (34, 32), "q4_0": (18, 32)}
DEFAULT_UBATCH = 512


@dataclass(frozen=True)
class LlamaModel:
    """What llama.cpp holds for one GGUF."""

    label: str  # the GGUF type or file name
    tensors: dict[str, int]  # GGUF tensor name -> bytes
    n_layer: int
    full_attention: tuple[bool, ...]
    n_head_kv: int
    head_dim: int
    vocab: int
    n_embd: int
    ssm_inner: int
    ssm_state: int
    ssm_groups: int
    ssm_conv: int
    n_expert: int = 256  # routed experts per layer
    n_expert_used: int = 8  # routed per token (top-k): the share of a layer's experts a decode step reads
    elements: dict[str, int] = field(default_factory=dict)  # GGUF tensor name -> weights in it (prefill FLOPs)
    n_mtp: int = 0  # NextN (MTP) blocks after the trunk's n_layer: blk.n_layer ...

    def layer_bytes(self, layer: int, experts: bool) -> int:
        p = f"blk.{layer}."
        return sum(b for n, b in self.tensors.items() if n.startswith(p) and ("_exps." in n) == experts)

    def active_params(self, layer: int) -> float:
        """Weights one token multiplies in `layer`: every dense tensor, top-k / E of the routed experts."""
        p, share = f"blk.{layer}.", self.n_expert_used / self.n_expert
        return sum(e * (share if "_exps." in n else 1.0) for n, e in self.elements.items() if n.startswith(p))

    @property
    def mtp_bytes(self) -> int:
        """The NextN blocks' weights, experts included (loaded only when drafting with them)."""
        return sum(self.layer_bytes(L, e) for L in range(self.n_layer, self.n_layer + self.n_mtp) for e in (False, True))

    @property
    def output_bytes(self) -> int:
        return self.tensors.get("output.weight", 0) + self.tensors.get("output_norm.weight", 0)

    @property
    def total(self) -> int:
        return sum(self.tensors.values())


def model_from_spec(spec: ModelSpec, ftype: str, mtp: bool = True) -> LlamaModel:
    """The GGUF `quantkit export gguf --type ftype` writes for `spec` (`mtp=False`: with --no-mtp-layer), sized
    without writing it."""

    c = spec.config
    tensors, elements = {}, {}
    for t in spec.tensors:
        if t.role == Role.MTP and not mtp:
            continue
        for pc in pieces_for(t.name, t.shape, c):
            tensors[pc.gguf_name] = tensor_bytes(pc.shape, tensor_type(pc.gguf_name, pc.shape, ftype)[0])
            elements[pc.gguf_name] = math.prod(pc.shape)
    return LlamaModel(ftype, tensors, c.num_hidden_layers, tuple(t == "full_attention" for t in c.layer_types),
                      c.num_key_value_heads, c.head_dim, c.vocab_size, c.hidden_size,
                      c.linear_value_head_dim * c.linear_num_value_heads, c.linear_key_head_dim,
                      c.linear_num_key_heads, c.linear_conv_kernel_dim, c.num_experts, c.num_experts_per_tok,
                      elements, len({b for b in map(_block, tensors) if b is not None and b >= c.num_hidden_layers}))


def _block(name: str) -> int | None:
    """N of a `blk.N.*` tensor name."""
    part = name.split(".")
    return int(part[1]) if part[0] == "blk" and len(part) > 2 and part[1].isdecimal() else None


def model_from_gguf(info: Any) -> LlamaModel:
    """The model of an existing GGUF (quantkit.checkpoint.gguf_file.GgufInfo): its own tensor bytes."""
    if info.arch != ARCH:
        raise QuantkitError(f"{info.path}: architecture {info.arch or 'unknown'!r}, not {ARCH} "
                            "(Qwen3.5-MoE); quantkit plans this model family only")
    def num(key: str, hi: int, default: int | None = None) -> int:
        """An architecture key: a whole number in 1..hi (a float, a bool, zero or 2^62 layers is refused)."""
        v = info.get(key, default)
        if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= hi:
            raise QuantkitError(f"{info.path}: GGUF key {ARCH}.{key} is {v!r}, not a whole number in 1..{hi}; "
                                "re-export it")
        return v

    n_all = num("block_count", MAX_LAYERS)
    n_mtp = info.get("nextn_predict_layers", 0)
    if not isinstance(n_mtp, int) or isinstance(n_mtp, bool) or not 0 <= n_mtp < n_all:
        raise QuantkitError(f"{info.path}: GGUF key {ARCH}.nextn_predict_layers is {n_mtp!r}, not a count of MTP "
                            f"blocks below block_count {n_all}; re-export it")
    n = n_all - n_mtp
    rec = info.get("attention.recurrent_layers")
    if rec is None:
        every = num("full_attention_interval", n, 4)
        full = tuple((i + 1) % every == 0 for i in range(n))
    elif isinstance(rec, list) and len(rec) == n_all and all(x in (0, 1) for x in rec):
        full = tuple(not bool(x) for x in rec[:n])
    else:
        raise QuantkitError(f"{info.path}: GGUF key {ARCH}.attention.recurrent_layers is not {n_all} flags (one per "
                            "block); re-export it")
    tok = info.by_name().get("token_embd.weight")
    vocab = tok.shape[0] if tok else info.metadata.get("tokenizer.ggml.tokens", 0)
    if not isinstance(vocab, int) or isinstance(vocab, bool) or not 0 <= vocab <= MAX_DIM:
        raise QuantkitError(f"{info.path}: the GGUF vocabulary size {vocab!r} is not a count; re-export it")
    return LlamaModel(info.path.name, {t.name: t.nbytes for t in info.tensors}, n, full,
                      num("attention.head_count_kv", MAX_DIM), num("attention.key_length", MAX_DIM), vocab,
                      num("embedding_length", MAX_DIM), num("ssm.inner_size", MAX_DIM),
                      num("ssm.state_size", MAX_DIM), num("ssm.group_count", MAX_DIM),
                      num("ssm.conv_kernel", 64), num("expert_count", 1 << 16, 256),
                      num("expert_used_count", 1 << 16, 8), {t.name: math.prod(t.shape) for t in info.tensors},
                      n_mtp)


@dataclass(frozen=True)
class LlamaSettings:
    context: int = 4096  # tokens per sequence (slot), as quantkit's plan budgets them
    parallel: int = 1  # llama-server -np: sequences (each has its own recurrent state)
    cache_type: str = "f16"
    ubatch: int = DEFAULT_UBATCH
    mtp_draft: int = 0  # tokens llama-server drafts per step with the MTP layer (0: not drafting; not loaded)

    @property
    def n_ctx(self) -> int:
        """llama-server's -c: the KV cache of all slots together (-c 65536 -np 4 is 16k per slot)."""
        return self.context * self.parallel


def kv_layer_bytes(m: LlamaModel, s: LlamaSettings) -> int:
    bb, be = CACHE_BLOCKS[s.cache_type]
    return s.n_ctx * 2 * m.n_head_kv * math.ceil(m.head_dim / be) * bb


def rs_layer_bytes(m: LlamaModel, s: LlamaSettings) -> int:
    conv = (m.ssm_conv - 1) * (m.ssm_inner + 2 * m.ssm_groups * m.ssm_state)
    return s.parallel * (conv + m.ssm_state * m.ssm_inner) * 4


def compute_bytes(m: LlamaModel, s: LlamaSettings, with_output: bool) -> int:
    per_tok = m.n_embd * COMPUTE_PER_TOKEN_HIDDEN + (m.vocab * 4 if with_output else 0)
    return s.ubatch * per_tok + s.n_ctx * s.ubatch * 2


@dataclass
class LlamaPlacement:
    model: str
    settings: LlamaSettings
    n_layer: int
    n_gpu_layers: int  # -ngl (n_layer + 1 = every layer and the output)
    gpu_layers: list[list[int]]  # per GPU, its layers
    cpu_expert_layers: list[int]  # layers whose routed experts stay on the CPU
    gpu_bytes: list[dict[str, int]]  # per GPU, what llama.cpp allocates there
    cpu_bytes: dict[str, int]
    budgets: list[int]  # per GPU: card minus reserve
    reserve: int
    fits: bool
    assumptions: list[str] = field(default_factory=list)
    n_mtp: int = 0  # the GGUF's NextN blocks, which llama.cpp's -ngl counts among the layers

    @property
    def drafts(self) -> int:
        """Tokens drafted per step with the MTP layer (0 when the file has none or the line does not draft)."""
        return self.settings.mtp_draft if self.n_mtp else 0

    def gpu_totals(self) -> list[int]:
        return [sum(d.values()) for d in self.gpu_bytes]

    def flags(self) -> list[str]:
        """The -ngl / --n-cpu-moe / -ot / --tensor-split flags of this placement."""
        if not self.budgets:
            return ["-ngl", "0"]
        # llama.cpp offloads from the top of all blocks, the NextN ones included: count them (held or not)
        ngl = self.n_gpu_layers + self.n_mtp if self.n_gpu_layers else 0
        args = ["-ngl", "99" if self.n_gpu_layers > self.n_layer else str(ngl)]
        cpu = [L for L in self.cpu_expert_layers if L >= self.n_layer + 1 - self.n_gpu_layers]
        if cpu and len(self.budgets) == 1 and cpu == list(range(cpu[0], cpu[-1] + 1)):
            args += ["--n-cpu-moe", str(cpu[-1] + 1)]
        elif cpu:
            args += ["-ot", f"blk\\.({'|'.join(map(str, cpu))})\\.ffn_.*_exps\\.=CPU"]
        if len(self.budgets) > 1:
            counts = [len(x) for x in self.gpu_layers]
            counts[-1] += self.n_mtp if self.n_gpu_layers else 0  # the NextN blocks sit with the last layers
            args += ["--tensor-split", ",".join(map(str, counts)), "--split-mode", "layer"]
        return args

    def mtp_flags(self) -> list[str]:
        """llama-server's MTP speculative decoding (common/arg.cpp): draft-mtp and its draft length."""
        return ["--spec-type", "draft-mtp", "--spec-draft-n-max", str(self.drafts)] if self.drafts else []

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "n_gpu_layers": self.n_gpu_layers, "gpu_layers": self.gpu_layers,
                "mtp_blocks": self.n_mtp, "mtp_draft": self.drafts,
                "cpu_expert_layers": self.cpu_expert_layers, "gpu_bytes": self.gpu_bytes,
                "gpu_totals": self.gpu_totals(), "cpu_bytes": self.cpu_bytes, "budgets": self.budgets,
                "reserve": self.reserve, "fits": self.fits, "flags": self.flags(), "assumptions": self.assumptions}


class _Layers:
    """Per-layer bytes, computed once for the solver's many trials."""

    def __init__(self, m: LlamaModel, s: LlamaSettings):
        self.m, self.s = m, s
        self.dense = [m.layer_bytes(L, False) for L in range(m.n_layer)]
        self.experts = [m.layer_bytes(L, True) for L in range(m.n_layer)]
        kv, rs = kv_layer_bytes(m, s), rs_layer_bytes(m, s)
        self.state = [kv if f else rs for f in m.full_attention]

    def use(self, layers: list[int], cpu_exp: set[int], output: bool) -> dict[str, int]:
        m, s = self.m, self.s
        d = {"weights": sum(self.dense[L] for L in layers),
             "experts": sum(self.experts[L] for L in layers if L not in cpu_exp),
             "kv_cache": sum(self.state[L] for L in layers if m.full_attention[L]),
             "recurrent_state": sum(self.state[L] for L in layers if not m.full_attention[L]),
             "compute": compute_bytes(m, s, output) if (layers or output) else 0}
        if output:
            d["output"] = m.output_bytes
            d.update(self.mtp())
        return d

    def mtp(self) -> dict[str, int]:
        """What drafting with the NextN blocks adds where the output layer is: their weights, their KV cache
        and the draft context's compute buffer (none when the line does not draft)."""
        m, s = self.m, self.s
        if not (s.mtp_draft and m.n_mtp):
            return {}
        return {"mtp": m.mtp_bytes + m.n_mtp * kv_layer_bytes(m, s) + compute_bytes(m, s, True)}


def _split(layers: list[int], budgets: list[int]) -> list[list[int]]:
    """Contiguous layer ranges per GPU in proportion to the budgets (the last GPU gets the output)."""
    total = sum(budgets) or 1
    out, start = [], 0
    for i, b in enumerate(budgets):
        k = len(layers) - start if i == len(budgets) - 1 else round(len(layers) * b / total)
        out.append(layers[start:start + k])
        start += k
    return out


def solve_llama(m: LlamaModel, s: LlamaSettings, gpu_memory: list[int], reserve: int,
                n_cpu_moe: int | None = None) -> LlamaPlacement:
    """Place `m` on GPUs of `gpu_memory` bytes each (empty: CPU only). `n_cpu_moe` fixes llama.cpp's
    --n-cpu-moe (the experts of the first N layers on the CPU, every layer's rest on the GPUs) instead of
    searching for the fewest."""
    if s.cache_type not in CACHE_BLOCKS:
        raise QuantkitError(f"llama.cpp has no {s.cache_type} KV cache; use one of {', '.join(CACHE_BLOCKS)}")
    n = m.n_layer
    budgets = [max(0, g - reserve) for g in gpu_memory]
    lb = _Layers(m, s)
    assumptions = [
        f"llama-server -fa on, -ub {s.ubatch}, -c {s.n_ctx} (-np {s.parallel}: {s.context} tokens per slot), "
        f"KV cache {s.cache_type}",
        "GPU bytes = this file's tensors on each card + KV cache + recurrent state + compute buffer "
        f"(logits ubatch x vocab x 4 = {s.ubatch * m.vocab * 4 / 2**20:.0f} MiB with the output layer); "
        f"{reserve / 2**30:.2f} GiB per card left for the CUDA context",
        "token_embd stays in CPU RAM (llama.cpp never offloads the input layer)",
    ]
    best: LlamaPlacement | None = None
    if s.mtp_draft and m.n_mtp:
        assumptions.append(f"MTP drafting ({s.mtp_draft} token{'s' if s.mtp_draft > 1 else ''} a step): the NextN "
                           "block's weights "
                           f"({m.mtp_bytes / 2**30:.2f} GiB), its KV cache and the draft context's compute buffer "
                           "(counted as the main context's) go with the output layer")
    if n_cpu_moe is not None:
        assumptions.append(f"--n-cpu-moe {n_cpu_moe} as given: the experts of the first {min(n_cpu_moe, n)} "
                           "layers on the CPU")
    for ngl in (range(n + 1, -1, -1) if n_cpu_moe is None else [n + 1]) if budgets else [0]:
        first = min(n, n + 1 - ngl)
        layers = list(range(first, n))
        split = _split(layers, budgets) if budgets else []
        cpu_exp: set[int] = set(range(first)) | set(range(min(n_cpu_moe or 0, n)))
        outs = [gi == len(split) - 1 and ngl > 0 for gi in range(len(split))]
        for gi, mine in enumerate(split):
            for L in [None, *mine] if n_cpu_moe is None else [None]:
                if L is not None:
                    cpu_exp.add(L)
                if sum(lb.use(mine, cpu_exp, outs[gi]).values()) <= budgets[gi]:
                    break
        use = [lb.use(mine, cpu_exp, outs[gi]) for gi, mine in enumerate(split)]
        fits = all(sum(u.values()) <= b for u, b in zip(use, budgets, strict=True))
        cpu = {"token_embd": m.tensors.get("token_embd.weight", 0),
               "weights": sum(lb.dense[:first]) + (m.output_bytes if ngl == 0 else 0),
               **(lb.mtp() if ngl == 0 else {}),
               "experts": sum(lb.experts[L] for L in cpu_exp),
               **{k: v for k, v in lb.use(list(range(first)), set(), False).items()
                  if k in ("kv_cache", "recurrent_state")},
               "logits": s.parallel * m.vocab * 4}
        best = LlamaPlacement(m.label, s, n, ngl, split, sorted(cpu_exp), use, cpu, budgets, reserve, fits,
                              assumptions, m.n_mtp)
        if fits:
            break
    assert best is not None
    return best
