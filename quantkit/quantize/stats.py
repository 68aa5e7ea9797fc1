"""`quantkit stats`: activation statistics of a checkpoint, streamed one decoder layer at a time.

Contract:
- Input: an opened bf16/fp16/fp32 `Checkpoint` and `TokenData` (calib_data.py). The last
  `heldout_fraction` of the chunks is HELD OUT: it is run through the model like the rest, but only
  feeds the `*.heldout_hessian` and `*.heldout_routing` tensors (the quantize report's output error and
  the placement profile's coverage are measured on it), never the statistics methods use.
- The model runs layer by layer: the embedding rows of the calibration tokens, then each decoder layer
  built from transformers' own `Qwen3_5MoeDecoderLayer` with its weights loaded alone (fp32 compute),
  the hidden states of all tokens carried from one layer to the next, then the final norm (for lm_head).
  Peak memory is about one layer's weights (routed experts as stored, the rest in fp32) plus the hidden
  states and the statistics of one layer, whatever the number of layers.
- MoE layers are calibrated on ALL experts for every token (as llm-compressor's
  `moe_calibrate_all_experts`): each expert's down_proj sees every token's act(gate)*up, while the layer's
  output keeps only the routed experts' contributions, so the next layer sees what the model computes.
- Output: one safetensors file, per quantizable linear `N` (canonical names; the fused expert stacks
  without `.weight`):
    `N.hessian`          fp32 sum of x x^T over calibration tokens ([in, in]; gate_up_proj: ONE matrix
                         shared by all experts; down_proj: [E, I, I], one per expert, all tokens),
    `N.heldout_hessian`  the same over the held-out tokens,
    `N.in_sum2`          fp32 per-input-column sum of x^2 over the tokens the tensor is used on
                         ([in]; experts: [E, in], routed tokens only: llama.cpp's imatrix statistic),
    `N.count`            int64 tokens behind `in_sum2` ([1]; experts [E]: routing counts),
  per MoE layer `L.mlp.routing` / `L.mlp.heldout_routing` int64 [E] (tokens routed to each expert), and
  `__metadata__` with the format version, the model fingerprint (config and tensor shapes), the data's
  fingerprint, token counts and chunk size.
- Resumable per layer: the work lives in a hidden folder next to `out` (`.NAME.partial`): one
  safetensors file of statistics per finished layer and the hidden states after the last finished layer.
  A rerun with the same model, data and options resumes after the last finished layer; the final file is
  assembled tensor by tensor (quantize/shards.py's writer) and renamed into place, then the folder goes.
  `--out` goes through the output guard (quantkit/outputs.py); the work folder is locked (a second run to
  the same `--out` is refused) and removed when a write fails (a full disk leaves nothing behind).
- Reading (`Stats.open`): the file is validated before use by quantize/stats_check.py.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from quantkit.checkpoint.reader import Checkpoint, read_safetensors
from quantkit.checkpoint.spec import text_config_dict
from quantkit.errors import QuantkitError
from quantkit.fileio import atomic_write_json, fsync_dir
from quantkit.outputs import guard_output
from quantkit.progress import NoProgress, Progress
from quantkit.quantize import stats_check
from quantkit.quantize.calib_data import TokenData
from quantkit.quantize.manifest import fingerprint
from quantkit.quantize.shards import TORCH_DTYPES, ShardLayout, ShardWriter, TensorLayout, read_header

STATS_VERSION = "1"
LM = "model.language_model."
DEFAULT_HELDOUT = 0.125
# Chunks run through a layer at once: bounds the attention / DeltaNet temporaries.
BATCH_CHUNKS = 4
# The dense linears whose inputs are collected, by the module path inside a decoder layer.
DENSE_LINEARS = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_a", "linear_attn.in_proj_b",
    "linear_attn.out_proj",
    "mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj",
)
GATE_UP = "mlp.experts.gate_up_proj"
DOWN = "mlp.experts.down_proj"


def model_fingerprint(ckpt: Checkpoint) -> str:
    """Config and canonical tensor names/shapes: statistics fit every checkpoint with the same value."""
    return fingerprint({"config": ckpt.config.get("text_config", ckpt.config),
                        "tensors": [[t.name, list(t.shape)] for t in ckpt.canonical()]})


# --- accumulating ---------------------------------------------------------------------------------------

@dataclass
class LayerSums:
    """Running sums for one layer; `heldout` switches which Hessian/routing sums the hooks feed."""

    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    heldout: bool = False

    def add(self, key: str, value: torch.Tensor) -> None:
        cur = self.sums.get(key)
        if cur is None:
            self.sums[key] = value.clone() if value.dtype != torch.float64 else value.float()
        else:
            cur.add_(value.to(cur.dtype))

    def hessian(self, name: str, x: torch.Tensor) -> None:
        """x [T, in] -> name.hessian (or heldout_hessian) += x^T x, and in_sum2/count on calibration."""
        x = x.reshape(-1, x.shape[-1]).float()
        if self.heldout:
            self.add(f"{name}.heldout_hessian", x.T @ x)
            return
        self.add(f"{name}.hessian", x.T @ x)
        self.add(f"{name}.in_sum2", x.square().sum(0))
        self.add(f"{name}.count", torch.tensor([x.shape[0]], dtype=torch.int64))


def linear_hook(acc: LayerSums, name: str) -> Callable:
    def hook(_mod: torch.nn.Module, args: tuple) -> None:
        acc.hessian(name, args[0])
    return hook


def _moe_forward(block: Any, x: torch.Tensor, acc: LayerSums, prefix: str) -> torch.Tensor:
    """Qwen3_5MoeSparseMoeBlock's output for x [B, T, H], with all-expert statistics (module docstring)."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    gu_name, dn_name = prefix + GATE_UP, prefix + DOWN
    _, weights, chosen = block.gate(x)  # transformers' router: softmax, top-k, renormalised
    n_exp = block.experts.num_experts
    routed = torch.zeros(x.shape[0], n_exp)
    routed.scatter_(1, chosen, 1.0)
    counts = routed.sum(0).round().to(torch.int64)
    acc.add(prefix + ("mlp.heldout_routing" if acc.heldout else "mlp.routing"), counts)
    x2 = x.square()
    if acc.heldout:
        acc.add(f"{gu_name}.heldout_hessian", x.T @ x)
    else:
        acc.add(f"{gu_name}.hessian", x.T @ x)
        acc.add(f"{gu_name}.in_sum2", routed.T @ x2)
        acc.add(f"{gu_name}.count", counts)
        acc.add(f"{dn_name}.count", counts)
    gate_up, down = block.experts.gate_up_proj, block.experts.down_proj
    inter = down.shape[-1]
    out = torch.zeros_like(x)
    hs, s2 = [], []
    for e in range(n_exp):
        g, u = F.linear(x, gate_up[e].float()).split(inter, dim=-1)
        h = block.experts.act_fn(g) * u  # [T, I]: every token through every expert
        hs.append(h.T @ h)
        if not acc.heldout:
            s2.append(routed[:, e] @ h.square())
        rows, slot = (chosen == e).nonzero(as_tuple=True)
        if rows.numel():
            out.index_add_(0, rows, F.linear(h[rows], down[e].float()) * weights[rows, slot, None].to(x.dtype))
    acc.add(f"{dn_name}.{'heldout_hessian' if acc.heldout else 'hessian'}", torch.stack(hs))
    if not acc.heldout:
        acc.add(f"{dn_name}.in_sum2", torch.stack(s2))
    shared = block.shared_expert(x) * torch.sigmoid(block.shared_expert_gate(x))
    return (out + shared).reshape(shape)


# --- the model, one layer at a time ----------------------------------------------------------------------

def _text_config(ckpt: Checkpoint) -> Any:
    import transformers
    from transformers import Qwen3_5MoeTextConfig


    transformers.logging.set_verbosity_error()
    cfg = Qwen3_5MoeTextConfig(**text_config_dict(ckpt.config))
    cfg._attn_implementation = "sdpa"
    return cfg


def _build_layer(ckpt: Checkpoint, cfg: Any, i: int) -> torch.nn.Module:
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeDecoderLayer

    with torch.device("meta"):
        layer = Qwen3_5MoeDecoderLayer(cfg, i)
    prefix = f"{LM}layers.{i}."
    for pname, _ in list(layer.named_parameters()):
        mod_path, _, leaf = pname.rpartition(".")
        mod = layer.get_submodule(mod_path) if mod_path else layer
        try:
            w = ckpt.load(prefix + pname)
        except (KeyError, QuantkitError) as e:
            raise QuantkitError(f"{ckpt.path}: layer {i} lacks {prefix + pname} ({e})") from None
        # expert stacks stay in their stored dtype (the largest tensors of a layer: 1.6 GB in bf16 at the
        # 35B's shapes) and are cast one expert at a time in _moe_forward; the rest computes in fp32
        keep = pname.startswith("mlp.experts.")
        mod._parameters[leaf] = torch.nn.Parameter(w if keep else w.float(), requires_grad=False)
    return layer.eval()


def _rotary(cfg: Any, n_tokens: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTextRotaryEmbedding

    rot = Qwen3_5MoeTextRotaryEmbedding(cfg)
    pos = torch.arange(n_tokens).view(1, 1, -1).expand(3, batch, -1)
    return rot(torch.zeros(1, dtype=torch.float32), pos)


def _run_layer(layer: torch.nn.Module, i: int, hidden: torch.Tensor, n_calib: int, cfg: Any,
               acc: LayerSums) -> torch.Tensor:
    prefix = f"{LM}layers.{i}."
    handles = []
    for path in DENSE_LINEARS:
        try:
            mod = layer.get_submodule(path)
        except AttributeError:
            continue
        handles.append(mod.register_forward_pre_hook(linear_hook(acc, f"{prefix}{path}.weight")))
    layer.mlp.forward = lambda x: _moe_forward(layer.mlp, x, acc, prefix)
    out = torch.empty_like(hidden)
    try:
        n = hidden.shape[0]
        # batches never mix calibration and held-out chunks
        starts = sorted({*range(0, n_calib, BATCH_CHUNKS), *range(n_calib, n, BATCH_CHUNKS)})
        for b0, b1 in zip(starts, [*starts[1:], n], strict=True):
            acc.heldout = b0 >= n_calib
            pe = _rotary(cfg, hidden.shape[1], b1 - b0)
            with torch.no_grad():
                out[b0:b1] = layer(hidden[b0:b1], position_embeddings=pe)
    finally:
        for h in handles:
            h.remove()
    return out


# --- the work folder, resuming, assembling ----------------------------------------------------------------

def is_stats_file(path: Path) -> bool:
    """An `owned` test (quantkit/outputs.py): a statistics file `quantkit stats` wrote."""
    try:
        return read_safetensors(path)[0].get("format") == "quantkit-stats"
    except QuantkitError:
        return False


def _work_dir(out: Path) -> Path:
    return out.parent / f".{out.name}.partial"


@dataclass
class StatsResult:
    out: Path
    n_tokens: int
    n_heldout: int
    layers: int
    resumed_layers: int
    seconds: float


def _n_heldout(n_chunks: int, fraction: float) -> int:
    if not 0 <= fraction < 1:
        raise QuantkitError(f"--heldout {fraction} must be in [0, 1)")
    k = math.ceil(n_chunks * fraction) if fraction > 0 else 0
    if k and n_chunks - k < 1:
        raise QuantkitError(f"{n_chunks} chunks leave none for calibration after holding out {k}; pass more text")
    return k


def collect_stats(ckpt: Checkpoint, tokens: TokenData, out: Path, heldout_fraction: float = DEFAULT_HELDOUT,
                  overwrite: bool = False, progress: Progress | None = None,
                  stop_after: int | None = None) -> StatsResult:
    """Run `tokens` through `ckpt` layer by layer and write the statistics to `out` (module docstring).
    `stop_after` (tests) stops after that many layers of this call, as an interrupted run would."""
    progress = progress or NoProgress()
    t0 = time.perf_counter()
    out = Path(out)
    need = sum(math.prod(s) * 8 for s, _d in stats_check.expected_shapes(
        ckpt.config, str(ckpt.path), DENSE_LINEARS, GATE_UP, DOWN).values()) + tokens.chunks.numel() * 4 * int(
        text_config_dict(ckpt.config).get("hidden_size", 0))  # the file + its work copy, the hidden states
    guard_output(out, sources=[Path(ckpt.path)], overwrite=overwrite, owned=is_stats_file, need_bytes=need,
                 flag="--out ", create_parents=True)
    for t in ckpt.canonical():
        if t.is_matrix and t.dtype not in ("bfloat16", "float16", "float32"):
            raise QuantkitError(f"{ckpt.path}: {t.name} is {t.dtype}; statistics need a bf16/fp16/fp32 source")
    cfg = _text_config(ckpt)
    n_layers = cfg.num_hidden_layers
    n_held = _n_heldout(tokens.chunks.shape[0], heldout_fraction)
    n_calib = tokens.chunks.shape[0] - n_held
    meta = {"format": "quantkit-stats", "version": STATS_VERSION, "model_fingerprint": model_fingerprint(ckpt),
            "data_fingerprint": tokens.fingerprint(), "data_source": tokens.source,
            "chunk_size": str(tokens.chunks.shape[1]), "chunk_count": str(n_calib),
            "heldout_chunks": str(n_held), "tokens": str(n_calib * tokens.chunks.shape[1]),
            "heldout_tokens": str(n_held * tokens.chunks.shape[1]), "layers": str(n_layers),
            "config": json.dumps(ckpt.config, sort_keys=True)}
    work = _work_dir(out)
    with _locked_work(work, out):
        try:
            return _collect(ckpt, tokens, out, work, meta, cfg, n_calib, n_held, progress, stop_after, t0)
        except (OSError, SafetensorError) as e:  # a full disk mid-run: nothing half-written stays behind
            shutil.rmtree(work, ignore_errors=True)
            why = getattr(e, "strerror", None) or str(e).splitlines()[0][:120]
            raise QuantkitError(f"--out {out}: statistics not written ({why}); its work folder was removed: "
                                "free space or pick another location") from None


@contextlib.contextmanager
def _locked_work(work: Path, out: Path) -> Iterator[None]:
    """Hold an exclusive lock on the work folder: a second `stats` to the same --out is refused, not raced."""
    try:
        work.mkdir(parents=True, exist_ok=True)
        fd = os.open(work, os.O_RDONLY)
    except OSError as e:
        raise QuantkitError(f"--out {out}: cannot create {work.name} ({e.strerror}); pick another location"
                            ) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise QuantkitError(f"--out {out}: another `quantkit stats` is writing it; wait for it to finish"
                                ) from None
        yield
    finally:
        os.close(fd)


def _collect(ckpt: Checkpoint, tokens: TokenData, out: Path, work: Path, meta: dict[str, str], cfg: Any,
             n_calib: int, n_held: int, progress: Progress, stop_after: int | None, t0: float) -> StatsResult:
    n_layers = cfg.num_hidden_layers
    state_path = work / "state.json"
    done = 0
    try:
        state = json.loads(state_path.read_text())
    except (OSError, ValueError, RecursionError):
        state = {}
    if isinstance(state, dict) and state.get("meta") == meta and isinstance(state.get("done"), int):
        done = min(max(state["done"], 0), n_layers)
    else:  # ours (hidden, named for `out`), for other data or another model: start afresh, keep the folder
        for p in work.iterdir():
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
    if done == 0:
        atomic_write_json(state_path, {"meta": meta, "done": 0})
        emb = ckpt.load(f"{LM}embed_tokens.weight")
        hidden = F.embedding(tokens.chunks, emb).float()
        del emb
    else:
        with safe_open(str(work / "hidden.safetensors"), "pt") as fh:
            hidden = fh.get_tensor("hidden")
    resumed = done
    progress.start(n_layers + 1, n_layers + 1)
    for _ in range(done):
        progress.advance("resumed", 1, True)
    ran = 0
    for i in range(done, n_layers):
        if stop_after is not None and ran >= stop_after:
            return StatsResult(out, n_calib * tokens.chunks.shape[1], n_held * tokens.chunks.shape[1], n_layers,
                               resumed, time.perf_counter() - t0)
        acc = LayerSums()
        layer = _build_layer(ckpt, cfg, i)
        hidden = _run_layer(layer, i, hidden, n_calib, cfg, acc)
        del layer
        ckpt.close()
        save_file(acc.sums, str(work / f".layer-{i:04d}.tmp"))
        os.replace(work / f".layer-{i:04d}.tmp", work / f"layer-{i:04d}.safetensors")
        save_file({"hidden": hidden.contiguous()}, str(work / ".hidden.tmp"))
        os.replace(work / ".hidden.tmp", work / "hidden.safetensors")
        atomic_write_json(state_path, {"meta": meta, "done": i + 1})
        ran += 1
        progress.advance(f"layer {i}", 1, True)
    # lm_head: its input is the final-normed hidden state
    final = _final_stats(ckpt, cfg, hidden, n_calib)
    save_file(final, str(work / ".final.tmp"))
    os.replace(work / ".final.tmp", work / "final.safetensors")
    _assemble(work, out, n_layers, meta)
    shutil.rmtree(work)
    progress.advance("lm_head", 1, True)
    return StatsResult(out, n_calib * tokens.chunks.shape[1], n_held * tokens.chunks.shape[1], n_layers, resumed,
                       time.perf_counter() - t0)


def _final_stats(ckpt: Checkpoint, cfg: Any, hidden: torch.Tensor, n_calib: int) -> dict[str, torch.Tensor]:
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeRMSNorm

    norm = Qwen3_5MoeRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
    norm.weight.data = ckpt.load(f"{LM}norm.weight").float()
    acc = LayerSums()
    with torch.no_grad():
        x = norm(hidden)
    acc.hessian("lm_head.weight", x[:n_calib])
    if n_calib < x.shape[0]:
        acc.heldout = True
        acc.hessian("lm_head.weight", x[n_calib:])
    return acc.sums


def _assemble(work: Path, out: Path, n_layers: int, meta: dict[str, str]) -> None:
    files = [work / f"layer-{i:04d}.safetensors" for i in range(n_layers)] + [work / "final.safetensors"]
    where: dict[str, Path] = {}
    layouts = []
    for f in files:
        for name, (shape, dtype) in _header_shapes(f).items():
            where[name] = f
            layouts.append(TensorLayout(name, shape, dtype))
    lay = ShardLayout(layouts, metadata=meta)
    out.parent.mkdir(parents=True, exist_ok=True)
    with ShardWriter(out, lay) as w:
        for f in files:
            with safe_open(str(f), "pt") as fh:
                for name in fh.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    w.write(name, fh.get_tensor(name))
        w.commit()
    fsync_dir(out.parent)


def _header_shapes(path: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:

    hdr = read_header(path)
    return {k: (tuple(v["shape"]), TORCH_DTYPES[v["dtype"]]) for k, v in hdr.items() if k != "__metadata__"}


# --- reading a statistics file ----------------------------------------------------------------------------

class Stats:
    """A statistics file opened lazily (header checked, tensors read on demand)."""

    def __init__(self, path: Path, meta: dict[str, str], names: set[str],
                 shapes: dict[str, list[int]] | None = None):
        self.path = path
        self.meta = meta
        self.names = names
        self.shapes = shapes or {}  # from the header: a tensor's size is known before it is read
        self._fh: Any = None

    @classmethod
    def open(cls, path: str | Path) -> Stats:
        """Open and validate (quantize/stats_check.py) a statistics file; one QuantkitError if it is unusable."""
        p = Path(path)
        if not p.is_file():
            raise QuantkitError(f"statistics file {p} does not exist; make it with `quantkit stats MODEL --out FILE`")
        try:
            meta, entries = read_safetensors(p)
        except QuantkitError as e:  # the shard reader's words, said of a statistics file
            why = str(e).removeprefix(f"{p}: ").removesuffix("; re-download it")
            raise QuantkitError(f"{p} is not a quantkit statistics file or is damaged ({why}); rerun "
                                "`quantkit stats`") from None
        if meta.get("format") != "quantkit-stats":
            raise QuantkitError(f"{p} is not a quantkit statistics file; make one with `quantkit stats`")
        if meta.get("version") != STATS_VERSION:
            raise QuantkitError(f"{p} is statistics format {meta.get('version')}, this quantkit reads "
                                f"{STATS_VERSION}; rerun `quantkit stats`")
        config = stats_check.check_meta(p, meta)
        stats_check.check_names(p, set(entries))
        if config is not None:  # else shapes are checked against the model it is used with (check_model)
            found = {k: (e.shape, e.dtype) for k, e in entries.items()}
            stats_check.check_tensors(p, found, stats_check.expected_shapes(config, f"{p} (its config)",
                                                                            DENSE_LINEARS, GATE_UP, DOWN))
        return cls(p, meta, set(entries), {k: list(e.shape) for k, e in entries.items()})

    def check_model(self, ckpt: Checkpoint) -> None:
        """The statistics are this checkpoint's: the fingerprint, and every tensor's shape against its config."""
        if self.meta.get("model_fingerprint") != model_fingerprint(ckpt):
            raise QuantkitError(f"{self.path} holds statistics of another model or shape than {ckpt.path}; "
                                f"run `quantkit stats {ckpt.path} --out FILE` for this one")
        found = {k: (tuple(v), "") for k, v in self.shapes.items()}
        want = stats_check.expected_shapes(ckpt.config, str(ckpt.path), DENSE_LINEARS, GATE_UP, DOWN)
        stats_check.check_tensors(self.path, found, {k: (s, "") for k, (s, _d) in want.items()})

    @property
    def tokens(self) -> int:
        return int(self.meta.get("tokens", 0))

    def has(self, key: str) -> bool:
        return key in self.names

    def get(self, key: str) -> torch.Tensor:
        """One tensor, its values checked (finite floats, non-negative counts)."""
        if key not in self.names:
            raise QuantkitError(f"{self.path} has no {key}")
        try:
            if self._fh is None:
                self._fh = safe_open(str(self.path), "pt")
            t = self._fh.get_tensor(key)
        except (SafetensorError, OSError) as e:
            raise QuantkitError(f"{self.path}: cannot read {key} ({str(e).splitlines()[0][:120]}); "
                                "rerun `quantkit stats`") from None
        return stats_check.check_values(self.path, key, t)

    def check_all(self) -> None:
        """Read every tensor once (one at a time) and check its values: a NaN is refused before a long run."""
        for key in sorted(self.names):
            self.get(key)

    def close(self) -> None:
        self._fh = None

    def routing(self, heldout: bool = False) -> dict[int, torch.Tensor]:
        """Routed-token counts per MoE layer: {layer: int64 [E]}."""
        suffix = "mlp.heldout_routing" if heldout else "mlp.routing"
        out = {}
        for k in self.names:
            if k.endswith(suffix) and k.startswith(f"{LM}layers."):
                out[int(k[len(f"{LM}layers."):].split(".")[0])] = self.get(k)
        return dict(sorted(out.items()))


def routing_coverage(stats: Stats, fraction: float) -> dict[str, float]:
    """How much routed traffic the most-routed `fraction` of (layer, expert) pairs serve: ranked by the
    calibration counts, measured on the calibration tokens (in-sample) and on the held-out tokens
    (what a static placement profile can expect on new text of the same corpus)."""
    cal, held = stats.routing(), stats.routing(heldout=True)
    if not cal:
        raise QuantkitError(f"{stats.path} holds no routing counts (no MoE layer)")
    c = torch.stack([cal[k] for k in sorted(cal)]).flatten().double()
    h = torch.stack([held[k] for k in sorted(held)]).flatten().double() if held else None
    k = max(1, round(fraction * c.numel()))
    top = torch.argsort(c, descending=True, stable=True)[:k]
    out = {"fraction": k / c.numel(), "in_sample": float(c[top].sum() / c.sum())}
    if h is not None and h.sum() > 0:
        out["held_out"] = float(h[top].sum() / h.sum())
    return out
