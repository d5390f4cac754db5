"""An encoded file held back until it is complete, so its header can state its length before it is sent.

A streamed FLAC header says "length unknown", which libsndfile (``soundfile.read``) cannot read
(:mod:`moss_rt.formats.flac_length`). When a take's length is only known at its end (OpenAI speech), the
file is held here while it is encoded: in memory up to :data:`MEMORY_BYTES`, then in a temporary file (a
5-minute stereo FLAC is tens of MB; a few concurrent ones must not become RAM), and read out in pieces
once its header was completed. Every call does blocking file I/O: call it from a worker thread (the
encoder's own thread writes, :func:`asyncio.to_thread` for the rest).
"""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Callable

MEMORY_BYTES = 1024 * 1024
PIECE_BYTES = 64 * 1024


class HeldFile:
    def __init__(self, *, memory_bytes: int = MEMORY_BYTES) -> None:
        self._file = tempfile.SpooledTemporaryFile(max_size=memory_bytes)  # noqa: SIM115 - closed by close()
        self._lock = threading.Lock()  # the encoder's thread writes, another worker thread finishes and reads
        self.size = 0

    def write(self, data: bytes) -> None:
        """Append ``data`` (the encoder's next bytes)."""
        if not data:
            return
        with self._lock:
            self._file.seek(0, 2)
            self._file.write(data)
            self.size += len(data)

    def rewrite_head(self, n: int, change: Callable[[bytes], bytes]) -> None:
        """Replace the first ``n`` bytes by ``change(them)`` (same length): a header completed at the end."""
        with self._lock:
            self._file.seek(0)
            head = self._file.read(n)
            new = change(head)
            if len(new) != len(head):
                raise ValueError("a header rewrite must keep its length")
            self._file.seek(0)
            self._file.write(new)

    def read(self, offset: int, size: int = PIECE_BYTES) -> bytes:
        """Up to ``size`` bytes from ``offset`` (b"" at the end)."""
        with self._lock:
            self._file.seek(offset)
            return self._file.read(size)

    def close(self) -> None:
        with self._lock:
            self._file.close()
