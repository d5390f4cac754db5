"""The directing bench's shared retake instant (``--retake-at``) and its report of how close together the seeks went
out: the figures of two trees are comparable only under the same burst of retakes (bench/directing_bench.py)."""

from __future__ import annotations

import asyncio
import json
import struct
import time
from types import SimpleNamespace

import aiohttp
import pytest

from tests.engine.helpers import bench_module


@pytest.fixture(scope="module")
def bench():
    with bench_module("directing_bench.py") as module:
        yield module


def frame(tag: int, payload: bytes) -> SimpleNamespace:
    return SimpleNamespace(type=aiohttp.WSMsgType.BINARY, data=bytes([tag]) + struct.pack(">I", len(payload)) + payload)


class FakeSocket:
    """What the bench reads from: frames put in a queue by the test, as the server would send them."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[SimpleNamespace] = asyncio.Queue()

    async def receive(self) -> SimpleNamespace:
        return await self.queue.get()


def test_seek_spread_reports_the_burst_the_retakes_came_in(bench) -> None:
    directors = []
    for i, sent in enumerate([10.0, 10.1, 10.4, 12.0]):
        d = bench.Director(i)
        d.retake_window = (sent, sent + 0.3)
        directors.append(d)
    directors[3].retake_late = True
    directors.append(bench.Director(4))  # failed before its retake: not counted
    spread = bench.seek_spread(directors)
    assert spread["last"] == pytest.approx(2000.0)
    assert spread["p50"] == pytest.approx(250.0)
    assert spread["late"] == 1
    assert bench.seek_spread([bench.Director(0)]) == {"p50": None, "p95": None, "last": None, "late": 0}


def test_waiting_for_the_shared_instant_keeps_reading_the_audio(bench) -> None:
    async def scenario() -> tuple[bool, int, float, bool]:
        ws = FakeSocket()
        rec = bench.Director(0)
        sock = bench.Socket(ws, rec)
        sock.current = "t1"
        sock.stream = "0.take"
        pcm = frame(1, b"\0" * bench.FRAME_BYTES * 2)  # two frames a message

        async def server() -> None:  # runs once the wait yields: the frames arrive while it waits, none timed
            for _ in range(5):
                await ws.queue.put(pcm)

        feeder = asyncio.create_task(server())
        t0 = time.perf_counter()
        ended = await sock.audio_until(t0 + 0.3)
        waited = time.perf_counter() - t0
        await feeder
        # A take that ends before the instant says so.
        await ws.queue.put(frame(0, json.dumps({"type": "end", "take": "t1", "reason": "done"}).encode()))
        ended_early = await sock.audio_until(time.perf_counter() + 5.0)
        return ended, sum(f for _, f, _ in rec.pcm), waited, ended_early

    ended, frames, waited, ended_early = asyncio.run(scenario())
    assert not ended
    assert frames == 10  # every frame sent meanwhile was read (a player's socket never backs up)
    assert waited >= 0.29
    assert ended_early
