"""Non-streaming work the worker thread does between steps: whole-take renders and reference encodes.

A render is cut into fixed chunks aligned at frame 0, one chunk per scheduling round while takes
stream, so a long download never stalls live audio. Fixed alignment also makes renders of two takes
that share a prefix agree bit for bit on that prefix (the codec is causal: frame t depends only on
codes <= t, and both renders run the same chunk shapes over it).
"""

from __future__ import annotations

import concurrent.futures
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from moss_rt.audio import to_int16_pcm

if TYPE_CHECKING:
    from moss_rt.codec.model import CodecModel
    from moss_rt.codec.streaming import DecoderState
    from moss_rt.engine.codec_batch import CodecBatcher

log = logging.getLogger(__name__)

RENDER_CHUNK_FRAMES = 25


class Job:
    """A unit of worker-side work with a thread-safe future for its result."""

    def __init__(self) -> None:
        self.future: concurrent.futures.Future[object] = concurrent.futures.Future()
        self._started = False

    def begin(self) -> bool:
        """False if the caller gave up (its future was cancelled) before we started."""
        if not self._started:
            self._started = True
            return self.future.set_running_or_notify_cancel()
        return True

    def advance(self) -> bool:
        """Do one bounded piece; True when finished (the future then holds the result)."""
        raise NotImplementedError

    def fail(self, exc: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(exc)


@dataclass
class RenderJob(Job):
    codes: np.ndarray
    channels: int
    codec: CodecBatcher
    _state: DecoderState | None = field(default=None, init=False)
    _done: int = field(default=0, init=False)
    _pcm: list[bytes] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        Job.__init__(self)

    @property
    def started(self) -> bool:
        """Whether its codec stream is open (a render's first piece opens it)."""
        return self._state is not None

    def advance(self) -> bool:
        n = int(self.codes.shape[0])
        if n == 0:
            self.future.set_result(b"")
            return True
        decoder = self.codec.decoder
        if self._state is None:
            self._state = decoder.new_state()
        try:
            end = min(n, self._done + RENDER_CHUNK_FRAMES)
            with self.codec.eager():  # one stream, odd lengths: no graph per shape for this
                audio = decoder.decode([self._state], [self.codes[self._done : end]])[0]
            self._pcm.append(to_int16_pcm(audio, self.channels))
            self._done = end
            if end < n:
                return False
            self.future.set_result(b"".join(self._pcm))
            self.close()
            return True
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._state is not None:
            self._state.close()
            self._state = None


@dataclass
class EncodeJob(Job):
    audio: bytes
    codec: CodecModel
    max_seconds: float | None

    def __post_init__(self) -> None:
        Job.__init__(self)

    def advance(self) -> bool:
        from moss_rt.codec.reference import encode_reference

        codes, _duration = encode_reference(self.codec, self.audio, max_seconds=self.max_seconds)
        self.future.set_result(np.asarray(codes, dtype=np.int64))
        return True
