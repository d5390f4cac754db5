"""TakeChannel.batches: a relay that fell behind takes the events that piled up in one go (a cluster replica sends
each batch as one stream item), in order, within a byte budget, with the same pausing, end and abandon rules."""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np

from moss_rt.engine.base import AudioChunk, EndReason, TakeEvent, TakeFinished, TakeFirstAudio
from moss_rt.engine.channel import TakeChannel

FRAME_BYTES = 7680


def chunk(first: int, n: int) -> AudioChunk:
    return AudioChunk(first, np.zeros((n, 12), dtype=np.int64), bytes(n * FRAME_BYTES))


async def settle() -> None:
    for _ in range(3):  # pushes land through call_soon_threadsafe
        await asyncio.sleep(0)


def test_what_piled_up_comes_together_in_order_within_the_budget() -> None:
    async def scenario() -> None:
        channel = TakeChannel(asyncio.get_running_loop(), "t", lead_frames=7)
        events: list[TakeEvent] = [TakeFirstAudio(12.0), *(chunk(i, 1) for i in range(5)), chunk(5, 4)]
        for event in events:
            channel.push(event)
        await settle()
        assert channel.paused  # 9 frames unread, lead 7
        batches = aiter(channel.batches(max_bytes=3 * FRAME_BYTES))
        first = await anext(batches)
        assert first == events[:4]  # first audio and three one-frame chunks: the fourth would exceed the budget
        assert not channel.paused  # 6 frames unread now
        assert await anext(batches) == events[4:6]
        assert await anext(batches) == [events[6]]  # alone over the budget: it still goes, alone
        channel.push(TakeFinished(EndReason.MAX_FRAMES, 9, 1.0))
        await settle()
        assert [type(e) for e in await anext(batches)] == [TakeFinished]
        assert [b async for b in batches] == []  # the end ends the batches
        assert channel.cancel_reason is None

    asyncio.run(scenario())


def test_the_last_chunk_and_the_end_travel_together_and_an_abandoned_reader_cancels() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        channel = TakeChannel(loop, "t", lead_frames=50)
        channel.push(chunk(0, 8))
        channel.push(TakeFinished(EndReason.DONE, 8, 1.0))
        await settle()
        assert [type(e) for e in await anext(aiter(channel.batches(max_bytes=10**6)))] == [AudioChunk, TakeFinished]

        other = TakeChannel(loop, "u", lead_frames=50)
        other.push(chunk(0, 1))
        await settle()
        async with contextlib.aclosing(other.batches(max_bytes=10**6)) as batches:
            await anext(batches)  # the reader walks away mid-take
        assert other.cancel_reason is EndReason.CANCELLED

    asyncio.run(scenario())
