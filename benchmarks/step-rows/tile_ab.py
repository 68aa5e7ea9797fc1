"""A/B of two builds of the CPU kernel's matrix call in one process: the same matrix and activation rows through
kernel A (main's build: rows in passes of 4, bf16 one activation row at a time, more than 4 bf16 rows in calls of
4) and kernel B (this tree's: passes of 8 on AVX512, bf16 rows sharing each weight load), calls alternating, the
outputs compared bit for bit. A matrix that fits L2 times the arithmetic; one of the head's size times the read.

    PYTHONPATH=. python benchmarks/step-rows/tile_ab.py A.so B.so THREADS N K FORMAT ROWS REPS
    e.g. ... ~/.cache/quantkit/kernels/qk_cpu-<main>/quantkit_qk_cpu_<main>.so \\
             ~/.cache/quantkit/kernels/qk_cpu-<this>/quantkit_qk_cpu_<this>.so 1 512 2048 int8 1,4,5,8,16 600

FORMAT: int8, int4 (g32 symmetric) or bf16. Prints per row count the best and median microseconds of each.
"""

import importlib.util
import sys
import time

import torch

from quantkit.formats import QuantSpec, get_format
from quantkit.runtime.kernels import prepare


def load(path: str):
    name = path.rsplit("/", 1)[1].split(".")[0]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


a_mod, b_mod = load(sys.argv[1]), load(sys.argv[2])
torch.set_num_threads(int(sys.argv[3]))
n, k, fmt = int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
rows = [int(r) for r in sys.argv[7].split(",")]
reps = int(sys.argv[8])
g = torch.Generator().manual_seed(0)
w = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)
if fmt == "bf16":
    kern = prepare(w, None, (n, k))
else:
    spec = QuantSpec("int4", 32, True) if fmt == "int4" else QuantSpec("int8")
    kern = prepare(get_format(spec.format).quantize(w, spec), spec, (n, k))


def call(mod, x: torch.Tensor, old: bool) -> torch.Tensor:
    if fmt != "bf16":
        return mod.linear(x, kern.qw, kern.scales, kern.zeros, kern.fmt_bits, kern.group, n)
    if old:  # main's step_batch: bf16 rows in calls of 4
        return torch.cat([mod.linear_bf16(x[i:i + 4], kern.w) for i in range(0, x.shape[0], 4)])
    return mod.linear_bf16(x, kern.w)


xs = {m: torch.randn(m, k, generator=g).to(torch.bfloat16) for m in rows}
times: dict[tuple[str, int], list[float]] = {}
outs: dict[tuple[str, int], torch.Tensor] = {}
for rep in range(reps):
    for m in rows:
        pair = (("A", a_mod), ("B", b_mod)) if rep % 2 == 0 else (("B", b_mod), ("A", a_mod))
        for name, mod in pair:
            t0 = time.perf_counter()
            y = call(mod, xs[m], name == "A")
            times.setdefault((name, m), []).append(time.perf_counter() - t0)
            outs.setdefault((name, m), y)
for m in rows:
    a, b = sorted(times[("A", m)]), sorted(times[("B", m)])
    same = torch.equal(outs[("A", m)], outs[("B", m)])
    print(f"rows {m:2d}: A best {a[0] * 1e6:9.1f} median {a[len(a) // 2] * 1e6:9.1f} | "
          f"B best {b[0] * 1e6:9.1f} median {b[len(b) // 2] * 1e6:9.1f} us | same bits {same}")
