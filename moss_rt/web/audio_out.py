"""How a take's audio leaves on the frame transports (WebSocket, ``POST /api/stream``).

By default as tag-1 frames of 48 kHz int16 PCM, exactly as produced (whole 80 ms codec frames).
A take whose ``start`` asked for a ``format`` other than 48 kHz ``pcm`` gets tag-2 frames instead:
the bytes of one file in that format and rate, encoded in a worker thread as each chunk arrives,
so its first bytes leave with the first frames. The take's PCM is still recorded as usual (replays,
downloads and retakes work on it); only what is sent changes. The session says when a file is
complete (:class:`~moss_rt.session.FinishAudio`), right before the take's ``end``.

Encoding and sending are two steps, so a sender can check right before each send that its run may
still send (a replay let go of by the session must send nothing after its ``end``): :meth:`AudioOuts.encode`
puts a chunk's bytes in its file's queue of bytes ready to go, :meth:`AudioOuts.ready` takes them out as a
frame to send, and :meth:`AudioOuts.finish` sends what is left in the queue with the end of the file. The
encoder's worker thread fills the queue, so bytes encoded for a sender that was cancelled or went stale are
not lost: they leave with the file's end, in order, and the file has no hole.
"""

from __future__ import annotations

from collections import deque

from moss_rt.formats import AudioFormat
from moss_rt.formats.async_encoder import AsyncEncoder, EncoderClosed
from moss_rt.protocol import StartTake, encode_audio_frame, encode_pcm_frame
from moss_rt.session import TakeRecord


def requested_format(request: StartTake) -> AudioFormat | None:
    """The delivery format a take asked for; None for the native 48 kHz PCM stream (tag 1)."""
    delivery = request.delivery()
    return None if delivery is None else AudioFormat(*delivery)


class AudioOut:
    """One file being written: PCM chunks in, its bytes queued until sent (tag-2 frames)."""

    def __init__(self, fmt: AudioFormat, channels: int) -> None:
        self.format = fmt
        self._encoder = AsyncEncoder(fmt, channels)
        # Encoded, not yet sent; appended by the encoder's worker thread (deque appends are thread-safe).
        self._ready: deque[bytes] = deque()

    async def encode(self, pcm: bytes) -> None:
        """Encode the next chunk into the queue of bytes ready to send (nothing once the file was closed)."""
        try:
            await self._encoder.encode(pcm, sink=self._ready.append)
        except EncoderClosed:
            return

    def ready(self) -> list[bytes]:
        """The queued bytes as one tag-2 frame (none when nothing is queued); they leave the queue."""
        data = self._drain()
        return [encode_audio_frame(data)] if data else []

    async def frames(self, pcm: bytes) -> list[bytes]:
        """Encode ``pcm`` and take what is ready (a sender with nothing to check in between)."""
        await self.encode(pcm)
        return self.ready()

    async def finish(self) -> list[bytes]:
        """The rest of the file: what is still queued, then the codec and container flushed."""
        try:
            tail = await self._encoder.finish()
        except EncoderClosed:
            tail = b""
        data = self._drain() + tail
        return [encode_audio_frame(data)] if data else []

    def close(self) -> None:
        self._encoder.close()

    def _drain(self) -> bytes:
        parts: list[bytes] = []
        while self._ready:
            parts.append(self._ready.popleft())
        return b"".join(parts)


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
        await self.encode(run, pcm)
        return self.ready(run, pcm)

    async def encode(self, run: int, pcm: bytes) -> None:
        """A run with a file: encode ``pcm`` into its queue of bytes ready to send; nothing for PCM runs."""
        out = self._file(run)
        if out is not None:
            await out.encode(pcm)

    def ready(self, run: int, pcm: bytes) -> list[bytes]:
        """What to send now for run ``run``'s chunk ``pcm``: the tag-1 frame of a PCM run, or the bytes its
        file has ready (after :meth:`encode`)."""
        entry = self._runs.get(run)
        if entry is None or requested_format(entry[1].request) is None:
            return [encode_pcm_frame(pcm)]
        out = self._files.get(entry[0])
        return [] if out is None else out.ready()

    def _file(self, run: int) -> AudioOut | None:
        """The file run ``run`` writes (made at its first audio); None for PCM, or once closing."""
        entry = self._runs.get(run)
        fmt = None if entry is None else requested_format(entry[1].request)
        if entry is None or fmt is None:
            return None
        key, take = entry
        out = self._files.get(key)
        if out is None and not self._closed:
            out = self._files[key] = AudioOut(fmt, take.request.channels)
        return out

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
