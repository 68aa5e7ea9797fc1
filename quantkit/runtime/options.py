"""Every switch that changes how a loaded model computes, in one `RuntimeOptions`.

The switches are filled in one place: by the caller (`load_model(..., options=)`, the CLI), or from the
environment by `RuntimeOptions.from_env()` when a load is given none. Nothing in quantkit/runtime reads an
environment variable at import time, so importing the package never depends on (or freezes) a switch.

Environment inputs (kept for scripts and tests):
- QUANTKIT_ROUTE: the one-token route kind (stack, fused, torch, cuda-graph; runtime/model/route.py);
- QUANTKIT_CPU_ISA: the CPU kernel's level (generic, avx2, avx512, LEVEL-plain without its extension, or
  none/off for torch's kernels only; kernels/cpu.py), applied when the kernel module first loads;
- QUANTKIT_MXFP4_ROUTE: int4x2 (an exact int4 pair, the default) or dequant (runtime/kernels.py).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace

from quantkit.kernels import cpu as cpu_kernel
from quantkit.kernels.cpu import CPU_ISA_ENV

ROUTE_ENV = "QUANTKIT_ROUTE"
MXFP4_ROUTE_ENV = "QUANTKIT_MXFP4_ROUTE"
MXFP4_ROUTES = ("int4x2", "dequant")
# how prompts compute in the batch's steps (`Runtime.set_prefill`): the T-token arithmetic, or as rows
PREFILL_KINDS = ("tokens", "rows")


@dataclass(frozen=True)
class RuntimeOptions:
    """The switches of one load. `route`: a one-token route kind to force (None: the best this model and
    machine can run); `route_source`: how a refused route is named in the load's note (the variable it came
    from, or "route"); `cpu_isa`: the CPU kernel's level as QUANTKIT_CPU_ISA spells it ("" the best);
    `mxfp4_route`: how MXFP4 matrices run; `kernel_route`: a route forced on every matrix ("torch" for
    torch's packed ops, "dequant" for the generic fallback; tests and benchmarks); `mtp`: drafts per verify
    from the MTP layer (None: tuned at run time)."""

    route: str | None = None
    route_source: str = "route"
    cpu_isa: str = ""
    mxfp4_route: str = "int4x2"
    kernel_route: str | None = None
    mtp: int | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RuntimeOptions:
        """The options the environment asks for (`environ`: os.environ when None); unset variables leave
        the defaults."""
        env = os.environ if environ is None else environ
        route = env.get(ROUTE_ENV, "").strip().lower() or None
        return cls(route=route, route_source=ROUTE_ENV if route else "route",
                   cpu_isa=env.get(CPU_ISA_ENV, "").strip().lower(),
                   mxfp4_route=env.get(MXFP4_ROUTE_ENV, "").strip().lower() or "int4x2")

    def with_(self, **changes: object) -> RuntimeOptions:
        """A copy with `changes` (dataclasses.replace)."""
        return replace(self, **changes)  # type: ignore[arg-type]

    @property
    def torch_only(self) -> bool:
        """QUANTKIT_CPU_ISA=none (or off): quantkit's CPU kernel is not loaded, torch's kernels run."""
        return cpu_kernel.torch_only(self.cpu_isa)

    @property
    def plain(self) -> bool:
        """LEVEL-plain: the level without its extension (AVX-VNNI, AVX512-BF16)."""
        return cpu_kernel.plain(self.cpu_isa)

    @property
    def isa_level(self) -> str:
        """The level asked for without the -plain suffix ("" for the best)."""
        return cpu_kernel.isa_level(self.cpu_isa)
