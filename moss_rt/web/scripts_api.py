"""HTTP routes of script renders (moss_rt/scripts, docs/scripts.md).

    POST   /api/scripts                         a script (JSON, or text/plain) → 201 {"script", "lines", "session"}
    GET    /api/scripts?session=s_…             the scripts of a session
    GET    /api/scripts/{id}                    state, and per line its status, take, seed, duration
    GET    /api/scripts/{id}/events             server-sent events: state (first), progress, line, done, error
    GET    /api/scripts/{id}.zip                lines, mix, cue sheets, captions (?format=, ?sample_rate=, ?partial=)
    DELETE /api/scripts/{id}
    POST   /api/scripts/{id}/lines/{n}/retake   render line n again: text, instruction, seed, frame (202)
    POST   /api/scripts/{id}/lines/{n}/accept   make a take of the session line n's take: {"take": id}

A script is its session's: whoever may reach the session (moss_rt/web/owners.py: the API key's principal, or the
owner cookie of a keyless server) may reach its scripts, and anyone else is answered 404 ``not_found`` exactly as
for a script that does not exist. The read-only GETs (state, events, zip, the listing) also take the session's
share token (``?share=``), as the session's own downloads do. A new script's session is owned by the caller (a
keyless client without an owner cookie is given one with the 201). Blocking work (SQLite, files) runs on worker
threads inside the service.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web

from moss_rt.engine.base import EngineBusy
from moss_rt.formats import parse_audio_format
from moss_rt.generation import FRAME_RATE, frame_at_time
from moss_rt.protocol import ErrorCode, ProtocolError
from moss_rt.protocol.frames import decode_json_object
from moss_rt.protocol.messages import SEED_FIELD
from moss_rt.protocol.schema import Field, short_repr, validate_fields
from moss_rt.scripts.export import ScriptExport
from moss_rt.scripts.format import Script, ScriptError, parse_cast, parse_json_script, parse_text_script
from moss_rt.scripts.job import Job
from moss_rt.scripts.service import ScriptService
from moss_rt.scripts.store import SCRIPT_ID_PATTERN
from moss_rt.session_records import SESSION_ID
from moss_rt.web.errors import busy_response, error_response
from moss_rt.web.format_download import wants_other_format
from moss_rt.web.http_api import expect_within_limit, read_body_limited, write_or_drop
from moss_rt.web.owners import owner_or_mint, request_owner, set_owner_cookie
from moss_rt.web.state import STATE

log = logging.getLogger(__name__)
routes = web.RouteTableDef()

SCRIPT = f"{{script_id:{SCRIPT_ID_PATTERN}}}"
LINE = r"{line:[0-9]{1,6}}"
KEEPALIVE_SEC = 15.0  # a comment line this often keeps proxies from closing a quiet event stream
RETRY_MS = 2000  # how soon an EventSource reconnects after the stream ends
_TEXT_OVERRIDES = ("title", "gap_sec", "scene_gap_sec", "max_new_tokens")


def _service(request: web.Request) -> ScriptService:
    service = request.app[STATE].scripts
    if service is None:
        raise ProtocolError(
            ErrorCode.NOT_FOUND,
            "this service keeps no sessions, so it renders no scripts (no data dir)",
            field="script",
        )
    return service


def _errors(handler: Any) -> Any:
    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            response: web.StreamResponse = await handler(request)
            return response
        except ProtocolError as err:
            headers = {"Retry-After": "1"} if err.code in (ErrorCode.BUSY, ErrorCode.RATE_LIMITED) else None
            return error_response(err.code, err.message, field=err.field, headers=headers)

    wrapped.__name__ = handler.__name__
    wrapped.__doc__ = handler.__doc__
    return wrapped


def _media_type(request: web.Request) -> str | None:
    declared = request.headers.get("Content-Type")
    return None if declared is None else declared.split(";", 1)[0].strip().lower()


def parse_script_body(body: bytes, media_type: str | None, limits: Any) -> tuple[Script, str | None]:
    """The script of a ``POST /api/scripts`` body and the session it names (None: a new one).

    ``text/plain``: the plain-text form. JSON: a JSON script, or ``{"script": "<plain text>", "cast": {…}}`` (the
    text form with its cast given alongside, which wins over the header's, plus optional ``title``, ``gap_sec``,
    ``scene_gap_sec``, ``max_new_tokens``); either may name ``"session"``.
    """
    if media_type == "text/plain":
        try:
            return parse_text_script(body.decode("utf-8"), limits), None
        except UnicodeDecodeError as exc:
            raise ProtocolError(ErrorCode.BAD_MESSAGE, f"the script is not UTF-8 (byte {exc.start})") from None
    if (
        media_type is not None
        and media_type != "application/json"
        and not (media_type.startswith("application/") and media_type.endswith("+json"))
    ):
        raise ProtocolError(
            ErrorCode.UNSUPPORTED_MEDIA_TYPE,
            f"a script is text/plain or application/json, not {media_type[:64]!r}",
            field="Content-Type",
        )
    obj = decode_json_object(body)
    session = obj.pop("session", None)
    if session is not None and not isinstance(session, str):
        raise ProtocolError(ErrorCode.INVALID_FIELD, "'session' is a session id", field="session")
    if "script" not in obj:
        return parse_json_script(obj, limits), session
    text = obj.pop("script")
    if not isinstance(text, str):
        raise ScriptError("script", "'script' is the plain-text script (or send the JSON form's 'lines')")
    cast = parse_cast(obj.pop("cast", None), limits)
    overrides = {k: obj.pop(k) for k in _TEXT_OVERRIDES if k in obj}
    if obj:
        raise ScriptError(
            "",
            f"unknown key {short_repr(sorted(obj)[0], 30)} beside a plain-text 'script' (it takes"
            f" 'cast', 'session', {', '.join(repr(k) for k in _TEXT_OVERRIDES)})",
        )
    script = parse_text_script(text, limits, cast=cast)
    if overrides:
        # The overrides go through the JSON form's own checks.
        canonical = {**script.to_dict(), **{k: v for k, v in overrides.items() if v is not None}}
        script = parse_json_script(canonical, limits)
    return script, session


def _check_voices(request: web.Request, script: Script) -> None:
    """Every cast voice exists now: a typo fails the post, not every line of the render."""
    voices = request.app[STATE].voices
    for name, member in script.cast.items():
        try:
            voices.resolve(member.voice)
        except ProtocolError:
            raise ProtocolError(
                ErrorCode.NOT_FOUND,
                f"cast.{name}: unknown voice {member.voice!r} (a built-in voice id, an uploaded ref_id, or none)",
                field="voice",
            ) from None


def _script_id(request: web.Request) -> str:
    return request.match_info["script_id"]


async def _job(request: web.Request, *, read_only: bool = False) -> Job:
    """The script the request names, if the caller may reach its session: its owner, or (``read_only``) the holder
    of the session's share token. Anyone else: ``not_found``, as for an unknown script."""
    share = request.query.get("share") if read_only else None
    return await _service(request).job_for(_script_id(request), request_owner(request), share=share)


async def _still_reaches(service: ScriptService, job: Job, owner: str | None, share: str) -> bool:
    try:
        await asyncio.to_thread(service.sessions.check_access, job.session_id, owner, share=share)
    except ProtocolError:
        return False
    return True


def _line(request: web.Request) -> int:
    return int(request.match_info["line"])


@routes.post("/api/scripts", expect_handler=expect_within_limit)
@_errors
async def create_script(request: web.Request) -> web.Response:
    """Render a script: its lines become takes of the director's session (``session``, else a new one)."""
    state = request.app[STATE]
    service = _service(request)
    limits = state.settings.limits
    body = await read_body_limited(request, limits.max_script_bytes)
    script, session = parse_script_body(body, _media_type(request), limits)
    if session is None:
        session = request.query.get("session")
    if session is not None and not SESSION_ID.match(session):
        raise ProtocolError(ErrorCode.NOT_FOUND, "no such session (it may have been deleted)", field="session")
    _check_voices(request, script)
    owner, cookie = owner_or_mint(request)
    if owner is None:
        raise ProtocolError(ErrorCode.UNAUTHORIZED, "no identity to own a session")
    job = await service.create(script, session, client=request.remote or "unknown", owner=owner)
    body_out = {
        "script": job.script_id,
        "lines": len(job.lines),
        "session": job.session_id,
        "state": job.state,
        # Nothing has been announced yet: a listener that sends this as Last-Event-ID gets every event.
        "event_id": job.log.last_id,
    }
    response = web.json_response(body_out, status=201, headers={"Location": f"/api/scripts/{job.script_id}"})
    set_owner_cookie(response, request, cookie)
    return response


@routes.get("/api/scripts")
@_errors
async def list_scripts(request: web.Request) -> web.Response:
    """The scripts rendered into a session (``?session=``; its owner, or with its ``?share=`` token), oldest
    first."""
    session = request.query.get("session", "")
    if not SESSION_ID.match(session):
        raise ProtocolError(ErrorCode.INVALID_FIELD, "give ?session= (a session id)", field="session")
    service = _service(request)
    owner, share = request_owner(request), request.query.get("share")
    await asyncio.to_thread(service.sessions.check_access, session, owner, share=share)  # not_found for others
    scripts = await service.of_session(session)
    return web.json_response({"session": session, "scripts": scripts})


@routes.get(f"/api/scripts/{SCRIPT}")
@_errors
async def get_script(request: web.Request) -> web.Response:
    job = await _job(request, read_only=True)
    return web.json_response(job.view())


@routes.delete(f"/api/scripts/{SCRIPT}")
@_errors
async def delete_script(request: web.Request) -> web.Response:
    """Stop its render and forget it; the takes it made stay in the session."""
    job = await _job(request)
    await _service(request).delete(job.script_id)
    return web.json_response({"deleted": _script_id(request)})


@routes.get(f"/api/scripts/{SCRIPT}/events")
@_errors
async def script_events(request: web.Request) -> web.StreamResponse:
    """Server-sent events, in order: first ``state`` (or what a ``Last-Event-ID`` missed), then ``progress``,
    ``line``, ``done`` and ``error`` as they happen, until the client leaves or the script is deleted. A stream
    opened with the session's share token ends within ``KEEPALIVE_SEC`` of the token being revoked."""
    service = _service(request)
    job = await _job(request, read_only=True)
    owner, share = request_owner(request), request.query.get("share")
    loop = asyncio.get_running_loop()
    next_check = loop.time() + KEEPALIVE_SEC
    last = request.headers.get("Last-Event-ID") or request.query.get("last_event_id")
    listener, first = service.listen(job, last)
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store", "X-Accel-Buffering": "no"}
    )
    try:
        await response.prepare(request)
        await write_or_drop(request, response, f"retry: {RETRY_MS}\n\n".encode())
        for event in first:
            await write_or_drop(request, response, event.encode())
        # Rendered by another front end now: its events are not seen here. The stream ends after the state, and
        # the client's reconnect (``retry``) reads the state again, wherever the balancer sends it.
        while not job.elsewhere:
            event = await listener.next(KEEPALIVE_SEC)
            if share is not None and loop.time() >= next_check:
                next_check = loop.time() + KEEPALIVE_SEC
                if not await _still_reaches(service, job, owner, share):
                    break  # the share was revoked (or the session deleted): its holder hears no more
            if event is None:
                if listener.ended:
                    break
                await write_or_drop(request, response, b": keep-alive\n\n")
                continue
            await write_or_drop(request, response, event.encode())
        await response.write_eof()
    except ConnectionResetError:
        log.debug("event stream of script %s: client %s left", job.log_id, request.remote)
    finally:
        listener.close()
    return response


@routes.get(f"/api/scripts/{SCRIPT}.zip")
@_errors
async def export_script(request: web.Request) -> web.StreamResponse:
    """The zip of the script's lines, mix, cue sheets and captions (docs/scripts.md)."""
    state = request.app[STATE]
    service = _service(request)
    job = await _job(request, read_only=True)
    fmt = None
    if wants_other_format(request.query):
        fmt = parse_audio_format(request.query.get("format", "wav"), request.query.get("sample_rate"))
        if fmt.name == "wav" and fmt.sample_rate == 48000:
            fmt = None  # the default: exact WAV headers
    partial = request.query.get("partial", "").lower() in ("1", "true", "yes")
    if job.failure is not None:
        raise ProtocolError(ErrorCode.NOT_FOUND, f"the script failed ({job.failure})", field="script")
    if job.state != "done" and not partial:
        progress = job.progress()
        return error_response(
            ErrorCode.BUSY,
            f"the script is {job.state} ({progress['lines_done']} of {progress['lines_total']} lines done); export it"
            " once it is done, or ask for ?partial=true to get the lines done so far",
            headers={"Retry-After": "2"},
        )
    if 0 < state.settings.max_script_exports <= service.exports_running:
        return busy_response(2.0)
    service.exports_running += 1
    try:
        export = ScriptExport(job, service.sessions, fmt)
        await export.check()
        export.words = await service.words_of(job.session_id, export.timeline)  # aligned now where missing

        async def write(response: web.StreamResponse, data: bytes) -> None:
            await write_or_drop(request, response, data)

        return await export.stream(request, write)
    except EngineBusy as busy:
        return busy_response(busy.retry_after_sec)
    finally:
        service.exports_running -= 1


RETAKE_FIELDS = {
    "text": Field("str", None, nullable=True),
    "instruction": Field("str", None, nullable=True),
    "seed": SEED_FIELD,
    "frame": Field("int", None, 0, None, nullable=True),
    "time_sec": Field("float", None, 0.0, None, nullable=True),
}


@routes.post(f"/api/scripts/{SCRIPT}/lines/{LINE}/retake", expect_handler=expect_within_limit)
@_errors
async def retake_line(request: web.Request) -> web.Response:
    """Render line n again (at interactive priority): any of ``text``, ``instruction`` (the whole direction),
    ``seed`` (default: a new one), ``frame`` or ``time_sec`` (keep the take up to there). 202; the result comes as
    a ``line`` event and in the script's state, and replaces the line in the next export."""
    job = await _job(request)
    state = request.app[STATE]
    limits = state.settings.limits
    raw = await read_body_limited(request, limits.max_request_bytes)
    obj = decode_json_object(raw or b"{}")
    values = validate_fields(RETAKE_FIELDS, obj)
    text, instruction = values["text"], values["instruction"]
    if text is not None and (not text.strip() or len(text) > limits.max_text_chars):
        raise ProtocolError(
            ErrorCode.INVALID_FIELD, f"'text' is 1 to {limits.max_text_chars} characters, not blank", field="text"
        )
    if instruction is not None and len(instruction) > limits.max_instruction_chars:
        raise ProtocolError(
            ErrorCode.INVALID_FIELD,
            f"'instruction' has at most {limits.max_instruction_chars} characters",
            field="instruction",
        )
    frame, time_sec = values["frame"], values["time_sec"]
    if frame is not None and time_sec is not None:
        raise ProtocolError(ErrorCode.INVALID_FIELD, "give 'frame' or 'time_sec', not both", field="frame")
    if time_sec is not None:
        frame = frame_at_time(min(time_sec, limits.max_new_tokens / FRAME_RATE))
    service = _service(request)
    number = _line(request)
    job = await service.retake(
        job.script_id, number, client=request.remote or "unknown", text=text, instruction=instruction,
        seed=values["seed"], frame=min(frame or 0, limits.max_new_tokens),
    )  # fmt: skip
    # Last-Event-ID for a listener that wants every event of this retake.
    body = {"script": job.script_id, "line": job.line_view(number), "event_id": job.log.last_id}
    return web.json_response(body, status=202)


@routes.post(f"/api/scripts/{SCRIPT}/lines/{LINE}/accept", expect_handler=expect_within_limit)
@_errors
async def accept_take(request: web.Request) -> web.Response:
    """Make ``take`` (a take of the script's session, e.g. a retake directed in the studio) line n's take."""
    job = await _job(request)
    limits = request.app[STATE].settings.limits
    obj = decode_json_object(await read_body_limited(request, limits.max_request_bytes) or b"{}")
    take = validate_fields({"take": Field("str", max_length=64)}, obj)["take"]
    number = _line(request)
    job = await _service(request).accept(job.script_id, number, take)
    return web.json_response({"script": job.script_id, "line": job.line_view(number)})
