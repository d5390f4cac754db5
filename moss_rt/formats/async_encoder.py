"""An incremental encoder for the event loop: each call runs in a worker thread, in order.

FFmpeg (PyAV) is loaded when the first encoder is made, not when this module is imported, so the
service (and its GPU test tier, on machines without PyAV) starts without it; only a request for a
delivery format needs it.
"""

from __future__ import annotations

import asyncio

from moss_rt.formats.spec import AudioFormat


class AsyncEncoder:
    """A :class:`~moss_rt.formats.encoder.StreamEncoder` whose work runs off the event loop."""

    def __init__(self, fmt: AudioFormat, channels: int, *, speed: float = 1.0) -> None:
        from moss_rt.formats.encoder import StreamEncoder

        self._encoder = StreamEncoder(fmt, channels, speed=speed)
        self._lock = asyncio.Lock()  # one call at a time: the encoder keeps codec state

    @property
    def format(self) -> AudioFormat:
        return self._encoder.format

    async def encode(self, pcm: bytes) -> bytes:
        async with self._lock:
            return await asyncio.to_thread(self._encoder.encode, pcm)

    async def finish(self) -> bytes:
        async with self._lock:
            return await asyncio.to_thread(self._encoder.finish)

    def close(self) -> None:
        self._encoder.close()
