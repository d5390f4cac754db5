"""The PCM each take actually streamed, kept within a byte budget (sans-I/O).

Replays and WAV downloads should send exactly what the director heard. The codes of a take are
kept anyway, but decoding them again in one pass can differ from the chunk-by-chunk streaming
decode in the last bit of a few samples (float rounding in other chunk and batch shapes). So the
streamed bytes themselves are kept here, least recently used first out, and the codes are
rendered again only for takes whose audio is no longer (or was never completely) held.

A retake starts from its parent's first N frames as they were heard, so its audio is the exact
splice the client made.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class _Heard:
    """One take's audio. Appended chunks are kept by reference (the streamed ``bytes`` themselves, no copy:
    every stream appends one per chunk, and growing one buffer would copy the take over and over as it
    grows); they are joined into ``joined`` only when someone reads the take (a replay, a download, a retake)."""

    bytes_per_frame: int
    joined: bytearray = field(default_factory=bytearray)
    tail: list[bytes] = field(default_factory=list)
    nbytes: int = 0

    @property
    def frames(self) -> int:
        return self.nbytes // self.bytes_per_frame

    def add(self, pcm: bytes) -> None:
        self.tail.append(pcm)
        self.nbytes += len(pcm)

    @property
    def pcm(self) -> bytearray:
        """Everything held, as one buffer (joined once per read after new chunks came)."""
        if self.tail:
            # One new buffer of the exact size: readers holding the previous one keep a valid prefix.
            self.joined = bytearray().join([self.joined, *self.tail])
            self.tail.clear()
        return self.joined


class HeardAudio:
    """Streamed PCM by take id, at most ``max_bytes`` in all (0 keeps nothing)."""

    def __init__(self, max_bytes: int) -> None:
        self._max_bytes = max(0, max_bytes)
        self._takes: OrderedDict[str, _Heard] = OrderedDict()
        self._bytes = 0

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __contains__(self, take_id: str) -> bool:
        return take_id in self._takes

    def begin(self, take_id: str, bytes_per_frame: int, *, parent: str | None = None, branch_frame: int = 0) -> None:
        """Start holding a take's audio; a retake starts from its parent's first ``branch_frame``
        frames, and is not held at all when those are gone (its audio is then rendered)."""
        self.discard(take_id)
        if self._max_bytes == 0:
            return
        heard = _Heard(bytes_per_frame)
        if branch_frame:
            prefix = self.get(parent, branch_frame, bytes_per_frame) if parent else None
            if prefix is None:
                return
            heard.add(prefix)
        self._takes[take_id] = heard
        self._bytes += heard.nbytes
        self._evict(keep=take_id)

    def append(self, take_id: str, first_frame: int, pcm: bytes) -> None:
        """Frames ``first_frame …`` as streamed; a gap (or a take not held) stops holding it."""
        heard = self._takes.get(take_id)
        if heard is None:
            return
        if first_frame != heard.frames or len(pcm) % heard.bytes_per_frame:
            self.discard(take_id)
            return
        heard.add(bytes(pcm))  # bytes() of bytes is the object itself: no copy
        self._bytes += len(pcm)
        self._takes.move_to_end(take_id)
        self._evict(keep=take_id)

    def get(self, take_id: str, n_frames: int, bytes_per_frame: int) -> bytes | None:
        """The first ``n_frames`` frames as heard, or None when they are not all held."""
        held = self.buffer(take_id, n_frames, bytes_per_frame)
        if held is None:
            return None
        with memoryview(held) as view:  # one copy out (a slice of a bytearray then bytes() would be two)
            return bytes(view[: n_frames * bytes_per_frame])

    def buffer(self, take_id: str, n_frames: int, bytes_per_frame: int) -> bytearray | None:
        """The held buffer itself (no copy) when its first ``n_frames`` frames are all there.

        For readers that copy it out piece by piece (downloads): many at once share one buffer.
        They must only slice it (not keep a memoryview of it) and only up to ``n_frames``; chunks
        streamed later go into a new buffer, and evicting the take drops it from here while they
        finish with it.
        """
        heard = self._takes.get(take_id)
        if heard is None or heard.bytes_per_frame != bytes_per_frame or heard.frames < n_frames:
            return None
        self._takes.move_to_end(take_id)
        return heard.pcm

    def discard(self, take_id: str) -> None:
        heard = self._takes.pop(take_id, None)
        if heard is not None:
            self._bytes -= heard.nbytes

    def _evict(self, *, keep: str) -> None:
        if self._takes[keep].nbytes > self._max_bytes:
            self.discard(keep)  # alone over the budget: never held, and nothing else makes way for it
            return
        self._takes.move_to_end(keep)
        while self._bytes > self._max_bytes:
            self.discard(next(iter(self._takes)))  # least recently used; never ``keep`` (it is last)
