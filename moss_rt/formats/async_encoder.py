"""An incremental encoder for the event loop: each call runs in a worker thread, in order.

FFmpeg (PyAV) is loaded when the first encoder is made, not when this module is imported, so the
service (and its GPU test tier, on machines without PyAV) starts without it; only a request for a
delivery format needs it.

One owner per FFmpeg container. A task awaiting ``encode`` can be cancelled (a client that drops
its connection), but the worker thread it started cannot: it keeps using the container until its
call returns. So every call into the :class:`~moss_rt.formats.encoder.StreamEncoder` (``encode``,
``finish`` and ``close``) runs in a worker thread under one thread lock, never on the event loop
and never beside another call. ``close()`` may be called at any moment from the loop: it queues the
release behind the call in flight, which then finds the encoder closed. Calls that come after
``close()`` raise :class:`EncoderClosed` without touching FFmpeg.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, TypeVar

from moss_rt.formats.spec import AudioFormat

if TYPE_CHECKING:
    from moss_rt.formats.encoder import StreamEncoder

log = logging.getLogger(__name__)
T = TypeVar("T")

# Encoder work is short (about a millisecond per 80 ms frame) and must not queue behind the loop's
# other blocking helpers (file writes, SQLite) in the default executor; a few threads serve every
# stream, and a stream's calls never overlap (the lock below), so their number only bounds parallelism.
_POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="moss-rt-encode")


class EncoderClosed(RuntimeError):
    """The encoder was closed (its take abandoned) before this call ran."""


class AsyncEncoder:
    """A :class:`~moss_rt.formats.encoder.StreamEncoder` whose work runs off the event loop."""

    def __init__(
        self, fmt: AudioFormat, channels: int, *, speed: float = 1.0, total_samples: int | None = None
    ) -> None:
        from moss_rt.formats.encoder import StreamEncoder

        self._encoder: StreamEncoder = StreamEncoder(fmt, channels, speed=speed, total_samples=total_samples)
        self._format = fmt
        self._order = asyncio.Lock()  # calls are made in the order they were asked for
        self._owner = threading.Lock()  # held by the one thread inside FFmpeg for this encoder
        self._closed = False  # set under _owner: nothing touches the container after it
        self._close_requested = False
        self._released: Future[None] | None = None

    @property
    def format(self) -> AudioFormat:
        return self._format

    @property
    def samples_out(self) -> int:
        """Samples per channel handed to the codec so far (read it once ``finish`` has returned)."""
        return self._encoder.samples_out

    @property
    def closed(self) -> bool:
        """True once the container has been released (no FFmpeg call can still be running)."""
        return self._closed

    async def encode(self, pcm: bytes, *, sink: Callable[[bytes], None] | None = None) -> bytes:
        """The bytes ready after ``pcm``. With ``sink`` they are handed to it by the worker thread instead
        (and b"" is returned), so a caller cancelled while the call runs loses nothing: the bytes are in the
        sink before any later call (``finish``) starts."""
        if sink is None:
            return await self._call(lambda: self._encoder.encode(pcm))

        def encode_into_sink() -> bytes:
            sink(self._encoder.encode(pcm))
            return b""

        return await self._call(encode_into_sink)

    async def finish(self) -> bytes:
        return await self._call(self._encoder.finish)

    def close(self) -> None:
        """Release FFmpeg's resources once any call in flight has returned; never blocks the loop."""
        if self._close_requested:
            return
        self._close_requested = True
        self._released = _POOL.submit(self._release)

    async def wait_closed(self) -> None:
        """Wait for the release that :meth:`close` queued (tests, shutdown)."""
        if self._released is not None:
            await asyncio.wrap_future(self._released)

    async def _call(self, work: Callable[[], T]) -> T:
        async with self._order:
            if self._close_requested:
                raise EncoderClosed("the encoder was closed")
            # Awaiting the wrapped future keeps the thread's work owned by the lock, not by this task:
            # a cancel here stops the waiting, and _owner keeps close() out until the work returns.
            return await asyncio.wrap_future(_POOL.submit(self._locked, work))

    def _locked(self, work: Callable[[], T]) -> T:
        with self._owner:
            if self._closed:
                raise EncoderClosed("the encoder was closed")
            return work()

    def _release(self) -> None:
        with self._owner:
            if self._closed:
                return
            self._closed = True
            try:
                self._encoder.close()
            except Exception:  # a half-written stream nobody will read
                log.debug("releasing an abandoned encoder failed", exc_info=True)
