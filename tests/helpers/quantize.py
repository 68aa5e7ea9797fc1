"""The quantize CLI run in process, and the tensors and config of a quantized folder."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

import quantkit.cli
from quantkit.errors import QuantkitError

runner = CliRunner()


def main_cli(*args: str) -> SimpleNamespace:
    """In process (so monkeypatch applies), mapping a QuantkitError as quantkit.cli.main() does: one
    `error:` line, exit 2. The subprocess tests below go through main() itself."""
    r = runner.invoke(quantkit.cli.app, [str(a) for a in args])
    if isinstance(r.exception, QuantkitError):
        return SimpleNamespace(exit_code=2, output=r.output + f"error: {r.exception}")
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception
    return SimpleNamespace(exit_code=r.exit_code, output=r.output)


def stored(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("model-*.safetensors")):
        out.update(load_file(f))
    return out


def qconfig(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())["quantization_config"]
