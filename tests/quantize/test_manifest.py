"""Manifest, journal, atomic writes and the streaming shard writer (against safetensors itself)."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from quantkit.errors import QuantkitError
from quantkit.fileio import atomic_write_json, temp_name
from quantkit.quantize.manifest import (
    JOURNAL_NAME,
    FileEntry,
    Journal,
    Manifest,
    check_file,
    file_entry,
    sha256_file,
)
from quantkit.quantize.shards import ShardLayout, ShardWriter, TensorLayout, read_header

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.uint8, torch.int8, torch.int32]


def _rand(shape, dtype, g):
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000) + 1, shape, generator=g, dtype=torch.int64).to(dtype)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(1, 5), min_size=1, max_size=3)),
                min_size=1, max_size=6), st.integers(0, 2**31 - 1))
def test_shard_writer_is_byte_identical_to_safetensors(tmp_path_factory, specs, seed):
    g = torch.Generator().manual_seed(seed)
    tensors = {f"t{i}.part": _rand(tuple(shape), dt, g) for i, (dt, shape) in enumerate(specs)}
    d = tmp_path_factory.mktemp("st")
    ours, theirs = d / "ours.safetensors", d / "theirs.safetensors"
    layout = ShardLayout([TensorLayout(k, tuple(v.shape), v.dtype) for k, v in tensors.items()])
    with ShardWriter(ours, layout) as w:
        for k, v in tensors.items():  # write along dim 0 in two pieces where possible
            cut = v.shape[0] // 2
            w.write(k, v[cut:], cut)
            w.write(k, v[:cut], 0)
        w.commit()
    save_file(tensors, theirs, metadata={"format": "pt"})
    assert ours.read_bytes() == theirs.read_bytes()
    back = load_file(ours)
    assert all(torch.equal(back[k], v) for k, v in tensors.items())
    assert not temp_name(ours).exists()


def test_shard_writer_refuses_incomplete_and_cleans_up(tmp_path):
    layout = ShardLayout([TensorLayout("a", (4, 2), torch.float32), TensorLayout("b", (3,), torch.bfloat16)])
    p = tmp_path / "s.safetensors"
    with pytest.raises(QuantkitError, match="got 0 of"):
        with ShardWriter(p, layout) as w:
            w.write("a", torch.zeros(4, 2))
            w.commit()
    assert not p.exists() and not temp_name(p).exists()
    with pytest.raises(QuantkitError, match="layout says"):
        with ShardWriter(p, layout) as w:
            w.write("a", torch.zeros(4, 2, dtype=torch.float16))
    with pytest.raises(KeyboardInterrupt):
        with ShardWriter(p, layout) as w:
            w.write("a", torch.zeros(4, 2))
            raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []


def test_read_header_names_corrupt_and_truncated(tmp_path):
    p = tmp_path / "m.safetensors"
    save_file({"x": torch.ones(100)}, p)
    assert set(read_header(p)) == {"x"}
    data = p.read_bytes()
    (tmp_path / "trunc.safetensors").write_bytes(data[:-10])
    with pytest.raises(QuantkitError, match="trunc.safetensors: truncated"):
        read_header(tmp_path / "trunc.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(data[:8] + b"\xff" * (len(data) - 8))
    with pytest.raises(QuantkitError, match="junk.safetensors: corrupt safetensors header"):
        read_header(tmp_path / "junk.safetensors")
    (tmp_path / "huge.safetensors").write_bytes((10**12).to_bytes(8, "little") + b"{}")
    with pytest.raises(QuantkitError, match="corrupt safetensors header"):
        read_header(tmp_path / "huge.safetensors")


def test_atomic_json_and_sha256(tmp_path):
    p = tmp_path / "a.json"
    atomic_write_json(p, {"k": [1, 2]})
    assert json.loads(p.read_text()) == {"k": [1, 2]}
    assert not temp_name(p).exists()
    blob = tmp_path / "blob"
    blob.write_bytes(bytes(range(256)) * 70000)  # > one 8 MiB read
    assert sha256_file(blob) == hashlib.sha256(blob.read_bytes()).hexdigest()


def test_check_file_names_each_problem(tmp_path):
    f = tmp_path / "model-00001-of-00001.safetensors"
    f.write_bytes(b"x" * 1000)
    e = file_entry(f)
    assert check_file(tmp_path, f.name, e) is None
    f.write_bytes(b"x" * 999 + b"y")
    assert "altered" in check_file(tmp_path, f.name, e)
    assert check_file(tmp_path, f.name, e, hash_it=False) is None
    f.write_bytes(b"x" * 10)
    assert "truncated" in check_file(tmp_path, f.name, e)
    f.unlink()
    assert check_file(tmp_path, f.name, e) == f"{f.name}: missing"


def test_manifest_and_journal_round_trip(tmp_path):
    m = Manifest({"s1": FileEntry(3, "ab")}, {"config.json": FileEntry(2, "cd")}, {"path": "/x"}, {"o": 1})
    m.write(tmp_path)
    back = Manifest.read(tmp_path)
    assert back.shards == m.shards and back.files == m.files and back.options == {"o": 1}
    j = Journal("key", {"s1": FileEntry(3, "ab")}, {"s1": [{"name": "t"}]})
    j.save(tmp_path)
    jb = Journal.load(tmp_path)
    assert (jb.key, jb.done, jb.stats) == ("key", j.done, j.stats)
    (tmp_path / JOURNAL_NAME).write_text("[1, 2]")
    with pytest.raises(QuantkitError, match="malformed progress journal"):
        Journal.load(tmp_path)
    with pytest.raises(QuantkitError, match="no quantkit-manifest.json"):
        Manifest.read(tmp_path / "nowhere")
