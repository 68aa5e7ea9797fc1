"""Validating a statistics file (`quantkit stats`) before any of it is used.

A statistics file is user input like any other: `quantize --stats`, `plan --routing` and `export imatrix`
read it. Before use:
- the safetensors header is checked as a shard's is (offsets within the file, known dtypes, metadata a map
  of strings: quantkit.checkpoint.reader.read_safetensors);
- the metadata's token counts are decimal integers and its `config` a JSON object of a valid model;
- every tensor is one `quantkit stats` writes for that model, with its shape and dtype (a Hessian of another
  size, counts cut short, a tensor of another model are refused by name);
- values, when read (`check_values`): floats finite, counts non-negative. A NaN never reaches GPTQ, an
  imatrix or a report.
Each refusal is one QuantkitError naming the file and the field."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from quantkit.checkpoint.spec import spec_from_config
from quantkit.errors import QuantkitError

COUNT_FIELDS = ("tokens", "heldout_tokens", "chunk_size", "chunk_count", "heldout_chunks", "layers")
MAX_COUNT = 10**15
_FLOAT = ("hessian", "heldout_hessian", "in_sum2")
_INT = ("count", "routing", "heldout_routing")


def check_meta(path: Path, meta: dict[str, str]) -> dict[str, Any] | None:
    """The metadata's counts as decimal integers, and its model config (a JSON object); returns the config
    (None when the file carries none: then its shapes are checked against the model it is used with)."""
    for key in COUNT_FIELDS:
        v = meta.get(key)
        if v is not None and not (v.isdecimal() and v.isascii() and int(v) <= MAX_COUNT):
            raise QuantkitError(f"{path}: metadata {key}={v[:40]!r} is not a token count; rerun `quantkit stats`")
    if "config" not in meta:
        return None
    try:
        config = json.loads(meta["config"])
    except (ValueError, RecursionError):
        config = None
    if not isinstance(config, dict):
        raise QuantkitError(f"{path}: metadata 'config' is not the model's config.json; rerun `quantkit stats`")
    return config


def expected_shapes(config: dict[str, Any], source: str, dense: Sequence[str], gate_up: str,
                    down: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """{tensor name: (shape, torch dtype name)} of every tensor `quantkit stats` writes for this model."""
    spec = spec_from_config(config, source=source, include_mtp=False)
    c = spec.config
    out: dict[str, tuple[tuple[int, ...], str]] = {}

    def per_input(name: str, hess: tuple[int, ...], sum2: tuple[int, ...], count: tuple[int, ...]) -> None:
        out.update({f"{name}.hessian": (hess, "float32"), f"{name}.heldout_hessian": (hess, "float32"),
                    f"{name}.in_sum2": (sum2, "float32"), f"{name}.count": (count, "int64")})

    wanted = tuple(f"{d}.weight" for d in dense)
    for t in spec.tensors:
        if t.name.endswith(wanted):
            per_input(t.name, (t.shape[1], t.shape[1]), (t.shape[1],), (1,))
        elif t.name.endswith(gate_up):
            e, _, h = t.shape
            per_input(t.name, (h, h), (e, h), (e,))
            prefix = t.name[: -len(gate_up)]
            out[f"{prefix}mlp.routing"] = out[f"{prefix}mlp.heldout_routing"] = ((e,), "int64")
        elif t.name.endswith(down):
            e, _, i = t.shape
            per_input(t.name, (e, i, i), (e, i), (e,))
    per_input("lm_head.weight", (c.hidden_size, c.hidden_size), (c.hidden_size,), (1,))
    return out


def check_tensors(path: Path, found: dict[str, tuple[tuple[int, ...], str]],
                  expected: dict[str, tuple[tuple[int, ...], str]]) -> None:
    """Every tensor of the file is one `quantkit stats` writes for the model, with its shape and dtype."""
    for name, (shape, dtype) in sorted(found.items()):
        want = expected.get(name)
        if want is None:
            raise QuantkitError(f"{path}: {name[:120]} is not a statistic of this model; rerun `quantkit stats`")
        if tuple(shape) != want[0] or dtype != want[1]:
            raise QuantkitError(f"{path}: {name} is {dtype} {list(shape)}, the model needs {want[1]} "
                                f"{list(want[0])}; rerun `quantkit stats` on this model")


_NAME = re.compile(r"^(?:lm_head\.weight|model\.language_model\.layers\.\d{1,4}\.[a-z_.0-9]+)"
                   r"\.(?:hessian|heldout_hessian|in_sum2|count|routing|heldout_routing)$")


def check_names(path: Path, names: set[str]) -> None:
    """Every tensor name is one `quantkit stats` writes (a layer index of digits, a known statistic): what
    holds when the file carries no config to check shapes against."""
    for name in sorted(names):
        if not _NAME.match(name):
            raise QuantkitError(f"{path}: {name[:120]} is not a statistic `quantkit stats` writes; rerun it")


def check_values(path: Path, name: str, t: torch.Tensor) -> torch.Tensor:
    """`t` itself when its values are usable: floats finite, counts non-negative."""
    if t.is_floating_point():
        if not bool(torch.isfinite(t).all()):
            raise QuantkitError(f"{path}: {name} holds NaN or infinite values; rerun `quantkit stats`")
    elif bool((t < 0).any()):
        raise QuantkitError(f"{path}: {name} holds negative counts; rerun `quantkit stats`")
    return t
