"""HTTP routes of directing sessions (moss_rt/session_store.py): create, list, delete, share, notes, audio, archives.

A session belongs to the identity that created it (moss_rt/web/owners.py: the API key's principal, or the owner
cookie of a keyless server). Every route checks it: another identity is answered 404 ``not_found`` exactly as for
an id that does not exist. The owner may share a session read-only (``POST …/share``): whoever has the share
token may then list it, download its takes and export it (``?share=<token>``), until the owner revokes it.

The WebSocket binds a connection to a session with ``resume`` (docs/protocol.md); everything a director does to
stored takes outside of generating goes here. The store blocks on the disk: every call runs on a worker thread.
Audio and archives are streamed in pieces (a take from its file, an archive as it is packed), so what a download
holds never grows with the take or the session; imports are spooled to disk and unpacked within their bounds,
a few at a time (``max_concurrent_archives``, one per client).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import IO, Any

from aiohttp import web

from moss_rt.audio import wav_header
from moss_rt.protocol import FRAME_SAMPLES, SAMPLE_RATE, ErrorCode, ProtocolError
from moss_rt.protocol.frames import dumps_json
from moss_rt.session import new_take_id
from moss_rt.session_records import pcm_bytes, short_id
from moss_rt.session_store import SessionStore
from moss_rt.splices import parse_edit_request
from moss_rt.web.downloads import WRITE_CHUNK
from moss_rt.web.errors import error_response
from moss_rt.web.http_api import expect_within_limit, read_body_into, read_json_request, write_or_drop
from moss_rt.web.owners import owner_or_mint, request_owner, set_owner_cookie
from moss_rt.web.state import STATE
from moss_rt.web.thread_pipe import stream_from_thread

log = logging.getLogger(__name__)
routes = web.RouteTableDef()

SID = r"{session_id:s_[A-Za-z0-9_-]{16,64}}"
SPOOL_CHECK_BYTES = 16 * 1024 * 1024  # how often an import's spooled body looks at the data dir's room
TID = r"{take_id:[A-Za-z0-9_-]{1,64}}"


def _json(body: Any, *, status: int = 200) -> web.Response:
    """Strict JSON (never ``NaN``/``Infinity``, whatever a record holds)."""
    return web.json_response(body, status=status, dumps=dumps_json)


def _store(request: web.Request) -> SessionStore:
    store = request.app[STATE].sessions
    if store is None:
        raise ProtocolError(ErrorCode.NOT_FOUND, "this service keeps no sessions (no data dir)", field="session")
    return store


def _client(request: web.Request) -> str:
    return request.remote or "unknown"


async def _owned(request: web.Request, *, read_only: bool = False) -> tuple[SessionStore, str]:
    """The store and the session id of a request the caller may make: its owner's, or (``read_only``) one that
    carries the session's share token. Anyone else: ``not_found``."""
    store = _store(request)
    session_id = request.match_info["session_id"]
    share = request.query.get("share") if read_only else None
    await asyncio.to_thread(store.check_access, session_id, request_owner(request), share=share)
    return store, session_id


def _session_json(store: SessionStore, session_id: str, takes: list[Any], next_number: int) -> web.Response:
    body = {
        "session": session_id,
        "takes": [t.public() for t in takes],
        "max_takes": store.max_session_takes,
        "next_number": next_number,
    }
    return _json(body)


def _errors(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> Any:
    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except ProtocolError as err:
            headers = {"Retry-After": "1"} if err.code in (ErrorCode.BUSY, ErrorCode.RATE_LIMITED) else None
            return error_response(err.code, err.message, field=err.field, headers=headers)

    wrapped.__name__ = handler.__name__
    wrapped.__doc__ = handler.__doc__
    return wrapped


# --------------------------------------------------------------------------- sessions


@routes.post("/api/sessions")
@_errors
async def create_session(request: web.Request) -> web.Response:
    """A new empty session, owned by the caller (a keyless client without an owner cookie is given one)."""
    store = _store(request)
    owner, cookie = owner_or_mint(request)
    if owner is None:
        raise ProtocolError(ErrorCode.UNAUTHORIZED, "no identity to own a session")
    session_id = await asyncio.to_thread(store.create, owner=owner, client=_client(request))
    response = _json({"session": session_id, "takes": [], "max_takes": store.max_session_takes, "next_number": 1})
    set_owner_cookie(response, request, cookie)
    return response


@routes.get("/api/sessions")
@_errors
async def list_sessions(request: web.Request) -> web.Response:
    """The caller's sessions, most recently used first."""
    store = _store(request)
    owner = request_owner(request)
    sessions = [] if owner is None else await asyncio.to_thread(store.list_sessions, owner)
    return _json({"sessions": sessions})


@routes.get(f"/api/sessions/{SID}")
@_errors
async def get_session(request: web.Request) -> web.Response:
    store, session_id = await _owned(request, read_only=True)
    takes = await asyncio.to_thread(store.takes, session_id)
    return _session_json(store, session_id, takes, await asyncio.to_thread(store.next_number, session_id))


@routes.delete(f"/api/sessions/{SID}")
@_errors
async def delete_session(request: web.Request) -> web.Response:
    """The session, its takes and their files, for good."""
    store, session_id = await _owned(request)
    await asyncio.to_thread(store.delete_session, session_id)
    log.info("session %s deleted by its owner", short_id(session_id))
    return _json({"deleted": session_id})


@routes.post(f"/api/sessions/{SID}/share")
@_errors
async def share_session(request: web.Request) -> web.Response:
    """A read-only share token for the session (the same one until revoked)."""
    store, session_id = await _owned(request)
    token = await asyncio.to_thread(store.share, session_id)
    return _json({"session": session_id, "share": token, "path": f"/api/sessions/{session_id}?share={token}"})


@routes.delete(f"/api/sessions/{SID}/share")
@_errors
async def unshare_session(request: web.Request) -> web.Response:
    """Revoke the session's share token: its holders get 404 from now on."""
    store, session_id = await _owned(request)
    revoked = await asyncio.to_thread(store.unshare, session_id)
    return _json({"session": session_id, "revoked": revoked})


# --------------------------------------------------------------------------- takes


@routes.post(f"/api/sessions/{SID}/takes")
@_errors
async def create_edit(request: web.Request) -> web.Response:
    """A splice or comp of the session's stored takes (moss_rt/splices.py): ``{"kind": "splice"|"comp", "parts":
    [{"take", "from", "to"}], "crossfade", "title", "starred", "note"}``, assembled from their stored audio on a
    worker thread and kept as a take of the session; answers 201 with its record."""
    state = request.app[STATE]
    store, session_id = await _owned(request)
    body = await read_json_request(request)  # bad_json / too_large / unsupported_media_type, never a 500
    edit = parse_edit_request(body, max_parts=state.settings.limits.max_splice_parts)
    with state.edit_slots.hold(_client(request)):
        take, pcm = await asyncio.to_thread(store.put_edit, session_id, edit, new_take_id())
    if take.has_codes:
        # Held as heard: a replay, and the kept frames of a retake of it, are these samples (its codes alone would
        # decode to other audio around the joins).
        frame_bytes = FRAME_SAMPLES * take.channels * 2
        state.heard.begin(take.take_id, frame_bytes)
        state.heard.append(take.take_id, 0, pcm)
    log.info("session %s: %s %s of %d part(s) kept", short_id(session_id), take.kind, take.take_id, len(edit.parts))
    return _json(take.public(), status=201)


@routes.get(f"/api/sessions/{SID}/takes/{TID}.wav")
@_errors
async def take_wav(request: web.Request) -> web.StreamResponse:
    """A stored take's audio as it was heard, as WAV: its header, then the samples in pieces from its file."""
    store, session_id = await _owned(request, read_only=True)
    take_id = request.match_info["take_id"]
    take = await asyncio.to_thread(store.get_take, session_id, take_id)
    source = await asyncio.to_thread(store.open_pcm, session_id, take_id)  # not_found when missing or damaged
    try:
        n_bytes = pcm_bytes(take)
        header = wav_header(n_bytes, SAMPLE_RATE, take.channels)
        response = web.StreamResponse(
            headers={
                "Content-Type": "audio/wav",
                "Content-Disposition": f'attachment; filename="{take_id}.wav"',
                "Cache-Control": "no-store",
            }
        )
        response.content_length = len(header) + n_bytes
        try:
            await response.prepare(request)
            await write_or_drop(request, response, header)
            left = n_bytes
            while left > 0:
                piece = await asyncio.to_thread(source.read, min(WRITE_CHUNK, left))
                if not piece:  # shortened since it was opened: a cut file must not look whole
                    log.warning("stored take %s ended early while being sent", take_id)
                    if request.transport is not None:
                        request.transport.abort()
                    return response
                await write_or_drop(request, response, piece)
                left -= len(piece)
            await response.write_eof()
        except ConnectionResetError:
            log.info("download of stored take %s: client %s left or stopped reading", take_id, request.remote)
        return response
    finally:
        await asyncio.to_thread(source.close)


@routes.patch(f"/api/sessions/{SID}/takes/{TID}")
@_errors
async def take_notes(request: web.Request) -> web.Response:
    """The director's notes on a take: any of title, starred, note, markers (a JSON object, at most
    ``max_request_bytes``; any other key is refused)."""
    store, session_id = await _owned(request)
    body = await read_json_request(request)  # bad_json / too_large / unsupported_media_type, never a 500
    take = await asyncio.to_thread(store.update_notes, session_id, request.match_info["take_id"], **body)
    return _json(take.public())


@routes.delete(f"/api/sessions/{SID}/takes/{TID}")
@_errors
async def delete_take(request: web.Request) -> web.Response:
    store, session_id = await _owned(request)
    await asyncio.to_thread(store.delete_take, session_id, request.match_info["take_id"])
    return _json({"deleted": request.match_info["take_id"]})


# --------------------------------------------------------------------------- archives


@routes.get(f"/api/sessions/{SID}/archive")
@_errors
async def export_archive(request: web.Request) -> web.StreamResponse:
    """The whole session as one zip (session.json + takes/<id>.wav + takes/<id>.codes.npy), packed on a worker
    thread while it is sent: a few pieces in flight, whatever the session's size."""
    state = request.app[STATE]
    store, session_id = await _owned(request, read_only=True)
    with state.export_slots.hold(_client(request)):
        takes = await asyncio.to_thread(store.exportable_takes, session_id)
        stamp = time.strftime("%Y%m%d-%H%M")
        response = web.StreamResponse(
            headers={
                "Content-Type": "application/zip",
                "Content-Disposition": f'attachment; filename="moss_rt-session-{stamp}.zip"',
                "Cache-Control": "no-store",
            }
        )
        await response.prepare(request)

        def produce(out: IO[bytes]) -> None:
            store.write_archive(takes, session_id, out)

        async def send(piece: bytes) -> None:
            await write_or_drop(request, response, piece)

        try:
            await stream_from_thread(produce, send)
            await response.write_eof()
        except ConnectionResetError:
            log.info("export of session %s: client %s left or stopped reading", short_id(session_id), request.remote)
        except Exception:  # a take deleted meanwhile, a read error: the headers are out, so only a cut is left
            log.exception("export of session %s failed midway", short_id(session_id))
            if request.transport is not None:
                request.transport.abort()
        return response


@routes.post("/api/sessions/import", expect_handler=expect_within_limit)
@_errors
async def import_archive(request: web.Request) -> web.Response:
    """A new session from an exported archive (the body), owned by the caller; answers its id and takes.

    The body is spooled to a file (never held in memory), then checked and unpacked on a worker thread within
    the import bounds; the session appears whole or not at all."""
    state, store = request.app[STATE], _store(request)
    owner, cookie = owner_or_mint(request)
    if owner is None:
        raise ProtocolError(ErrorCode.UNAUTHORIZED, "no identity to own a session")
    client = _client(request)
    limit = state.settings.limits.max_session_archive_bytes
    with state.archive_slots.hold(client):
        declared = request.content_length
        if declared is not None and declared <= limit and declared > await asyncio.to_thread(store.room, client):
            raise ProtocolError(
                ErrorCode.INSUFFICIENT_STORAGE, "not enough storage for this archive; delete sessions to make room"
            )
        staging = await asyncio.to_thread(store.new_staging)
        try:
            spool = await asyncio.to_thread(open, staging / "upload.zip", "w+b")
            try:
                spooled = [0, 0]  # bytes written, bytes at the last look at the disk

                async def write(chunk: bytes) -> None:
                    await asyncio.to_thread(spool.write, chunk)
                    spooled[0] += len(chunk)
                    if spooled[0] - spooled[1] >= SPOOL_CHECK_BYTES:  # a body without Content-Length, or a full disk
                        spooled[1] = spooled[0]
                        if await asyncio.to_thread(store.room, client) < 0:
                            raise ProtocolError(ErrorCode.INSUFFICIENT_STORAGE, "not enough storage for this archive")

                await read_body_into(request, limit, write)
                await asyncio.to_thread(spool.seek, 0)
                codebook = state.engine.info.codebook_size
                work = asyncio.ensure_future(
                    asyncio.to_thread(store.import_archive, spool, owner=owner, client=client, codebook_size=codebook)
                )
                try:
                    session_id = await asyncio.shield(work)
                except asyncio.CancelledError:
                    # The client left. The thread cannot be stopped: wait for it (its slot stays taken meanwhile)
                    # and delete what it made, a session nobody was told about.
                    with contextlib.suppress(Exception):
                        orphan = await work
                        await asyncio.to_thread(store.delete_session, orphan)
                    raise
                except MemoryError:  # not expected within the bounds; never a 500 if it happens anyway
                    raise ProtocolError(ErrorCode.TOO_LARGE, "the archive is too large to import") from None
            finally:
                await asyncio.to_thread(spool.close)
        finally:
            await asyncio.to_thread(store.drop_staging, staging)
    takes = await asyncio.to_thread(store.takes, session_id)
    log.info("session %s imported with %d take(s)", short_id(session_id), len(takes))
    response = _session_json(store, session_id, takes, await asyncio.to_thread(store.next_number, session_id))
    set_owner_cookie(response, request, cookie)
    return response
