"""Voice routes beyond the legacy upload: listing what a client may use, deleting its own voices,
and the admin listing (docs/security.md, "Voice owners").

An uploaded voice belongs to the client that uploaded it: its address, as resolved through
``trusted_proxies`` (the same identity the per-client limits use). Owners are kept in the voice's
record on disk, so they survive restarts. The API key itself (not a browser token) is the admin.
"""

from __future__ import annotations

from aiohttp import web

from moss_rt.protocol import ErrorCode, ProtocolError
from moss_rt.voices import REF_ID_PATTERN, Voice
from moss_rt.web.errors import error_response, protocol_error_response
from moss_rt.web.http_api import read_json_request
from moss_rt.web.owners import voice_owner
from moss_rt.web.security import bearer, same_secret
from moss_rt.web.state import STATE

routes = web.RouteTableDef()


def is_admin(request: web.Request) -> bool:
    """The request carries the API key itself (a token is not enough; no key configured: nobody)."""
    key = request.app[STATE].settings.api_key
    return bool(key) and same_secret(bearer(request) or "", key or "")


def _listed(voice: Voice, owner: str) -> dict[str, object]:
    return {**voice.public(), "owned": voice.owner == owner}


@routes.get("/api/voices")
async def list_voices(request: web.Request) -> web.Response:
    """Built-in voices, this client's uploads (``owned: true``), and uploads stored before voices
    had owners. Other clients' uploads stay usable by their ``ref_id`` but are not listed."""
    owner = voice_owner(request)
    voices = [v for v in request.app[STATE].voices.list() if v.kind == "builtin" or v.owner in (None, owner)]
    return web.json_response({"voices": [_listed(v, owner) for v in voices]})


# The stored reference file as it was uploaded (or found in the voices folder), so a director can listen to a
# voice before using it. The same voices as the listing: built-ins, this client's uploads, ownerless ones (and
# every one for the admin). Served from disk without reading it on the loop.
VOICE_MEDIA_TYPES = {".wav": "audio/wav", ".flac": "audio/flac", ".mp3": "audio/mpeg", ".ogg": "audio/ogg"}


@routes.get(r"/api/voices/{voice_id:[A-Za-z0-9_.-]{1,128}}/audio")
async def voice_audio(request: web.Request) -> web.StreamResponse:
    try:
        voice = request.app[STATE].voices.get(request.match_info["voice_id"])
    except ProtocolError as err:
        return protocol_error_response(err)
    if voice.kind != "builtin" and voice.owner not in (None, voice_owner(request)) and not is_admin(request):
        return error_response(ErrorCode.NOT_FOUND, f"unknown reference voice {voice.id!r}", field="reference")
    media = VOICE_MEDIA_TYPES.get(voice.path.suffix.lower(), "application/octet-stream")
    return web.FileResponse(voice.path, headers={"Content-Type": media, "Cache-Control": "no-cache"})


@routes.delete(r"/api/voices/{voice_id}")
async def delete_voice(request: web.Request) -> web.Response:
    voice_id = request.match_info["voice_id"]
    if not REF_ID_PATTERN.match(voice_id):
        return error_response(ErrorCode.NOT_FOUND, "only uploaded voices (ref_…) can be deleted", field="voice")
    try:
        voice = await request.app[STATE].voices.delete(voice_id, owner=voice_owner(request), admin=is_admin(request))
    except ProtocolError as err:
        return protocol_error_response(err)
    return web.json_response({"deleted": voice.id})


@routes.patch(r"/api/voices/{voice_id}")
async def rename_voice(request: web.Request) -> web.Response:
    """Rename an uploaded voice (its owner or the admin): a JSON object ``{"name": "..."}`` (1-64 characters
    without control characters, trimmed); any other key is refused. Answers the voice as listed."""
    voice_id = request.match_info["voice_id"]
    if not REF_ID_PATTERN.match(voice_id):
        return error_response(ErrorCode.NOT_FOUND, "only uploaded voices (ref_…) can be renamed", field="voice")
    try:
        body = await read_json_request(request)  # bad_json / too_large / unsupported_media_type, never a 500
        unknown = sorted(set(body) - {"name"})
        if unknown:
            raise ProtocolError(
                ErrorCode.INVALID_FIELD, f"unknown voice field {unknown[0][:40]!r}", field=unknown[0][:40]
            )
        if "name" not in body:
            raise ProtocolError(ErrorCode.INVALID_FIELD, "'name' is required", field="name")
        owner = voice_owner(request)
        voice = await request.app[STATE].voices.rename(voice_id, body["name"], owner=owner, admin=is_admin(request))
    except ProtocolError as err:
        return protocol_error_response(err)
    return web.json_response(_listed(voice, owner))


@routes.get("/api/admin/voices")
async def admin_voices(request: web.Request) -> web.Response:
    """Every stored voice with its owner and usage per owner (API key holders only)."""
    if not is_admin(request):
        return error_response(
            ErrorCode.UNAUTHORIZED,
            "the admin listing needs the API key itself (Authorization: Bearer <api key>); "
            "a server without a key has no admin",
            headers={"WWW-Authenticate": 'Bearer realm="moss_rt"'},
        )
    state = request.app[STATE]
    voices = [v for v in state.voices.list() if v.kind == "uploaded"]
    owners: dict[str, int] = {}
    for voice in voices:
        owners[voice.owner or ""] = owners.get(voice.owner or "", 0) + 1
    limits = state.settings.limits
    return web.json_response(
        {
            "voices": [{**v.public(), "owner": v.owner} for v in voices],
            "owners": owners,
            "max_stored_voices": limits.max_stored_voices,
            "max_voices_per_owner": limits.max_voices_per_owner,
        }
    )
