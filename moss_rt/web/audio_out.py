"""How a take's audio leaves on the frame transports (WebSocket, ``POST /api/stream``).

By default as tag-1 frames of 48 kHz int16 PCM, exactly as produced (whole 80 ms codec frames).
A take whose ``start`` asked for a ``format`` other than 48 kHz ``pcm`` gets tag-2 frames instead:
the bytes of one file in that format and rate, encoded in a worker thread as each chunk arrives,
so its first bytes leave with the first frames. The take's PCM is still recorded as usual (replays,
downloads and retakes work on it); only what is sent changes. The session says when a file is
complete (:class:`~moss_rt.session.FinishAudio`), right before the take's ``end``.
"""

from __future__ import annotations

from moss_rt.formats import AudioFormat
from moss_rt.formats.async_encoder import AsyncEncoder, EncoderClosed
from moss_rt.protocol import StartTake, encode_audio_frame, encode_pcm_frame
from moss_rt.session import TakeRecord


def requested_format(request: StartTake) -> AudioFormat | None:
    """The delivery format a take asked for; None for the native 48 kHz PCM stream (tag 1)."""
    delivery = request.delivery()
    return None if delivery is None else AudioFormat(*delivery)


class AudioOut:
    """One file being written: PCM chunk in → tag-2 frames out."""

    def __init__(self, fmt: AudioFormat, channels: int) -> None:
        self.format = fmt
        self._encoder = AsyncEncoder(fmt, channels)

    async def frames(self, pcm: bytes) -> list[bytes]:
        """The next bytes of the file; none once it was closed (its connection is going away)."""
        try:
            data = await self._encoder.encode(pcm)
        except EncoderClosed:
            return []
        return [encode_audio_frame(data)] if data else []

    async def finish(self) -> list[bytes]:
        """The rest of the file (codec and container flushed)."""
        try:
            data = await self._encoder.finish()
        except EncoderClosed:
            return []
        return [encode_audio_frame(data)] if data else []

    def close(self) -> None:
        self._encoder.close()


class AudioOuts:
    """The files being written for one connection's takes.

    A take's continuations (several runs of the session) write one file, keyed by the take; a
    replay writes its own, keyed by its run. A file is made at the take's first audio (a take that
    never sounded costs nothing) and closed when the session says it is complete
    (``FinishAudio``), or when the connection closes.
    """

    def __init__(self) -> None:
        self._runs: dict[int, tuple[str, TakeRecord]] = {}  # live run → (file key, take)
        self._files: dict[str, AudioOut] = {}
        self._closed = False  # the connection is going away: no new files

    @staticmethod
    def _key(take: TakeRecord, run: int, replay: bool) -> str:
        return f"replay-{run}" if replay else take.take_id

    def track(self, run: int, take: TakeRecord, *, replay: bool = False) -> None:
        """Run ``run`` sends ``take``'s audio (a replay: into a file of its own)."""
        self._runs[run] = (self._key(take, run, replay), take)

    def forget(self, run: int) -> None:
        """Run ``run`` is over; its file, if still open, waits for the session's ``FinishAudio``."""
        self._runs.pop(run, None)

    async def audio(self, run: int, pcm: bytes) -> list[bytes]:
        """The frames that carry ``pcm`` of run ``run``: tag-1 PCM, or the next bytes of its file."""
        entry = self._runs.get(run)
        fmt = None if entry is None else requested_format(entry[1].request)
        if entry is None or fmt is None:
            return [encode_pcm_frame(pcm)]
        key, take = entry
        out = self._files.get(key)
        if out is None:
            if self._closed:
                return []
            out = self._files[key] = AudioOut(fmt, take.request.channels)
        return await out.frames(pcm)

    async def finish(self, take: TakeRecord, *, run: int, replay: bool = False) -> list[bytes]:
        """The rest of the file (nothing for PCM, or when the take never sounded)."""
        out = self._files.pop(self._key(take, run, replay), None)
        if out is None:
            return []
        try:
            return await out.finish()
        finally:
            out.close()

    def close(self) -> None:
        """Close every open file; each is released once its encoder call in flight returns."""
        self._closed = True
        for out in self._files.values():
            out.close()
        self._files.clear()
        self._runs.clear()
