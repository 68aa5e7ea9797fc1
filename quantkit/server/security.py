"""What the server lets in, checked before any route runs, by three ASGI middlewares in this order
(`install` adds them): `HostGuard`, then `Cors` (only with --cors-origin), then `Guard`:

- the `Host` header must name the server: loopback names (localhost, 127.0.0.1, ::1) by default, the bound
  address, and what `--allowed-hosts` adds (`*` for any). A web page that rebinds its own DNS name to
  127.0.0.1 sends its own name as Host, and gets 403 (DNS rebinding). This comes first, CORS preflights
  included: a server never tells a foreign Host which origins it trusts;
- a CORS preflight (OPTIONS with Origin and Access-Control-Request-Method) is answered before the API key
  is asked for, since browsers send none with it; one from an origin, method or header not allowed is a
  400 error object naming what was refused;
- with an API key (`--api-key` or QUANTKIT_API_KEY), every endpoint but /health needs
  `Authorization: Bearer KEY` (or `x-api-key: KEY`), compared in constant time; 401 otherwise;
- a POST from a browser page (it carries an `Origin` header) must be declared `application/json`: a page can
  post `text/plain` or a form cross-origin without a CORS preflight, never JSON; 415 otherwise. A request
  without an Origin (curl, scripts, SDKs) may leave the content type out or say another one (`curl -d`
  says a form), as llama-server allows: its body is parsed as JSON all the same (400 when it is not). An
  origin listed by --cors-origin is trusted like a client without one.

Errors are OpenAI error objects, as every other error of the server.

An API key must be printable ASCII (`check_api_key`): HTTP clients (httpx and so the openai SDK, browsers'
fetch) refuse to send other characters in a header, so a key holding them could never be given."""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Iterable
from typing import Any

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse, Response

from quantkit.errors import QuantkitError
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


def check_api_key(key: str, name: str = "the API key") -> str:
    """`key` when an HTTP header can carry it (printable ASCII, no space at either end); else QuantkitError
    naming the position of the first character that cannot be sent (not the character: the key is secret)."""
    for i, c in enumerate(key):
        if not " " <= c <= "~":
            raise QuantkitError(f"{name}: character {i + 1} of {len(key)} is not printable ASCII; HTTP clients "
                                "(the openai SDK, httpx, browsers) cannot send it in a header, so no request "
                                "could give this key: use letters, digits and punctuation")
    if key != key.strip():
        raise QuantkitError(f"{name} starts or ends with a space, which HTTP strips from a header: remove it")
    return key


def _headers(scope: dict[str, Any]) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}


class HostGuard:
    """ASGI middleware: the Host check, before anything else answers (see the module docstring)."""

    def __init__(self, app: Any, *, hosts: frozenset[str]):
        self.app, self.hosts = app, hosts

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            given = _headers(scope).get("host", "")
            host = host_name(given)
            if "*" not in self.hosts and host not in self.hosts and not is_loopback(host):
                refused = _error(403, f"Host {given!r} is not allowed: this server answers to "
                                      f"{', '.join(sorted(self.hosts))} (start it with --allowed-hosts NAME to "
                                      "add one)", "permission_error", "host_not_allowed")
                await refused(scope, receive, send)
                return
        await self.app(scope, receive, send)


_CORS_WHY = {"origin": "the origin {origin!r} is not allowed (start the server with --cors-origin {origin} to "
                       "allow it)",
             "method": "the method {method!r} is not allowed ({methods} are)",
             "headers": "the headers {headers!r} are not all allowed ({allowed} are)",
             "private-network": "private network access is not allowed"}


class Cors(CORSMiddleware):
    """Starlette's CORS middleware, whose preflight refusals are OpenAI error objects instead of plain text."""

    def preflight_response(self, request_headers: Headers) -> Response:
        resp = super().preflight_response(request_headers=request_headers)
        if resp.status_code < 400:
            return resp
        failures = bytes(resp.body).decode().removeprefix("Disallowed CORS ").split(", ")
        values = {"origin": request_headers.get("origin"),
                  "method": request_headers.get("access-control-request-method"),
                  "headers": request_headers.get("access-control-request-headers"),
                  "methods": ", ".join(sorted(self.allow_methods)),
                  "allowed": ", ".join(sorted(self.allow_headers))}
        why = "; ".join(_CORS_WHY.get(f, f"{f} is not allowed").format(**values) for f in failures)
        keep = {k: v for k, v in resp.headers.items() if k not in ("content-length", "content-type")}
        return _error(resp.status_code, f"CORS preflight refused: {why}", "invalid_request_error", "cors_refused",
                      headers=keep)


class Guard:
    """ASGI middleware: API key, JSON content type (see the module docstring)."""

    def __init__(self, app: Any, *, api_key: str | None, open_paths: tuple[str, ...] = ("/health",),
                 cors_origins: tuple[str, ...] = ()):
        self.app, self.api_key, self.open_paths = app, api_key, open_paths
        self.origins = frozenset(o.rstrip("/").lower() for o in cors_origins)

    def _check(self, scope: dict[str, Any]) -> JSONResponse | None:
        headers = _headers(scope)
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


def install(app: Any, *, hosts: frozenset[str], api_key: str | None, cors_origins: tuple[str, ...]) -> None:
    """Add the three middlewares to a Starlette `app` (the last added runs first): Host, CORS, key."""
    app.add_middleware(Guard, api_key=api_key, cors_origins=cors_origins)
    if cors_origins:  # inside the Host check, outside the key: a preflight carries no API key
        app.add_middleware(Cors, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type", "X-Api-Key"], max_age=600)
    app.add_middleware(HostGuard, hosts=hosts)
