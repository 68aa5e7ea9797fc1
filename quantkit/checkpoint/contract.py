"""The on-disk contract of a quantkit output folder, in one place: its file names, the quantization method name
and version written into `config.json["quantization_config"]`, and how that entry is read back.

A quantkit folder is a Hugging Face folder (config.json, model.safetensors.index.json, shards) whose
`quantization_config` has `quant_method == "quantkit"`, a `version` this code knows, the recipe, and a
`tensors` table: per quantized tensor its format spec, original shape and dtype. Each quantized tensor N is
stored as its format's parts `N.<suffix>` (quantkit/formats). The manifest (sha256 per shard) and the
resume journal sit beside them. Every reader (the runtime loader, verify, both exporters, the planner) and
the writer (quantize) take these names from here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from quantkit.errors import QuantkitError
from quantkit.fileio import read_json_bounded

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
MANIFEST_NAME = "quantkit-manifest.json"
JOURNAL_NAME = ".quantkit-progress.json"
MANIFEST_VERSION = 1
QUANT_METHOD = "quantkit"
QUANT_VERSION = 1
KNOWN_QUANT_VERSIONS = (QUANT_VERSION,)


def quant_method(config: Any) -> str | None:
    """`quantization_config.quant_method` of a parsed config.json, or None when there is none."""
    qc = config.get("quantization_config") if isinstance(config, dict) else None
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    return method if isinstance(method, str) else None


def read_quant_config(folder: Path, config: dict[str, Any]) -> dict[str, Any] | None:
    """The quantkit `quantization_config` of `folder`'s config, or None for a folder quantkit did not quantize.
    Refuses an unknown version and a missing `tensors` table."""
    if quant_method(config) != QUANT_METHOD:
        return None
    qc = config["quantization_config"]
    v = qc.get("version")
    if v not in KNOWN_QUANT_VERSIONS:
        raise QuantkitError(
            f"{folder / CONFIG_NAME}: quantization_config version {v!r} is unknown to this quantkit (it reads "
            f"{', '.join(map(str, KNOWN_QUANT_VERSIONS))}); upgrade quantkit or quantize the model again")
    if not isinstance(qc.get("tensors"), dict):
        raise QuantkitError(f"{folder / CONFIG_NAME}: quantization_config has no 'tensors' table")
    return qc


def is_quantkit_output(folder: Path) -> bool:
    """Whether `folder` was written by `quantkit quantize` (its tensors are codes and scales): a yes/no look at
    config.json that never raises."""
    try:
        config = read_json_bounded(folder / CONFIG_NAME, "config")
    except QuantkitError:
        return False
    return quant_method(config) == QUANT_METHOD


def holds_quantize_run(folder: Path) -> bool:
    """Whether `folder` holds a `quantkit quantize` run, finished (manifest) or under way (journal)."""
    return (folder / MANIFEST_NAME).is_file() or (folder / JOURNAL_NAME).is_file()
