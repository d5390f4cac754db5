"""Running one take for either transport: request → engine spec → frames out, recorded in a session.

Both the legacy HTTP stream and the WebSocket channel use this module, so the bytes they send
for a take are the same: a tag-0 ``start``, whole-frame tag-1 PCM chunks, a tag-0 ``end``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import numpy as np

from moss_rt.engine.base import AudioChunk, EndReason, TakeFinished, TakeFirstAudio, TakeHandle, TakeSpec
from moss_rt.generation import FRAME_RATE, FRAME_SAMPLES
from moss_rt.protocol import (
    UNSET,
    ErrorCode,
    ErrorMessage,
    ProtocolError,
    ServerMessage,
    TakeEnded,
    TakeStarted,
    encode_json_frame,
    encode_pcm_frame,
)
from moss_rt.session import DirectingSession, TakeRecord
from moss_rt.web.state import ServiceState

log = logging.getLogger(__name__)

SendFrame = Callable[[bytes], Awaitable[None]]


def resolve_model(state: ServiceState, requested: str) -> str:
    info = state.engine.info
    if requested in ("", info.default_model) or requested in info.models:
        return info.default_model if requested == "" else requested
    raise ProtocolError(
        ErrorCode.NOT_FOUND, f"unknown model {requested!r}; available: {list(info.models)}", field="model"
    )


async def build_spec(
    state: ServiceState,
    take: TakeRecord,
    *,
    prefix_codes: np.ndarray | None = None,
) -> TakeSpec:
    """Resolve the reference voice (encoding it once) and produce the engine's spec; the caller has
    already resolved the model."""
    request = take.request
    reference_codes = None
    voice = state.voices.resolve(request.reference)
    if voice is not None:
        tag = state.engine.info.details.get("codec", state.engine.info.name)
        reference_codes = await state.voices.codes(voice, state.engine.encode_reference, tag)
    return take.engine_spec(reference_codes=reference_codes, prefix_codes=prefix_codes)


def start_message(
    take: TakeRecord, gpu_first_ms: float | None, model: str, *, first_frame: int | None = None, replay: bool = False
) -> TakeStarted:
    return TakeStarted(
        gpu_first_ms=round(gpu_first_ms, 2) if gpu_first_ms is not None else None,
        take=take.take_id,
        channels=take.request.channels,
        seed=take.seed,
        model=model,
        first_frame=take.branch_frame if first_frame is None else first_frame,
        label=UNSET if take.label is None else take.label,
        replay=True if replay else UNSET,
    )


def replay_end(
    take: TakeRecord, reason: EndReason, *, frame: int | None = None, gpu_total_ms: float | None = None
) -> TakeEnded:
    """The ``end`` of a replay; ``frame`` (where it started) and ``gpu_total_ms`` when it ran to the end."""
    return TakeEnded(
        take=take.take_id,
        reason=reason.value,
        replay=True,
        n_frames=take.n_frames,
        new_frames=UNSET if frame is None else take.n_frames - frame,
        duration_sec=round(take.n_frames / FRAME_RATE, 3),
        gpu_total_ms=UNSET if gpu_total_ms is None else round(gpu_total_ms, 2),
    )


def frame_of(message: ServerMessage) -> bytes:
    return encode_json_frame(message.to_dict())


def bytes_per_frame(take: TakeRecord) -> int:
    return FRAME_SAMPLES * take.request.channels * 2


async def take_audio(state: ServiceState, take: TakeRecord) -> bytes:
    """A take's int16 PCM as it was streamed when still held, else rendered again from its codes."""
    heard = state.heard.get(take.take_id, take.n_frames, bytes_per_frame(take))
    if heard is not None:
        return heard
    return await state.engine.render(take.codes, take.request.channels)


class Pacer:
    """Keeps a client at most ``max_lead_sec`` of audio ahead of real time (0 disables)."""

    def __init__(self, max_lead_sec: float) -> None:
        self._max_lead = max_lead_sec
        self._t0: float | None = None
        self._sent_sec = 0.0

    async def wait(self, chunk_sec: float) -> None:
        now = time.monotonic()
        if self._t0 is None:
            self._t0 = now
        ahead = self._sent_sec - (now - self._t0)
        if self._max_lead > 0 and ahead > self._max_lead:
            await asyncio.sleep(ahead - self._max_lead)
        self._sent_sec += chunk_sec


async def stream_take(
    state: ServiceState,
    handle: TakeHandle,
    take: TakeRecord,
    session: DirectingSession,
    send: SendFrame,
    *,
    t_request: float,
    model: str,
    keep: Callable[[TakeRecord], Awaitable[None]] | None = None,
) -> TakeFinished:
    """Forward a running take's events as frames; returns how it ended.

    ``keep`` stores the ended take (a directing session on disk) before its end frame goes out, so a client that
    has seen the end and reloads at once finds the take. The caller owns cancellation: on disconnect it cancels
    the handle (and this coroutine).
    """
    pacer = Pacer(state.settings.max_lead_sec)
    state.heard.begin(take.take_id, bytes_per_frame(take), parent=take.parent, branch_frame=take.branch_frame)
    started = False
    ttfa_ms: float | None = None
    gpu_first_ms: float | None = None
    async for event in handle:
        if isinstance(event, TakeFirstAudio):
            gpu_first_ms = event.gpu_first_ms
        elif isinstance(event, AudioChunk):
            if not started:
                await send(frame_of(start_message(take, gpu_first_ms, model)))
                started = True
            session.record_chunk(take, event.first_frame, event.codes)
            state.heard.append(take.take_id, event.first_frame, event.pcm)
            await pacer.wait(event.n_frames / FRAME_RATE)
            await send(encode_pcm_frame(event.pcm))
            if ttfa_ms is None:
                ttfa_ms = (time.monotonic() - t_request) * 1000.0
        elif isinstance(event, TakeFinished):
            if not started:
                await send(frame_of(start_message(take, event.gpu_first_ms, model)))
            new_frames = event.n_frames - take.branch_frame
            duration = new_frames / FRAME_RATE
            wall_ms = (time.monotonic() - t_request) * 1000.0
            stats = {
                "gpu_total_ms": round(event.gpu_total_ms, 2),
                "gpu_first_ms": round(event.gpu_first_ms, 2) if event.gpu_first_ms is not None else None,
                "ttfa_ms": round(ttfa_ms, 2) if ttfa_ms is not None else None,
                "rtf": round(duration / (wall_ms / 1000.0), 3) if wall_ms > 0 else None,
            }
            session.record_end(take, event.reason.value, {k: v for k, v in stats.items() if v is not None})
            if keep is not None:
                await keep(take)
            if event.reason == EndReason.ERROR:
                error = ProtocolError(ErrorCode.INTERNAL, event.error or "generation failed")
                await send(frame_of(ErrorMessage.of(error, take=take.take_id)))
            end = TakeEnded(
                take=take.take_id,
                reason=event.reason.value,
                n_frames=event.n_frames,
                new_frames=new_frames,
                duration_sec=round(event.n_frames / FRAME_RATE, 3),
                **{k: UNSET if v is None else v for k, v in stats.items()},
                extra=dict(event.timings),
            )
            await send(frame_of(end))
            return event
    raise RuntimeError("engine stream ended without TakeFinished")


async def replay_take(
    state: ServiceState, take: TakeRecord, frame: int, send: SendFrame, *, model: str
) -> None:
    """Re-send a stored take's audio from ``frame`` without generating anything."""
    t0 = time.monotonic()
    pcm = await take_audio(state, take)
    frame_bytes = bytes_per_frame(take)
    await send(frame_of(start_message(take, None, model, replay=True, first_frame=frame)))
    pacer = Pacer(state.settings.max_lead_sec)
    step = max(1, take.request.chunk_frames)
    for first in range(frame, take.n_frames, step):
        last = min(take.n_frames, first + step)
        await pacer.wait((last - first) / FRAME_RATE)
        await send(encode_pcm_frame(pcm[first * frame_bytes : last * frame_bytes]))
    gpu_total_ms = (time.monotonic() - t0) * 1000.0
    await send(frame_of(replay_end(take, EndReason.DONE, frame=frame, gpu_total_ms=gpu_total_ms)))

