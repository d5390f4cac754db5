"""HTTP routes: the original playground's API (byte-compatible) plus health, info and downloads."""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web

from moss_rt import __version__
from moss_rt.audio import wav_bytes
from moss_rt.engine.base import EndReason, EngineBusy
from moss_rt.protocol import (
    SAMPLE_RATE,
    ErrorCode,
    ProtocolError,
    parse_stream_request,
)
from moss_rt.protocol.frames import decode_json_object
from moss_rt.session import DirectingSession
from moss_rt.web.errors import busy_response, error_response, protocol_error_response
from moss_rt.web.state import STATE
from moss_rt.web.takes import build_spec, resolve_model, stream_take

log = logging.getLogger(__name__)
routes = web.RouteTableDef()


async def read_body_limited(request: web.Request, limit: int) -> bytes:
    """Read a request body, refusing it before reading when it declares (or grows) past ``limit``."""
    if request.content_length is not None and request.content_length > limit:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"body of {request.content_length} bytes exceeds {limit}")
    data = await request.content.read(limit + 1)
    if len(data) > limit:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"body exceeds {limit} bytes")
    return data


@routes.get("/")
async def index(request: web.Request) -> web.StreamResponse:
    path = request.app[STATE].settings.static_dir / "index.html"
    return web.FileResponse(path, headers={"Cache-Control": "no-cache"})


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
            "details": info.details,
            "ready": state.engine.ready,
            "sr": SAMPLE_RATE,
            "limits": state.settings.limits.to_dict(),
        }
    )


@routes.get("/healthz")
async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


@routes.get("/readyz")
async def readyz(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.engine.ready and not state.shutting_down:
        return web.json_response({"status": "ready"})
    return web.json_response({"status": "shutting_down" if state.shutting_down else "loading"}, status=503)


@routes.get("/api/voices")
async def list_voices(request: web.Request) -> web.Response:
    voices = request.app[STATE].voices.list()
    return web.json_response({"voices": [v.public() for v in voices]})


@routes.post("/api/upload_ref")
async def upload_ref(request: web.Request) -> web.Response:
    state = request.app[STATE]
    try:
        ext = request.query.get("ext", "wav")
        data = await read_body_limited(request, state.settings.limits.max_upload_bytes)
        voice = await state.voices.add_upload(data, ext, name=request.query.get("name"))
    except ProtocolError as err:
        return protocol_error_response(err)
    return web.json_response(
        {"ref_id": voice.id, "duration": round(voice.duration, 3), "frames": voice.frames, "name": voice.name}
    )


@routes.post("/api/stream")
async def stream(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    t_request = time.monotonic()
    if state.shutting_down:
        return error_response(ErrorCode.BUSY, "the service is shutting down", headers={"Retry-After": "5"})
    try:
        body = await read_body_limited(request, state.settings.limits.max_request_bytes)
        start = parse_stream_request(decode_json_object(body or b"{}"), state.settings.limits)
        model = resolve_model(state, start.model)
        session = DirectingSession(state.takes, max_takes=1)
        plan = session.plan_start(start)
        spec = await build_spec(state, plan.take)
        handle = await state.engine.submit(spec)
    except ProtocolError as err:
        return protocol_error_response(err)
    except EngineBusy as busy:
        return busy_response(busy.retry_after_sec)

    response = web.StreamResponse(headers={"Content-Type": "application/octet-stream", "Cache-Control": "no-store"})
    try:
        await response.prepare(request)
        await stream_take(state, handle, plan.take, session, response.write, t_request=t_request, model=model)
        await response.write_eof()
    except (ConnectionResetError, asyncio.CancelledError):
        log.info("client left during take %s; cancelling it", plan.take.take_id)
        raise
    finally:
        # A client that disconnected (or any failure) must free the engine slot.
        handle.cancel(EndReason.CANCELLED)
    return response


@routes.get(r"/api/takes/{take_id:[A-Za-z0-9_-]{1,64}}.wav")
async def download_take(request: web.Request) -> web.Response:
    state = request.app[STATE]
    take = state.takes.get(request.match_info["take_id"])
    if take is None:
        return error_response(ErrorCode.NOT_FOUND, "no such take (it may have been evicted)", field="take")
    pcm = await state.engine.render(take.codes, take.request.channels)
    return web.Response(
        body=wav_bytes(pcm, SAMPLE_RATE, take.request.channels),
        content_type="audio/wav",
        headers={"Content-Disposition": f'attachment; filename="{take.take_id}.wav"'},
    )


@routes.get(r"/api/takes/{take_id:[A-Za-z0-9_-]{1,64}}")
async def take_summary(request: web.Request) -> web.Response:
    take = request.app[STATE].takes.get(request.match_info["take_id"])
    if take is None:
        return error_response(ErrorCode.NOT_FOUND, "no such take (it may have been evicted)", field="take")
    return web.json_response(take.summary())
