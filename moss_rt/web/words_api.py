"""HTTP routes of word timing (docs/words.md): a take's words as JSON, SRT or WebVTT, and ``POST /api/align``.

A take's words are those it streamed (``words: true``), or stored with its session, or else aligned on demand from
its audio the first time they are asked for (then kept with the take). ``POST /api/align`` aligns any audio with any
text, so the aligner can be used and checked on its own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
from email.parser import BytesParser
from email.policy import default as email_policy

import numpy as np
import soundfile as sf
import soxr
from aiohttp import web

from moss_rt.align.base import AlignResult, WordTime
from moss_rt.align.normalize import tokenize
from moss_rt.align.service import AlignerBusy, AlignerUnavailable
from moss_rt.align.track import WordTrack
from moss_rt.captions import group_cues, to_srt, to_vtt
from moss_rt.engine.base import EngineBusy, EngineLoading
from moss_rt.protocol import ErrorCode, Limits, ProtocolError
from moss_rt.protocol.frames import decode_json_object
from moss_rt.session import TakeRecord, TakeStatus
from moss_rt.voices import InvalidUpload, probe_audio
from moss_rt.web.errors import busy_response, error_response, protocol_error_response
from moss_rt.web.http_api import expect_within_limit, read_body_limited
from moss_rt.web.owners import request_owner
from moss_rt.web.state import STATE, ServiceState
from moss_rt.web.words import require_aligner, stored_take_words, take_words

routes = web.RouteTableDef()

TID = r"{take_id:[A-Za-z0-9_-]{1,64}}"
SID = r"{session_id:s_[A-Za-z0-9_-]{16,64}}"
MIN_ALIGN_SECONDS = 0.05
CAPTION_TYPES = {"srt": "application/x-subrip", "vtt": "text/vtt"}


def _not_found() -> web.Response:
    return error_response(ErrorCode.NOT_FOUND, "no such take (it may have been evicted)", field="take")


async def _words_answer(state: ServiceState, take: TakeRecord, fmt: str) -> web.StreamResponse:
    """The take's words as ``json``, ``srt`` or ``vtt`` (aligned first when they never were)."""
    try:
        words = await take_words(state, take)
    except ProtocolError as err:
        return protocol_error_response(err)
    except EngineBusy as busy:  # its audio must be rendered from codes and the engine is full
        return busy_response(busy.retry_after_sec, loading=isinstance(busy, EngineLoading))
    return _render(take.take_id, words, fmt, complete=take.status is not TakeStatus.RUNNING)


def _render(take_id: str, words: list[WordTime], fmt: str, *, complete: bool) -> web.Response:
    if fmt == "json":
        return web.json_response({"take": take_id, "complete": complete, "words": [w.to_dict() for w in words]})
    cues = group_cues(words)
    body = to_srt(cues) if fmt == "srt" else to_vtt(cues)
    return web.Response(
        text=body,
        content_type=CAPTION_TYPES[fmt],
        charset="utf-8",
        headers={"Content-Disposition": f'attachment; filename="{take_id}.{fmt}"', "Cache-Control": "no-store"},
    )


@routes.get(f"/api/takes/{TID}/words")
async def get_take_words(request: web.Request) -> web.StreamResponse:
    """A take's words: ``{"take", "complete", "words": [{"word", "start", "end", "flags"?}]}``."""
    state = request.app[STATE]
    take = state.takes.get(request.match_info["take_id"])
    return _not_found() if take is None else await _words_answer(state, take, "json")


@routes.get(f"/api/takes/{TID}.srt")
async def get_take_srt(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    take = state.takes.get(request.match_info["take_id"])
    return _not_found() if take is None else await _words_answer(state, take, "srt")


@routes.get(f"/api/takes/{TID}.vtt")
async def get_take_vtt(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    take = state.takes.get(request.match_info["take_id"])
    return _not_found() if take is None else await _words_answer(state, take, "vtt")


# --------------------------------------------------------------------------- takes of stored sessions


async def _session_words(request: web.Request, fmt: str) -> web.StreamResponse:
    """A stored take's words: as streamed (the take still in memory) or kept with it, else aligned now from its
    stored audio and kept (:func:`~moss_rt.web.words.stored_take_words`)."""
    state = request.app[STATE]
    session_id, take_id = request.match_info["session_id"], request.match_info["take_id"]
    try:
        store = state.sessions
        if store is None:
            raise ProtocolError(ErrorCode.NOT_FOUND, "this service keeps no sessions", field="session")
        # As the session's other reads: its owner, or whoever holds its share token (anyone else: not_found).
        share = request.query.get("share")
        await asyncio.to_thread(store.check_access, session_id, request_owner(request), share=share)
        stored = await asyncio.to_thread(store.get_take, session_id, take_id)  # this session's take, or not_found
        held = state.takes.get(take_id)
        if held is not None and held.status is TakeStatus.ENDED and held.words is not None:
            words = list(held.words)  # streamed with it; the connection keeps them with the stored take
        else:
            words = await stored_take_words(state, session_id, stored)
            if held is not None and held.status is TakeStatus.ENDED:
                held.words = list(words)  # a seek by word on a connection that holds it needs no second alignment
    except ProtocolError as err:
        return protocol_error_response(err)
    return _render(take_id, words, fmt, complete=True)


@routes.get(f"/api/sessions/{SID}/takes/{TID}/words")
async def get_session_take_words(request: web.Request) -> web.StreamResponse:
    return await _session_words(request, "json")


@routes.get(f"/api/sessions/{SID}/takes/{TID}.srt")
async def get_session_take_srt(request: web.Request) -> web.StreamResponse:
    return await _session_words(request, "srt")


@routes.get(f"/api/sessions/{SID}/takes/{TID}.vtt")
async def get_session_take_vtt(request: web.Request) -> web.StreamResponse:
    return await _session_words(request, "vtt")


# --------------------------------------------------------------------------- POST /api/align


def _align_limits(limits: Limits) -> Limits:
    """The upload checks (formats, rates, channels, truncation) with the alignment's own duration bounds."""
    samples = int(limits.max_align_seconds * limits.max_upload_sample_rate * 2)
    return dataclasses.replace(
        limits,
        max_upload_seconds=limits.max_align_seconds,
        min_upload_seconds=MIN_ALIGN_SECONDS,
        max_upload_samples=max(limits.max_upload_samples, samples),
    )


def decode_for_alignment(data: bytes, limits: Limits, rate: int) -> np.ndarray:
    """Audio bytes (wav, flac, mp3, ogg) → mono float32 at ``rate``; InvalidUpload (4xx) for anything else."""
    probe_audio(data, _align_limits(limits))  # refuses before decoding what the header says is too much
    audio, sr = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    mono = audio.mean(axis=1)
    return np.ascontiguousarray(soxr.resample(mono, sr, rate) if sr != rate else mono, dtype=np.float32)


def _split_body(request: web.Request, body: bytes) -> tuple[bytes, str | None]:
    """The audio and the text of an align request: a multipart form (``audio`` file + ``text`` or a JSON part),
    or the body itself as audio with ``?text=``."""
    text = request.query.get("text")
    if request.content_type != "multipart/form-data":
        return body, text
    header = f"Content-Type: {request.headers.get('Content-Type', '')}\r\n\r\n".encode("latin-1", "replace")
    message = BytesParser(policy=email_policy).parsebytes(header + body)
    if not message.is_multipart():
        raise ProtocolError(ErrorCode.BAD_MESSAGE, "a multipart body without parts", field="audio")
    audio = b""
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        payload = part.get_payload(decode=True) or b""
        if not isinstance(payload, bytes):
            continue
        if name == "audio" or (name not in ("text", "json", "request") and part.get_filename()):
            audio = payload
        elif name == "text":
            text = payload.decode("utf-8", "replace")
        elif name in ("json", "request"):
            obj = decode_json_object(payload)
            value = obj.get("text")
            if value is not None and not isinstance(value, str):
                raise ProtocolError(ErrorCode.INVALID_FIELD, "'text' must be a string", field="text")
            text = value if value is not None else text
    return audio, text


def _check_text(text: str | None, limits: Limits) -> str:
    if text is None or not text.strip():
        raise ProtocolError(ErrorCode.INVALID_FIELD, "'text' must not be empty (?text= or a text part)", field="text")
    if len(text) > limits.max_text_chars:
        raise ProtocolError(
            ErrorCode.INVALID_FIELD, f"'text' has {len(text)} characters; the limit is {limits.max_text_chars}",
            field="text",
        )  # fmt: skip
    if not tokenize(text):
        raise ProtocolError(
            ErrorCode.INVALID_FIELD, "'text' has no word that is spoken (only punctuation or cues)", field="text"
        )
    return text


@routes.post("/api/align", expect_handler=expect_within_limit)
async def align(request: web.Request) -> web.StreamResponse:
    """Words of ``text`` in the audio of the body: ``{"words": [...], "aligner", "duration"}``."""
    state = request.app[STATE]
    limits = state.settings.limits
    try:
        service = require_aligner(state)
        body = await read_body_limited(request, limits.max_align_bytes)
        audio_bytes, text = _split_body(request, body)
        text = _check_text(text, limits)
        rate = service.aligner.sample_rate
        audio = await asyncio.to_thread(decode_for_alignment, audio_bytes, limits, rate)
        track = WordTrack(text, sample_rate=rate, input_rate=rate)
        track.add_audio(audio)
        due = track.next_job(final=True, complete=True)
        if due is not None:
            job, pending = due
            try:
                result = await service.align(job, wait=False)
            except AlignerBusy:
                return busy_response(1.0)
            except AlignerUnavailable:
                result = AlignResult()  # placed by estimate, flagged
            track.apply(pending, result)
    except InvalidUpload as err:
        return protocol_error_response(err)
    except ProtocolError as err:
        return protocol_error_response(err)
    except (ValueError, json.JSONDecodeError) as exc:
        return error_response(ErrorCode.BAD_MESSAGE, f"unreadable request: {exc}")
    return web.json_response(
        {"words": [w.to_dict() for w in track.words], "aligner": service.name, "duration": round(len(audio) / rate, 3)}
    )
