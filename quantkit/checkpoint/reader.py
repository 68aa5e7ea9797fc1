"""Reading HF checkpoint folders lazily and safely.

A `Checkpoint` is a folder of safetensors shards (with or without `model.safetensors.index.json`) and a
`config.json`. Headers are parsed here, without loading weights, and checked against the file sizes, so
a truncated shard or a corrupt header is named before any tensor is read. `load` reads weights with plain
file reads (one tensor or one slab of experts at a time); `get` maps them through `safetensors.safe_open`.

Two source layouts are accepted and presented the same way, as CANONICAL tensors (the published names):
- "published": `model.language_model.layers.N.*`, routed experts fused `mlp.experts.gate_up_proj`
  [E, 2I, H] and `mlp.experts.down_proj` [E, H, I];
- "transformers": what `Qwen3_5MoeForCausalLM.save_pretrained` writes: `model.layers.N.*` with experts
  per expert (`mlp.experts.E.{gate,up,down}_proj.weight`); these are fused on the fly by `load`, only for
  the experts asked for, so memory stays bounded.
MTP tensors (`mtp.*`) pass through as stored (per expert, as published).

FP8 sources (F8_E4M3 weights with `weight_scale_inv` block scales, as in Qwen's FP8 releases) are
dequantized to bfloat16 in `load`, block size from `quantization_config.weight_block_size`.

Never unpickles: a folder with only `.bin`/`.pt` weights is refused. Every file an index names must lie
inside the folder (an HF cache snapshot may link into its own repo's `blobs/`).
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from quantkit.checkpoint.contract import INDEX_NAME, is_quantkit_output, quant_method
from quantkit.checkpoint.spec import (
    ModelSpec,
    TensorSpec,
    default_spec,
    layer_of,
    load_config,
    parse_text_config,
    role_of,
    spec_from_config,
)
from quantkit.errors import QuantkitError

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit

# safetensors dtype code -> (torch name, bytes per element)
ST_DTYPES: dict[str, tuple[str, int]] = {
    "BF16": ("bfloat16", 2), "F16": ("float16", 2), "F32": ("float32", 4), "F64": ("float64", 8),
    "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1),
    "I8": ("int8", 1), "U8": ("uint8", 1), "I16": ("int16", 2), "U16": ("uint16", 2),
    "I32": ("int32", 4), "U32": ("uint32", 4), "I64": ("int64", 8), "U64": ("uint64", 8), "BOOL": ("bool", 1),
}
FLOAT_SOURCE_DTYPES = ("bfloat16", "float16", "float32")
FP8_DTYPES = ("float8_e4m3fn",)

_LM = "model.language_model."
_EXPERT_RE = re.compile(r"^(?P<pre>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


@dataclass(frozen=True)
class HeaderEntry:
    """One tensor as a shard header describes it."""

    name: str
    file: Path
    shape: tuple[int, ...]
    dtype: str  # torch name, e.g. "bfloat16"
    start: int  # absolute byte offsets in the file
    end: int


def read_safetensors_header(path: Path) -> dict[str, HeaderEntry]:
    """Parse and validate one shard's header (no weights read). Raises QuantkitError naming the file."""
    return read_safetensors(path)[1]


def read_safetensors(path: Path) -> tuple[dict[str, str], dict[str, HeaderEntry]]:
    """(string metadata, tensors) of a safetensors header, both validated (no weights read): offsets against
    shapes and the file's size, `__metadata__` a map of strings. Raises QuantkitError naming the file."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise QuantkitError(f"{path}: truncated safetensors file ({size} bytes, no header); re-download it")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise QuantkitError(
                    f"{path}: corrupt safetensors header (header length {n} does not fit the {size}-byte file); "
                    "re-download it")
            raw = f.read(n)
    except OSError as e:
        raise QuantkitError(f"{path}: cannot read ({e.strerror})") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):  # RecursionError: nested thousands deep
        raise QuantkitError(f"{path}: corrupt safetensors header (not valid JSON); re-download it") from None
    if not isinstance(header, dict):
        raise QuantkitError(f"{path}: corrupt safetensors header (not a JSON object); re-download it")
    meta = header.get("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise QuantkitError(f"{path}: corrupt safetensors header (__metadata__ is not a map of strings)")
    base = 8 + n
    out: dict[str, HeaderEntry] = {}
    data_end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            code, shape, (s, e) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
            s, e = int(s), int(e)
        except (KeyError, TypeError, ValueError):
            raise QuantkitError(f"{path}: corrupt safetensors header (entry {name!r} is malformed)") from None
        if not isinstance(code, str) or code not in ST_DTYPES:
            raise QuantkitError(f"{path}: tensor {name} has dtype {code}, which quantkit does not read")
        tname, width = ST_DTYPES[code]
        numel = 1
        for d in shape:
            if d < 0:
                raise QuantkitError(f"{path}: corrupt safetensors header (negative dim in {name})")
            numel *= d
        if s < 0 or e < s or e - s != numel * width:
            raise QuantkitError(
                f"{path}: corrupt safetensors header ({name}: offsets {s}..{e} do not match shape {list(shape)} "
                f"of {code})")
        out[name] = HeaderEntry(name, path, shape, tname, base + s, base + e)
        data_end = max(data_end, e)
    spans = sorted((t.start - base, t.end - base) for t in out.values())
    if any(a != b for (_, b), (a, _) in zip([(0, 0), *spans], spans, strict=False)):
        raise QuantkitError(f"{path}: corrupt safetensors header (tensor data offsets overlap or leave gaps); "
                            "re-download it")
    if base + data_end > size:
        raise QuantkitError(
            f"{path}: truncated shard: the header needs {base + data_end} bytes, the file has {size}; "
            "re-download it")
    return meta, out


FileIdentity = tuple[int, int, int, int, int]


def file_identity(path: Path) -> FileIdentity:
    """(size, mtime_ns, ctime_ns, inode, device) of a file: a rewrite in place keeps the size and the inode but
    not the times, a replacement by rename changes the inode, a cut changes the size."""
    st = os.stat(path)
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)


def _allowed_roots(folder: Path) -> list[Path]:
    roots = [folder.resolve()]
    # An HF cache snapshot (models--org--name/snapshots/<rev>/) links its files into the repo's blobs/.
    if folder.parent.name == "snapshots":
        roots.append((folder.parent.parent / "blobs").resolve())
    return roots


def safe_member(folder: Path, rel: str, source: str) -> Path:
    """`folder/rel`, refused when `rel` is absolute, climbs out with `..`, or links outside the folder."""
    if not isinstance(rel, str) or not rel or os.path.isabs(rel) or rel.startswith(("/", "\\")) \
            or re.match(r"^[A-Za-z]:", rel):
        raise QuantkitError(f"{source}: refuses shard path {rel!r}: it must be a file name inside {folder}")
    parts = re.split(r"[\\/]", rel)
    if ".." in parts:
        raise QuantkitError(f"{source}: refuses shard path {rel!r}: '..' would leave {folder}")
    p = folder / rel
    real = p.resolve()
    if not any(real == r or r in real.parents for r in _allowed_roots(folder)):
        raise QuantkitError(f"{source}: refuses shard {rel!r}: it links outside {folder} (to {real})")
    return p


def _refuse_pickles(folder: Path) -> None:
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix.lower() in PICKLE_SUFFIXES and p.is_file())
    if pickles:
        raise QuantkitError(
            f"{folder}: holds only PyTorch pickle weights ({pickles[0]}{', ...' if len(pickles) > 1 else ''}); "
            "quantkit never unpickles (it can run arbitrary code): convert them to safetensors first "
            "(e.g. with transformers: load in a trusted environment and save_pretrained(..., safe_serialization=True))")


def find_shards(folder: Path) -> list[Path]:
    """The shard files of a checkpoint folder (from its index if there is one), validated."""
    index = folder / INDEX_NAME
    if index.is_file():
        data = load_config(index)
        wm = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(wm, dict) or not wm:
            raise QuantkitError(f"{index}: field 'weight_map' is missing or empty")
        files: list[Path] = []
        for rel in dict.fromkeys(wm.values()):
            p = safe_member(folder, rel, str(index))
            if not p.is_file():
                raise QuantkitError(f"{index}: names shard {rel}, which is missing; re-download the checkpoint")
            files.append(p)
        return files
    shards = sorted(p for p in folder.glob("*.safetensors") if p.is_file() or p.is_symlink())
    for p in shards:
        safe_member(folder, p.name, str(folder))
    return shards


def check_finite(name: str, t: torch.Tensor) -> None:
    """Raise a QuantkitError naming `name` if the floating tensor holds NaN or Inf."""
    if not t.is_floating_point() or t.numel() == 0:
        return
    # min and max propagate NaN and carry +-Inf: one vectorized pass, far cheaper on bf16 than
    # isfinite(t).all(), which makes a bool tensor of the whole input; the count is only taken when something is wrong
    if t.element_size() == 1:
        t = t.float()  # torch has no aminmax or isfinite kernels for the 8-bit floats
    if all(bool(torch.isfinite(v)) for v in torch.aminmax(t)):
        return
    raise QuantkitError(f"{name}: {int((~torch.isfinite(t)).sum())} NaN/Inf values in the source weights; the "
                        "checkpoint is damaged")


@dataclass(frozen=True)
class _Fused:
    """A canonical fused expert tensor assembled from per-expert source tensors."""

    kind: str  # "gate_up" or "down"
    sources: tuple[tuple[str, ...], ...]  # per expert: (gate, up) or (down,)


class Checkpoint:
    """A checkpoint folder, read lazily. Open with `Checkpoint.open(path)`."""

    def __init__(self, path: Path, config: dict[str, Any], files: list[Path], tensors: dict[str, HeaderEntry]):
        self.path = path
        self.config = config
        self.files = files
        self._src = tensors
        # each file's identity when it was opened (file_identity), taken before its header was read: a reader
        # that must not mix two versions of a file (the quantizer) compares it again later
        self.identities: dict[Path, FileIdentity] = {}
        self._handles: dict[Path, Any] = {}
        self._canon: dict[str, TensorSpec] | None = None
        self._recipe: dict[str, str | _Fused] = {}
        self.layout = self._detect_layout()
        self.quant_method = quant_method(config)

    # ---- opening ----
    @classmethod
    def open(cls, path: str | Path) -> Checkpoint:
        p = Path(path)
        if p.is_file() and p.suffix == ".safetensors":
            folder, files = p.parent, [p]
        elif p.is_dir():
            folder = p
            files = find_shards(folder)
            if not files:
                _refuse_pickles(folder)
                raise QuantkitError(f"no safetensors in {folder}: pass a checkpoint folder with *.safetensors shards")
        elif p.exists():
            raise QuantkitError(f"{p}: not a checkpoint folder or a .safetensors file")
        else:
            raise QuantkitError(f"{p}: no such file or folder")
        cfg_path = folder / "config.json"
        if not cfg_path.is_file():
            raise QuantkitError(f"{folder}: no config.json beside the safetensors shards")
        config = load_config(cfg_path)
        tensors: dict[str, HeaderEntry] = {}
        identities: dict[Path, FileIdentity] = {}
        for f in files:
            try:
                identities[f] = file_identity(f)
            except OSError as e:
                raise QuantkitError(f"{f}: cannot read ({e.strerror})") from None
            for name, st in read_safetensors_header(f).items():
                if name in tensors:
                    raise QuantkitError(f"{f}: tensor {name} is also in {tensors[name].file.name}")
                tensors[name] = st
        index = folder / INDEX_NAME
        if index.is_file() and len(files) > 0 and not (p.is_file()):
            wm = load_config(index)["weight_map"]
            for name, rel in wm.items():
                st = tensors.get(name)
                if st is None or st.file.name != Path(rel).name:
                    raise QuantkitError(f"{index}: names {name} in {rel}, but that shard does not hold it")
        if not tensors:
            raise QuantkitError(f"no tensors in the safetensors of {folder}")
        ckpt = cls(folder, config, files, tensors)
        ckpt.identities = identities
        return ckpt

    def _detect_layout(self) -> str:
        names = self._src.keys()
        if any(n.startswith(_LM) for n in names):
            return "published"
        if any(n.startswith("model.layers.") or n.startswith("model.embed_tokens.") for n in names):
            return "transformers"
        return "published"

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- source tensors ----
    def names(self) -> list[str]:
        """Source tensor names, in file order."""
        return list(self._src)

    def header(self, name: str) -> tuple[tuple[int, ...], str]:
        """(shape, torch dtype name) of a source tensor, from the header."""
        st = self._source(name)
        return st.shape, st.dtype

    def _source(self, name: str) -> HeaderEntry:
        try:
            return self._src[name]
        except KeyError:
            raise QuantkitError(f"{self.path}: no tensor named {name}") from None

    def _handle(self, file: Path) -> Any:
        h = self._handles.get(file)
        if h is None:
            from safetensors import safe_open

            try:
                h = safe_open(str(file), framework="pt", device="cpu")
            except Exception as e:  # safetensors raises its own SafetensorError
                raise QuantkitError(f"{file}: cannot open as safetensors ({e})") from None
            self._handles[file] = h
        return h

    def read(self, name: str, rows: slice | None = None, drop_cache: bool = False) -> torch.Tensor:
        """A source tensor as stored, read with plain file reads into fresh memory (a slab of dim 0 with `rows`).
        Unlike `get` (safetensors' memory map), no page of the file stays mapped into this process, so its RSS
        counts each weight once; `drop_cache` also tells the kernel the file's pages are not needed again
        (POSIX_FADV_DONTNEED): a loader that copies a folder the size of RAM does not hold it twice."""
        st = self._source(name)
        dtype = getattr(torch, st.dtype)
        shape = tuple(st.shape)
        start, n = st.start, st.end - st.start
        if rows is not None:
            lo, hi, _ = rows.indices(shape[0])
            row = n // shape[0] if shape and shape[0] else 0
            start, n, shape = start + lo * row, max(hi - lo, 0) * row, (max(hi - lo, 0), *shape[1:])
        out = torch.empty(shape, dtype=dtype)
        if not n:
            return out
        buf = memoryview(out.view(-1).view(torch.uint8).numpy())
        try:
            fd = os.open(st.file, os.O_RDONLY)
        except OSError as e:
            raise QuantkitError(f"{st.file}: cannot read ({e.strerror})") from None
        try:
            got = 0
            while got < n:
                k = os.preadv(fd, [buf[got:]], start + got)
                if not k:
                    raise QuantkitError(f"{st.file}: truncated while reading {name} (the file changed)")
                got += k
            if drop_cache and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, start, n, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        return out

    def get(self, name: str, rows: slice | None = None) -> torch.Tensor:
        """A source tensor as stored (no conversion); `rows` reads only that slab of dim 0 from disk."""
        st = self._source(name)
        if rows is None:
            return self._handle(st.file).get_tensor(name)
        return self._handle(st.file).get_slice(name)[rows.start:rows.stop]

    # ---- canonical view ----
    def _canonical_name(self, name: str) -> str:
        if self.layout == "transformers" and name.startswith("model.") and not name.startswith(
                (_LM, "model.visual.", "model.vision_tower.")):
            return _LM + name[len("model."):]
        return name

    def canonical(self) -> list[TensorSpec]:
        """Every tensor under its published name, routed experts fused; FP8 weights listed as bfloat16."""
        if self._canon is None:
            self._canon = self._build_canonical()
        return list(self._canon.values())

    def _build_canonical(self) -> dict[str, TensorSpec]:
        scales = {n for n in self._src if n.endswith("_scale_inv")}
        entries: dict[str, tuple[tuple[int, ...], str]] = {}
        groups: dict[str, dict[int, dict[str, str]]] = {}
        for name, st in self._src.items():
            if name in scales:
                continue
            self._check_dtype(name, st)
            dtype = "bfloat16" if st.dtype in FP8_DTYPES else st.dtype
            cname = self._canonical_name(name)
            m = _EXPERT_RE.match(cname)
            if m and not cname.startswith("mtp."):
                groups.setdefault(m["pre"], {}).setdefault(int(m["e"]), {})[m["proj"]] = name
                continue
            entries[cname] = (st.shape, dtype)
            self._recipe[cname] = name
        for pre, experts in groups.items():
            n = len(experts)
            if sorted(experts) != list(range(n)) or any(len(v) != 3 for v in experts.values()):
                raise QuantkitError(f"{self.path}: the per-expert tensors of {pre} are incomplete "
                                    f"(experts 0..{n - 1} each need gate_proj, up_proj and down_proj)")
            g0, u0, d0 = (self._src[experts[0][k]] for k in ("gate_proj", "up_proj", "down_proj"))
            for parts in experts.values():
                for k, ref in (("gate_proj", g0), ("up_proj", u0), ("down_proj", d0)):
                    st = self._src[parts[k]]
                    if st.shape != ref.shape or st.dtype != ref.dtype:
                        raise QuantkitError(f"{self.path}: {parts[k]} has shape {list(st.shape)} {st.dtype}, "
                                            f"expert 0 has {list(ref.shape)} {ref.dtype}")
            if g0.shape != u0.shape or len(g0.shape) != 2 or d0.shape != (g0.shape[1], g0.shape[0]):
                raise QuantkitError(f"{self.path}: {pre} gate/up/down shapes do not fit together")
            dt = "bfloat16" if g0.dtype in FP8_DTYPES else g0.dtype
            i, h = g0.shape
            gu, dn = f"{pre}.gate_up_proj", f"{pre}.down_proj"
            entries[gu] = ((n, 2 * i, h), dt)
            entries[dn] = ((n, h, i), dt)
            self._recipe[gu] = _Fused("gate_up", tuple((experts[e]["gate_proj"], experts[e]["up_proj"])
                                                       for e in range(n)))
            self._recipe[dn] = _Fused("down", tuple((experts[e]["down_proj"],) for e in range(n)))
        order = self._config_order()
        keyed = sorted(enumerate(entries), key=lambda it: (order.get(it[1], len(order) + it[0])))
        return {n: TensorSpec(n, entries[n][0], entries[n][1], role_of(n), layer_of(n)) for _, n in keyed}

    def _config_order(self) -> dict[str, int]:
        try:
            ref = spec_from_config(self.config, source=str(self.path / "config.json"))
        except QuantkitError:
            return {}
        return {t.name: i for i, t in enumerate(ref.tensors)}

    def _check_dtype(self, name: str, st: HeaderEntry) -> None:
        if st.dtype in FLOAT_SOURCE_DTYPES:
            return
        if st.dtype in FP8_DTYPES:
            if self._scale_name(name) not in self._src:
                raise QuantkitError(f"{st.file}: {name} is FP8 ({st.dtype}) without a {name}_scale_inv block "
                                    "scale; quantkit cannot dequantize it: use the bf16 checkpoint")
            self._fp8_block()
            return
        if self.quant_method:
            raise QuantkitError(f"{self.path}: already quantized (quantization_config.quant_method="
                                f"{self.quant_method!r}; {name} is {st.dtype}); quantize the bf16 checkpoint instead")
        raise QuantkitError(f"{st.file}: {name} has dtype {st.dtype}; quantkit reads bfloat16, float16, "
                            "float32 or block-scaled FP8 source weights")

    @staticmethod
    def _scale_name(name: str) -> str:
        return name + "_scale_inv"

    def _fp8_block(self) -> tuple[int, int]:
        qc = self.config.get("quantization_config") or {}
        blk = qc.get("weight_block_size") if isinstance(qc, dict) else None
        if not (isinstance(blk, list) and len(blk) == 2 and all(isinstance(b, int) and b > 0 for b in blk)):
            raise QuantkitError(f"{self.path / 'config.json'}: FP8 weights need "
                                "quantization_config.weight_block_size [rows, cols]; it is missing or malformed")
        return blk[0], blk[1]

    def _dequant_fp8(self, name: str, w: torch.Tensor, rows: slice | None) -> torch.Tensor:
        b0, b1 = self._fp8_block()
        s = self.read(self._scale_name(name), rows).float()
        out, inn = w.shape[-2], w.shape[-1]
        want = (-(-out // b0), -(-inn // b1))
        if tuple(s.shape[-2:]) != want or s.shape[:-2] != w.shape[:-2]:
            raise QuantkitError(f"{self.path}: {name}_scale_inv has shape {list(s.shape)}, expected "
                                f"{list(w.shape[:-2]) + list(want)} for block size [{b0}, {b1}]")
        full = s.repeat_interleave(b0, dim=-2)[..., :out, :].repeat_interleave(b1, dim=-1)[..., :inn]
        return (w.float() * full).to(torch.bfloat16)

    def _read(self, src: str, rows: slice | None = None) -> torch.Tensor:
        # plain reads, not the memory map of `get`: a file cut short while it is read is one line naming it
        # (a short read), where a mapped page past the new end kills the process with SIGBUS
        w = self.read(src, rows)
        if w.dtype in (torch.float8_e4m3fn,):
            w = self._dequant_fp8(src, w, rows)
        return w

    def load(self, canonical_name: str, experts: slice | None = None) -> torch.Tensor:
        """The canonical tensor `canonical_name`; for a fused expert tensor, `experts` selects a slab."""
        if self._canon is None:
            self._canon = self._build_canonical()
        spec = self._canon.get(canonical_name)
        if spec is None:
            raise QuantkitError(f"{self.path}: no tensor named {canonical_name}")
        rec = self._recipe[canonical_name]
        rows = None
        if experts is not None:
            if len(spec.shape) != 3:
                raise QuantkitError(f"{canonical_name}: not a stack of experts; cannot take an expert slice")
            start, stop, step = experts.indices(spec.shape[0])
            if step != 1:
                raise QuantkitError(f"{canonical_name}: expert slices must be contiguous")
            rows = slice(start, max(start, stop))
        if isinstance(rec, str):
            return self._read(rec, rows)
        ids = range(spec.shape[0]) if rows is None else range(rows.start, rows.stop)
        out = torch.empty((len(ids), *spec.shape[1:]), dtype=getattr(torch, spec.dtype))
        for j, e in enumerate(ids):
            srcs = rec.sources[e]
            if rec.kind == "gate_up":
                i = spec.shape[1] // 2
                out[j, :i] = self._read(srcs[0])
                out[j, i:] = self._read(srcs[1])
            else:
                out[j] = self._read(srcs[0])
        return out

    def spec(self) -> ModelSpec:
        """The exact spec (canonical names, shapes and dtypes from the headers)."""
        c = parse_text_config(self.config, str(self.path / "config.json"))
        return ModelSpec(name=self.path.name, config=c, tensors=self.canonical(), raw_config=self.config,
                         exact=True)


# ---- model ids and the HF cache ----
_HF_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def hf_cache_dir() -> str:
    """The HF hub cache, read from the environment at call time (huggingface_hub reads it at import)."""
    env = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if env:
        return env
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


GGUF_MAGIC = b"GGUF"


def refuse_gguf(path: str | Path) -> None:
    """One line for a GGUF file given as a model (by its name or its first bytes): what quantkit runs instead,
    how to get it, and how the file runs as it is. Every model path the CLI takes, and `resolve_model`, pass
    here first."""
    p = Path(path).expanduser()
    if not p.is_file():
        return
    if p.suffix.lower() != ".gguf":
        try:
            with open(p, "rb") as f:
                if f.read(len(GGUF_MAGIC)) != GGUF_MAGIC:
                    return
        except OSError:
            return
    raise QuantkitError(
        f"{p} is a GGUF file; quantkit runs safetensors checkpoint folders (the bf16 release, or an FP8 one), "
        "fetched with `hf download Qwen/Qwen-AgentWorld-35B-A3B --local-dir DIR`; this file runs as it is with "
        f"`llama-server -m {p}` (`quantkit plan --model {p} --export llama.cpp` sizes that line for your GPUs)")


def resolve_model(path_or_id: str | Path) -> Path:
    """A local folder/file as is, or an HF model id resolved from the local HF cache (never the network)."""
    p = Path(path_or_id).expanduser()
    refuse_gguf(p)
    if p.exists():
        return p
    text = str(path_or_id)
    if not _HF_ID_RE.match(text):
        raise QuantkitError(f"{text}: no such file or folder (and not an HF model id like org/name)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        snap = snapshot_download(text, cache_dir=hf_cache_dir(), local_files_only=True)
    except (LocalEntryNotFoundError, HFValidationError, FileNotFoundError, OSError, ValueError):
        raise QuantkitError(f"{text}: not in the local HF cache; download it with `hf download {text}` "
                            "or pass a folder") from None
    return Path(snap)


def spec_from_path(path_or_id: str | Path | None) -> ModelSpec:
    """None: the embedded default; a config.json: from config; a folder with safetensors: exact from the
    headers; a folder with only config.json, or a quantkit output: from config. HF ids resolve from the
    local cache."""
    if path_or_id is None or str(path_or_id) == "":
        return default_spec()
    p = resolve_model(path_or_id)
    if p.exists() and not p.is_dir():  # a config.json; any other file (a device too) is read with a bound
        if p.suffix == ".safetensors":
            return Checkpoint.open(p).spec()
        return spec_from_config(load_config(p), name=p.parent.name or "model", source=str(p))
    if find_shards(p) and not is_quantkit_output(p):
        return Checkpoint.open(p).spec()
    if (p / "config.json").is_file():  # a quantkit output has the model's shapes in its config
        return spec_from_config(load_config(p / "config.json"), name=p.name, source=str(p / "config.json"))
    _refuse_pickles(p)
    raise QuantkitError(f"no safetensors in {p}: pass a checkpoint folder, a config.json or a cached HF id")
