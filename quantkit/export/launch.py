"""Launch plans for other engines: the `quantkit export` line that writes the file an engine needs and the
engine's own launch line for a placement.

llama.cpp's line is solved by quantkit.export.llama_placement on the bytes of the GGUF it loads (the
exported type's per-tensor bytes, or an existing file's header), not on quantkit's own runtime plan:
llama.cpp stores the experts in another format and has other buffers, and its automatic fitting is off
once -ngl / --n-cpu-moe / -ot are given, so the line must fit by itself.

File names are chosen here once: `quantkit plan --export llama.cpp` names the GGUF that the `quantkit export
gguf` line it prints writes, and the vLLM plan serves the folder its `quantkit export vllm` line writes.

MTP: when the plan keeps the model's MTP layer (`plan --mtp N`, by default when the model has one), both lines
draft with it, N tokens a step (DEFAULT_MTP_DRAFT unless --mtp says): llama-server with `--spec-type draft-mtp
--spec-draft-n-max N` (common/arg.cpp of the llama.cpp llama-cpp-python 0.3.36 vendors) on the GGUF's NextN
block, vLLM with `--speculative-config '{"method":"mtp","num_speculative_tokens":N}'`; each placement counts
the layer. `--mtp 0` leaves it out: no draft flags, and the GGUF is exported with --no-mtp-layer.

vLLM's platform (quantkit.export.vllm_cpu): a plan with GPUs gets `vllm serve` and the export for Marlin (quality:
`--rest int8`); a CPU-only plan gets vLLM's CPU build, `python -m vllm.entrypoints.openai.api_server` with its KV
space, the `--rest bf16` export (vLLM CPU has no int8 kernel) and the MoE backend this CPU would use (Intel AMX,
AMD zentorch, or none: then the line is withheld). Drafting turns prefix caching off on both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from quantkit.checkpoint.spec import ModelSpec, Role, TextConfig, default_spec
from quantkit.export.gguf_types import DEFAULT_TYPE
from quantkit.export.llama_placement import (
    LlamaModel,
    LlamaPlacement,
    LlamaSettings,
    model_from_spec,
    solve_llama,
)
from quantkit.export.llama_speed import llama_decode_tok_s, llama_prefill_tok_s
from quantkit.export.vllm_cpu import (
    GPU_SERVER,
    INT8_ON_CPU,
    MTP_PREFIX,
    cpu_backend,
    cpu_command,
    kv_space_gib,
    speculative_flags,
    target_rest,
)
from quantkit.export.vllm_placement import VllmFit, vllm_fit
from quantkit.planner.budget import kv_bytes_per_token, linear_state_bytes
from quantkit.planner.hardware import Hardware
from quantkit.planner.placement import Plan

# quantkit plan's schemes -> the GGUF `--type` that carries them. nf4/fp4 have no GGUF type: Q4_0 (same 4.5
# bits per weight) is the nearest llama.cpp runs.
GGUF_TYPES = {"quality": DEFAULT_TYPE, "bf16": "bf16", "fp16": "f16", "int8": "q8_0", "int4": "q4_0", "nf4": "q4_0",
              "fp4": "q4_0", "mxfp4": "mxfp4"}
# schemes whose routed experts are 4-bit: vLLM gets the compressed-tensors int4 export of them
FOUR_BIT = ("quality", "int4", "nf4", "fp4", "mxfp4")
ENGINES = {"llama.cpp": "llama.cpp", "llamacpp": "llama.cpp", "llama-cpp": "llama.cpp", "vllm": "vllm"}
# tokens drafted per step when the plan keeps the MTP layer and --mtp does not say: one breaks even at the
# lowest draft acceptance (reports/bench-mtp.md: 0.70 for one draft, 0.80 for two or three)
DEFAULT_MTP_DRAFT = 1
EXPORT_CONTEXT = 32768  # the --max-model-len of the line `export vllm` prints (capped at the model's)


@dataclass
class LaunchPlan:
    engine: str
    command: str  # the engine's launch line ("" when the engine cannot run this plan)
    export_command: str | None  # the quantkit line that writes what `command` loads; None: serve the source
    warnings: list[str] = field(default_factory=list)
    placement: LlamaPlacement | None = None  # llama.cpp: what the line puts on each card
    vllm: VllmFit | None = None  # vLLM: what the line asks of each GPU
    decode_tok_s: float | None = None  # llama.cpp: the line's own estimated decode (quantkit.export.llama_speed)
    prefill_tok_s: float | None = None  # llama.cpp: and its prefill, in steps of the line's -ub
    notes: list[str] = field(default_factory=list)  # what the line relies on (vLLM CPU: the MoE backend)

    def to_dict(self) -> dict[str, object]:
        d: dict[str, Any] = {"target": self.engine, "command": self.command, "export_command": self.export_command,
                             "warnings": self.warnings, "notes": self.notes}
        if self.placement is not None:
            d["llama_cpp"] = self.placement.to_dict()
        if self.decode_tok_s is not None:
            d["est_decode_tok_s"] = round(self.decode_tok_s, 1)
        if self.prefill_tok_s is not None:
            d["est_prefill_tok_s"] = round(self.prefill_tok_s, 1)
        if self.vllm is not None:
            d["vllm"] = self.vllm.to_dict()
        return d


def vllm_folder_name(model: str) -> str:
    return f"{model}-ct-w4a16"


def llama_cache_type(cache_dtype: str) -> str:
    """quantkit's cache dtype as llama.cpp's -ctk/-ctv type (fp8 has no llama.cpp type: q8_0, same bytes)."""
    return _LLAMA_CACHE[cache_dtype]


def llama_settings(plan: Plan, mtp_draft: int = 0) -> LlamaSettings:
    return LlamaSettings(context=plan.settings.context, parallel=plan.settings.batch,
                         cache_type=llama_cache_type(plan.settings.cache_dtype), ubatch=plan.settings.prefill_chunk,
                         mtp_draft=mtp_draft)


def mtp_draft(plan: Plan, mtp: int | None) -> int:
    """Tokens the launch lines draft per step: `mtp` (plan --mtp) or DEFAULT_MTP_DRAFT when the plan keeps the
    MTP layer, else 0."""
    if not plan.settings.include_mtp:
        return 0
    return DEFAULT_MTP_DRAFT if mtp is None else mtp


def vllm_speculative(draft: int) -> list[str]:
    """vLLM's MTP speculative decoding flags (none for 0 drafts), prefix caching off (vllm_cpu's docstring)."""
    return speculative_flags(draft)


def llama_launch(gm: LlamaModel, st: LlamaSettings, hw: Hardware, path: str, reserve: int,
                 export: str | None = None, warns: list[str] | None = None,
                 n_cpu_moe: int | None = None) -> LaunchPlan:
    """The llama-server line for GGUF `gm` (at `path`) on `hw`'s GPUs, solved on the file's bytes
    (`n_cpu_moe`: the user's --n-cpu-moe instead of the fewest that fit)."""
    pl = solve_llama(gm, st, [g.usable_bytes for g in hw.gpus], reserve, n_cpu_moe)
    warns = list(warns or [])
    if not pl.fits:
        need = max(t - b for t, b in zip(pl.gpu_totals(), pl.budgets, strict=True))
        warns.append(f"{path} does not fit these GPUs even with every expert on the CPU ({need / 2**30:.2f} GiB "
                     "over): shorten the context, use a smaller type or a q8_0 KV cache")
    speed = llama_decode_tok_s(pl, gm, hw) if pl.fits else None
    prefill = llama_prefill_tok_s(pl, gm, hw) if pl.fits else None
    return LaunchPlan("llama.cpp", llama_cpp_command(pl, path), export, warns, pl, decode_tok_s=speed,
                      prefill_tok_s=prefill)


def launch_plan(engine: str, plan: Plan, hw: Hardware, model: str, source: str, spec: ModelSpec | None = None,
                gguf_type: str | None = None, n_cpu_moe: int | None = None, mtp: int | None = None) -> LaunchPlan:
    """`engine` (llama.cpp or vllm) launch for `plan`; `source` is the checkpoint the export reads, `spec`
    the model (the embedded default when None), `gguf_type` the GGUF --type (default: the scheme's), `mtp` the
    tokens to draft with the MTP layer (plan --mtp; None: DEFAULT_MTP_DRAFT when the plan keeps the layer)."""
    engine = ENGINES[engine.lower()]
    spec = spec or default_spec()
    draft = mtp_draft(plan, mtp)
    if engine == "llama.cpp":
        ty = gguf_type or GGUF_TYPES.get(plan.scheme, DEFAULT_TYPE)
        path = f"{model}-{ty}.gguf"
        warns = []
        if plan.scheme in ("nf4", "fp4") and not gguf_type:
            warns.append(f"GGUF has no {plan.scheme}: the export uses Q4_0 (same 4.5 bits per weight)")
        gm = model_from_spec(spec, ty, mtp=draft > 0)
        drop = " --no-mtp-layer" if not draft and any(t.role == Role.MTP for t in spec.tensors) else ""
        return llama_launch(gm, llama_settings(plan, draft), hw, path, plan.gpus[0].reserve if plan.gpus else 0,
                            f"quantkit export gguf {source} {path} --type {ty}{drop}", warns, n_cpu_moe)
    target = "gpu" if hw.gpus else "cpu"
    if plan.scheme in FOUR_BIT:
        folder = vllm_folder_name(model)
        rest = target_rest(target) if plan.scheme == "quality" else "bf16"
        export = f"quantkit export vllm {source} {folder} --rest {rest} --target {target}"
        warns = []
        if plan.scheme == "quality" and target == "cpu":
            warns.append(f"{INT8_ON_CPU}: the export keeps attention, linear attention and the shared expert bf16")
        if plan.scheme not in ("quality", "int4"):
            warns.append(f"vLLM's MoE kernels take int4 symmetric experts: the export writes {plan.scheme}'s "
                         "experts as int4 (requantized from the source)")
        if plan.scheme != "quality":
            warns.append("non-expert weights stay bf16 in the vLLM export (vLLM has no 4-bit path for them)")
    else:
        folder, export, warns = source, None, []
    cmd, vwarns, notes = vllm_command(plan, hw, folder, draft, spec)
    fit = None
    if hw.gpus:
        tp, pp, _ = vllm_parallel(hw)
        fit = vllm_fit(spec, plan.scheme, plan.settings, hw.gpus[0].usable_bytes, tp, pp, mtp=draft > 0)
        if not fit.fits:
            vwarns.append(f"by the served weights' bytes vLLM needs {sum(fit.per_gpu.values()) / 2**30:.2f} GiB per "
                          f"GPU at --max-model-len {plan.settings.context}, {fit.budget / 2**30:.2f} GiB available "
                          f"({fit.max_tokens} tokens of KV fit)")
    if plan.scheme == "int8" and cmd and target == "gpu":
        # quantkit's vLLM export is int4 for the experts; vLLM's own fp8 quantizes the bf16 source at load
        # to the same 8 bits per weight this plan budgets
        cmd += " --quantization fp8"
        warns.append("8 bits in vLLM: its on-load fp8 quantization of the bf16 source (same bytes as int8)")
    return LaunchPlan(engine, cmd, export, warns + vwarns, vllm=fit, notes=notes)


_LLAMA_CACHE = {"fp16": "f16", "bf16": "bf16", "q8_0": "q8_0", "q4_0": "q4_0", "fp8": "q8_0"}


def llama_cpp_command(p: LlamaPlacement, model_path: str = "model.gguf") -> str:
    """llama-server line for a llama.cpp placement (drafting with the MTP layer when its settings say)."""
    st = p.settings
    # -c is all slots' KV together; --jinja: the GGUF's own chat template, which tool calls need
    args = ["llama-server", "-m", model_path, "-c", str(st.n_ctx), *p.flags(), "-fa", "on", "--jinja",
            *p.mtp_flags()]
    if st.ubatch != 512:
        args += ["-ub", str(st.ubatch)]
    if st.cache_type != "f16":
        args += ["-ctk", st.cache_type, "-ctv", st.cache_type]
    if st.parallel > 1:
        args += ["-np", str(st.parallel)]
    return " ".join(args)


def vllm_parallel(hw: Hardware) -> tuple[int, int, list[str]]:
    """(tensor parallel, pipeline parallel, warnings): TP within a node as far as the 16 heads split."""
    per_node = len(hw.gpus)
    tp, pp = per_node, hw.nodes
    while tp > 1 and 16 % tp:
        tp //= 2
    if tp != per_node:
        pp = hw.nodes * per_node // tp
        return tp, pp, [f"attention heads do not split {per_node} ways: using TP {tp} x PP {pp}"]
    return tp, pp, []


# the parsers Qwen3.5 needs: its thinking, and the XML tool calls it writes
VLLM_PARSERS = ["--reasoning-parser", "qwen3", "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder"]


def vllm_cpu_launch(plan: Plan, model: str, draft: int, spec: ModelSpec | None = None,
                    cpuinfo: str | None = None) -> tuple[str, list[str], list[str]]:
    """vLLM CPU's line for a CPU-only plan (quantkit.export.vllm_cpu), or "" where this CPU has no MoE kernel
    for the int4 experts, with warnings and notes (which backend runs the experts, why prefix caching is off)."""
    c = (spec or default_spec()).config
    if plan.scheme == "int8":
        return "", ["vLLM CPU has no 8-bit path quantkit has run (its fp8 on-load quantization targets GPUs): plan "
                    "a 4-bit scheme for it (int4 experts, bf16 rest), or run int8 with quantkit"], []
    warns, notes = [], []
    if plan.scheme in FOUR_BIT:
        backend = cpu_backend(cpuinfo)
        if backend.name is None:
            return "", [backend.note], []
        notes.append(backend.note)
    else:
        notes.append(f"{plan.scheme} on vLLM CPU serves the source unquantized (its bf16 MoE path; quantkit's vLLM "
                     "check runs the int4 export)")
    notes += [MTP_PREFIX["cpu"]] if draft else []
    return vllm_cpu_line(c, model, plan.settings.context, draft, plan.settings.batch), warns, notes


def vllm_cpu_line(c: TextConfig, model: str, context: int, draft: int = 0, batch: int = 1) -> str:
    """vLLM CPU's server line for the folder `model`: its KV space holds `batch` sequences of `context` tokens
    (the full-attention layers' K/V in bf16, the MTP layer's when drafting, the Gated DeltaNet states)."""
    n_full = len(c.full_attention_layers) + (c.mtp_num_hidden_layers if draft else 0)
    rec, conv = linear_state_bytes(c)
    kv = (kv_bytes_per_token(c, "bf16", n_full) * context + (rec + conv) * len(c.linear_attention_layers)) * batch
    return cpu_command(model, context, kv_space_gib(kv), draft, ["--host", "127.0.0.1", *VLLM_PARSERS])


def export_serve_line(c: TextConfig, folder: str, target: str, has_mtp: bool) -> tuple[str, list[str]]:
    """What `quantkit export vllm` prints after writing `folder` for `target` (gpu or cpu): the line that serves
    it there, drafting DEFAULT_MTP_DRAFT tokens with its MTP layer when it has one, and notes on the line."""
    draft = DEFAULT_MTP_DRAFT if has_mtp and c.mtp_num_hidden_layers else 0
    notes = [MTP_PREFIX[target]] if draft else []
    if target == "cpu":
        return vllm_cpu_line(c, folder, min(EXPORT_CONTEXT, c.max_position_embeddings), draft), notes
    return " ".join([GPU_SERVER, folder, "--language-model-only", *VLLM_PARSERS, *vllm_speculative(draft)]), notes


def vllm_command(plan: Plan, hw: Hardware, model: str, draft: int = 0,
                 spec: ModelSpec | None = None) -> tuple[str, list[str], list[str]]:
    """A vLLM launch line (tensor parallel within a node, pipeline parallel across nodes, expert
    parallel for the MoE; `draft` tokens a step drafted with the MTP layer) and warnings when the plan does
    not fit vLLM's all-on-GPU model, and notes; a CPU-only plan gets vLLM CPU's line (`vllm_cpu_launch`)."""
    per_node = len(hw.gpus)
    if per_node == 0:
        return vllm_cpu_launch(plan, model, draft, spec)
    tp, pp, warns = vllm_parallel(hw)
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
             "--gpu-memory-utilization", "0.92", *VLLM_PARSERS]
    if plan.settings.cache_dtype == "fp8":
        args += ["--kv-cache-dtype", "fp8"]
    elif plan.settings.cache_dtype in ("q8_0", "q4_0"):
        warns.append(f"vLLM has no {plan.settings.cache_dtype} KV cache; use fp8 or fp16")
    if hw.nodes > 1:
        args += ["--distributed-executor-backend", "ray"]
    args += vllm_speculative(draft)
    return " ".join(args), warns, [MTP_PREFIX["gpu"]] if draft else []
