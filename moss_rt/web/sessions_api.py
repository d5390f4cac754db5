"""HTTP routes of directing sessions (moss_rt/session_store.py): create, list, notes, delete, audio, archives.

A session id is the capability to its takes (like a take id), so these routes need nothing else than it (and the
API key when one is configured, like every /api route). The WebSocket binds a connection to a session with
``resume`` (docs/protocol.md); everything a director does to stored takes outside of generating goes here.
The store blocks on the disk: every call runs on a worker thread.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiohttp import web

from moss_rt.audio import wav_bytes
from moss_rt.protocol import SAMPLE_RATE, ErrorCode, ProtocolError
from moss_rt.web.errors import error_response, protocol_error_response
from moss_rt.web.http_api import read_body_limited
from moss_rt.web.state import STATE

routes = web.RouteTableDef()

SID = r"{session_id:s_[A-Za-z0-9_-]{16,64}}"
TID = r"{take_id:[A-Za-z0-9_-]{1,64}}"


def _store(request: web.Request) -> Any:
    store = request.app[STATE].sessions
    if store is None:
        raise ProtocolError(ErrorCode.NOT_FOUND, "this service keeps no sessions (no data dir)", field="session")
    return store


def _session_json(store: Any, session_id: str, takes: list[Any]) -> web.Response:
    body = {"session": session_id, "takes": [t.public() for t in takes], "max_takes": store.max_takes}
    return web.json_response(body)


def _errors(handler: Any) -> Any:
    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            response: web.StreamResponse = await handler(request)
            return response
        except ProtocolError as err:
            return protocol_error_response(err)

    wrapped.__name__ = handler.__name__
    wrapped.__doc__ = handler.__doc__
    return wrapped


@routes.post("/api/sessions")
@_errors
async def create_session(request: web.Request) -> web.Response:
    store = _store(request)
    session_id = await asyncio.to_thread(store.create)
    return web.json_response({"session": session_id, "takes": [], "max_takes": store.max_takes})


@routes.get(f"/api/sessions/{SID}")
@_errors
async def get_session(request: web.Request) -> web.Response:
    store = _store(request)
    takes = await asyncio.to_thread(store.takes, request.match_info["session_id"])
    return _session_json(store, request.match_info["session_id"], takes)


@routes.get(f"/api/sessions/{SID}/takes/{TID}.wav")
@_errors
async def take_wav(request: web.Request) -> web.Response:
    """A stored take's audio as it was heard, as WAV."""
    store, sid, tid = _store(request), request.match_info["session_id"], request.match_info["take_id"]
    take = await asyncio.to_thread(store.get_take, sid, tid)
    pcm = await asyncio.to_thread(store.pcm, sid, tid)
    return web.Response(
        body=wav_bytes(pcm, SAMPLE_RATE, take.channels),
        content_type="audio/wav",
        headers={"Content-Disposition": f'attachment; filename="{tid}.wav"'},
    )


@routes.patch(f"/api/sessions/{SID}/takes/{TID}")
@_errors
async def take_notes(request: web.Request) -> web.Response:
    """The director's notes on a take: any of title, starred, note, markers."""
    try:
        body = await request.json()
    except ValueError:
        return error_response(ErrorCode.BAD_JSON, "the body must be a JSON object")
    if not isinstance(body, dict):
        return error_response(ErrorCode.BAD_MESSAGE, "the body must be a JSON object")
    store = _store(request)
    sid, tid = request.match_info["session_id"], request.match_info["take_id"]
    take = await asyncio.to_thread(store.update_notes, sid, tid, **body)
    return web.json_response(take.public())


@routes.delete(f"/api/sessions/{SID}/takes/{TID}")
@_errors
async def delete_take(request: web.Request) -> web.Response:
    store = _store(request)
    await asyncio.to_thread(store.delete_take, request.match_info["session_id"], request.match_info["take_id"])
    return web.json_response({"deleted": request.match_info["take_id"]})


@routes.get(f"/api/sessions/{SID}/archive")
@_errors
async def export_archive(request: web.Request) -> web.Response:
    """The whole session as one zip: session.json + takes/<id>.wav + takes/<id>.codes.npy."""
    store = _store(request)
    data = await asyncio.to_thread(store.export_archive, request.match_info["session_id"])
    stamp = time.strftime("%Y%m%d-%H%M")
    return web.Response(
        body=data,
        content_type="application/zip",
        headers={"Content-Disposition": f'attachment; filename="moss_rt-session-{stamp}.zip"'},
    )


@routes.post("/api/sessions/import")
@_errors
async def import_archive(request: web.Request) -> web.Response:
    """A new session from an exported archive (the body); answers its id and takes."""
    state, store = request.app[STATE], _store(request)
    limit = state.settings.limits.max_session_archive_bytes
    data = await read_body_limited(request, limit)
    session_id = await asyncio.to_thread(store.import_archive, data)
    takes = await asyncio.to_thread(store.takes, session_id)
    return _session_json(store, session_id, takes)
