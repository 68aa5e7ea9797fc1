"""`quantkit verify DIR`: a quantized folder against its manifest, its index and its config."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quantkit.checkpoint.contract import INDEX_NAME, QUANT_METHOD, quant_method
from quantkit.checkpoint.spec import spec_from_config
from quantkit.errors import QuantkitError
from quantkit.formats import QuantSpec
from quantkit.quantize.manifest import Manifest, check_file, read_json
from quantkit.quantize.run import part_layouts
from quantkit.quantize.shards import ST_DTYPES, read_header


@dataclass
class VerifyResult:
    folder: Path
    problems: list[str] = field(default_factory=list)
    shards: int = 0
    tensors: int = 0
    quantized: int = 0
    bytes: int = 0
    formats: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_folder(folder: Path, hash_files: bool = True, progress: Any = None) -> VerifyResult:
    """Check every file against the manifest (size, sha256), the index against the shards' headers and
    config.json's quantization_config against the stored tensors. Problems are collected, not raised,
    except when the folder is not a quantkit output at all."""
    folder = Path(folder)
    if not folder.is_dir():
        raise QuantkitError(f"{folder}: not a folder")
    man = Manifest.read(folder)
    res = VerifyResult(folder)
    for name, entry in sorted({**man.shards, **man.files}.items()):
        p = check_file(folder, name, entry, hash_files, progress)
        if p:
            res.problems.append(p)
        else:
            res.bytes += entry.size
    res.shards = len(man.shards)
    if res.problems:
        return res  # headers of broken files are not worth reading

    index = read_json(folder / INDEX_NAME, "index")
    wmap = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wmap, dict):
        res.problems.append(f"{INDEX_NAME}: no weight_map")
        return res
    stored: dict[str, dict] = {}
    for sn in sorted(set(wmap.values()) | set(man.shards)):
        if sn not in man.shards:
            res.problems.append(f"{INDEX_NAME}: names shard {sn}, which the manifest does not list")
            continue
        try:
            hdr = read_header(folder / sn)
        except QuantkitError as e:
            res.problems.append(str(e))
            continue
        for k, v in hdr.items():
            if wmap.get(k) != sn:
                res.problems.append(f"{sn}: holds {k}, which the index places in {wmap.get(k)}")
            stored[k] = v
    for k, sn in wmap.items():
        if k not in stored and sn in man.shards:
            res.problems.append(f"{INDEX_NAME}: {k} is mapped to {sn} but that shard does not hold it")
    res.tensors = len(stored)

    cfg = read_json(folder / "config.json", "config.json")
    qc = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    if quant_method(cfg) != QUANT_METHOD or not isinstance(qc.get("tensors"), dict):
        res.problems.append("config.json: no quantkit quantization_config")
        return res
    claimed: set[str] = set()
    for name, d in qc["tensors"].items():
        try:
            spec = QuantSpec.from_dict(d)
            shape = tuple(int(x) for x in d["shape"])
            parts = part_layouts(name, spec, shape)
        except (KeyError, TypeError, ValueError, QuantkitError) as e:
            res.problems.append(f"config.json: quantization_config entry {name} is malformed ({e})")
            continue
        res.quantized += 1
        res.formats[spec.format] = res.formats.get(spec.format, 0) + 1
        if name in stored:
            res.problems.append(f"{name}: stored unquantized but quantization_config lists it as {spec.format}")
        for p in parts:
            claimed.add(p.name)
            got = stored.get(p.name)
            if got is None:
                res.problems.append(f"{p.name}: missing ({spec.format} part of {name})")
            elif got["dtype"] != ST_DTYPES[p.dtype] or tuple(got["shape"]) != p.shape:
                res.problems.append(
                    f"{p.name}: stored {got['dtype']} {tuple(got['shape'])}, {spec.format} of {list(shape)} "
                    f"needs {ST_DTYPES[p.dtype]} {p.shape}"
                )
    prefixes = set(qc["tensors"])
    for k in stored:
        if k not in claimed and k.rsplit(".", 1)[0] in prefixes:
            res.problems.append(f"{k}: an extra part of quantized tensor {k.rsplit('.', 1)[0]}")
    # Every tensor the config implies is there, quantized or not.
    try:
        spec = spec_from_config(cfg, source=str(folder / "config.json"))
    except QuantkitError as e:
        res.problems.append(str(e))
        return res
    missing = [t.name for t in spec.tensors if t.name not in stored and t.name not in prefixes]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        res.problems.append(f"{missing[0]}{more}: missing, though config.json describes them")
    return res
