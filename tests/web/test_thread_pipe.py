"""The pipe an export is packed through: all bytes in order, a bounded number of pieces in flight, and a
writing thread that stops when its reader leaves (pure asyncio, no server)."""

from __future__ import annotations

import asyncio
import threading
from typing import IO

import pytest

from moss_rt.web.thread_pipe import PipeClosed, stream_from_thread


def test_every_byte_arrives_in_order_with_few_pieces_in_flight() -> None:
    data = bytes(range(256)) * 4000  # ~1 MB
    high_water = [0]

    async def scenario() -> bytes:
        received = bytearray()
        sent = [0]

        def produce(out: IO[bytes]) -> None:
            for i in range(0, len(data), 1000):
                out.write(data[i : i + 1000])
                sent[0] = i + 1000
                high_water[0] = max(high_water[0], sent[0] - len(received))

        async def send(piece: bytes) -> None:
            await asyncio.sleep(0.001)  # a slow reader
            received.extend(piece)

        await stream_from_thread(produce, send, piece_size=16 * 1024, max_pieces=2)
        return bytes(received)

    assert asyncio.run(scenario()) == data
    assert high_water[0] <= 16 * 1024 * 4  # the writer waited for the reader: never far ahead


def test_a_reader_that_leaves_stops_the_writer() -> None:
    stopped = threading.Event()

    async def scenario() -> None:
        def produce(out: IO[bytes]) -> None:
            try:
                while True:
                    out.write(b"x" * 4096)
            except PipeClosed:
                stopped.set()
                raise

        async def send(piece: bytes) -> None:
            raise ConnectionResetError("gone")

        with pytest.raises(ConnectionResetError):
            await stream_from_thread(produce, send, piece_size=4096, max_pieces=1)
        assert stopped.is_set()  # stopped and awaited before stream_from_thread returned

    asyncio.run(scenario())


def test_a_writer_failure_reaches_the_reader_after_what_it_wrote() -> None:
    async def scenario() -> bytes:
        received = bytearray()

        def produce(out: IO[bytes]) -> None:
            out.write(b"abc")
            raise OSError("disk error")

        async def send(piece: bytes) -> None:
            received.extend(piece)

        with pytest.raises(OSError, match="disk error"):
            await stream_from_thread(produce, send)
        return bytes(received)

    assert asyncio.run(scenario()) == b"abc"
