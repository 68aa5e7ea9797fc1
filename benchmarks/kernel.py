"""`python -m benchmarks.kernel`: one MoE layer at batch-1 decode, route by route, ms per layer-token.

The layer of the real model (hidden 2048, experts of 512, top-8 of `experts`), `layers` such layers with
their own weights so every token reads its experts from DRAM, not a cache (each token draws new experts;
every route sees the same draws). Routes, one run, same threads:
- quantkit's C++ kernel, fused: one `qk.moe` call per layer (runtime/cpu_kernel.py) - the runtime's route;
- the same kernel per expert (2k `qk.linear` calls and the small ops from Python): what fusion buys;
- torch's packed ops per expert (`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`): the route before;
- ggml (the libggml-cpu that llama-cpp-python ships): a graph of `layers` MoE layers as llama.cpp builds
  them (`ggml_mul_mat_id` for gate, up and down, SiLU x up, weighted sum), computed once per token with
  `ggml_graph_compute_with_ctx` on the same expert codes (our int4 g32 codes ARE Q4_0; int8 per-channel
  codes written as Q8_0 blocks with the row's scale). Plain Q4_0/Q8_0 rows: llama.cpp's model loader may
  also repack Q4_0 into interleaved rows, which `quantkit bench engines` measures end to end.
The bound: bytes of the k experts' codes and scales / read bandwidth, for a fixed reference bandwidth
(`REFERENCE_GBPS`, so runs on different days compare) and for the bandwidth measured in this run (a streaming
read of 512 MB, same threads; other jobs on the machine lower it).
Then one decode token's attention layer core over 64-8192 cached tokens: the model's torch route against
`qk.attn_rows`.
"""

from __future__ import annotations

import ctypes
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.cli import guard_reports, run_command, shared
from benchmarks.cli import threads as resolve_threads
from quantkit.bench import read_bandwidth_gbs, write_reports
from quantkit.bench.engines import describe_machine
from quantkit.formats import QuantSpec
from quantkit.formats.int4 import int4_to_q4_0_blocks
from quantkit.kernels import cpu as cpu_kernel
from quantkit.runtime.kernels import prepare, slice_parts
from quantkit.runtime.model.ops import TORCH
from quantkit.runtime.model.qwen3_5_moe import Attention
from quantkit.runtime.qexperts import ExpertGroup, QuantExperts

DEFAULTS = {"hidden": 2048, "inter": 512, "experts": 64, "top_k": 8, "layers": 4, "tokens": 24, "reps": 5}
GGML_KERNEL = {"int4": "Q4_0 x Q8_0", "int8": "Q8_0 x Q8_0", "bf16": "BF16 x BF16"}
REFERENCE_GBPS = 37.6  # the bound's fixed reference: a 2-thread streaming read where the first reports ran


def _parts(fmt: str, e: int, n: int, k: int, g: torch.Generator) -> Any:
    """Random stored parts in quantkit's layout (codes and scales drawn directly: timing needs no real
    weights); bf16: the weight tensor itself."""
    if fmt == "bf16":
        return (torch.randn(e, n, k, generator=g) * 0.02).to(torch.bfloat16)
    if fmt == "int4":
        return {"qweight": torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, generator=g),
                "scales": ((torch.rand(e, n, k // 32, generator=g) + 0.5) * 1e-3).to(torch.bfloat16)}
    return {"qweight": torch.randint(-127, 128, (e, n, k), dtype=torch.int8, generator=g),
            "scales": ((torch.rand(e, n, generator=g) + 0.5) * 1e-4).to(torch.bfloat16)}


def _spec(fmt: str) -> QuantSpec | None:
    return {"int4": QuantSpec("int4", 32), "int8": QuantSpec("int8")}.get(fmt)


def _layer_bytes(fmt: str, h: int, i: int, k: int) -> int:
    """Bytes of codes and scales the k routed experts of one layer hold (what a token must read)."""
    per = 3 * h * i
    if fmt == "bf16":
        return k * per * 2
    return k * (per // 2 + per // 32 * 2 if fmt == "int4" else per + (2 * i + h) * 2)


def read_gbps(threads: int) -> float:
    """This run's read bandwidth on `threads` threads (a streaming read of 512 MB, bench.read_bandwidth_gbs)."""
    torch.set_num_threads(threads)
    return read_bandwidth_gbs(0.5)


def _quantexperts(layer: tuple[dict, dict], fmt: str, route: str | None, cfg: dict) -> Any:

    h, i, e = cfg["hidden"], cfg["inter"], cfg["experts"]
    gu, dn = layer
    grp = ExpertGroup(torch.device("cpu"), list(range(e)))
    for x in range(e):
        a, b = (gu[x], dn[x]) if fmt == "bf16" else (slice_parts(gu, x), slice_parts(dn, x))
        grp.gate_up.append(prepare(a, _spec(fmt), (2 * i, h), route=route))
        grp.down.append(prepare(b, _spec(fmt), (h, i), route=route))
    return QuantExperts(e, h, i, [grp])


def time_quantexperts(layers: list[tuple[dict, dict]], fmt: str, route: str | None, fused: bool,
                      draws: torch.Tensor, wts: torch.Tensor, cfg: dict) -> tuple[float, str]:
    """Best ms per layer-token over `reps` passes of `tokens` tokens through every layer."""
    qs = [_quantexperts(layer, fmt, route, cfg) for layer in layers]
    if not fused:
        for q in qs:
            q._fused = False  # the per-expert path (the table is otherwise built at the first decode)
    x = torch.randn(1, cfg["hidden"], generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    name = qs[0].groups[0].gate_up[0].route
    tokens, nl = draws.shape[0], len(qs)

    def one_pass() -> float:
        t = time.perf_counter()
        for tok in range(tokens):
            for li, q in enumerate(qs):
                q(x, draws[tok, li][None], wts[tok, li][None])
        return time.perf_counter() - t

    one_pass()  # warm-up (and the fused table)
    best = min(one_pass() for _ in range(cfg["reps"]))
    qs.clear()
    return best / (tokens * nl) * 1e3, name


# ---------------------------------------------------------------- ggml through ctypes


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


def _ggml_libs() -> tuple[ctypes.CDLL, ctypes.CDLL]:
    import llama_cpp  # noqa: F401  (loads libggml-base / libggml-cpu from its lib folder)

    lib = Path(llama_cpp.__file__).parent / "lib"
    base = ctypes.CDLL(str(lib / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    cpu = ctypes.CDLL(str(lib / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    base.ggml_init.restype = vp
    base.ggml_init.argtypes = [_InitParams]
    base.ggml_free.argtypes = [vp]
    base.ggml_new_tensor_1d.restype = vp
    base.ggml_new_tensor_1d.argtypes = [vp, ctypes.c_int, i64]
    base.ggml_new_tensor_2d.restype = vp
    base.ggml_new_tensor_2d.argtypes = [vp, ctypes.c_int, i64, i64]
    base.ggml_new_tensor_3d.restype = vp
    base.ggml_new_tensor_3d.argtypes = [vp, ctypes.c_int, i64, i64, i64]
    base.ggml_get_data.restype = vp
    base.ggml_get_data.argtypes = [vp]
    base.ggml_nbytes.restype = ctypes.c_size_t
    base.ggml_nbytes.argtypes = [vp]
    for name in ("ggml_mul", "ggml_add"):
        getattr(base, name).restype = vp
        getattr(base, name).argtypes = [vp, vp, vp]
    base.ggml_silu.restype = vp
    base.ggml_silu.argtypes = [vp, vp]
    base.ggml_mul_mat_id.restype = vp
    base.ggml_mul_mat_id.argtypes = [vp, vp, vp, vp]
    base.ggml_view_2d.restype = vp
    base.ggml_view_2d.argtypes = [vp, vp, i64, i64, ctypes.c_size_t, ctypes.c_size_t]
    base.ggml_new_graph.restype = vp
    base.ggml_new_graph.argtypes = [vp]
    base.ggml_build_forward_expand.argtypes = [vp, vp]
    cpu.ggml_cpu_init.argtypes = []
    cpu.ggml_graph_compute_with_ctx.restype = ctypes.c_int
    cpu.ggml_graph_compute_with_ctx.argtypes = [vp, vp, ctypes.c_int]
    return base, cpu


def _fill(base: ctypes.CDLL, t: int, arr: np.ndarray) -> None:
    arr = np.ascontiguousarray(arr)
    assert base.ggml_nbytes(t) == arr.nbytes, (base.ggml_nbytes(t), arr.nbytes)
    ctypes.memmove(base.ggml_get_data(t), arr.ctypes.data, arr.nbytes)


def _ggml_rows(fmt: str, parts: Any) -> np.ndarray:
    """Rows of GGML blocks [E, N, blocks*bytes]: int4 g32 -> Q4_0 (lossless), int8 -> Q8_0 (row scale per
    block), bf16 -> BF16 (the bytes)."""
    if fmt == "bf16":
        return parts.view(torch.uint8).numpy()
    if fmt == "int4":

        return int4_to_q4_0_blocks(parts, _spec("int4"))
    q = parts["qweight"]
    e, n, k = q.shape
    d = parts["scales"].to(torch.float16).view(torch.uint8).reshape(e, n, 1, 2).expand(e, n, k // 32, 2)
    blocks = torch.cat([d, q.view(torch.uint8).reshape(e, n, k // 32, 32)], dim=-1)
    return blocks.reshape(e, n, -1).numpy()


def time_ggml(layers: list[tuple[dict, dict]], fmt: str, draws: torch.Tensor, wts: torch.Tensor, cfg: dict,
              threads: int, probe: dict | None = None) -> float:
    """ms per layer-token of a ggml graph of all layers, computed once per token (ids rewritten per token).
    `probe` (a dict) receives the graph's input "x" and its output "out" for token 0 (tests check that the
    graph computes the same layers as quantkit's route)."""
    import gguf

    base, cpu = _ggml_libs()
    cpu.ggml_cpu_init()
    qt = int({"int4": gguf.GGMLQuantizationType.Q4_0, "int8": gguf.GGMLQuantizationType.Q8_0,
              "bf16": gguf.GGMLQuantizationType.BF16}[fmt])
    f32, i32 = int(gguf.GGMLQuantizationType.F32), int(gguf.GGMLQuantizationType.I32)
    h, i, e, k = cfg["hidden"], cfg["inter"], cfg["experts"], cfg["top_k"]
    wbytes = sum(_ggml_rows(fmt, p).nbytes for p in layers[0])
    ctx = base.ggml_init(_InitParams(wbytes * len(layers) + (256 << 20), None, False))
    if not ctx:
        raise RuntimeError("ggml_init failed")
    try:
        x = base.ggml_new_tensor_2d(ctx, f32, h, 1)
        x_in = np.random.default_rng(3).standard_normal(h).astype(np.float32)
        _fill(base, x, x_in)
        cur, ids_t = x, []
        for gu, dn in layers:
            rows = _ggml_rows(fmt, gu)  # [E, 2I, ...]: gate = first I rows, up = next I
            gate = base.ggml_new_tensor_3d(ctx, qt, h, i, e)
            up = base.ggml_new_tensor_3d(ctx, qt, h, i, e)
            _fill(base, gate, rows[:, :i])
            _fill(base, up, rows[:, i:])
            down = base.ggml_new_tensor_3d(ctx, qt, i, h, e)
            _fill(base, down, _ggml_rows(fmt, dn))
            ids = base.ggml_new_tensor_2d(ctx, i32, k, 1)
            w = base.ggml_new_tensor_3d(ctx, f32, 1, k, 1)
            ids_t.append((ids, w))
            g = base.ggml_mul_mat_id(ctx, gate, cur, ids)  # [I, k, 1]
            u = base.ggml_mul_mat_id(ctx, up, cur, ids)
            act = base.ggml_mul(ctx, base.ggml_silu(ctx, g), u)
            out = base.ggml_mul(ctx, base.ggml_mul_mat_id(ctx, down, act, ids), w)  # [H, k, 1] weighted
            acc = base.ggml_view_2d(ctx, out, h, 1, h * 4, 0)
            for s in range(1, k):
                acc = base.ggml_add(ctx, acc, base.ggml_view_2d(ctx, out, h, 1, h * 4, s * h * 4))
            cur = acc
        graph = base.ggml_new_graph(ctx)
        base.ggml_build_forward_expand(graph, cur)
        tokens = draws.shape[0]

        def step(tok: int) -> None:
            for li, (ids, w) in enumerate(ids_t):
                _fill(base, ids, draws[tok, li].to(torch.int32).numpy())
                _fill(base, w, wts[tok, li].float().numpy())
            if cpu.ggml_graph_compute_with_ctx(ctx, graph, threads) != 0:
                raise RuntimeError("ggml_graph_compute failed")

        def one_pass() -> float:
            t = time.perf_counter()
            for tok in range(tokens):
                step(tok)
            return time.perf_counter() - t

        if probe is not None:
            step(0)
            out = np.empty(h, dtype=np.float32)
            ctypes.memmove(out.ctypes.data, base.ggml_get_data(cur), out.nbytes)
            probe["x"], probe["out"] = x_in, out
        one_pass()
        best = min(one_pass() for _ in range(cfg["reps"]))
        return best / (tokens * len(layers)) * 1e3
    finally:
        base.ggml_free(ctx)


ATTENTION_TOKENS = (64, 512, 2048, 8192)


def time_attention(reps: int, lengths: tuple[int, ...] = ATTENTION_TOKENS) -> list[dict[str, Any]]:
    """One decode token's attention layer core (q/k norms, rotary, K/V write, attention over n cached tokens,
    gate) in the real model's shapes (16 query heads on 2 kv heads of 256, a quarter rotated, bf16): the model's
    torch route (`TorchOps.attention`) against quantkit's `qk.attn_rows` of one row, best of `reps` interleaved
    passes each; [] where the kernel has no AVX512-BF16 route."""
    mod = cpu_kernel.module()
    if mod is None or not cpu_kernel.bf16_available():
        return []
    heads, kv, hd, rot = 16, 2, 256, 64
    g = torch.Generator().manual_seed(2)
    scale = torch.ones(heads + kv, hd)
    layer = Attention(None, None, None, None, scale, heads, kv, hd, rot, 1e-6)
    qo = torch.randn(1, heads * 2 * hd, generator=g).to(torch.bfloat16)
    ko, vo = (torch.randn(1, kv * hd, generator=g).to(torch.bfloat16) for _ in range(2))
    cos, sin = torch.ones(1, rot, dtype=torch.bfloat16), torch.zeros(1, rot, dtype=torch.bfloat16)
    out = []
    for n in lengths:
        keys = torch.randn(kv, n, hd, generator=g).to(torch.bfloat16)
        values = torch.randn(kv, n, hd, generator=g).to(torch.bfloat16)
        routes = {"torch": lambda k=keys, v=values, n=n: TORCH.attention(layer, qo, ko, vo, k, v, n - 1, cos, sin),
                  "qk": lambda k=keys, v=values, n=n: mod.attn_rows(qo, ko, vo, scale, cos, sin, k, v, n - 1,
                                                                   hd ** -0.5, 1e-6)}
        best = {name: float("inf") for name in routes}
        for _ in range(reps):
            for name, fn in routes.items():
                fn()
                t = time.perf_counter()
                for _i in range(5):
                    fn()
                best[name] = min(best[name], (time.perf_counter() - t) / 5)
        out.append({"tokens": n, "kv_bytes": 2 * keys.numel() * 2, "torch_us": best["torch"] * 1e6,
                    "qk_us": best["qk"] * 1e6})
    return out


def run(reports: Path, threads: int, layers: int = DEFAULTS["layers"], tokens: int = DEFAULTS["tokens"],
        reps: int = DEFAULTS["reps"], formats: tuple[str, ...] = ("int4", "int8", "bf16"),
        log: Any = print) -> dict[str, Any]:

    t0 = time.time()
    cfg = {**DEFAULTS, "layers": layers, "tokens": tokens, "reps": reps}
    torch.set_num_threads(threads)
    machine = describe_machine()
    gbps = read_gbps(threads)
    log(f"read bandwidth {gbps:.1f} GB/s ({threads} threads)")
    h, i, e, k = cfg["hidden"], cfg["inter"], cfg["experts"], cfg["top_k"]
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(layers)])
                         for _ in range(tokens)])  # [tokens, layers, k]
    wts = torch.softmax(torch.randn(tokens, layers, k, generator=g), -1)
    rows: list[dict[str, Any]] = []
    for fmt in formats:
        gen = torch.Generator().manual_seed(1)
        nl = max(2, layers // 2) if fmt == "bf16" else layers  # bf16 is 3.6x int4: half the layers, still >> L3
        lays = [(_parts(fmt, e, 2 * i, h, gen), _parts(fmt, e, h, i, gen)) for _ in range(nl)]
        nbytes = _layer_bytes(fmt, h, i, k)
        bound_ref, bound_run = nbytes / (REFERENCE_GBPS * 1e9) * 1e3, nbytes / (gbps * 1e9) * 1e3
        cands: list[tuple[str, Any]] = []
        if cpu_kernel.available():
            cands += [("quantkit qk, fused (one call per layer)", lambda f=fmt, ls=lays: time_quantexperts(
                          ls, f, None, True, draws, wts, cfg)),
                      ("quantkit qk, per expert", lambda f=fmt, ls=lays: time_quantexperts(
                          ls, f, None, False, draws, wts, cfg))]
        cands.append(("torch packed ops, per expert", lambda f=fmt, ls=lays: time_quantexperts(
            ls, f, "torch", False, draws, wts, cfg)))
        cands.append(("ggml mul_mat_id graph", lambda f=fmt, ls=lays: (time_ggml(ls, f, draws, wts, cfg, threads),
                                                                      GGML_KERNEL[f])))
        for name, fn in cands:
            try:
                ms, route = fn()
            except Exception as err:  # ggml missing (llama-cpp-python not installed) or failing: say so
                log(f"  {fmt} {name}: failed ({type(err).__name__}: {err})")
                rows.append({"format": fmt, "route": name, "error": f"{type(err).__name__}: {err}"})
                continue
            torch.set_num_threads(threads)
            log(f"  {fmt} {name}: {ms:.3f} ms per layer-token")
            rows.append({"format": fmt, "route": name, "kernel": route, "ms": ms, "layers": nl, "bound_ms_ref": bound_ref,
                         "bound_ms_run": bound_run, "layer_bytes": nbytes})
        del lays
    log("attention over the cache: torch route vs qk.attn_rows")
    attention = time_attention(reps)
    d = {"command": f"python -m benchmarks.kernel --threads {threads} --layers {layers} --new-tokens {tokens} --reps {reps}",
         "machine": machine, "threads": threads, "read_gbps": gbps, "reference_gbps": REFERENCE_GBPS,
         "isa": cpu_kernel.isa_name(), "config": cfg, "rows": rows, "attention": attention, "seconds": time.time() - t0}
    reports.mkdir(parents=True, exist_ok=True)
    write_reports(reports, "bench-kernel", d, render(d), indent=1)
    return d


def render(d: dict[str, Any]) -> str:
    m, c = d["machine"], d["config"]
    out = [
        "# Kernel: one MoE layer at batch-1 decode, route by route",
        "",
        f"Command: `{d['command']}` ({d['seconds']:.0f} s). Machine: {m['cpu']}, {m['cores']} cores, "
        f"{m['ram_gb']} GB RAM, torch {m['torch']}, {d['threads']} threads for every route, quantkit kernel "
        f"path {d['isa']}; load average at start {m['load_avg_at_start']:.1f} (the machine is shared: compare "
        f"the ratios, not the absolute times). Read bandwidth measured in this run: {d['read_gbps']:.1f} GB/s "
        f"(a streaming read of 512 MB); the reference bound uses {d['reference_gbps']} GB/s.",
        "",
        f"Layer: hidden {c['hidden']}, experts of {c['inter']}, top-{c['top_k']} of {c['experts']}; {c['layers']} "
        f"layers with their own weights, {c['tokens']} tokens per pass, new experts drawn per token and layer "
        f"(the same draws for every route; bf16, 3.6x the bytes of int4, runs half as many layers), best of "
        f"{c['reps']} passes.",
        "",
        "| format | route | kernel | ms per layer-token | vs torch | vs ggml | bound ms (37.6 GB/s) | of bound | "
        "bound ms (this run) | of bound |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for fmt in dict.fromkeys(r["format"] for r in d["rows"]):
        rs = [r for r in d["rows"] if r["format"] == fmt]
        ref = {r["route"]: r.get("ms") for r in rs}
        t_ms = ref.get("torch packed ops, per expert")
        g_ms = ref.get("ggml mul_mat_id graph")
        for r in rs:
            if "error" in r:
                out.append(f"| {fmt} | {r['route']} | failed: {r['error'][:80]} | | | | | | | |")
                continue
            vt = f"{t_ms / r['ms']:.2f}x" if t_ms else "-"
            vg = f"{g_ms / r['ms']:.2f}x" if g_ms else "-"
            out.append(f"| {fmt} | {r['route']} | {r['kernel']} | {r['ms']:.3f} | {vt} | {vg} | "
                       f"{r['bound_ms_ref']:.3f} | {r['bound_ms_ref'] / r['ms']:.0%} | {r['bound_ms_run']:.3f} | "
                       f"{r['bound_ms_run'] / r['ms']:.0%} |")
    out += [
        "",
        "Reading it: `vs torch` and `vs ggml` are speed-ups (their time / this route's time); `of bound` is the "
        "share of the read-bandwidth bound reached (bytes of the k experts' codes and scales / bandwidth). "
        "The ggml row is libggml-cpu's plain Q4_0/Q8_0 `mul_mat_id` path as llama.cpp's graph uses it (a "
        "per-call thread start included, amortized over the layers of one graph).",
        "",
    ]
    if d.get("attention"):
        out += [
            "## Attention over the cache at decode",
            "",
            "One token's attention layer core in the real model's shapes (16 query heads on 2 kv heads of 256, "
            "bf16) over n cached tokens: the model's torch route (`TorchOps.attention`: transformers' eager "
            "roundings) against quantkit's `qk.attn_rows` of one row (same roundings, fp32 sums in another order), "
            "best of the passes.",
            "",
            "| cached tokens | K+V MB | torch us | qk.attn_rows us | speed-up | qk.attn_rows GB/s |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        for a in d["attention"]:
            out.append(f"| {a['tokens']:,} | {a['kv_bytes'] / 1e6:.1f} | {a['torch_us']:.0f} | {a['qk_us']:.0f} | "
                       f"{a['torch_us'] / a['qk_us']:.2f}x | {a['kv_bytes'] / a['qk_us'] / 1e3:.1f} |")
        out.append("")
    return "\n".join(out)


def cli(
    reports: Path = shared("reports", Path("reports")),
    threads: int = shared("threads", None),
    layers: int = shared("layers", 4),
    new_tokens: int = shared("new_tokens", 24),
    reps: int = shared("reps", 5),
) -> None:
    """One MoE layer at batch-1 decode: quantkit's CPU kernel vs torch's ops vs ggml, and the bandwidth bound.

    --layers: MoE layers with their own weights (tokens read them from DRAM); --new-tokens: tokens per timed
    pass."""
    guard_reports(reports, "kernel")
    d = run(reports, resolve_threads(threads), layers, new_tokens, reps)
    print(f"wrote {reports / 'bench-kernel.md'} ({d['seconds']:.0f} s)")


def main(argv: list[str] | None = None) -> int:
    return run_command(cli, argv, "kernel")


if __name__ == "__main__":
    sys.exit(main())
