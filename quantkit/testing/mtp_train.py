"""Self-distillation of a tiny checkpoint's MTP layer, a test fixture: `train_mtp(folder)` makes the layer agree
with its own model, so speculative decoding has drafts that are actually accepted (a random MTP layer never
agrees). A fixture for tests and benchmarks, not a training feature.

Contract:
- Input: an unquantized published-layout checkpoint folder with an MTP layer (`mtp.*`), e.g. `quantkit tiny-model
  OUT --mtp`. A folder without the layer, or a quantized one, is refused in one line (QuantkitError).
- Data: `prompts` seeded chat prompts (lines of the tokenizer's corpus, `prompt_texts`) each continued
  `new_tokens` greedy tokens by quantkit's runtime on the checkpoint as stored; one forward over prompt and
  continuation gives every position's final-normed hidden state h (what generation feeds the MTP layer: the
  prompt's in `mtp_prefill`, a verify's after each accepted run, runtime/speculative.py) and its logits.
- Pairs: as the runtime appends them to the MTP's KV, pair i is (token x_(i+1), hidden h_i) at position i; its
  target is the model's own greedy token after x_(i+1) (argmax of the logits at i + 1: the continuation itself
  where the model wrote it). Teacher forcing: the layer always sees the model's hidden states.
- Model: `TorchMTP`, a differentiable torch copy of runtime/model/qwen3_5_moe.py `MTP` (the two input norms, `fc` over
  [embedding, hidden], transformers' own Qwen3.5-MoE decoder layer as a one-layer full-attention config, the final
  norm) on the frozen embedding and lm_head. `compare` holds it to the runtime's `MTP.forward` on the same pairs;
  training refuses (one line) a copy whose logits are not close at MIN_CLOSE of the positions.
- Training: only the `mtp.*` weights, fp32, AdamW on cross-entropy, `steps` steps of `batch` sequences in a
  seeded order; the first `held_out` prompts are never trained on and give the report's held-out agreement.
  Deterministic for the same folder and options (one thread while it trains). `REALISTIC` is the budget for
  realistic shapes (hidden 2048), where a step costs hundreds of times the tiny shape's: there a random model's
  continuations barely generalise, the layer mostly learns its training prompts (`train_agreement`), which is
  what an engine comparison on those prompts needs (benchmarks/vllm_check.py).
- Output: every `mtp.*` tensor written back under its own name, shape and dtype into the shard that held it; the
  other tensors, the index and the other files unchanged; the folder replaced atomically (a copy is written
  beside it, then swapped in). The report (`TrainReport`) is returned and, where the folder has the tiny-model
  sidecar, recorded there under "mtp_trained".
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from quantkit.checkpoint.contract import read_quant_config
from quantkit.checkpoint.reader import Checkpoint, read_safetensors_header
from quantkit.checkpoint.spec import load_config, text_config_dict
from quantkit.errors import QuantkitError
from quantkit.fileio import pid_temp_name, replace_folder
from quantkit.runtime import SamplingParams, load_model
from quantkit.testing.tokenizer import tiny_corpus
from quantkit.threads import torch_threads

EMBED = "model.language_model.embed_tokens.weight"
HEAD = "lm_head.weight"
SIDECAR = "quantkit-tiny.json"
CLOSE = 0.1  # `compare`: a position's logits agree when they differ by less than this share of their spread
MIN_CLOSE = 0.9  # `train_mtp` refuses a torch copy whose logits are close at fewer positions
EVAL_SEED = 1000  # prompt_texts(n, seed + EVAL_SEED): prompts no training run of the same seed draws


@dataclass(frozen=True)
class TrainOptions:
    """The data and the budget (the defaults: the bench's fixture)."""

    prompts: int = 320  # seeded chat prompts the model continues (held_out of them never trained on)
    new_tokens: int = 64  # greedy tokens per prompt
    held_out: int = 16
    steps: int = 600
    batch: int = 16  # sequences per step
    lr: float = 3e-3
    seed: int = 0

    def check(self) -> None:
        if self.prompts <= self.held_out or min(self.new_tokens, self.steps, self.batch) < 1 or self.held_out < 1:
            raise QuantkitError("MTP training needs prompts > held-out >= 1 and at least one new token, step "
                                "and sequence per step")
        if not self.lr > 0:
            raise QuantkitError(f"MTP training: learning rate {self.lr} must be positive")


# realistic shapes: fewer, shorter prompts and smaller batches (module docstring)
REALISTIC = TrainOptions(prompts=48, new_tokens=32, held_out=8, steps=60, batch=8)


@dataclass
class TrainReport:
    """What a training did: the sidecar's "mtp_trained"."""

    options: dict[str, Any]
    pairs: int  # training pairs (positions) in all
    loss_before: float  # mean cross-entropy of the training pairs before / after
    loss_after: float
    held_out_before: float  # the layer's top-1 agreement with the model on the held-out continuations
    held_out_after: float
    agreement: dict[str, float]  # `compare` before training, on the first held-out sequence
    seconds: float
    train_agreement: float  # the layer's top-1 agreement with the model on the training continuations, after

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---- the MTP layer in torch ----
def one_layer_config(config: dict[str, Any]) -> Any:
    """transformers' text config of the MTP's decoder layer: the model's, one full-attention layer, eager."""
    from transformers import Qwen3_5MoeTextConfig

    tc = {**text_config_dict(config), "num_hidden_layers": 1, "layer_types": ["full_attention"],
          "mtp_num_hidden_layers": 0}
    cfg = Qwen3_5MoeTextConfig(**tc)
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    return cfg


class TorchMTP(nn.Module):
    """runtime/model/qwen3_5_moe.py `MTP.forward` in torch, differentiable, over whole sequences of pairs: the final-normed
    output [B, T, H] of pairs (embedding rows [B, T, H], hidden states [B, T, H]) at positions 0..T-1."""

    def __init__(self, config: dict[str, Any]):
        super().__init__()
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
            Qwen3_5MoeDecoderLayer,
            Qwen3_5MoeRMSNorm,
            Qwen3_5MoeTextRotaryEmbedding,
        )

        cfg = one_layer_config(config)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.pre_fc_norm_embedding = Qwen3_5MoeRMSNorm(h, eps)
        self.pre_fc_norm_hidden = Qwen3_5MoeRMSNorm(h, eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layer = Qwen3_5MoeDecoderLayer(cfg, 0)
        self.norm = Qwen3_5MoeRMSNorm(h, eps)
        self.rotary = Qwen3_5MoeTextRotaryEmbedding(cfg)
        self.experts = cfg.num_experts

    def forward(self, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        b, t, _ = emb.shape
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(emb), self.pre_fc_norm_hidden(hidden)], dim=-1))
        pos = torch.arange(t).expand(b, t)
        mask = torch.full((t, t), torch.finfo(x.dtype).min, dtype=x.dtype).triu(1).expand(b, 1, t, t)
        x = self.layer(x, position_embeddings=self.rotary(x, pos), attention_mask=mask, position_ids=pos)
        return self.norm(x)

    # checkpoint names <-> parameters (the checkpoint stores the experts one by one)
    def load_checkpoint(self, ck: Checkpoint) -> None:
        """The checkpoint's `mtp.*` tensors into the parameters (fp32; the experts stacked as transformers holds
        them, gate then up)."""
        params = dict(self.named_parameters())
        ex = self.layer.mlp.experts
        with torch.no_grad():
            for k, name in self._plain_names().items():
                params[k].copy_(_read(ck, name, tuple(params[k].shape)))
            _e, two_i, h = ex.gate_up_proj.shape
            for e in range(self.experts):
                p = f"mtp.layers.0.mlp.experts.{e}."
                gate, up = (_read(ck, f"{p}{n}_proj.weight", (two_i // 2, h)) for n in ("gate", "up"))
                ex.gate_up_proj[e].copy_(torch.cat([gate, up]))
                ex.down_proj[e].copy_(_read(ck, f"{p}down_proj.weight", tuple(ex.down_proj.shape[1:])))

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """fp32 tensors under the checkpoint's names."""
        params = dict(self.named_parameters())
        out = {n: params[k].detach().clone() for k, n in self._plain_names().items()}
        ex = self.layer.mlp.experts
        inter = ex.gate_up_proj.shape[1] // 2
        for e in range(self.experts):
            p = f"mtp.layers.0.mlp.experts.{e}."
            out[f"{p}gate_proj.weight"] = ex.gate_up_proj[e, :inter].detach().clone()
            out[f"{p}up_proj.weight"] = ex.gate_up_proj[e, inter:].detach().clone()
            out[f"{p}down_proj.weight"] = ex.down_proj[e].detach().clone()
        return out

    def _plain_names(self) -> dict[str, str]:
        """Parameter name -> checkpoint name, for all but the fused experts."""
        out = {}
        for k, _ in self.named_parameters():
            if k.startswith("layer.mlp.experts."):
                continue
            out[k] = "mtp.layers.0." + k[len("layer."):] if k.startswith("layer.") else f"mtp.{k}"
        return out


def _read(ck: Checkpoint, name: str, want: tuple[int, ...]) -> torch.Tensor:
    """`name` as fp32, refused in one line unless it has the shape the config gives it (`want`)."""
    t = ck.read(name).float()
    if tuple(t.shape) != tuple(want):
        raise QuantkitError(f"{ck.path}: {name} has shape {list(t.shape)}; its config makes it {list(want)}")
    return t


# ---- data ----
@dataclass
class Pairs:
    """One sequence's pairs: tokens x_(i+1) [T], hidden h_i [T, H] (bf16, as the runtime holds them), targets [T]."""

    tokens: torch.Tensor
    hidden: torch.Tensor
    target: torch.Tensor


def prompt_texts(n: int, seed: int) -> list[str]:
    """`n` seeded user messages of one to three lines of the tokenizer's corpus."""
    lines = tiny_corpus(3 * n, seed=seed)
    rng = random.Random(seed)
    return ["".join(lines[3 * i:3 * i + rng.randint(1, 3)]).strip() for i in range(n)]


def chat_prompts(rt: Any, n: int, seed: int) -> list[list[int]]:
    """The ids of `prompt_texts(n, seed)` as user turns through the model's chat template (no thinking)."""
    return [rt.render_ids([{"role": "user", "content": s}], enable_thinking=False)[1] for s in prompt_texts(n, seed)]


def greedy(rt: Any, ids: list[int], new_tokens: int) -> list[int]:
    """The runtime's greedy continuation of `ids` (no drafts, no stop token)."""
    resp = None
    sp = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
    for e in rt.generate_ids(ids, sp, thinking=False, stop_ids=set()):
        resp = e.response or resp
    assert resp is not None
    return list(resp.token_ids)


def sequence_pairs(model: Any, seq: list[int]) -> Pairs:
    """The pairs of `seq` (module docstring) from one forward of the runtime's model."""
    with torch.inference_mode():
        logits, hidden = model.forward(seq, model.new_cache(len(seq)), all_logits=True, hidden=True)
    return Pairs(torch.tensor(seq[1:]), hidden[:-1].to(torch.bfloat16).cpu(), logits[1:].float().argmax(-1).cpu())


OnStep = Callable[[str, int, int], None]  # (stage, done, total): "continuing" per prompt, "training" per step


def make_pairs(rt: Any, o: TrainOptions, on_step: OnStep | None = None) -> list[Pairs]:
    rt.set_mtp(0)
    prompts = chat_prompts(rt, o.prompts, o.seed)
    out = []
    for i, ids in enumerate(prompts):
        out.append(sequence_pairs(rt.model, ids + greedy(rt, ids, o.new_tokens)))
        if on_step:
            on_step("continuing", i + 1, len(prompts))
    return out


# ---- training ----
def _batch(seqs: list[Pairs], embed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (embedding rows, hidden, targets with -100 at the padding) of `seqs`."""
    t = max(len(s.tokens) for s in seqs)
    h = embed.shape[1]
    emb = torch.zeros(len(seqs), t, h)
    hid = torch.zeros(len(seqs), t, h)
    tgt = torch.full((len(seqs), t), -100, dtype=torch.long)
    for i, s in enumerate(seqs):
        n = len(s.tokens)
        emb[i, :n] = embed[s.tokens]
        hid[i, :n] = s.hidden.float()
        tgt[i, :n] = s.target
    return emb, hid, tgt


def _loss_and_agreement(mtp: TorchMTP, seqs: list[Pairs], embed: torch.Tensor, head: torch.Tensor,
                        chunk: int = 32) -> tuple[float, float]:
    """Mean cross-entropy and top-1 agreement over every pair of `seqs`."""
    loss = hits = n = 0.0
    with torch.no_grad():
        for a in range(0, len(seqs), chunk):
            emb, hid, tgt = _batch(seqs[a:a + chunk], embed)
            logits = mtp(emb, hid) @ head.t()
            keep = tgt != -100
            loss += float(nn.functional.cross_entropy(logits[keep], tgt[keep], reduction="sum"))
            hits += float((logits[keep].argmax(-1) == tgt[keep]).sum())
            n += float(keep.sum())
    return loss / n, hits / n


def fit(mtp: TorchMTP, train: list[Pairs], embed: torch.Tensor, head: torch.Tensor, o: TrainOptions,
        on_step: OnStep | None = None) -> None:
    """`o.steps` AdamW steps on batches of `o.batch` sequences, a seeded shuffle per pass."""
    opt = torch.optim.AdamW(mtp.parameters(), lr=o.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * (1 - s / o.steps))
    rng = random.Random(o.seed)
    order: list[int] = []
    for step in range(o.steps):
        if len(order) < o.batch:
            more = list(range(len(train)))
            rng.shuffle(more)
            order += more
        pick, order = order[:o.batch], order[o.batch:]
        emb, hid, tgt = _batch([train[i] for i in pick], embed)
        logits = mtp(emb, hid) @ head.t()
        loss = nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), tgt.view(-1), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if on_step:
            on_step("training", step + 1, o.steps)


def check_folder(folder: Path) -> Checkpoint:
    """The checkpoint, refused in one line unless it is unquantized and has an MTP layer."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise QuantkitError(f"{folder}: not a checkpoint folder (no config.json)")
    config = load_config(folder / "config.json")
    if read_quant_config(folder, config) is not None:
        raise QuantkitError(f"{folder} is quantized; train the MTP layer of the unquantized checkpoint, then "
                            "quantize it")
    ck = Checkpoint.open(folder)
    if not text_config_dict(config).get("mtp_num_hidden_layers") or "mtp.fc.weight" not in ck.names():
        ck.close()
        raise QuantkitError(f"{folder} has no MTP layer (mtp.* tensors) to train; write one with "
                            "`quantkit tiny-model OUT --mtp-layer`")
    return ck


def train_mtp(folder: str | Path, options: TrainOptions | None = None, on_step: OnStep | None = None) -> TrainReport:
    """Train the MTP layer of `folder` on its own model's greedy continuations and write it back (module
    docstring); `on_step` hears of each prompt continued and each step trained."""
    o = options or TrainOptions()
    o.check()
    folder = Path(folder)
    t0 = time.perf_counter()
    with check_folder(folder) as ck, torch_threads(1):
        torch.manual_seed(o.seed)
        mtp = TorchMTP(ck.config)
        mtp.load_checkpoint(ck)
        embed, head = ck.read(EMBED).float(), ck.read(HEAD).float()
        rt = load_model(folder, verify="quick", mtp_copies=False)
        seqs = make_pairs(rt, o, on_step)
        check = compare(rt.model, ck, seqs[0])  # what is trained must be the layer the runtime drafts with (as stored)
        del rt
        if check["close"] < MIN_CLOSE:
            raise QuantkitError(f"the torch copy of {folder.name}'s MTP layer does not compute what the runtime "
                                f"does (logits close at {check['close']:.0%} of {check['positions']} positions); "
                                "training it would train another layer")
        held, train = seqs[:o.held_out], seqs[o.held_out:]
        loss0, _ = _loss_and_agreement(mtp, train, embed, head)
        _, held0 = _loss_and_agreement(mtp, held, embed, head)
        mtp.train()
        fit(mtp, train, embed, head, o, on_step)
        mtp.eval()
        loss1, train1 = _loss_and_agreement(mtp, train, embed, head)
        _, held1 = _loss_and_agreement(mtp, held, embed, head)
        report = TrainReport(asdict(o), sum(len(s.tokens) for s in train), loss0, loss1, held0, held1,
                             check, time.perf_counter() - t0, train1)
        write_back(ck, mtp.checkpoint_tensors(), report)
    return report


# ---- writing back ----
def write_back(ck: Checkpoint, tensors: dict[str, torch.Tensor], report: TrainReport | None = None) -> None:
    """`tensors` (checkpoint names, any float dtype) into the shards of `ck` that hold them, each in its stored
    dtype and shape; the folder replaced atomically (module docstring)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    folder = ck.path
    where = {name: f for f in ck.files for name in read_safetensors_header(f)}
    by_file: dict[Path, list[str]] = {}
    for name in tensors:
        shape, _dtype = ck.header(name)
        if tuple(tensors[name].shape) != tuple(shape):
            raise ValueError(f"{name}: trained {tuple(tensors[name].shape)}, stored {tuple(shape)}")
        by_file.setdefault(where[name], []).append(name)
    tmp = pid_temp_name(folder)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        for f in folder.iterdir():
            if f in by_file or f.name == SIDECAR:
                continue
            if f.is_dir():
                shutil.copytree(f, tmp / f.name)
            else:
                shutil.copy2(f, tmp / f.name)
        for f, names in by_file.items():
            with safe_open(str(f), framework="pt") as h:
                meta = h.metadata()
                out = {k: h.get_tensor(k) for k in h.keys()}  # noqa: SIM118 (safe_open is not a mapping)
            for n in names:
                out[n] = tensors[n].to(out[n].dtype).contiguous()
            save_file(out, str(tmp / f.name), metadata=meta)
        side = folder / SIDECAR
        if side.is_file():
            info = json.loads(side.read_text())
            if report is not None:
                info["mtp_trained"] = report.to_dict()
            (tmp / SIDECAR).write_text(json.dumps(info, indent=2) + "\n")
        os.chmod(tmp, folder.stat().st_mode & 0o777)
        replace_folder(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# ---- the torch copy against the runtime ----
def agreement(folder: str | Path, new_tokens: int = 32, seed: int = 0) -> dict[str, float]:
    """`compare` on the pairs of one greedy continuation of a held-out prompt of `folder`'s model."""
    with check_folder(Path(folder)) as ck, torch_threads(1), torch.inference_mode():
        rt = load_model(folder, verify="quick", mtp_copies=False)
        ids = chat_prompts(rt, 1, seed + EVAL_SEED)[0]
        return compare(rt.model, ck, sequence_pairs(rt.model, ids + greedy(rt, ids, new_tokens)))


def compare(model: Any, ck: Checkpoint, p: Pairs) -> dict[str, float]:
    """`TorchMTP` with `ck`'s weights as stored (bf16) against the runtime's `MTP.forward` on the pairs `p`, the
    runtime fed one pair per call as it drafts. Per position, the largest logit difference; `close`: the share of
    positions where it is under CLOSE of the logits' spread (a position whose routing is a near tie may pick another
    expert in either); `argmax_agreement`: how often the two drafts agree."""
    with torch.inference_mode():
        cache = model.mtp.new_cache(len(p.tokens))
        ours = torch.stack([model.mtp.forward(model, [int(t)], p.hidden[i:i + 1], cache)[0].float()
                            for i, t in enumerate(p.tokens)])
        mtp = TorchMTP(ck.config)
        mtp.load_checkpoint(ck)
        for w in mtp.parameters():  # parameters only: the rotary's inv_freq stays fp32, as the runtime's
            w.data = w.data.to(torch.bfloat16)
        embed, head = ck.read(EMBED), ck.read(HEAD)
        theirs = (mtp(embed[p.tokens][None], p.hidden[None])[0] @ head.t()).float()
    diff = (ours - theirs).abs().amax(-1)
    spread = float(theirs.std())
    return {"positions": len(p.tokens), "logit_std": spread, "max_abs_diff": float(diff.max()),
            "median_abs_diff": float(diff.median()), "close": float((diff < CLOSE * spread).float().mean()),
            "argmax_agreement": float((ours.argmax(-1) == theirs.argmax(-1)).float().mean())}
