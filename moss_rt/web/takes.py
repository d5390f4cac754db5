"""What both transports do for a take, around the sans-I/O :class:`~moss_rt.session.TakeLifecycle`.

The lifecycle decides what is sent and when a take starts or stops; this module performs the I/O
it asks for: resolving the reference voice and submitting to the engine (``Admit``), pumping a
take's engine events through the lifecycle, fetching a take's audio for replays and downloads, and
pacing PCM to real time. The legacy HTTP stream and the WebSocket channel send the same bytes for
a take: a tag-0 ``start``, whole-frame tag-1 PCM chunks, a tag-0 ``end``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager

import numpy as np

from moss_rt.engine.base import EndReason, EngineBusy, EngineLoading, TakeHandle
from moss_rt.protocol import ErrorCode, ProtocolError, ServerMessage, StartTake, encode_json_frame, encode_pcm_frame
from moss_rt.session import (
    Action,
    Admit,
    FinishAudio,
    SendAudio,
    SendMessage,
    TakeLifecycle,
    TakeRecord,
    bytes_per_frame,
    resolve_model,
)
from moss_rt.web.audio_out import AudioOuts
from moss_rt.web.state import ServiceState

SendFrame = Callable[[bytes], Awaitable[None]]
Perform = Callable[[Sequence[Action]], Awaitable[None]]


def new_lifecycle(
    state: ServiceState, *, max_takes_kept: int, client: str | None = None, early_admission: bool = False
) -> TakeLifecycle:
    """A take lifecycle over the service's recent takes; its takes count as ``client``'s (per-client eviction).
    ``early_admission``: a take replacing a streaming one is submitted at once (the directing socket)."""
    info = state.engine.info
    return TakeLifecycle(
        state.takes,
        models=info.models,
        default_model=info.default_model,
        heard=state.heard,
        max_takes_kept=max_takes_kept,
        max_text_chars=state.settings.limits.max_text_chars,
        client=client,
        early_admission=early_admission,
    )


async def reference_codes(state: ServiceState, take: TakeRecord) -> np.ndarray | None:
    """The take's reference voice as codes (encoded once per voice and codec, then cached)."""
    voice = state.voices.resolve(take.request.reference)
    if voice is None:
        return None
    tag = state.engine.info.details.get("codec", state.engine.info.name)
    return await state.voices.codes(voice, state.engine.encode_reference, tag)


async def admit(state: ServiceState, action: Admit) -> TakeHandle:
    """Carry out an ``Admit``: the engine's request, resolved, submitted (raises EngineBusy/ProtocolError)."""
    return await state.engine.submit(action.spec(await reference_codes(state, action.take)))


async def pump_events(handle: TakeHandle, run: int, lifecycle: TakeLifecycle, perform: Perform) -> None:
    """Feed a running take's engine events through the lifecycle and perform what it answers.

    The iterator is closed however this ends, which cancels the take if it has not finished.
    """
    events = aiter(handle)
    try:
        async for event in events:
            await perform(lifecycle.take_event(run, event))
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()


@asynccontextmanager
async def held_take_audio(state: ServiceState, take: TakeRecord, *, client: str | None = None) -> AsyncIterator[bytes]:
    """A take's int16 PCM while inside: as streamed when still held, else a render of its codes reserved within
    the renders' budget (shared with the take's downloads, charged to ``client``; ``EngineBusy`` past it), so a
    replay of a long take costs no more memory than a download of it may."""
    heard = state.heard.get(take.take_id, take.n_frames, bytes_per_frame(take))
    if heard is not None:
        yield heard
        return
    codes, channels = take.codes, take.request.channels
    n_bytes = take.n_frames * bytes_per_frame(take)
    async with state.renders.hold(
        take.take_id, n_bytes, lambda: state.engine.render(codes, channels), client=client
    ) as pcm:
        yield pcm


def busy_error(busy: EngineBusy) -> ProtocolError:
    """The tag-0 form of an engine at capacity or still loading (HTTP answers 503 with Retry-After instead)."""
    if isinstance(busy, EngineLoading):
        return ProtocolError(ErrorCode.LOADING, f"the model is still loading; retry in {busy.retry_after_sec:.0f} s")
    return ProtocolError(ErrorCode.BUSY, f"the service is at capacity; retry in {busy.retry_after_sec:.0f} s")


def message_frame(message: ServerMessage) -> bytes:
    return encode_json_frame(message.to_dict())


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


async def send_action(action: Action, send: SendFrame, pacer: Pacer | None, outs: AudioOuts | None = None) -> bool:
    """Perform a sending action (``SendMessage``, ``SendAudio``, ``FinishAudio``); False for any other kind.

    ``outs`` turns the audio of takes that asked for a format into tag-2 frames (else tag-1 PCM).
    """
    if isinstance(action, SendMessage):
        await send(message_frame(action.message))
        return True
    if isinstance(action, SendAudio):
        if pacer is not None and action.paced:
            await pacer.wait(action.seconds)
        frames = [encode_pcm_frame(action.pcm)] if outs is None else await outs.audio(action.run, action.pcm)
        for frame in frames:
            await send(frame)
        return True
    if isinstance(action, FinishAudio):
        if outs is not None:
            for frame in await outs.finish(action.take, run=action.run, replay=action.replay):
                await send(frame)
        return True
    return False


class OneTake:
    """One take outside a directing socket (``POST /api/stream`` and other one-shot HTTP routes).

    :meth:`open` plans, admits and submits it through a one-take lifecycle, raising before anything
    is sent (``ProtocolError``, ``EngineBusy``), so the route can still answer with an HTTP error;
    :meth:`stream` then sends its frames exactly as the WebSocket channel would.
    """

    def __init__(self, lifecycle: TakeLifecycle, run: int, handle: TakeHandle, take: TakeRecord) -> None:
        self.lifecycle = lifecycle
        self.run = run
        self.handle = handle
        self.take = take

    @staticmethod
    def check(state: ServiceState, request: StartTake) -> None:
        """Refuse a request naming an unknown model (ProtocolError not_found)."""
        info = state.engine.info
        resolve_model(request.model, info.models, info.default_model)

    @classmethod
    async def open(
        cls, state: ServiceState, request: StartTake, *, received_at: float | None = None, client: str | None = None
    ) -> OneTake:
        lifecycle = new_lifecycle(state, max_takes_kept=1, client=client)
        actions = lifecycle.handle(request, received_at=received_at)
        admission = next(a for a in actions if isinstance(a, Admit))
        handle = await admit(state, admission)
        lifecycle.admitted(admission.run)
        return cls(lifecycle, admission.run, handle, admission.take)

    async def stream(self, send: SendFrame, *, max_lead_sec: float) -> None:
        pacer = Pacer(max_lead_sec)
        outs = AudioOuts()
        outs.track(self.run, self.take)

        async def perform(actions: Sequence[Action]) -> None:
            for action in actions:
                await send_action(action, send, pacer, outs)

        try:
            await pump_events(self.handle, self.run, self.lifecycle, perform)
        finally:
            outs.close()

    def close(self, reason: EndReason = EndReason.CANCELLED) -> None:
        """The request is over, however it ended: stop the engine take if it still runs, and end its record
        if its end never came through (the client left): a record left running is never evicted from the
        recent takes (issue 23, finding 7)."""
        self.handle.cancel(reason)
        self.lifecycle.close()  # a one-take lifecycle: its only action is the stop just made
