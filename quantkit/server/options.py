"""A request's generation options, checked: sampling, penalties, logprobs, choices, structured output.

`GenOptions.from_request(req, ...)` reads the fields /v1/chat/completions and /v1/completions share and
raises `ApiError` (400, naming the field and the value) for what is out of range or not served; every field
that changes the answer is applied (penalties, min_p and logit_bias through quantkit/server/logits.py, a
grammar through quantkit/server/grammar.py) or refused, never ignored. `hook(prompt_ids, opens_reasoning)`
makes the per-generation logits hook (None when nothing needs one, so a plain request costs nothing).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from quantkit.server.errors import ApiError
from quantkit.server.logits import LogitsHook, Penalties
from quantkit.server.schema_check import check_schema

MAX_N = 8  # choices per request (generated one after another)
_TOKEN_ID = re.compile(r"-?[0-9]{1,20}")
# Below this a temperature samples greedily, as vLLM does (its _SAMPLING_EPS): logits divided by a smaller one
# overflow float32 (1e-300 rounds to 0), and the distribution is already the argmax's.
MIN_TEMPERATURE = 1e-5


def sampling_temperature(t: float | None) -> float | None:
    """The temperature the runtime samples at for a request's `temperature` (None: the model's default)."""
    return 0.0 if t is not None and t < MIN_TEMPERATURE else t


def _bias(raw: dict[str, float] | None, vocab: int) -> dict[int, float] | None:
    if not raw:
        return None
    out = {}
    for k, v in raw.items():
        # decimal ASCII digits only: int() also reads " 5 ", "1_0" and other scripts' digits as a token id
        if not _TOKEN_ID.fullmatch(k):
            raise ApiError(400, f"logit_bias key {k[:40]!r} is not a token id (write it in decimal digits)",
                           param="logit_bias")
        t = int(k)
        if not 0 <= t < vocab:
            raise ApiError(400, f"logit_bias token id {t} is outside the vocabulary (0..{vocab - 1})",
                           param="logit_bias")
        if not -100 <= v <= 100:
            raise ApiError(400, f"logit_bias value {v} for token {t} must be in [-100, 100]", param="logit_bias")
        out[t] = float(v)
    return out


def response_format_schema(rf: dict[str, Any] | None) -> tuple[bool, dict[str, Any] | None]:
    """(constrained?, schema) of a `response_format`: text -> (False, None); json_object -> (True, None);
    json_schema -> (True, its schema)."""
    if rf is None:
        return False, None
    kind = rf.get("type")
    if kind == "text":
        return False, None
    if kind == "json_object":
        return True, None
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
            raise ApiError(400, "response_format.json_schema.schema is missing or not a JSON object",
                           param="response_format")
        check_schema(js["schema"], "response_format.json_schema.schema")
        return True, js["schema"]
    raise ApiError(400, f"response_format type {kind!r} is not one of text, json_object, json_schema",
                   param="response_format")


@dataclass
class GenOptions:
    n: int
    penalties: Penalties
    top_logprobs: int | None  # None: no logprobs

    @classmethod
    def from_request(cls, req: Any, *, vocab: int, max_n: int = MAX_N, top_logprobs: int | None = None) -> GenOptions:
        n = req.n or 1
        if n > max_n:
            raise ApiError(400, f"n {n}: at most {max_n} choices per request (they are generated one after "
                                "another); ask for fewer", param="n")
        pen = Penalties(presence=req.presence_penalty or 0.0, frequency=req.frequency_penalty or 0.0,
                        repetition=req.repetition_penalty or 1.0, min_p=req.min_p or 0.0,
                        logit_bias=_bias(req.logit_bias, vocab))
        return cls(n=n, penalties=pen, top_logprobs=top_logprobs)

    def hook(self, prompt_ids: list[int], temperature: float, constraint: Any = None) -> LogitsHook | None:
        if self.penalties.neutral and self.top_logprobs is None and constraint is None:
            return None
        return LogitsHook(prompt_ids, penalties=self.penalties, temperature=temperature,
                          top_logprobs=self.top_logprobs, constraint=constraint)
