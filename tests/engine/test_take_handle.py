"""A take's event iterator cancels its take when abandoned, so consumers need no cancel of their own."""

from __future__ import annotations

import asyncio
import contextlib

from moss_rt.engine.base import AudioChunk, EndReason, TakeSpec
from moss_rt.engine.scripted import ScriptedEngine


async def _wait_idle(engine: ScriptedEngine, within: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + within
    while engine.active_count:
        assert asyncio.get_running_loop().time() < deadline, "the abandoned take still holds its slot"
        await asyncio.sleep(0.01)


def test_closing_the_iterator_early_cancels_the_take() -> None:
    async def scenario() -> None:
        async with ScriptedEngine(frame_ms=5.0) as engine:
            handle = await engine.submit(TakeSpec("t", text="x", tokens=10_000, max_frames=10_000, seed=1))
            async with contextlib.aclosing(aiter(handle)) as events:
                async for event in events:
                    if isinstance(event, AudioChunk):
                        break  # the consumer walks away after the first audio
            assert handle.cancel_reason is EndReason.CANCELLED
            await _wait_idle(engine)

    asyncio.run(scenario())


def test_cancelling_the_consuming_task_cancels_the_take() -> None:
    async def scenario() -> None:
        async with ScriptedEngine(frame_ms=5.0) as engine:
            handle = await engine.submit(TakeSpec("t", text="x", tokens=10_000, max_frames=10_000, seed=1))
            first = asyncio.Event()

            async def consume() -> None:
                async for _ in handle:
                    first.set()

            task = asyncio.create_task(consume())
            await asyncio.wait_for(first.wait(), 5)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            assert handle.cancel_reason is EndReason.CANCELLED
            await _wait_idle(engine)

    asyncio.run(scenario())


def test_a_take_read_to_its_end_is_not_cancelled() -> None:
    async def scenario() -> None:
        async with ScriptedEngine(frame_ms=1.0) as engine:
            assert engine.info.ready
            handle = await engine.submit(TakeSpec("t", text="x", tokens=3, seed=1))
            events = [event async for event in handle]
            assert events[-1].reason is EndReason.DONE and handle.cancel_reason is None

    asyncio.run(scenario())
