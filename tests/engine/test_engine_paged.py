"""The paged KV cache through the real server (tiny model): retakes share blocks, every block comes back."""

from __future__ import annotations

import asyncio
import random

import pytest

from moss_rt.client import DirectingClient
from tests.engine.helpers import LONG, metrics
from tests.helpers import RunningServer, next_message, run

BLOCK = 16


async def _settled(srv: RunningServer, name: str) -> float:
    """A gauge once the engine is idle and has refreshed its gauges (they update every round)."""
    last = None
    for _ in range(200):
        m = await metrics(srv)
        if m["moss_rt_active_slots"] == 0 and m["moss_rt_queued_takes"] == 0:
            if last == m[name]:
                return last
            last = m[name]
        await asyncio.sleep(0.05)
    raise AssertionError(f"{name} never settled")


def _kept_blocks(srv: RunningServer) -> int:
    """Distinct blocks held by finished takes kept for retakes and by the prompt cache (read while the engine
    is idle)."""
    sched = srv.engine._scheduler  # type: ignore[attr-defined]
    return len({b for ref in sched.retained.refs() for b in ref.blocks} | set(sched.prompts.blocks()))


def test_a_retake_uses_blocks_for_its_new_frames_only(moss_server) -> None:  # type: ignore[no-untyped-def]
    srv = moss_server(max_slots=4)

    async def scenario() -> tuple[float, float, float]:
        free0 = await _settled(srv, "moss_rt_kv_blocks_free")
        async with DirectingClient.connect(srv.ws_url) as client:
            first = await client.speak("A line to direct, long enough to fill blocks.", seed=3, max_new_tokens=80,
                                       **LONG)
            free1 = await _settled(srv, "moss_rt_kv_blocks_free")
            retakes = []
            for seed in (10, 11, 12):  # three branches from frame 60, each making 80 new frames
                await client.seek(first.take_id, 60, seed=seed, **LONG)
                await next_message(client, "seek")
                retakes.append(await client.collect())
            assert [t.end["new_frames"] for t in retakes] == [80, 80, 80]
            free2 = await _settled(srv, "moss_rt_kv_blocks_free")
        return free0 - free1, free1 - free2, free0

    parent, branches, _ = run(scenario())
    assert parent >= 80 // BLOCK + 1  # the parent holds its prompt + 80 frames
    # Each branch shares the parent's prompt and first 60 frames and owns only the blocks of its 80 new
    # frames (5 or 6 of them) plus the copied branch block; a copy of the parent's cache would cost more.
    assert 3 * (80 // BLOCK) <= branches <= 3 * (80 // BLOCK + 2)
    assert branches / 3 < parent + (80 - 20) // BLOCK


def _codec_blocks(srv: RunningServer) -> tuple[list[int], list[set[int]], int]:
    """Free codec state blocks per stage, the distinct blocks kept codec states hold, and how many states are kept
    (read while the engine is idle)."""
    sched = srv.engine._scheduler  # type: ignore[attr-defined]
    kept = sched.retained.codec_states()
    held: list[set[int]] = [set() for _ in sched.decoder.free_blocks]
    for k in kept:
        for i, blocks in enumerate(k.blocks):
            held[i].update(blocks)
    return sched.decoder.free_blocks, held, len(kept)


@pytest.mark.slow  # started first in parallel runs (tests/conftest.py)
def test_every_block_comes_back_after_100_random_takes(moss_server) -> None:  # type: ignore[no-untyped-def]
    """100 random directing acts on 4 slots: takes run out or are cancelled, sockets drop mid-take, retakes branch
    from frames near the end (their codec state shared with the parent's kept blocks) or further back (rebuilt from
    the codes), some cancelled or dropped mid-way. KV blocks: what is not free is held by kept takes and kept
    prompt blocks. Codec state blocks, after every 4 acts: each is free or held by a kept state, and in the end
    each block's references are exactly the kept states holding it."""
    srv = moss_server(max_slots=4, max_queue=8, max_takes_per_client=0)
    rng = random.Random(1234)

    async def one(i: int) -> None:
        action = rng.choice(["done", "done", "cancel", "disconnect", "seek", "seek"])
        async with DirectingClient.connect(srv.ws_url) as client:
            await client.start(f"Take number {i}.", seed=i, max_new_tokens=rng.randint(4, 20), chunk_frames=4, **LONG)
            await next_message(client, "start")
            if action == "cancel":
                await client.cancel()
                await client.collect()
            elif action == "disconnect":
                return  # the socket closes mid-take
            else:
                take = await client.collect()
                frames = take.end["n_frames"]
                if action == "seek" and frames >= 2:  # a retake (shares the parent's blocks)
                    if rng.random() < 0.5:  # near the end: the tiny codec's ring (10 frames) still holds it
                        frame = rng.randint(max(1, frames - 4), frames - 1)
                    else:  # further back than the ring keeps, where the take is long enough: rebuilt
                        frame = rng.randint(1, frames - 12 if frames > 12 else frames - 1)
                    await client.seek(take.take_id, frame, seed=i + 1000)
                    await next_message(client, "seek")
                    if rng.random() < 0.5:
                        await client.collect()
                    elif rng.random() < 0.5:
                        await client.cancel()
                        await client.collect()
                    # else: disconnect during the retake

    async def scenario() -> tuple[float, float, list[int], dict[str, float]]:
        total = await _settled(srv, "moss_rt_kv_blocks_total")
        start = await _settled(srv, "moss_rt_kv_blocks_free")
        assert start == total
        codec_start, held, kept = _codec_blocks(srv)
        assert kept == 0 and not any(held)
        for batch in range(25):  # 4 clients at a time
            await asyncio.gather(*(one(batch * 4 + k) for k in range(4)))
            await _settled(srv, "moss_rt_codec_blocks_free")
            free, held, _ = _codec_blocks(srv)
            assert [f + len(h) for f, h in zip(free, held, strict=True)] == codec_start, batch
        end = await _settled(srv, "moss_rt_kv_blocks_free")
        return start, end, codec_start, await metrics(srv)

    start, end, codec_start, m = run(scenario(), timeout=600)
    # What is not free is held by finished takes kept for retakes and kept prompt blocks, and nothing else.
    assert end + _kept_blocks(srv) == start
    assert run(_settled(srv, "moss_rt_kv_blocks_promised")) == 0
    # Retakes took both codec paths; every codec reference is a kept state's.
    assert m['moss_rt_codec_states_total{source="shared"}'] >= 5
    assert m['moss_rt_codec_states_total{source="rebuilt"}'] >= 2
    sched = srv.engine._scheduler  # type: ignore[attr-defined]
    tables, kept = sched.decoder._tables, sched.retained.codec_states()
    for i, g in enumerate(tables.geoms):
        for block in range(g.scratch_blocks, tables.n_blocks[i]):
            assert tables.refcount(i, block) == sum(block in k.blocks[i] for k in kept)
    assert sched.decoder.unreserved_blocks == sched.decoder.free_blocks  # nothing promised to a stream
