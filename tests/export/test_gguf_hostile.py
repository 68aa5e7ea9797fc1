"""Hostile GGUF headers for `plan --model` (issue 26): every count, length and dimension a header declares is
bounded before it is walked, and the architecture's keys must be whole numbers in range; each case ends in
one `error:` line naming the file and the key, quickly (none may hang), with nothing planned."""

from __future__ import annotations

import dataclasses
import struct
from pathlib import Path

import pytest

from quantkit.checkpoint.gguf_file import read_gguf
from quantkit.errors import QuantkitError
from quantkit.export.llama_placement import ARCH, model_from_gguf

from helpers.cli import run_cli
from helpers.probe import count, expect_one_line


@pytest.fixture(scope="module")
def good(tiny_model: Path, tmp_path_factory) -> Path:
    from quantkit.export.gguf import export_gguf

    return export_gguf(tiny_model, tmp_path_factory.mktemp("gguf") / "t.gguf", "q8_0").path


def _plan(path: Path, capsys, monkeypatch, needle: str) -> None:
    code, out, err = run_cli(["plan", "--model", path, "--gpu", "rtx4090"], capsys, monkeypatch)
    line = expect_one_line(code, out, err, needle)
    assert path.name in line, line


def _string(s: str) -> bytes:
    return struct.pack("<Q", len(s)) + s.encode()


def _raw_gguf(n_tensors: int, kvs: bytes, n_kv: int, tail: bytes = b"") -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv) + kvs + tail


ARCH_KV = _string("general.architecture") + struct.pack("<I", 8) + _string(ARCH)
RAW = {  # header-level lies: each would make the reader walk (or allocate) without end
    "tensor-count-2^62": (_raw_gguf(2**62, ARCH_KV, 1), "declares"),
    "key-count-2^40": (_raw_gguf(0, ARCH_KV, 2**40), "declares"),
    "array-of-2^40-bytes": (_raw_gguf(0, ARCH_KV + _string("x.arr") + struct.pack("<IIQ", 9, 0, 2**40), 2),
                            "array of"),
    "array-of-2^20-strings-past-the-end": (_raw_gguf(0, ARCH_KV + _string("x.arr") + struct.pack("<IIQ", 9, 8, 2**20),
                                                     2), "past the end"),
    "string-of-2^50-bytes": (_raw_gguf(0, _string("general.architecture") + struct.pack("<IQ", 8, 2**50), 1),
                             "string of"),
    "unknown-value-type": (_raw_gguf(0, _string("k") + struct.pack("<I", 77), 1), "value type"),
    "tensor-of-9-dims": (_raw_gguf(1, ARCH_KV, 1, _string("t") + struct.pack("<I", 9)), "dimensions"),
    "version-99": (b"GGUF" + struct.pack("<IQQ", 99, 0, 0), "version"),
}


@pytest.mark.parametrize("case", sorted(RAW))
def test_header_that_declares_too_much_is_refused_fast(case, tmp_path, capsys, monkeypatch):
    data, needle = RAW[case]
    p = tmp_path / f"{case}.gguf"
    p.write_bytes(data)
    _plan(p, capsys, monkeypatch, needle)


def _tensor_info_pos(path: Path) -> tuple[int, int, int]:
    """(position of the first tensor's first dimension, of its offset field, its number of dims)."""
    import gguf

    t = gguf.GGUFReader(str(path)).tensors[0]
    name_len = len(t.name.encode())
    dims_at = t.field.offset + 8 + name_len + 4
    n_dims = len(t.shape)
    return dims_at, dims_at + 8 * n_dims + 4, n_dims


@pytest.mark.parametrize("what", ["zero-dimension", "unaligned-offset", "dimension-2^50"])
def test_tensor_table_lies_are_refused(what, good, tmp_path, capsys, monkeypatch):
    data = bytearray(good.read_bytes())
    dims_at, off_at, _ = _tensor_info_pos(good)
    if what == "zero-dimension":
        struct.pack_into("<Q", data, dims_at, 0)
    elif what == "dimension-2^50":
        struct.pack_into("<Q", data, dims_at, 2**50)
    else:
        struct.pack_into("<Q", data, off_at, struct.unpack_from("<Q", data, off_at)[0] + 1)
    p = tmp_path / f"{what}.gguf"
    p.write_bytes(bytes(data))
    _plan(p, capsys, monkeypatch, "aligned" if what == "unaligned-offset" else "shape")


def _block_count_at(path: Path) -> int:
    import gguf

    f = gguf.GGUFReader(str(path)).fields[f"{ARCH}.block_count"]
    return int(f.offset) + 8 + len(f.name.encode()) + 4  # key length, key, value type, then the value


@pytest.mark.parametrize("value", [0, 2_000_000_000, 2**32 - 1])
def test_absurd_block_count_in_the_file_is_refused(value, good, tmp_path, capsys, monkeypatch):
    data = bytearray(good.read_bytes())
    struct.pack_into("<I", data, _block_count_at(good), value)
    p = tmp_path / f"blocks-{value}.gguf"
    p.write_bytes(bytes(data))
    _plan(p, capsys, monkeypatch, "block_count")


KEYS = [("block_count", 0), ("block_count", -3), ("block_count", 2.5), ("block_count", 2**62), ("block_count", True),
        ("full_attention_interval", 0), ("full_attention_interval", -4), ("embedding_length", 0),
        ("ssm.state_size", "128"), ("ssm.state_size", 1.5), ("attention.head_count_kv", -2),
        ("attention.recurrent_layers", [1, 0]), ("attention.recurrent_layers", "yes"),
        ("nextn_predict_layers", 4), ("nextn_predict_layers", -1), ("nextn_predict_layers", True)]


@pytest.mark.parametrize("key,value", KEYS, ids=[f"{k}={v!r}" for k, v in KEYS])
def test_architecture_keys_out_of_range_or_of_the_wrong_type_are_refused(key, value, good):
    count()
    info = read_gguf(good)
    meta = dict(info.metadata)
    if key == "full_attention_interval":
        meta.pop(f"{ARCH}.attention.recurrent_layers", None)
    meta[f"{ARCH}.{key}"] = value
    with pytest.raises(QuantkitError, match=key.replace(".", r"\.")) as e:
        model_from_gguf(dataclasses.replace(info, metadata=meta))
    assert "\n" not in str(e.value) and good.name in str(e.value)


def test_the_real_header_passes(good):
    count()
    m = model_from_gguf(read_gguf(good))
    assert m.n_layer == 4 and sum(m.full_attention) == 1


def test_an_imatrix_with_a_chunk_count_of_the_wrong_type_is_refused(tmp_path):
    import gguf
    import numpy as np

    from quantkit.export.gguf_imatrix import load_imatrix

    count()
    p = tmp_path / "im.gguf"
    w = gguf.GGUFWriter(str(p), arch="imatrix")
    w.add_type("imatrix")
    w.add_string("imatrix.chunk_count", "many")
    w.add_tensor("blk.0.attn_q.weight.in_sum2", np.ones((1, 8), dtype=np.float32))
    w.add_tensor("blk.0.attn_q.weight.counts", np.ones((1, 1), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(QuantkitError, match="chunk_count") as e:
        load_imatrix(p, {"blk.0.attn_q.weight": (4, 8)}, [])
    assert "\n" not in str(e.value) and "im.gguf" in str(e.value)


def test_reading_an_imatrix_walks_its_header_with_bounds_first(tmp_path):
    from quantkit.quantize.imatrix import read_imatrix_gguf

    count()
    p = tmp_path / "im.gguf"
    p.write_bytes(RAW["array-of-2^40-bytes"][0])
    with pytest.raises(QuantkitError, match="an array of"):
        read_imatrix_gguf(p)
