"""Launch plans for other engines: the `quantkit export` line that writes the file an engine needs and the
engine's own launch line for a placement. Pure string building (no torch, no gguf import), so that
`quantkit plan --export` stays fast.

File names are chosen here once: `quantkit plan --export llama.cpp` names the GGUF that the `quantkit export
gguf` line it prints writes, and the vLLM plan serves the folder its `quantkit export vllm` line writes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from quantkit.planner.hardware import Hardware
from quantkit.planner.placement import Plan

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


_LLAMA_CACHE = {"fp16": "f16", "bf16": "bf16", "q8_0": "q8_0", "q4_0": "q4_0", "fp8": "q8_0"}


def llama_cpp_command(plan: Plan, model_path: str = "model.gguf") -> str:
    """llama-server flags for this placement. llama.cpp keeps a layer's experts in one stacked tensor,
    so a layer split between GPU and CPU goes wholly to the CPU (--n-cpu-moe rounds up)."""
    n = len(plan.layer_device)
    gpu_layers = sum(1 for d in plan.layer_device if d != "cpu")
    args = ["llama-server", "-m", model_path, "-c", str(plan.settings.context)]
    if not plan.gpus:
        args += ["-ngl", "0"]
    else:
        args += ["-ngl", "99" if gpu_layers == n else str(gpu_layers)]
        cpu_moe = plan.cpu_expert_layers
        contiguous = all(c.get("cpu", 0) for c in plan.expert_counts()[:cpu_moe])
        if cpu_moe and len(plan.gpus) == 1 and contiguous:
            args += ["--n-cpu-moe", str(cpu_moe)]
        elif cpu_moe:
            layers = [str(L) for L, c in enumerate(plan.expert_counts()) if c.get("cpu", 0)]
            args += ["-ot", f"blk\\.({'|'.join(layers)})\\.ffn_.*_exps\\.=CPU"]
        if len(plan.gpus) > 1:
            share = [sum(1 for d in plan.layer_device if d == g.id) for g in plan.gpus]
            args += ["--tensor-split", ",".join(map(str, share)), "--split-mode", "layer"]
    args += ["-fa", "on"]
    ct = _LLAMA_CACHE[plan.settings.cache_dtype]
    if ct != "f16":
        args += ["-ctk", ct, "-ctv", ct]
    if plan.settings.batch > 1:
        args += ["-np", str(plan.settings.batch)]
    return " ".join(args)


def vllm_command(plan: Plan, hw: Hardware, model: str) -> tuple[str, list[str]]:
    """A vLLM launch line (tensor parallel within a node, pipeline parallel across nodes, expert
    parallel for the MoE) and warnings when the plan does not fit vLLM's all-on-GPU model."""
    warns = []
    per_node = len(hw.gpus)
    if per_node == 0:
        return "", ["vLLM needs GPUs; this plan is CPU-only"]
    tp, pp = per_node, hw.nodes
    c_heads = 16
    while tp > 1 and c_heads % tp:
        tp //= 2
    if tp != per_node:
        pp = hw.nodes * per_node // tp
        warns.append(f"attention heads do not split {per_node} ways: using TP {tp} x PP {pp}")
    if plan.where != "gpu":
        warns.append(
            "vLLM keeps all weights on the GPUs (its --cpu-offload-gb streams weights each step): "
            "this plan needs CPU-resident experts, use quantkit's runtime or llama.cpp instead"
        )
    args = ["vllm", "serve", model, "--tensor-parallel-size", str(tp)]
    if pp > 1:
        args += ["--pipeline-parallel-size", str(pp)]
    if tp * pp > 1:
        args += ["--enable-expert-parallel"]
    args += ["--language-model-only", "--max-model-len", str(plan.settings.context),
             "--gpu-memory-utilization", "0.92", "--reasoning-parser", "qwen3"]
    if plan.settings.cache_dtype == "fp8":
        args += ["--kv-cache-dtype", "fp8"]
    elif plan.settings.cache_dtype in ("q8_0", "q4_0"):
        warns.append(f"vLLM has no {plan.settings.cache_dtype} KV cache; use fp8 or fp16")
    if hw.nodes > 1:
        args += ["--distributed-executor-backend", "ray"]
    return " ".join(args), warns
