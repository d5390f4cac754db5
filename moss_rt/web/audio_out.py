"""How a take's audio leaves on the frame transports (WebSocket, ``POST /api/stream``).

By default as tag-1 frames of 48 kHz int16 PCM, exactly as produced (whole 80 ms codec frames).
A take whose ``start`` asked for a ``format`` other than 48 kHz ``pcm`` gets tag-2 frames instead:
the bytes of one file in that format and rate, encoded in a worker thread as each chunk arrives,
so its first bytes leave with the first frames. The take's PCM is still recorded as usual (replays,
downloads and retakes work on it); only what is sent changes.
"""

from __future__ import annotations

from moss_rt.formats import AudioFormat
from moss_rt.formats.encoder import AsyncEncoder
from moss_rt.protocol import SAMPLE_RATE, StartTake, encode_audio_frame, encode_pcm_frame

NATIVE = AudioFormat("pcm", SAMPLE_RATE)


def requested_format(request: StartTake) -> AudioFormat | None:
    """The delivery format a take asked for; None for the native 48 kHz PCM stream (tag 1)."""
    fmt = AudioFormat(request.format or "pcm", request.sample_rate or SAMPLE_RATE)
    return None if fmt == NATIVE else fmt


class AudioOut:
    """One take's audio, PCM chunk in → frames to send out."""

    def __init__(self, fmt: AudioFormat | None, channels: int) -> None:
        self.format = fmt or NATIVE
        self._encoder = None if self.format == NATIVE else AsyncEncoder(self.format, channels)

    @property
    def encoded(self) -> bool:
        return self._encoder is not None

    async def frames(self, pcm: bytes) -> list[bytes]:
        if self._encoder is None:
            return [encode_pcm_frame(pcm)]
        data = await self._encoder.encode(pcm)
        return [encode_audio_frame(data)] if data else []

    async def finish(self) -> list[bytes]:
        """The rest of the file (codec and container flushed); nothing for native PCM."""
        if self._encoder is None:
            return []
        data = await self._encoder.finish()
        return [encode_audio_frame(data)] if data else []

    def close(self) -> None:
        if self._encoder is not None:
            self._encoder.close()
