"""`python -m benchmarks.full_size_agents [--workdir DIR]`: the agent-rollout load (`quantkit bench serve --agents`)
on the whole 35B shape, quantkit alone.

1. The folder: `quantkit tiny-model --full-size --quantized quality` (random weights in the stored format, the
   published shape with its MTP layer), once per workdir.
2. The real Qwen3.5 tokenizer put in (quantkit.testing.qwen_tokenizer, the 248,320 rows given text, as the 4-layer
   bench checkpoint carries it): the agents' texts then tokenize as they would on the real model, not into the
   fixture tokenizer's bytes. config.json and generation_config.json take the tokenizer's special ids and the
   manifest the new files' sizes and hashes (`quantkit verify` passes).
3. `quantkit bench serve --agents N --turns T --model FOLDER --reports REPORTS`: each agent a T-turn rollout over
   the shared tool prompt and its own history, streamed; total tok/s, first-token p50/p95, prompt tokens reused.
Writes REPORTS/bench-serve-agents.{json} and a section of REPORTS/bench-serve.md (default reports/full-size-agents,
apart from the 4-layer runs in reports/).
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import typer

from benchmarks.cli import child_env, run_command, shared
from quantkit.quantize.manifest import sha256_file

FOLDER = "qwen-agentworld-35b-a3b-quality-qwen-vocab"
DONE = "qwen-tokenizer.done"  # written last: a folder without it is made again


def qwen_tokenizer_into(folder: Path) -> None:
    """The real tokenizer and its special ids into a generated full-size folder, the manifest kept true."""
    from quantkit.fileio import atomic_write_json
    from quantkit.testing.qwen_tokenizer import VOCAB, special_ids, write_qwen_tokenizer

    ids = special_ids()
    write_qwen_tokenizer(folder, VOCAB)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["text_config"]["eos_token_id"] = ids["<|endoftext|>"]
    for key, tok in (("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
                     ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>")):
        cfg[key] = ids[tok]
    atomic_write_json(folder / "config.json", cfg)
    gen = json.loads((folder / "generation_config.json").read_text())
    gen.update(eos_token_id=[ids["<|endoftext|>"], ids["<|im_end|>"]], pad_token_id=ids["<|endoftext|>"])
    atomic_write_json(folder / "generation_config.json", gen)
    manifest = json.loads((folder / "quantkit-manifest.json").read_text())
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        manifest["files"][name] = {"size": (folder / name).stat().st_size, "sha256": sha256_file(folder / name)}
    atomic_write_json(folder / "quantkit-manifest.json", manifest)
    (folder / DONE).write_text("the tokenizer and token ids are the real Qwen3.5 ones\n")


def cli(workdir: Path = shared("workdir", Path("/tmp/quantkit-bench-full-size")),
        reports: Path = shared("reports", Path("reports/full-size-agents")),
        n_threads: int = shared("threads", None), rounds: int = shared("rounds", 1),
        agents: str = typer.Option("4", "--agents", help="agent counts, as `bench serve --agents`"),
        turns: int = typer.Option(3, "--turns", help="turns per agent"),
        quantkit_args: str = typer.Option("", "--quantkit-args", help="more `quantkit serve` arguments")) -> None:
    """Build the full-size folder with the real tokenizer (once), then run the agent load on it."""
    folder = workdir / FOLDER
    quantkit = [sys.executable, "-m", "quantkit"]
    if not (folder / DONE).is_file():
        workdir.mkdir(parents=True, exist_ok=True)
        subprocess.run([*quantkit, "tiny-model", "--full-size", "--quantized", "quality", "--overwrite", str(folder)],
                       check=True, env=child_env())
        qwen_tokenizer_into(folder)
    bench = [*quantkit, "bench", "--model", str(folder), "--reports", str(reports), "--rounds", str(rounds),
             *(["--threads", str(n_threads)] if n_threads else []),
             "serve", "--agents", agents, "--turns", str(turns),
             *(["--quantkit-args", quantkit_args] if quantkit_args else [])]
    print("running:", shlex.join(bench), flush=True)
    reports.mkdir(parents=True, exist_ok=True)
    subprocess.run(bench, check=True, env=child_env())


if __name__ == "__main__":
    sys.exit(run_command(cli, None, "full_size_agents"))
