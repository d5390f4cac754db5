"""HTTP routes: the original playground's API (byte-compatible) plus health, info and downloads."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import HttpVersion11, web

from moss_rt import __version__
from moss_rt.engine.base import EngineBusy, EngineLoading
from moss_rt.formats import parse_audio_format
from moss_rt.protocol import (
    SAMPLE_RATE,
    ErrorCode,
    ProtocolError,
    parse_stream_request,
)
from moss_rt.protocol.frames import decode_json_object
from moss_rt.web.cross_site import check_request, require_json_body
from moss_rt.web.downloads import send_wav, take_pcm
from moss_rt.web.errors import busy_response, error_response, protocol_error_response
from moss_rt.web.format_download import send_encoded, wants_other_format
from moss_rt.web.http_take import admit_http_take
from moss_rt.web.openapi import openapi_document
from moss_rt.web.owners import owner_or_mint, set_owner_cookie, voice_owner
from moss_rt.web.security import bearer, is_authorized, issue_token, same_secret, unauthorized
from moss_rt.web.state import STATE

log = logging.getLogger(__name__)
routes = web.RouteTableDef()
BODY_CHUNK = 64 * 1024


async def read_body_limited(request: web.Request, limit: int) -> bytes:
    """Read a request body, refusing it before reading when it declares (or grows) past ``limit``.

    ``Content-Length`` is checked before a byte is read; a chunked body is read in pieces and
    cut off as soon as it passes the limit, so no more than ``limit`` + one chunk is ever held.
    A body that pauses longer than ``body_stall_timeout_sec``, or takes longer than
    ``body_read_timeout_sec`` in all, is refused with 408 ``timeout`` and its connection closed.
    """
    parts: list[bytes] = []

    async def keep(chunk: bytes) -> None:
        parts.append(chunk)

    await read_body_into(request, limit, keep)
    return b"".join(parts)


async def read_body_into(request: web.Request, limit: int, sink: Callable[[bytes], Awaitable[None]]) -> int:
    """Hand a request body to ``sink`` piece by piece (a file on disk: nothing held in memory) within the
    limits of :func:`read_body_limited`; returns its size."""
    if request.content_length is not None and request.content_length > limit:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"body of {request.content_length} bytes exceeds {limit}")
    settings = request.app[STATE].settings
    loop = asyncio.get_running_loop()
    deadline = loop.time() + settings.body_read_timeout_sec
    size = 0
    while True:
        wait = min(settings.body_stall_timeout_sec, deadline - loop.time())
        try:
            chunk = await asyncio.wait_for(request.content.read(min(BODY_CHUNK, limit + 1 - size)), max(0.0, wait))
        except TimeoutError:
            log.info("body from %s stalled after %d bytes; refusing it", request.remote, size)
            raise BodyTimeout(size) from None
        if not chunk:
            break
        size += len(chunk)
        if size > limit:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"body exceeds {limit} bytes")
        await sink(chunk)
    return size


class BodyTimeout(ProtocolError):
    """The client stopped sending its body; the answer closes the connection (the rest is unread)."""

    def __init__(self, received: int) -> None:
        super().__init__(
            ErrorCode.TIMEOUT,
            f"the request body stopped arriving (after {received} bytes); send it without pauses",
            field="body",
        )


async def read_json_request(request: web.Request) -> dict[str, Any]:
    """A JSON request body (415 for a non-JSON content type: a cross-site form or text/plain post is never
    JSON), within ``max_request_bytes``; an empty body is ``{}``."""
    require_json_body(request)
    body = await read_body_limited(request, request.app[STATE].settings.limits.max_request_bytes)
    return decode_json_object(body or b"{}")


def _body_limit_for(request: web.Request) -> int:
    limits = request.app[STATE].settings.limits
    if request.path == "/api/align":
        return limits.max_align_bytes
    if request.path == "/api/sessions/import":
        return limits.max_session_archive_bytes
    if request.path == "/api/scripts":
        return limits.max_script_bytes
    return limits.max_upload_bytes if request.path == "/api/upload_ref" else limits.max_request_bytes


async def expect_within_limit(request: web.Request) -> web.StreamResponse | None:
    """``Expect: 100-continue``: refuse an oversize or unauthenticated body before it is sent.

    aiohttp runs this before the middlewares, so the auth check is repeated here.
    """
    settings = request.app[STATE].settings
    refusal = check_request(settings, request)  # Host and Origin, as the middleware would
    if refusal is not None:
        return refusal
    if settings.api_key and not is_authorized(settings, request):
        return unauthorized()
    limit = _body_limit_for(request)
    if request.content_length is not None and request.content_length > limit:
        return error_response(ErrorCode.TOO_LARGE, f"body of {request.content_length} bytes exceeds {limit}")
    if request.version == HttpVersion11 and request.headers.get("Expect", "").lower() == "100-continue":
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the interim answer is not part of the response body
    return None


async def write_or_drop(request: web.Request, response: web.StreamResponse, frame: bytes) -> None:
    """Write one frame; a client that leaves it unread past the stall timeout is disconnected."""
    stall = request.app[STATE].settings.send_stall_timeout_sec
    try:
        await asyncio.wait_for(response.write(frame), stall)
    except TimeoutError:
        log.warning("HTTP stream client %s stopped reading for %.1f s; dropping it", request.remote, stall)
        if request.transport is not None:
            request.transport.abort()
        raise ConnectionResetError("client stopped reading") from None


@routes.get("/")
async def index(request: web.Request) -> web.StreamResponse:
    path = request.app[STATE].settings.static_dir / "index.html"
    response = web.FileResponse(path, headers={"Cache-Control": "no-cache"})
    # A keyless server gives the studio its owner cookie with the page, before it opens a session.
    set_owner_cookie(response, request, owner_or_mint(request)[1])
    return response


@routes.get("/api/models")
async def models(request: web.Request) -> web.Response:
    info = request.app[STATE].engine.info
    return web.json_response(
        {"models": list(info.models), "default": info.default_model, "demo": info.demo, "engine": info.name}
    )


@routes.get("/api/info")
async def service_info(request: web.Request) -> web.Response:
    state = request.app[STATE]
    info = state.engine.info
    return web.json_response(
        {
            "service": "moss_rt",
            "version": __version__,
            "engine": info.name,
            "models": list(info.models),
            "default_model": info.default_model,
            "demo": info.demo,
            "device": info.device,
            "status": info.status.value,
            # details.status: the same status, where clients read it before it had its own field.
            "details": {**info.details, "status": info.status.value},
            "ready": info.ready,
            "sr": SAMPLE_RATE,
            "limits": state.settings.limits.to_dict(),
            # The engine's start-up memory plan (slots x positions and where the memory goes), once made.
            "memory_plan": None if info.memory_plan is None else info.memory_plan.as_dict(),
            # Cluster mode: one entry per engine replica (docs/cluster.md).
            **({"replicas": [r.to_dict() for r in info.replicas]} if info.replicas else {}),
        }
    )


@routes.get("/healthz")
async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


@routes.get("/readyz")
async def readyz(request: web.Request) -> web.Response:
    state = request.app[STATE]
    info = state.engine.info
    # Cluster mode: ready while at least one replica is; the counts say how many.
    extra = (
        {"replicas": len(info.replicas), "replicas_ready": sum(r.ready for r in info.replicas)}
        if info.replicas
        else {}
    )
    if info.ready and not state.shutting_down:
        return web.json_response({"status": "ready", **extra})
    if state.engine_failure is not None:
        return web.json_response({"status": "failed", "error": state.engine_failure, **extra}, status=503)
    return web.json_response({"status": "shutting_down" if state.shutting_down else "loading", **extra}, status=503)


@routes.post("/api/upload_ref", expect_handler=expect_within_limit)
async def upload_ref(request: web.Request) -> web.Response:
    state = request.app[STATE]
    try:
        ext = request.query.get("ext", "wav")
        data = await read_body_limited(request, state.settings.limits.max_upload_bytes)
        voice = await state.voices.add_upload(data, ext, name=request.query.get("name"), owner=voice_owner(request))
    except ProtocolError as err:
        return protocol_error_response(err)
    return web.json_response(
        {"ref_id": voice.id, "duration": round(voice.duration, 3), "frames": voice.frames, "name": voice.name}
    )


@routes.post("/api/stream", expect_handler=expect_within_limit)
async def stream(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    t_request = time.monotonic()
    if state.shutting_down:
        return error_response(ErrorCode.BUSY, "the service is shutting down", headers={"Retry-After": "5"})
    try:
        start = parse_stream_request(await read_json_request(request), state.settings.limits)
        admitted = await admit_http_take(state, request.remote or "unknown", start, t_request=t_request)
    except ProtocolError as err:
        headers = {"Retry-After": "1"} if err.code == ErrorCode.RATE_LIMITED else None
        return error_response(err.code, err.message, field=err.field, headers=headers)
    except EngineBusy as busy:
        return busy_response(busy.retry_after_sec, loading=isinstance(busy, EngineLoading))

    response = web.StreamResponse(headers={"Content-Type": "application/octet-stream", "Cache-Control": "no-store"})

    async def send(frame: bytes) -> None:
        await write_or_drop(request, response, frame)

    take_id = admitted.take.take_id
    try:
        await response.prepare(request)
        await admitted.stream(send)
        await response.write_eof()
    except ConnectionResetError:
        # The client hung up (or was dropped for not reading): not a server error, nothing to answer.
        log.info("client left during take %s; cancelling it", take_id)
    except asyncio.CancelledError:
        log.info("request for take %s cancelled; cancelling the take", take_id)
        raise
    finally:
        admitted.release()  # a client that disconnected (or any failure) must free the engine slot
    return response


@routes.post("/api/token")
async def issue_browser_token(request: web.Request) -> web.Response:
    """Trade the API key (Bearer) for a short-lived token a browser may put on the WebSocket URL."""
    settings = request.app[STATE].settings
    if not settings.api_key:
        return web.json_response({"auth_required": False, "token": None, "expires_at": None, "expires_in": None})
    # Only the key itself buys a token: a token that leaked (URLs end up in logs) must not be able
    # to renew itself forever.
    if not same_secret(bearer(request) or "", settings.api_key):
        return error_response(ErrorCode.UNAUTHORIZED, "a token is issued for the API key only (Bearer <api key>)")
    token, expiry = issue_token(settings.api_key, settings.token_ttl_sec)
    return web.json_response(
        {"auth_required": True, "token": token, "expires_at": expiry, "expires_in": int(settings.token_ttl_sec)},
        headers={"Cache-Control": "no-store"},
    )


@routes.get("/api/openapi.json")
async def openapi_json(request: web.Request) -> web.Response:
    return web.json_response(openapi_document(request.app))


@routes.get(r"/api/takes/{take_id:[A-Za-z0-9_-]{1,64}}.wav")
async def download_take(request: web.Request) -> web.StreamResponse:
    """The take as 48 kHz WAV, or ``?format=`` mp3/opus/aac/flac/wav/pcm at ``?sample_rate=`` 48000/24000/16000."""
    state = request.app[STATE]
    take = state.takes.get(request.match_info["take_id"])
    if take is None:
        return error_response(ErrorCode.NOT_FOUND, "no such take (it may have been evicted)", field="take")
    fmt = None
    if wants_other_format(request.query):
        try:
            fmt = parse_audio_format(request.query.get("format", "wav"), request.query.get("sample_rate"))
        except ProtocolError as err:
            return protocol_error_response(err)

    async def write(response: web.StreamResponse, data: bytes) -> None:
        await write_or_drop(request, response, data)

    try:
        async with take_pcm(state, take, client=request.remote or "unknown") as pcm:
            if fmt is not None:
                return await send_encoded(request, take, pcm, fmt, write)
            return await send_wav(request, take, pcm, write)
    except EngineBusy as busy:  # its codes must be rendered, and renders or the job queue are full
        return busy_response(busy.retry_after_sec, loading=isinstance(busy, EngineLoading))
    except ProtocolError as err:  # its codes cannot be rendered (out of the codebook: damaged stored data)
        return protocol_error_response(err)


@routes.get(r"/api/takes/{take_id:[A-Za-z0-9_-]{1,64}}")
async def take_summary(request: web.Request) -> web.Response:
    take = request.app[STATE].takes.get(request.match_info["take_id"])
    if take is None:
        return error_response(ErrorCode.NOT_FOUND, "no such take (it may have been evicted)", field="take")
    return web.json_response(take.summary())
