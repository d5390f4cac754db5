"""Bytes a worker thread writes, streamed out by the event loop with a few pieces in flight at most.

Some outputs are made by blocking code that wants a file to write into (``zipfile`` packing a session archive).
Made whole in memory, a long session would cost its full size per request; written to a temporary file, its
full size on disk. A :class:`ThreadPipe` is the file the thread writes into: every ``piece_size`` bytes become
one piece for the event loop to send, and the thread blocks while ``max_pieces`` pieces wait, so what a request
holds is bounded by ``piece_size * (max_pieces + 1)`` whatever it sends, and a slow reader slows the thread
down instead of growing a buffer. :func:`stream_from_thread` runs one producer against one consumer and makes
sure the thread stops (at its next write) when the consumer leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import threading
from collections.abc import Awaitable, Callable
from typing import IO, cast

PIECE_SIZE = 256 * 1024
MAX_PIECES = 4
_EOF = b""


class PipeClosed(Exception):
    """The reading side is gone; the writing thread should stop."""


class ThreadPipe(io.RawIOBase):
    """Writable from one thread (not seekable), read as pieces on one event loop."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, *, piece_size: int = PIECE_SIZE, max_pieces: int = MAX_PIECES
    ) -> None:
        super().__init__()
        self._loop = loop
        self._piece_size = piece_size
        self._queue: asyncio.Queue[bytes] = asyncio.Queue()  # bounded by _space (max_pieces + the end marker)
        self._space = threading.Semaphore(max_pieces)
        self._buf = bytearray()
        self._cancelled = threading.Event()

    def writable(self) -> bool:
        return True

    def write(self, data: bytes | bytearray | memoryview) -> int:  # type: ignore[override]
        if self._cancelled.is_set():
            raise PipeClosed("the reader left")
        self._buf += data
        while len(self._buf) >= self._piece_size:
            piece = bytes(self._buf[: self._piece_size])
            del self._buf[: self._piece_size]
            self._put(piece)
        return len(data)

    def finish(self) -> None:
        """The writer is done (or failed): send what is buffered, then the end marker."""
        try:
            if self._buf and not self._cancelled.is_set():
                self._put(bytes(self._buf))
        finally:
            self._buf.clear()
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody reads any more
                self._loop.call_soon_threadsafe(self._queue.put_nowait, _EOF)

    def cancel(self) -> None:
        """From the loop: the reader leaves; a blocked or later write raises ``PipeClosed``."""
        self._cancelled.set()
        self._space.release()

    def _put(self, piece: bytes) -> None:
        while not self._space.acquire(timeout=0.25):
            if self._cancelled.is_set():
                raise PipeClosed("the reader left")
        if self._cancelled.is_set():
            raise PipeClosed("the reader left")
        self._loop.call_soon_threadsafe(self._queue.put_nowait, piece)

    async def next_piece(self) -> bytes:
        """The next piece, or ``b""`` at the end."""
        piece = await self._queue.get()
        if piece:
            self._space.release()
        return piece


async def stream_from_thread(
    produce: Callable[[IO[bytes]], None], send: Callable[[bytes], Awaitable[None]], **pipe_options: int
) -> None:
    """Run ``produce(pipe)`` on a worker thread and ``send`` every piece it writes, in order.

    Raises what ``produce`` raised (after the pieces it did write were sent) or what ``send`` raised; either way
    the thread is stopped and awaited before this returns.
    """
    pipe = ThreadPipe(asyncio.get_running_loop(), **pipe_options)

    def run() -> None:
        try:
            produce(cast(IO[bytes], pipe))  # a writable binary stream (RawIOBase), which is all produce writes to
        finally:
            pipe.finish()

    producer = asyncio.ensure_future(asyncio.to_thread(run))
    try:
        while piece := await pipe.next_piece():
            await send(piece)
        await producer
    finally:
        if not producer.done():
            pipe.cancel()
            with contextlib.suppress(PipeClosed, Exception):
                await asyncio.shield(producer)
