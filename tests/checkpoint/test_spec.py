"""The spec: config-derived vs transformers' own model (meta device) vs safetensors headers."""

from __future__ import annotations

import json
import shutil
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from quantkit.checkpoint.reader import Checkpoint, spec_from_path
from quantkit.checkpoint.spec import (
    Role,
    default_config_path,
    default_spec,
    load_config,
    role_of,
    spec_from_config,
)


def _published(name: str) -> str:
    return "model.language_model." + name[len("model."):] if name.startswith("model.") else name


@pytest.fixture(scope="module")
def meta_model():
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    tc = load_config(default_config_path())["text_config"]
    cfg = Qwen3_5MoeTextConfig(**{k: v for k, v in tc.items() if k != "model_type"})
    with torch.device("meta"):
        return Qwen3_5MoeForCausalLM(cfg)


def test_default_spec_matches_transformers_meta_model_tensor_by_tensor(meta_model) -> None:
    spec = default_spec()
    ours = {t.name: t.shape for t in spec.tensors if t.role != Role.MTP}
    theirs = {_published(n): tuple(p.shape) for n, p in meta_model.state_dict().items()}
    assert ours == theirs  # every name and shape, fused experts included (transformers keeps them fused in memory)


def test_param_counts_per_role_and_total_match_transformers(meta_model) -> None:
    spec = default_spec()
    theirs: dict[Role, int] = defaultdict(int)
    for n, p in meta_model.state_dict().items():
        theirs[role_of(_published(n))] += p.numel()
    ours = {r: v for r, v in spec.params_by_role().items() if r != Role.MTP}
    assert ours == dict(theirs)
    total = sum(p.numel() for p in meta_model.parameters())
    assert spec.text_params == total
    assert round(total / 1e9, 2) == 34.66
    assert round(ours[Role.ROUTED_EXPERT] / 1e9, 3) == 32.212
    assert 2.9e9 < spec.active_params_per_token < 3.1e9  # "A3B": about 3B active per token
    assert 0.7e9 < spec.params_by_role()[Role.MTP] < 0.9e9  # the MTP layer adds about 0.8B


def test_exact_spec_from_headers_equals_config_spec(tiny_model: Path, tiny_model_mtp: Path,
                                                    tiny_model_transformers_layout: Path) -> None:
    for folder in (tiny_model, tiny_model_mtp, tiny_model_transformers_layout):
        exact = spec_from_path(str(folder))
        derived = spec_from_config(load_config(folder / "config.json"))
        assert exact.exact and not derived.exact
        assert [(t.name, t.shape, t.role) for t in exact.tensors] == \
            [(t.name, t.shape, t.role) for t in derived.tensors]
        assert {t.dtype for t in exact.tensors} == {"bfloat16"}
        assert exact.total_params == derived.total_params
    mtp = spec_from_path(str(tiny_model_mtp))
    assert any(t.name == "mtp.layers.0.mlp.experts.0.gate_proj.weight" for t in mtp.tensors)


def test_exact_spec_reports_real_dtypes(tiny_model: Path, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    ck = Checkpoint.open(tiny_model)
    folder = tmp_path / "f32"
    folder.mkdir()
    shutil.copy(tiny_model / "config.json", folder / "config.json")
    save_file({t.name: ck.load(t.name).float() for t in ck.canonical()}, str(folder / "model.safetensors"))
    spec = spec_from_path(str(folder))
    assert {t.dtype for t in spec.tensors} == {"float32"}
    assert spec.bytes_by_role()[Role.ROUTED_EXPERT] == 2 * spec_from_path(str(tiny_model)).bytes_by_role()[
        Role.ROUTED_EXPERT]


def test_spec_from_path_sources(tiny_model: Path, tmp_path: Path) -> None:
    assert spec_from_path(None).total_params == default_spec().total_params
    cfg_only = tmp_path / "cfg"
    cfg_only.mkdir()
    shutil.copy(tiny_model / "config.json", cfg_only / "config.json")
    from_dir = spec_from_path(str(cfg_only))
    from_file = spec_from_path(str(cfg_only / "config.json"))
    assert not from_dir.exact and not from_file.exact
    assert [t.name for t in from_dir.tensors] == [t.name for t in from_file.tensors]
    # a bare qwen3_5_moe_text config (transformers' layout) gives the same published-name spec
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(load_config(tiny_model / "config.json")["text_config"]))
    assert [t.name for t in spec_from_path(str(bare)).tensors] == [t.name for t in from_dir.tensors]
