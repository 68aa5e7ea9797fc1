"""Launch plans for other engines: the `quantkit export` line that writes the file an engine needs and the
engine's own launch line for a placement. Pure string building (no torch, no gguf import), so that
`quantkit plan --export` stays fast.

File names are chosen here once: `quantkit plan --export llama.cpp` names the GGUF that the `quantkit export
gguf` line it prints writes, and the vLLM plan serves the folder its `quantkit export vllm` line writes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from quantkit.hardware import Hardware
from quantkit.plan import Plan, llama_cpp_command, vllm_command

# quantkit plan's schemes -> the GGUF `--type` that carries them. nf4/fp4 have no GGUF type: Q4_0 (same 4.5
# bits per weight) is the nearest llama.cpp runs.
GGUF_TYPES = {"quality": "mixed", "bf16": "bf16", "fp16": "f16", "int8": "q8_0", "int4": "q4_0", "nf4": "q4_0",
              "fp4": "q4_0", "mxfp4": "mxfp4"}
# schemes whose routed experts are 4-bit: vLLM gets the compressed-tensors int4 export of them
FOUR_BIT = ("quality", "int4", "nf4", "fp4", "mxfp4")
ENGINES = {"llama.cpp": "llama.cpp", "llamacpp": "llama.cpp", "llama-cpp": "llama.cpp", "vllm": "vllm"}


@dataclass
class LaunchPlan:
    engine: str
    command: str  # the engine's launch line ("" when the engine cannot run this plan)
    export_command: str | None  # the quantkit line that writes what `command` loads; None: serve the source
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, object]:
        return {"target": self.engine, "command": self.command, "export_command": self.export_command,
                "warnings": self.warnings}


def gguf_file_name(model: str, scheme: str) -> str:
    return f"{model}-{GGUF_TYPES.get(scheme, 'mixed')}.gguf"


def vllm_folder_name(model: str) -> str:
    return f"{model}-ct-w4a16"


def launch_plan(engine: str, plan: Plan, hw: Hardware, model: str, source: str) -> LaunchPlan:
    """`engine` (llama.cpp or vllm) launch for `plan`; `source` is the checkpoint the export reads."""
    engine = ENGINES[engine.lower()]
    if engine == "llama.cpp":
        ty = GGUF_TYPES.get(plan.scheme, "mixed")
        path = gguf_file_name(model, plan.scheme)
        warns = []
        if plan.scheme in ("nf4", "fp4"):
            warns.append(f"GGUF has no {plan.scheme}: the export uses Q4_0 (same 4.5 bits per weight)")
        return LaunchPlan(engine, llama_cpp_command(plan, path), f"quantkit export gguf {source} {path} --type {ty}",
                          warns)
    if plan.scheme in FOUR_BIT:
        folder = vllm_folder_name(model)
        rest = "int8" if plan.scheme == "quality" else "bf16"
        export = f"quantkit export vllm {source} {folder} --rest {rest}"
        warns = []
        if plan.scheme not in ("quality", "int4"):
            warns.append(f"vLLM's MoE kernels take int4 symmetric experts: the export writes {plan.scheme}'s "
                         "experts as int4 (requantized from the source)")
        if plan.scheme != "quality":
            warns.append("non-expert weights stay bf16 in the vLLM export (vLLM has no 4-bit path for them)")
    else:
        folder, export, warns = source, None, []
    cmd, vwarns = vllm_command(plan, hw, folder)
    if plan.scheme == "int8" and cmd:
        # quantkit's vLLM export is int4 for the experts; vLLM's own fp8 quantizes the bf16 source at load
        # to the same 8 bits per weight this plan budgets
        cmd += " --quantization fp8"
        warns.append("8 bits in vLLM: its on-load fp8 quantization of the bf16 source (same bytes as int8)")
    return LaunchPlan(engine, cmd, export, warns + vwarns)
