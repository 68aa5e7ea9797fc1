"""The disk prompt cache's tests (tests/runtime/test_prompt_cache_*.py): a log-like prompt, a runtime with a
disk cache, a greedy run and its cold reference, the entry files of a folder, and an entry's header rewritten
as a hand (or an attacker) would."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from quantkit.runtime import SamplingParams, load_model, prompt_disk

SP = SamplingParams(temperature=0, max_new_tokens=6)


def text(lines: int, last: str = "the end") -> str:
    return "\n".join(f"log {i:03d}: worker {i % 7} wrote {i * 37 % 101} rows" for i in range(lines)) + "\n" + last


def fresh(model: Path, disk: Path | str | None = None, disk_bytes: int | None = 1 << 30, warn=None,
          memory: int = 1 << 28):
    rt = load_model(model, recipe="bf16")
    rt.set_prompt_cache(memory, disk, disk_bytes if disk is not None else None, warn)
    return rt


def run(rt, ids: list[int]) -> tuple[list[int], int]:
    resp = None
    for e in rt.generate_ids(ids, SP):
        resp = e.response or resp
    return resp.token_ids, resp.cached_tokens


def cold(model: Path, ids: list[int]) -> list[int]:
    return run(fresh(model, memory=0), ids)[0]


def entries(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if prompt_disk.NAME.match(p.name))


def read_header(data: bytes) -> tuple[dict[str, Any], bytes]:
    """(the safetensors header of an entry's bytes, the tensor bytes after it)."""
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n]), data[8 + n:]


def with_header(header: dict[str, Any], rest: bytes) -> bytes:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw + rest
