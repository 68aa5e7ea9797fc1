"""int8: symmetric, one scale per output channel.

Parts: `qweight` int8 [..., out, in] and `scales` bf16 [..., out], w = qweight * scales. bf16 scales
are what torch's `_weight_int8pack_mm(x_bf16, qweight, scales)` takes, so the runtime uses the stored
tensors as they are.
"""

from __future__ import annotations

import torch

from quantkit.formats import Part, QuantSpec, register
from quantkit.formats.common import ErrorSums, check_matrix, out_buffer, row_sq, run_chunks
from quantkit.kernels import quant as quant_kernel


class Int8:
    name = "int8"
    fills_buffers = True  # quantize takes out= and sums= (the streaming quantizer's fast path)

    default_group = None  # one scale per output row

    def parts(self, spec: QuantSpec, shape: tuple[int, ...]) -> dict[str, Part]:
        return {"qweight": Part(tuple(shape), "int8", "weight"), "scales": Part(tuple(shape[:-1]), "bfloat16", "scales")}

    def quantize(self, w: torch.Tensor, spec: QuantSpec, out: dict[str, torch.Tensor] | None = None,
                 sums: ErrorSums | None = None) -> dict[str, torch.Tensor]:
        """`out`: preallocated parts to fill; `sums`: gathers the squared error of the stored weights
        (scale^2 x the squared code residual, as int4 measures it)."""
        check_matrix(w, None, self.name)
        cols = w.shape[-1]
        flat = w.reshape(-1, cols)
        q = out_buffer(out, "qweight", tuple(flat.shape), torch.int8)
        scales = out_buffer(out, "scales", (flat.shape[0],), torch.bfloat16)

        fast = quant_kernel.ops() if flat.dtype == torch.bfloat16 and flat.is_contiguous() and flat.device.type == "cpu" \
            else None

        def work(sl: slice) -> None:
            if fast is not None:  # the same bytes as below, in one pass (kernels/quant.py)
                e, r = quant_kernel.int8_row(fast, flat[sl], q[sl], scales[sl])
                if sums is not None:
                    sums.add(sl, e, r)
                return
            x = flat[sl].float()
            s = (x.abs().amax(dim=1) / 127.0).to(torch.bfloat16)  # the inf-norm gives the same, far slower
            sf = s.float()
            inv = torch.where(sf > 0, 1.0 / sf, torch.zeros_like(sf))
            t = x * inv[:, None]
            r = torch.clamp(t, -127, 127).round_()
            q[sl].copy_(r)  # cast while copying (r holds integers in range): no int8 temporary
            scales[sl] = s
            if sums is not None:
                r.sub_(t)
                per_row = torch.linalg.vector_norm(r, dim=1, dtype=torch.float32).double().pow_(2)
                err = float(per_row.mul_(sf.double().pow(2)).sum())
                sums.add(sl, err, row_sq(x))

        run_chunks(flat.shape[0], cols, work)
        return {"qweight": q.reshape(w.shape), "scales": scales.reshape(w.shape[:-1])}

    def dequantize(
        self, parts: dict[str, torch.Tensor], spec: QuantSpec, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor:
        w = parts["qweight"].float() * parts["scales"].float()[..., None]
        return w.reshape(shape).to(dtype)


INT8 = register(Int8())
