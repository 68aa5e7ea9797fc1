"""Generation with and without MTP drafts, on every route the kernel offers."""

from __future__ import annotations

from quantkit.kernels import cpu as kernel_cpu
from quantkit.runtime import SamplingParams
from quantkit.runtime.generate import stream_tokens

MTP_ROUTES = ["stack", "torch"] if kernel_cpu.available() else ["torch"]

PROMPT = [{"role": "user", "content": "write a long story about rivers, files and folders"}]


def generate_tokens(rt, draft: int, n: int = 40, **kw) -> tuple[list[int], dict | None]:
    sp = SamplingParams(**{"temperature": 0, "max_new_tokens": n, "ignore_eos": True, **kw})
    ids = rt.render_ids(PROMPT)[1]
    resp = None
    for e in stream_tokens(rt.model, rt.tokenizer, ids, sampling=sp, stop_ids=set(), context=512, devices=["cpu"],
                           thinking=True, mtp=draft):
        resp = e.response or resp
    return resp.token_ids, resp.mtp
