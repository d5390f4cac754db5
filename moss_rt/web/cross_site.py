"""Defences against requests that a web page makes on another site's behalf (docs/security.md).

A page the user visits can make the browser send requests to a service on the user's machine or
network. Three checks stop it from driving moss_rt that way:

- **Host allowlist** (keyless servers only): a DNS-rebinding page resolves its own name to
  127.0.0.1, so the browser treats it as same-origin. Its requests still carry the page's name in
  ``Host``; a server without an API key answers only localhost names, loopback addresses, its own
  bind address and ``allowed_hosts``. A server with a key relies on the key (a page cannot have it).
- **Origin on state-changing requests** (POST, PUT, PATCH, DELETE): browsers send ``Origin`` on
  every such request, cross-site or not. It must be the service's own origin, or listed in
  ``allowed_origins`` / ``cors_origins``. Scripts send no ``Origin`` and pass (the key holds them).
- **JSON content type** where JSON is expected: the only body types a page may send cross-site
  without a preflight are ``text/plain`` and the form types, so a JSON route refuses those
  (a missing ``Content-Type`` is accepted: legacy scripts post bare JSON bytes).
"""

from __future__ import annotations

import ipaddress
import logging
import re
from urllib.parse import urlsplit

from aiohttp import web

from moss_rt.config import Settings
from moss_rt.protocol import ErrorCode, ProtocolError
from moss_rt.web.errors import error_response
from moss_rt.web.security import Handler
from moss_rt.web.state import STATE

log = logging.getLogger(__name__)

STATE_CHANGING_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
# Probes are answered whatever the Host: orchestrators call them by pod or node address.
HOST_EXEMPT_PATHS = frozenset({"/healthz", "/readyz"})
_HOST_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,253}$")
_WILDCARD_BINDS = frozenset({"", "0.0.0.0", "::", "*"})


def parse_host(host: str) -> str | None:
    """The lower-case name (or bare IP address) of a ``Host`` value ``name[:port]`` / ``[v6]:port``;
    None when it is malformed (never raises: the value comes straight from the client)."""
    try:
        parts = urlsplit("//" + host)
        name = parts.hostname
        _ = parts.port  # raises ValueError on a bad port
    except ValueError:
        return None
    if not name or parts.username is not None or parts.path or parts.query or parts.fragment:
        return None
    if host.startswith("["):
        try:
            return str(ipaddress.IPv6Address(name))
        except ValueError:
            return None
    return name if _HOST_NAME.match(name) else None


def is_local_name(name: str) -> bool:
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def host_allowed(settings: Settings, name: str) -> bool:
    """Whether a keyless server answers requests for ``name`` (see the module docstring)."""
    if settings.api_key or is_local_name(name):
        return True
    allowed = {h.strip().lower().rstrip(".") for h in settings.allowed_hosts}
    if "*" in allowed or name in allowed:
        return True
    bind = settings.host.strip().lower().strip("[]")
    return bind not in _WILDCARD_BINDS and name == bind


def _origin_of(scheme: str, host: str) -> str:
    return f"{scheme}://{host}".lower()


def same_origin(request: web.Request, origin: str) -> bool:
    """``origin`` is the page this service serves: same host:port, scheme http(s) (or the proxy's)."""
    schemes = {request.scheme, "https" if request.secure else "http"}
    forwarded_proto = request.headers.get("X-Forwarded-Proto")
    if forwarded_proto:
        schemes.add(forwarded_proto.strip().lower())
    return any(origin == _origin_of(scheme, request.host) for scheme in schemes)


def origin_allowed(request: web.Request, *extra_allowed: tuple[str, ...]) -> bool:
    """No ``Origin`` (not a browser), the service's own origin, or one listed in ``extra_allowed``
    (``*`` allows any)."""
    origin = request.headers.get("Origin")
    if origin is None:
        return True
    origin = origin.strip().lower()
    allowed = {o.strip().lower().rstrip("/") for group in extra_allowed for o in group}
    return "*" in allowed or origin in allowed or same_origin(request, origin)


def require_json_body(request: web.Request) -> None:
    """Refuse a body declared as anything but JSON (``application/json`` or ``*/*+json``)."""
    declared = request.headers.get("Content-Type")
    if declared is None:
        return
    media_type = declared.split(";", 1)[0].strip().lower()
    if media_type == "application/json" or (media_type.startswith("application/") and media_type.endswith("+json")):
        return
    raise ProtocolError(
        ErrorCode.UNSUPPORTED_MEDIA_TYPE,
        f"the body must be JSON (Content-Type: application/json), not {media_type[:64]!r}",
        field="Content-Type",
    )


def check_request(settings: Settings, request: web.Request) -> web.Response | None:
    """The Host and Origin checks of one request: None when it may go on, else the refusal."""
    host = request.headers.get("Host")  # absent only from HTTP/1.0 scripts; browsers always send it
    name = parse_host(host) if host is not None else "localhost"
    if name is None:
        return error_response(ErrorCode.BAD_MESSAGE, "malformed Host header", field="Host")
    if request.path not in HOST_EXEMPT_PATHS and not host_allowed(settings, name):
        log.info("refused %s %s for host %r from %s", request.method, request.path, name[:64], request.remote)
        return error_response(
            ErrorCode.FORBIDDEN_ORIGIN,
            f"host {name[:64]!r} is not served without an API key "
            "(list it in MOSS_RT_ALLOWED_HOSTS, or set an API key)",
            field="Host",
        )
    if request.method in STATE_CHANGING_METHODS and not origin_allowed(
        request, settings.allowed_origins, settings.cors_origins
    ):
        origin = request.headers.get("Origin", "")
        log.info("refused %s %s from origin %r (%s)", request.method, request.path, origin[:100], request.remote)
        return error_response(
            ErrorCode.FORBIDDEN_ORIGIN, f"origin {origin[:100]!r} may not call this service", field="Origin"
        )
    return None


@web.middleware
async def cross_site_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    refusal = check_request(request.app[STATE].settings, request)
    if refusal is not None:
        return refusal
    return await handler(request)
