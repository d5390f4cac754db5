"""OpenAI-compatible speech: ``POST /v1/audio/speech`` and ``GET /v1/models``.

Clients built on OpenAI's SDK (or on its HTTP API) work unchanged: ``input`` is the text,
``instructions`` our direction, ``voice`` a built-in voice id, an uploaded ``ref_id`` or ``none``,
``response_format`` one of mp3/opus/aac/flac/wav/pcm, ``speed`` 0.25-4 (a tempo change of the
generated audio, pitch kept), ``stream_format`` ``audio`` (the encoded bytes, chunked as they are
produced) or ``sse`` (``speech.audio.delta`` events with base64 audio, then ``speech.audio.done``).
Our own parameters travel as extra body fields (``language``, ``seed``, the sampling fields,
``max_new_tokens``, ``chunk_frames``, ``tokens``, ``channels``, ``sample_rate``).

A request becomes the same :class:`~moss_rt.protocol.StartTake` as ``POST /api/stream`` and runs
through the same admission and take path (:mod:`moss_rt.web.http_take`), so limits, the API key,
busy and rate answers are shared; the frames that path produces are encoded on the way out.
Every error under ``/v1/`` has OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``
with our stable code strings in ``code``.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from moss_rt.config import Settings
from moss_rt.engine.base import EndReason, EngineBusy, EngineInfo, EngineLoading
from moss_rt.formats import MAX_SPEED, MIN_SPEED, AudioFormat, flac_length, parse_audio_format
from moss_rt.formats.async_encoder import AsyncEncoder
from moss_rt.formats.held_file import HeldFile
from moss_rt.openai_aliases import OpenAIAliases
from moss_rt.protocol import (
    SAMPLE_RATE,
    SAMPLING_DEFAULTS,
    TAG_PCM,
    ErrorCode,
    Limits,
    ProtocolError,
    StartTake,
    decode_frame,
)
from moss_rt.protocol.schema import Field, coerce, short_repr
from moss_rt.voices import VoiceStore
from moss_rt.web.errors import busy_response, error_response
from moss_rt.web.http_api import expect_within_limit, read_json_request, write_or_drop
from moss_rt.web.http_take import admit_http_take
from moss_rt.web.state import STATE

log = logging.getLogger(__name__)
routes = web.RouteTableDef()
# OpenAI's voice and model names accepted here (settings openai_voice_aliases / openai_model_aliases).
OPENAI_ALIASES: web.AppKey[OpenAIAliases] = web.AppKey("moss_rt_openai_aliases", OpenAIAliases)


def openai_aliases(settings: Settings) -> OpenAIAliases:
    """The alias maps of ``settings``; ValueError names the setting of a malformed entry."""
    return OpenAIAliases.parse(settings.openai_voice_aliases, settings.openai_model_aliases)

STREAM_FORMATS = ("audio", "sse")
# OpenAI documents raw ``pcm`` as 24 kHz; the other formats carry their rate and default to ours.
PCM_DEFAULT_RATE = 24000
# Extra body fields passed straight to the take (same names, types and limits as /api/stream).
PASSTHROUGH_FIELDS = ("language", "seed", *SAMPLING_DEFAULTS, "max_new_tokens", "chunk_frames", "tokens", "channels")
_CREATED = int(time.time())  # "created" of /v1/models entries: when this service started
VOICES_LISTED = 50  # an unknown-voice error names at most this many valid voices


@dataclass(frozen=True)
class SpeechRequest:
    """A validated ``/v1/audio/speech`` body."""

    start: StartTake
    format: AudioFormat
    speed: float
    stream_format: str


def _voice_id(raw: Any) -> str:
    """``voice`` is a string, or (newer SDKs) an object ``{"id": ...}`` for custom voices."""
    if raw is None:
        return "none"
    if isinstance(raw, dict):
        raw = raw.get("id")
    if not isinstance(raw, str):
        raise ProtocolError(
            ErrorCode.INVALID_FIELD, "'voice' must be a voice id string or an object with an 'id'", field="voice"
        )
    return raw


def parse_speech_request(obj: Any, limits: Limits) -> SpeechRequest:
    """Validate an OpenAI speech body (sans-I/O; whether the voice exists is checked by the caller)."""
    if not isinstance(obj, dict):
        raise ProtocolError(ErrorCode.BAD_MESSAGE, f"the body must be a JSON object, got {type(obj).__name__}")
    if obj.get("input") is None:
        raise ProtocolError(ErrorCode.INVALID_FIELD, "'input' is required (the text to speak)", field="input")
    # Absent or null means OpenAI's default; an empty string is not a format (the schema's enum has none), so it gets
    # the same 400 as any unknown name (schemathesis found it answered 200 as mp3).
    fmt_name = obj.get("response_format")
    if fmt_name is None:
        fmt_name = "mp3"
    fmt_rate = obj.get("sample_rate")
    default_rate = PCM_DEFAULT_RATE if fmt_name == "pcm" else SAMPLE_RATE
    fmt = parse_audio_format(fmt_name, fmt_rate, default_rate=default_rate, name_field="response_format")
    speed = coerce("speed", Field("float", 1.0, MIN_SPEED, MAX_SPEED), obj.get("speed"))
    stream_format = coerce("stream_format", Field("str", "audio", choices=STREAM_FORMATS), obj.get("stream_format"))
    fields: dict[str, Any] = {
        "text": obj["input"],
        "instruction": obj.get("instructions") if obj.get("instructions") is not None else "",
        "reference": _voice_id(obj.get("voice")),
    }
    if obj.get("model") is not None:
        fields["model"] = obj["model"]
    fields.update({name: obj[name] for name in PASSTHROUGH_FIELDS if name in obj})
    try:
        start = StartTake.parse(fields, limits)
    except ProtocolError as err:
        # Report OpenAI's names for the fields it renamed.
        renamed = {"text": "input", "instruction": "instructions", "reference": "voice"}.get(err.field or "")
        if renamed is None:
            raise
        message = err.message.replace(f"'{err.field}'", f"'{renamed}'")
        raise ProtocolError(err.code, message, field=renamed) from None
    return SpeechRequest(start, fmt, float(speed), str(stream_format))


def check_voice(voices: VoiceStore, voice: str, aliases: OpenAIAliases | None = None) -> None:
    """An unknown voice is a 400 that lists the valid ones (and the OpenAI names accepted)."""
    try:
        voices.resolve(voice)
    except ProtocolError:
        ids = [v.id for v in voices.list()]
        shown = ", ".join(["none", *ids[:VOICES_LISTED]])
        more = f" and {len(ids) - VOICES_LISTED} more" if len(ids) > VOICES_LISTED else ""
        named = sorted(aliases.voices) if aliases is not None else []
        openai = f"; OpenAI's names: {', '.join(named)}" if named else ""
        raise ProtocolError(
            ErrorCode.INVALID_FIELD,
            f"unknown voice {short_repr(voice)}; valid voices: {shown}{more}{openai} "
            "(GET /api/voices lists them; POST /api/upload_ref adds one)",
            field="voice",
        ) from None


def apply_aliases(speech: SpeechRequest, aliases: OpenAIAliases, voices: VoiceStore, info: EngineInfo) -> SpeechRequest:
    """OpenAI's voice and model names → ours (a name that is one of ours stays ours); see docs/openai.md."""
    start = speech.start
    voice = start.reference
    if not _is_voice(voices, voice) and (target := aliases.voice(voice)) is not None:
        if not _is_voice(voices, target):
            raise ProtocolError(
                ErrorCode.INVALID_FIELD,
                f"voice {short_repr(voice)} is mapped to {short_repr(target)} (openai_voice_aliases), which is not "
                "a voice of this service; GET /api/voices lists them",
                field="voice",
            )
        start = dataclasses.replace(start, reference=target)
    model = start.model
    if model not in ("", info.default_model, *info.models):
        target = aliases.model(model, info.default_model)
        if target is not None:
            start = dataclasses.replace(start, model=target)
    return dataclasses.replace(speech, start=start)


def _is_voice(voices: VoiceStore, voice: str) -> bool:
    try:
        voices.resolve(voice)
    except ProtocolError:
        return False
    return True


# --------------------------------------------------------------------------- output


def holds_whole_file(fmt: AudioFormat) -> bool:
    """Formats sent only once complete: a FLAC header must state the length (soundfile cannot read one that
    says "unknown"), which is known only at the take's end (see :mod:`moss_rt.formats.flac_length`)."""
    return fmt.name == "flac"


class SpeechWriter:
    """Turns the take path's frames into the response body: encoded audio, raw or as SSE events.

    A format whose header needs the take's length (:func:`holds_whole_file`) is held (:class:`HeldFile`,
    spilling to a temporary file past 1 MB) until the take ends, then its header is completed and the file
    is sent in pieces; the others are sent as they are encoded.
    """

    def __init__(
        self, encoder: AsyncEncoder, write: Callable[[bytes], Awaitable[None]], *, sse: bool, hold: bool = False
    ) -> None:
        self._encoder = encoder
        self._write = write
        self._sse = sse
        self._held = HeldFile() if hold else None
        self.end: dict[str, Any] = {}
        self.error: dict[str, Any] | None = None
        self.bytes_out = 0

    async def on_frame(self, frame: bytes) -> None:
        decoded = decode_frame(frame)
        if decoded.tag == TAG_PCM:
            if self._held is not None:  # written by the encoder's thread: no file I/O on the loop
                await self._encoder.encode(decoded.payload, sink=self._held.write)
            else:
                await self._emit(await self._encoder.encode(decoded.payload))
            return
        message = decoded.json()
        if message.get("type") == "error":
            self.error = message
        elif message.get("type") == "end":
            self.end = message

    async def finish(self) -> None:
        tail = await self._encoder.finish()
        if self._held is None:
            await self._emit(tail)
        else:
            await self._emit_held(tail)
        if self._sse:
            frames = int(self.end.get("new_frames", self.end.get("n_frames", 0)) or 0)
            done = {
                "type": "speech.audio.done",
                "usage": {"input_tokens": 0, "output_tokens": frames, "total_tokens": frames},
                "take": self.end.get("take"),
                "reason": self.end.get("reason"),
                "duration_sec": self.end.get("duration_sec"),
            }
            await self._write(_sse_event(done))

    async def fail(self, message: str) -> None:
        """SSE only: an error event (a raw audio stream cannot carry one; its connection is cut)."""
        event = {"type": "error", "error": {"message": message, "type": "server_error", "code": "internal"}}
        await self._write(_sse_event(event))

    async def _emit_held(self, tail: bytes) -> None:
        """The held file, complete: its last bytes added, its header stating its length, sent in pieces."""
        held = self._held
        assert held is not None
        total = self._encoder.samples_out

        def complete() -> None:
            held.write(tail)
            held.rewrite_head(flac_length.HEADER_BYTES, lambda head: flac_length.set_total_samples(head, total))

        await asyncio.to_thread(complete)
        offset = 0
        while piece := await asyncio.to_thread(held.read, offset):
            offset += len(piece)
            await self._emit(piece)

    def close(self) -> None:
        if self._held is not None:
            self._held.close()

    async def _emit(self, data: bytes) -> None:
        if not data:
            return
        self.bytes_out += len(data)
        if self._sse:
            await self._write(_sse_event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()}))
        else:
            await self._write(data)


def _sse_event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


# --------------------------------------------------------------------------- routes


@routes.get("/v1/models")
async def list_models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": list(_model_entries(request.app).values())})


@routes.get("/v1/models/{model_id:.+}")
async def get_model(request: web.Request) -> web.Response:
    entries = _model_entries(request.app)
    model_id = request.match_info["model_id"]
    if model_id not in entries:
        return error_response(
            ErrorCode.NOT_FOUND, f"unknown model {short_repr(model_id)}; available: {list(entries)}", field="model"
        )
    return web.json_response(entries[model_id])


def _model_entries(app: web.Application) -> dict[str, dict[str, Any]]:
    """Our models, then the OpenAI model names accepted for them (``alias_of`` says which)."""
    info = app[STATE].engine.info
    entries = {m: _model_entry(m) for m in info.models}
    for name in app[OPENAI_ALIASES].models:
        target = app[OPENAI_ALIASES].model(name, info.default_model)
        if name not in entries and target in info.models:
            entries[name] = {**_model_entry(name), "alias_of": target}
    return entries


def _model_entry(model_id: str) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": _CREATED, "owned_by": "moss_rt"}


@routes.post("/v1/audio/speech", expect_handler=expect_within_limit)
async def create_speech(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    t_request = time.monotonic()
    if state.shutting_down:
        return error_response(ErrorCode.BUSY, "the service is shutting down", headers={"Retry-After": "5"})
    try:
        speech = parse_speech_request(await read_json_request(request), state.settings.limits)
        aliases = request.app[OPENAI_ALIASES]
        speech = apply_aliases(speech, aliases, state.voices, state.engine.info)
        check_voice(state.voices, speech.start.reference, aliases)
        admitted = await admit_http_take(state, request.remote or "unknown", speech.start, t_request=t_request)
    except ProtocolError as err:
        headers = {"Retry-After": "1"} if err.code == ErrorCode.RATE_LIMITED else None
        return error_response(err.code, err.message, field=err.field, headers=headers)
    except EngineBusy as busy:
        return busy_response(busy.retry_after_sec, loading=isinstance(busy, EngineLoading))

    take_id = admitted.take.take_id
    sse = speech.stream_format == "sse"
    encoder: AsyncEncoder | None = None
    writer: SpeechWriter | None = None
    response = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream" if sse else speech.format.media_type,
            "Cache-Control": "no-store",
            # Ours: the take (downloadable again at /api/takes/{id}.wav?format=...) and the stream's layout.
            "X-Take-Id": take_id,
            "X-Sample-Rate": str(speech.format.sample_rate),
            "X-Channels": str(speech.start.channels),
        }
    )

    async def write(data: bytes) -> None:
        await write_or_drop(request, response, data)

    try:
        encoder = AsyncEncoder(speech.format, speech.start.channels, speed=speech.speed)
        writer = SpeechWriter(encoder, write, sse=sse, hold=holds_whole_file(speech.format))
        await response.prepare(request)
        await admitted.stream(writer.on_frame, paced=not holds_whole_file(speech.format))
        ended = str(writer.end.get("reason", "error"))
        if ended in (EndReason.DONE.value, EndReason.MAX_FRAMES.value):
            await writer.finish()
            await response.write_eof()
        else:
            # Cancelled, shut down or failed mid-take: a truncated file must not look complete.
            reason = (writer.error or {}).get("message") or f"the take ended early ({ended})"
            log.info("speech take %s ended with %s; ending the response as failed", take_id, ended)
            if sse:
                await writer.fail(reason)
                await response.write_eof()
            elif request.transport is not None:
                request.transport.abort()
    except ConnectionResetError:
        log.info("client left during speech take %s; cancelling it", take_id)
    except asyncio.CancelledError:
        log.info("speech request for take %s cancelled; cancelling the take", take_id)
        raise
    finally:
        admitted.release()
        if encoder is not None:
            encoder.close()
        if writer is not None:
            writer.close()
    return response


# --------------------------------------------------------------------------- errors

_OPENAI_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}
_OPENAI_STATUS = {422: 400}  # OpenAI answers every invalid parameter with 400


@web.middleware
async def openai_errors_middleware(request: web.Request, handler: Callable[..., Any]) -> web.StreamResponse:
    """Rewrite error answers under ``/v1/`` (ours, auth's, aiohttp's) into OpenAI's error shape."""
    response: web.StreamResponse = await handler(request)
    if (
        not request.path.startswith("/v1/")
        or response.status < 400
        or response.prepared
        or not isinstance(response, web.Response)
        or response.content_type != "application/json"
        or not isinstance(response.body, bytes)
    ):
        return response
    try:
        error = json.loads(response.body)["error"]
        code, message = error["code"], error["message"]
    except (ValueError, KeyError, TypeError):
        return response
    status = _OPENAI_STATUS.get(response.status, response.status)
    kind = _OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    body = {"error": {"message": message, "type": kind, "param": error.get("field"), "code": code}}
    headers = {k: v for k, v in response.headers.items() if k in ("Retry-After", "WWW-Authenticate", "Allow")}
    return web.json_response(body, status=status, headers=headers)


__all__ = [
    "OPENAI_ALIASES",
    "SpeechRequest",
    "apply_aliases",
    "check_voice",
    "openai_aliases",
    "openai_errors_middleware",
    "parse_speech_request",
    "routes",
]
