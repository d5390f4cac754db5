"""Authentication, browser tokens, Origin and CORS checks, and JSON answers for every HTTP error.

All of it is optional: with no ``api_key`` every route is open, with no ``cors_origins`` no CORS
header is ever sent, and WebSocket upgrades are accepted from the page's own origin (plus
``allowed_origins``) or from clients that send no ``Origin`` at all (scripts, not browsers).

Browser tokens are stateless: ``v1.<expiry>.<nonce>.<hmac>`` signed with the API key, so they
need no storage and stop working when the key changes or the expiry passes.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import math
import secrets
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from moss_rt.config import Settings
from moss_rt.protocol import ErrorCode
from moss_rt.web.errors import error_response
from moss_rt.web.state import STATE

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# Reachable without credentials: liveness probes, the page itself (it asks for a key and trades it
# for a token), its static assets, and the API description.
OPEN_PATHS = frozenset({"/", "/healthz", "/readyz", "/favicon.ico", "/api/openapi.json"})
OPEN_PREFIXES = ("/static/",)
TOKEN_PREFIX = "v1"


# --------------------------------------------------------------------------- tokens


def _sign(key: str, payload: str) -> str:
    digest = hmac.new(key.encode(), payload.encode("utf-8", "surrogatepass"), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def issue_token(key: str, ttl_sec: float, *, now: float | None = None) -> tuple[str, int]:
    """A short-lived token derived from ``key``; returns (token, expiry as Unix seconds)."""
    expiry = int((time.time() if now is None else now) + ttl_sec)
    payload = f"{TOKEN_PREFIX}.{expiry}.{secrets.token_hex(8)}"
    return f"{payload}.{_sign(key, payload)}", expiry


def same_secret(given: str, expected: str) -> bool:
    """Constant-time comparison of a client's credential (any text, lone surrogates included: aiohttp
    decodes raw header bytes with surrogateescape) with a secret. ``hmac.compare_digest`` refuses
    non-ASCII ``str``, so both are compared as bytes."""
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), expected.encode("utf-8", "surrogatepass"))


def verify_token(key: str, token: str, *, now: float | None = None) -> bool:
    parts = token.split(".")
    if len(parts) != 4 or parts[0] != TOKEN_PREFIX or not parts[1].isascii() or not parts[1].isdigit():
        return False
    if len(token) > 200:
        return False
    payload = ".".join(parts[:3])
    if not same_secret(parts[3], _sign(key, payload)):
        return False
    return int(parts[1]) > (time.time() if now is None else now)


def bearer(request: web.Request) -> str | None:
    value = request.headers.get("Authorization", "")
    scheme, _, credential = value.partition(" ")
    return credential.strip() if scheme.lower() == "bearer" and credential.strip() else None


# The principal of the API key: whoever holds the key, or a browser token bought with it, acts as this one identity
# (what it creates, directing sessions, belongs to it).
API_KEY_PRINCIPAL = "api-key"


def key_principal(settings: Settings, request: web.Request) -> str | None:
    """The principal a request's credential names, or None (no key configured, or no valid credential).

    The API key or a valid token as a Bearer header; a token (never the key) as ``?token=``. Query tokens are
    accepted only on GET (the WebSocket upgrade and downloads), because a browser cannot set headers on those;
    they are short-lived precisely because URLs get logged.
    """
    key = settings.api_key
    if not key:
        return None
    credential = bearer(request)
    if credential is not None:
        return API_KEY_PRINCIPAL if same_secret(credential, key) or verify_token(key, credential) else None
    query_token = request.query.get("token")
    if request.method == "GET" and query_token is not None and verify_token(key, query_token):
        return API_KEY_PRINCIPAL
    return None


def is_authorized(settings: Settings, request: web.Request) -> bool:
    """No key configured, or the request's credential names a principal (see :func:`key_principal`)."""
    return not settings.api_key or key_principal(settings, request) is not None


def needs_auth(path: str) -> bool:
    return path not in OPEN_PATHS and not path.startswith(OPEN_PREFIXES)


def unauthorized() -> web.Response:
    return error_response(
        ErrorCode.UNAUTHORIZED,
        "missing or invalid credentials: send 'Authorization: Bearer <api key or token>' "
        "(browsers: get a token at POST /api/token and pass ?token= on the WebSocket URL)",
        headers={"WWW-Authenticate": 'Bearer realm="moss_rt"'},
    )


# --------------------------------------------------------------------------- origins


def _origin_of(url: str) -> str:
    # Plain string work: ``request.host`` comes from the client and may not parse as a URL ("[").
    return url.lower()


def websocket_origin_allowed(settings: Settings, request: web.Request) -> bool:
    """Same origin by default, plus ``allowed_origins`` (``*`` allows any).

    A browser always sends ``Origin`` on a WebSocket upgrade, and CORS does not protect
    WebSockets, so this check is what stops another site's page from driving the service with
    the visitor's network position. Non-browser clients send no Origin and are let through
    (they are held by the API key when one is configured).
    """
    origin = request.headers.get("Origin")
    if origin is None:
        return True
    origin = origin.strip().lower()
    allowed = {o.strip().lower().rstrip("/") for o in settings.allowed_origins}
    if "*" in allowed or origin in allowed:
        return True
    forwarded_proto = request.headers.get("X-Forwarded-Proto")
    schemes = {request.scheme, "https" if request.secure else "http"}
    if forwarded_proto:
        schemes.add(forwarded_proto.strip().lower())
    # The page and its socket share host:port; the scheme is http(s) for the page, not ws(s).
    return any(origin == _origin_of(f"{scheme}://{request.host}") for scheme in schemes)


def forbidden_origin(origin: str) -> web.Response:
    return error_response(
        ErrorCode.FORBIDDEN_ORIGIN, f"origin {origin[:100]!r} may not open this WebSocket", field="Origin"
    )


# --------------------------------------------------------------------------- middlewares


def _cors_headers(settings: Settings, request: web.Request) -> dict[str, str]:
    origin = request.headers.get("Origin")
    if not origin or not settings.cors_origins:
        return {}
    allowed = {o.strip().rstrip("/") for o in settings.cors_origins}
    if "*" not in allowed and origin not in allowed:
        return {}
    return {
        "Access-Control-Allow-Origin": origin,
        "Vary": "Origin",
        "Access-Control-Expose-Headers": "Retry-After",
    }


@web.middleware
async def cors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """CORS only for configured origins; preflights are answered here (they carry no credentials)."""
    settings = request.app[STATE].settings
    headers = _cors_headers(settings, request)
    if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
        if not headers:
            return error_response(ErrorCode.FORBIDDEN_ORIGIN, "cross-origin requests from this origin are not allowed")
        headers.update(
            {
                "Access-Control-Allow-Methods": "GET, POST, DELETE, OPTIONS",
                "Access-Control-Allow-Headers": "Authorization, Content-Type",
                "Access-Control-Max-Age": "600",
            }
        )
        return web.Response(status=204, headers=headers)
    response = await handler(request)
    if headers and not response.prepared:
        response.headers.update(headers)
    return response


def costs_work(request: web.Request) -> bool:
    """Requests the per-client rate applies to: anything that posts, patches or deletes, opens a directing
    socket, or sends a take's audio (a download, rendered or read from a session) or a session's archive.
    Pages, probes, metrics and listings are cheap and stay unlimited."""
    if request.method in ("POST", "DELETE", "PATCH"):
        return True
    path = request.path
    if request.method != "GET":
        return False
    if path == "/api/ws" or (path.startswith("/api/takes/") and path.endswith(".wav")):
        return True
    if path.startswith("/api/scripts/") and path.endswith(".zip"):
        return True
    return path.startswith("/api/sessions/") and (path.endswith(".wav") or path.endswith("/archive"))


@web.middleware
async def request_rate_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    rate = request.app[STATE].request_rate
    if rate.enabled and costs_work(request):
        retry_after = rate.admit(request.remote or "unknown")
        if retry_after is not None:
            log.info("refused %s %s from %s: request rate", request.method, request.path, request.remote)
            return error_response(
                ErrorCode.RATE_LIMITED,
                "too many requests from this client; slow down",
                headers={"Retry-After": str(max(1, math.ceil(retry_after)))},
            )
    return await handler(request)


@web.middleware
async def client_connections_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """At most ``max_connections_per_client`` requests in progress per client address (probes exempt)."""
    state = request.app[STATE]
    if request.path in ("/healthz", "/readyz"):
        return await handler(request)
    client = request.remote or "unknown"
    if not state.client_connections.try_acquire(client):
        log.info(
            "refused %s %s from %s: %d requests in progress",
            request.method,
            request.path,
            client,
            state.client_connections.open(client),
        )
        response = error_response(
            ErrorCode.RATE_LIMITED,
            f"this client already has {state.settings.max_connections_per_client} requests in progress",
            headers={"Retry-After": "1", "Connection": "close"},
        )
        response.force_close()
        return response
    try:
        return await handler(request)
    finally:
        state.client_connections.release(client)


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    settings = request.app[STATE].settings
    if settings.api_key and needs_auth(request.path) and not is_authorized(settings, request):
        log.info("refused unauthenticated %s %s from %s", request.method, request.path, request.remote)
        return unauthorized()
    return await handler(request)


def _code_for_status(status: int) -> ErrorCode:
    return {
        401: ErrorCode.UNAUTHORIZED,
        404: ErrorCode.NOT_FOUND,
        413: ErrorCode.TOO_LARGE,
        429: ErrorCode.RATE_LIMITED,
        503: ErrorCode.BUSY,
    }.get(status, ErrorCode.INTERNAL if status >= 500 else ErrorCode.BAD_MESSAGE)


@web.middleware
async def json_errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error answer is JSON ``{"error": {"code", "message"}}``, even aiohttp's own 404/405/413."""
    try:
        return await handler(request)
    except ConnectionResetError:  # the client left; there is nobody to answer
        raise
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        headers = {k: v for k, v in exc.headers.items() if k in ("Allow", "Retry-After", "WWW-Authenticate")}
        response = error_response(_code_for_status(exc.status), exc.reason, headers=headers)
        response.set_status(exc.status, exc.reason)
        return response
    except Exception:
        # A bug, not bad input: log it with its traceback, answer a stable code, keep serving.
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(ErrorCode.INTERNAL, "internal error")
