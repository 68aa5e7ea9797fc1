"""Shared session fixtures: tiny checkpoints of the real qwen3_5_moe architecture, built once per session.

They are shared by many test files: treat them as read-only (copy a folder before damaging it).
- `tiny_model`: published layout (multimodal config.json, `model.language_model.*`, fused experts,
  3 shards + index), decisive routing (see quantkit.tiny.make_decisive), no MTP, 4 layers
  (3 linear-attention + 1 full), hidden 64, 8 experts, top-2, bf16, trained tokenizer + chat template.
- `tiny_model_transformers_layout`: the SAME weights written by transformers' save_pretrained
  (`model.layers.*`, per-expert experts): its canonical tensors equal `tiny_model`'s.
- `tiny_model_mtp`: published layout with the MTP layer (`mtp.*`, per-expert), not decisive.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

TINY_KW = {"layers": 4, "experts": 8, "top_k": 2, "hidden": 64, "intermediate": 32, "seed": 0}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from quantkit.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "published", decisive=True, **TINY_KW)


@pytest.fixture(scope="session")
def tiny_model_transformers_layout(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Path:
    from quantkit.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "transformers", decisive=True,
                           layout="transformers", **TINY_KW)


@pytest.fixture(scope="session")
def tiny_model_mtp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from quantkit.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "mtp", mtp=True, **TINY_KW)
