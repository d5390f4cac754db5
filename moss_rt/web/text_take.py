"""A WebSocket take whose text arrives while it speaks (``start`` with ``stream_text``, then ``append``).

The take is one take for the client: one ``start``, its audio frames in order, one ``end``. Inside,
it is a chain of engine takes ("continuations"): whenever none is generating and the
:class:`~moss_rt.text_feed.TextFeed` has text ready, the next one is submitted with the whole text
handed out so far as its text and every frame of the take so far as its prefix (the model's
continuation mode), so it picks up where the audio stopped, in the same voice and delivery. Text
that arrived meanwhile is spoken by the next continuation as soon as the current one ends, so there
is no gap while the text is ahead of the speech; when the text is behind, the take waits for it.

The take stays directable like any other: ``cancel`` ends it (the running continuation stops at
the next frame), a new ``start`` or a ``seek`` replaces it, and once recorded it can be replayed,
retaken from any frame (with the text spoken so far) and downloaded.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from moss_rt.engine.base import AudioChunk, EndReason, EngineBusy, TakeFinished, TakeFirstAudio, TakeHandle
from moss_rt.protocol import FRAME_RATE, UNSET, ErrorCode, ErrorMessage, ProtocolError, TakeEnded
from moss_rt.session import DirectingSession, TakeRecord
from moss_rt.text_feed import TextFeed
from moss_rt.web.audio_out import AudioOut, requested_format
from moss_rt.web.state import ServiceState
from moss_rt.web.takes import Pacer, SendFrame, build_spec, bytes_per_frame, frame_of, start_message

log = logging.getLogger(__name__)


class TextStreamTake:
    """Runs one streamed-text take; the connection's reader feeds it text and may stop it."""

    def __init__(
        self,
        state: ServiceState,
        take: TakeRecord,
        session: DirectingSession,
        send: SendFrame,
        *,
        model: str,
        t_request: float,
    ) -> None:
        self.state = state
        self.take = take
        self.take_id = take.take_id
        self._session = session
        self._send = send
        self._model = model
        self._t_request = t_request
        self.feed = TextFeed(state.settings.limits.max_text_chars, take.request.text)
        self._wake = asyncio.Event()
        self._stop: EndReason | None = None
        self._handle: TakeHandle | None = None
        self.continuations = 0

    # -- control, from the connection's reader ---------------------------------------------

    def append(self, text: str) -> None:
        self.feed.append(text)
        self._wake.set()

    def flush(self) -> None:
        self.feed.flush()
        self._wake.set()

    def end_of_text(self) -> None:
        self.feed.end()
        self._wake.set()

    def cancel(self, reason: EndReason = EndReason.CANCELLED) -> None:
        """Stop at the next frame (TakeHandle's contract: the take then ends with ``reason``)."""
        self._stop = self._stop or reason
        if self._handle is not None:
            self._handle.cancel(reason)
        self._wake.set()

    # -- the take ------------------------------------------------------------------------

    async def run(self) -> EndReason:
        """Speak the text as it comes; returns how the take ended (its ``end`` frame has been sent)."""
        state, take = self.state, self.take
        out = AudioOut(requested_format(take.request), take.request.channels)
        pacer = Pacer(state.settings.max_lead_sec)
        state.heard.begin(take.take_id, bytes_per_frame(take), parent=take.parent, branch_frame=take.branch_frame)
        stats = _Stats()
        reason: EndReason | None = None
        error: ProtocolError | None = None
        try:
            while reason is None:
                if self._stop is not None:
                    reason = self._stop
                    break
                piece = self.feed.take_ready()
                if piece is None:
                    if self.feed.finished:
                        reason = EndReason.DONE
                        break
                    if self.continuations:  # speaking began, nothing to say next: the text is behind
                        stats.text_waits += 1
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                budget = take.request.max_new_tokens - (take.n_frames - take.branch_frame)
                if budget <= 0:
                    reason = EndReason.MAX_FRAMES
                    break
                try:
                    finished = await self._continue(budget, out, pacer, stats)
                except ProtocolError as err:  # e.g. the text so far no longer fits the take's cache
                    reason, error = EndReason.ERROR, err
                    break
                except EngineBusy as busy:
                    reason = EndReason.ERROR
                    error = ProtocolError(ErrorCode.BUSY, f"at capacity; retry in {busy.retry_after_sec:.0f} s")
                    break
                if finished.reason == EndReason.ERROR:
                    reason = EndReason.ERROR
                    error = ProtocolError(ErrorCode.INTERNAL, finished.error or "generation failed")
                elif finished.reason != EndReason.DONE:
                    reason = self._stop or finished.reason
            await self._finish(reason, error, out, stats)
        finally:
            out.close()
        return reason

    async def _continue(self, budget: int, out: AudioOut, pacer: Pacer, stats: _Stats) -> TakeFinished:
        """Generate the next continuation: the text so far, every frame so far as its prefix."""
        take = self.take
        # The record carries the text spoken so far: summaries, downloads and retakes see it.
        take.request = dataclasses.replace(take.request, text=self.feed.spoken)
        spec = await build_spec(self.state, take, prefix_codes=take.codes if take.n_frames else None)
        previous = _engine_id(take.take_id, self.continuations - 1) if self.continuations else take.parent
        spec = dataclasses.replace(
            spec,
            take_id=_engine_id(take.take_id, self.continuations),
            parent_take=previous,
            max_frames=budget,
        )
        self.continuations += 1
        handle = await self.state.engine.submit(spec)
        self._handle = handle
        try:
            if self._stop is not None:
                handle.cancel(self._stop)
            async for event in handle:
                if isinstance(event, TakeFirstAudio):
                    if stats.gpu_first_ms is None:
                        stats.gpu_first_ms = event.gpu_first_ms
                elif isinstance(event, AudioChunk):
                    if not stats.started:
                        await self._send(frame_of(start_message(take, stats.gpu_first_ms, self._model)))
                        stats.started = True
                    self._session.record_chunk(take, event.first_frame, event.codes)
                    self.state.heard.append(take.take_id, event.first_frame, event.pcm)
                    await pacer.wait(event.n_frames / FRAME_RATE)
                    for frame in await out.frames(event.pcm):
                        await self._send(frame)
                    if stats.ttfa_ms is None:
                        stats.ttfa_ms = (time.monotonic() - self._t_request) * 1000.0
                elif isinstance(event, TakeFinished):
                    stats.gpu_total_ms += event.gpu_total_ms
                    return event
        finally:
            self._handle = None
            handle.cancel(EndReason.CANCELLED)  # a no-op once it finished; frees the engine otherwise
        raise RuntimeError("engine stream ended without TakeFinished")

    async def _finish(self, reason: EndReason, error: ProtocolError | None, out: AudioOut, stats: _Stats) -> None:
        take = self.take
        if not stats.started:
            await self._send(frame_of(start_message(take, stats.gpu_first_ms, self._model)))
        for frame in await out.finish():
            await self._send(frame)
        new_frames = take.n_frames - take.branch_frame
        wall_ms = (time.monotonic() - self._t_request) * 1000.0
        timings = {
            "gpu_total_ms": round(stats.gpu_total_ms, 2),
            "gpu_first_ms": round(stats.gpu_first_ms, 2) if stats.gpu_first_ms is not None else None,
            "ttfa_ms": round(stats.ttfa_ms, 2) if stats.ttfa_ms is not None else None,
            "rtf": round((new_frames / FRAME_RATE) / (wall_ms / 1000.0), 3) if wall_ms > 0 else None,
        }
        # How the text came: continuations generated, and waits for text once speaking had begun.
        text_stats = {"continuations": self.continuations, "text_waits": stats.text_waits}
        recorded = {k: v for k, v in timings.items() if v is not None}
        self._session.record_end(take, reason.value, {**recorded, **text_stats})
        if error is not None:
            await self._send(frame_of(ErrorMessage.of(error, take=take.take_id)))
        end = TakeEnded(
            take=take.take_id,
            reason=reason.value,
            n_frames=take.n_frames,
            new_frames=new_frames,
            duration_sec=round(take.n_frames / FRAME_RATE, 3),
            **{k: UNSET if v is None else v for k, v in timings.items()},
            extra=text_stats,
        )
        await self._send(frame_of(end))


@dataclasses.dataclass
class _Stats:
    started: bool = False
    gpu_first_ms: float | None = None
    gpu_total_ms: float = 0.0
    ttfa_ms: float | None = None
    text_waits: int = 0


def _engine_id(take_id: str, index: int) -> str:
    """The engine's id of a take's ``index``-th continuation (the first is the take itself)."""
    return take_id if index == 0 else f"{take_id}.{index}"
