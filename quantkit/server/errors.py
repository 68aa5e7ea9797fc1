"""The server's one error type: an OpenAI error object (`{"error": {"message", "type", "param", "code"}}`)
with its HTTP status; `validation_error` turns pydantic's errors into one naming the field as the user wrote it."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from quantkit.server.schemas import ErrorInfo, ErrorResponse


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        body = ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.code))
        return JSONResponse(body.model_dump(), status_code=self.status, headers=self.headers)


_ROLE_TAGS = {"system", "developer", "user", "assistant", "tool"}
_TYPE_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}


def _param(loc: tuple[Any, ...]) -> str | None:
    """pydantic's error location as the request path a user wrote (`messages[0].content`), without the
    union-branch and discriminator labels pydantic inserts."""
    out = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _TYPE_TAGS or "[" in part or part[:1].isupper() or (
                part in _ROLE_TAGS and i > 0 and isinstance(loc[i - 1], int)):
            continue
        else:
            out += f".{part}" if out else part
    return out or None


def validation_error(e: ValidationError) -> ApiError:
    errs = e.errors(include_url=False)
    for err in errs:
        if err["type"] == "json_invalid":
            return ApiError(400, f"malformed JSON body: {err.get('ctx', {}).get('error', err['msg'])}",
                            code="invalid_json")
    err = errs[0]
    param = _param(err["loc"])
    if err["type"] == "union_tag_invalid":
        param = f"{param}.role" if param else "role"
        got = err.get("ctx", {}).get("tag")
        msg = f"unknown role {got!r} in {param}: expected one of system, developer, user, assistant, tool"
    elif err["type"] == "missing":
        msg = f"missing required field {param}"
    else:
        msg = f"{param}: {err['msg']}" if param else err["msg"]
    others = {_param(x["loc"]) for x in errs} - {_param(err["loc"])}
    if others:
        msg += f" (and {len(others)} more problem{'s' if len(others) > 1 else ''}: {', '.join(sorted(map(str, others)))})"
    return ApiError(400, msg, param=param, code="missing_field" if err["type"] == "missing" else err["type"])


