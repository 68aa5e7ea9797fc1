"""What the server lets in, checked before any route runs (an ASGI middleware, `Guard`):

- the `Host` header must name the server: loopback names (localhost, 127.0.0.1, ::1) by default, the bound
  address, and what `--allowed-hosts` adds (`*` for any). A web page that rebinds its own DNS name to
  127.0.0.1 sends its own name as Host, and gets 403 (DNS rebinding);
- with an API key (`--api-key` or QUANTKIT_API_KEY), every endpoint but /health needs
  `Authorization: Bearer KEY` (or `x-api-key: KEY`), compared in constant time; 401 otherwise;
- a POST from a browser page (it carries an `Origin` header) must be declared `application/json`: a page can
  post `text/plain` or a form cross-origin without a CORS preflight, never JSON; 415 otherwise. A request
  without an Origin (curl, scripts, SDKs) may leave the content type out or say another one (`curl -d`
  says a form), as llama-server allows: its body is parsed as JSON all the same (400 when it is not). An
  origin listed by --cors-origin is trusted like a client without one.

Errors are OpenAI error objects, as every other error of the server."""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Iterable
from typing import Any

from starlette.responses import JSONResponse

from quantkit.server.schemas import ErrorInfo, ErrorResponse

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARD_BINDS = ("0.0.0.0", "::", "")
API_KEY_ENV = "QUANTKIT_API_KEY"


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The name in a Host header, without port or IPv6 brackets, lower case."""
    h = header.strip().lower()
    if h.startswith("["):
        return h[1:h.find("]")] if "]" in h else h
    return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


def allowed_host_names(bind: str, extra: Iterable[str]) -> frozenset[str]:
    names = set(LOOPBACK_NAMES)
    if bind not in WILDCARD_BINDS:
        names.add(host_name(bind) if not bind.startswith("[") else bind.strip("[]").lower())
        names.add(bind.lower())
    names.update(h.strip().lower().strip("[]") for h in extra if h.strip())
    return frozenset(names)


def _error(status: int, message: str, type_: str, code: str, param: str | None = None,
           headers: dict[str, str] | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=type_, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


class Guard:
    """ASGI middleware: Host check, API key, JSON content type (see the module docstring)."""

    def __init__(self, app: Any, *, hosts: frozenset[str], api_key: str | None,
                 open_paths: tuple[str, ...] = ("/health",), cors_origins: tuple[str, ...] = ()):
        self.app, self.hosts, self.api_key, self.open_paths = app, hosts, api_key, open_paths
        self.origins = frozenset(o.rstrip("/").lower() for o in cors_origins)

    def _check(self, scope: dict[str, Any]) -> JSONResponse | None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        host = host_name(headers.get("host", ""))
        if "*" not in self.hosts and host not in self.hosts and not is_loopback(host):
            return _error(403, f"Host {headers.get('host', '')!r} is not allowed: this server answers to "
                               f"{', '.join(sorted(self.hosts))} (start it with --allowed-hosts NAME to add one)",
                          "permission_error", "host_not_allowed")
        if self.api_key and scope.get("path") not in self.open_paths:
            auth = headers.get("authorization", "")
            given = auth[7:].strip() if auth[:7].lower() == "bearer " else headers.get("x-api-key", "")
            if not hmac.compare_digest(given.encode(), self.api_key.encode()):
                return _error(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY'",
                              "authentication_error", "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        if scope.get("method") == "POST":
            ctype = headers.get("content-type", "").split(";")[0].strip().lower()
            origin = headers.get("origin")
            trusted = origin is None or "*" in self.origins or origin.rstrip("/").lower() in self.origins
            if ctype != "application/json" and not trusted:
                return _error(415, f"Content-Type {ctype or 'missing'!r} is not accepted from a web page (Origin "
                                   f"{origin!r}): send the body as application/json",
                              "invalid_request_error", "unsupported_media_type")
        return None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            refused = self._check(scope)
            if refused is not None:
                await refused(scope, receive, send)
                return
        await self.app(scope, receive, send)
