"""Hand-off of one take's events from an engine worker thread to its consumer on the event loop.

The worker never blocks on the consumer: it asks :meth:`TakeChannel.paused` before generating
more audio, so a client that reads slowly pauses its own take instead of growing a buffer.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator

from moss_rt.engine.base import AudioChunk, EndReason, TakeEvent, TakeFinished


class TakeChannel:
    """Bounded, thread-safe event pipe for one take; also its cancel flag.

    ``lead_frames`` is how many frames may wait unconsumed before the take counts as paused.
    """

    rebuilt = False  # a single engine keeps (or re-prefills) its own caches: never rebuilt elsewhere

    def __init__(self, loop: asyncio.AbstractEventLoop, take_id: str, lead_frames: int) -> None:
        self.take_id = take_id
        self._loop = loop
        self._lead_frames = max(1, lead_frames)
        # Bounded: audio stops being produced once lead_frames wait, and at most a few control
        # events (first-audio, finished) follow; the margin covers one oversized chunk too.
        self._queue: asyncio.Queue[TakeEvent] = asyncio.Queue(maxsize=self._lead_frames + 16)
        self._lock = threading.Lock()
        self._outstanding = 0
        self._cancel_reason: EndReason | None = None
        self._finished = threading.Event()
        self.created = time.monotonic()

    # -- worker side (any thread) -------------------------------------------------------

    @property
    def cancel_reason(self) -> EndReason | None:
        return self._cancel_reason

    @property
    def paused(self) -> bool:
        """True while the consumer holds more than the allowed lead of unconsumed audio."""
        with self._lock:
            return self._outstanding >= self._lead_frames

    @property
    def finished(self) -> bool:
        return self._finished.is_set()

    def push(self, event: TakeEvent) -> None:
        if isinstance(event, AudioChunk):
            with self._lock:
                self._outstanding += event.n_frames
        if isinstance(event, TakeFinished):
            self._finished.set()
        self._loop.call_soon_threadsafe(self._put, event)

    def _put(self, event: TakeEvent) -> None:
        try:
            self._queue.put_nowait(event)
        except asyncio.QueueFull:  # pragma: no cover - the pause rule keeps us below maxsize
            # Dropping audio would corrupt the take; fail it loudly instead.
            self._queue = asyncio.Queue(maxsize=2)
            self._queue.put_nowait(TakeFinished(EndReason.ERROR, 0, 0.0, error="event queue overflow"))

    # -- consumer side (event loop) -----------------------------------------------------

    def cancel(self, reason: EndReason = EndReason.CANCELLED) -> None:
        if self._cancel_reason is None:
            self._cancel_reason = reason

    def __aiter__(self) -> AsyncIterator[TakeEvent]:
        return self._events()

    async def batches(self, max_bytes: int) -> AsyncIterator[list[TakeEvent]]:
        """The events in order, each time together with those already queued behind the first, up to
        ``max_bytes`` of audio (the first event always): a relay that fell behind takes what piled up in one
        go instead of one hop per chunk. Ends and cancels on abandon like iterating the channel."""
        finished = False
        carry: TakeEvent | None = None  # taken off the queue but left for the next batch (over the size)
        try:
            while not finished:
                first = carry if carry is not None else await self._queue.get()
                carry = None
                batch, size = [first], _audio_bytes(first)
                while not self._queue.empty() and not isinstance(batch[-1], TakeFinished):
                    nxt = self._queue.get_nowait()
                    size += _audio_bytes(nxt)
                    if size > max_bytes:
                        carry = nxt
                        break
                    batch.append(nxt)
                with self._lock:
                    self._outstanding -= sum(e.n_frames for e in batch if isinstance(e, AudioChunk))
                finished = isinstance(batch[-1], TakeFinished)
                yield batch
        finally:
            if not finished:
                self.cancel(EndReason.CANCELLED)

    async def _events(self) -> AsyncIterator[TakeEvent]:
        finished = False
        try:
            while True:
                event = await self._queue.get()
                if isinstance(event, AudioChunk):
                    with self._lock:
                        self._outstanding -= event.n_frames
                finished = isinstance(event, TakeFinished)
                yield event
                if finished:
                    return
        finally:
            if not finished:
                # Abandoned (closed early, or the consuming task was cancelled): nobody will read
                # this take any more, so the engine must stop generating it.
                self.cancel(EndReason.CANCELLED)


def _audio_bytes(event: TakeEvent) -> int:
    return len(event.pcm) if isinstance(event, AudioChunk) else 0
