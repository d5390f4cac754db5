"""Stops that arrive while a take is still being admitted (slow engine admission) are not lost."""

from __future__ import annotations

import asyncio
import json

import websockets

from moss_rt.config import Settings
from moss_rt.engine.base import TakeSpec
from moss_rt.engine.channel import TakeChannel
from moss_rt.engine.scripted import ScriptedEngine
from tests.reliability.helpers import hello, next_json, run, wait_until

ADMIT_SEC = 0.4


class SlowAdmission(ScriptedEngine):
    """The scripted engine with a slow ``submit`` (like a real engine busy encoding a reference)."""

    async def submit(self, spec: TakeSpec) -> TakeChannel:
        await asyncio.sleep(ADMIT_SEC)
        return await super().submit(spec)


def slow(settings: Settings) -> ScriptedEngine:
    return SlowAdmission(
        frame_ms=settings.frame_ms,
        max_slots=settings.max_slots,
        max_queue=settings.max_queue,
        max_lead_sec=settings.max_lead_sec,
    )


def test_cancel_during_admission_still_ends_the_take(make_server) -> None:
    srv = make_server(slow, engine="scripted", frame_ms=20.0, max_lead_sec=0.0)

    async def scenario() -> None:
        async with websockets.connect(srv.ws_url) as ws:
            await hello(ws)
            await ws.send(json.dumps({"type": "start", "text": "long " * 50}))
            await asyncio.sleep(ADMIT_SEC / 4)
            await ws.send(json.dumps({"type": "cancel"}))
            end = await next_json(ws, "end", within=5)
            assert end["reason"] == "cancelled"
            await wait_until(lambda: srv.engine.active_count == 0, 2)
            # Barge-in during admission: the first take ends "replaced", the second plays.
            await ws.send(json.dumps({"type": "start", "text": "first " * 50}))
            await asyncio.sleep(ADMIT_SEC / 4)
            await ws.send(json.dumps({"type": "start", "text": "second", "tokens": 3}))
            first = await next_json(ws, "end", within=5)
            second = await next_json(ws, "end", within=5)
            assert (first["reason"], second["reason"]) == ("replaced", "done")

    run(scenario())


def test_disconnect_during_admission_frees_the_slot(make_server) -> None:
    srv = make_server(slow, engine="scripted", frame_ms=20.0, max_lead_sec=0.0)

    async def scenario() -> None:
        ws = await websockets.connect(srv.ws_url)
        await hello(ws)
        await ws.send(json.dumps({"type": "start", "text": "gone " * 50}))
        await asyncio.sleep(ADMIT_SEC / 4)
        ws.transport.abort()
        await wait_until(lambda: not srv.state.connections, 3)
        await asyncio.sleep(ADMIT_SEC)
        await wait_until(lambda: srv.engine.active_count == 0, 1)
        assert srv.state.client_takes.running("127.0.0.1") == 0

    run(scenario())


def test_back_to_back_messages_never_lose_an_end(make_server) -> None:
    """A replay stopped by the very next message (before its task ever ran) still gets its end."""
    from tests.web.conftest import scripted

    srv = make_server(scripted, engine="scripted", frame_ms=5.0, max_lead_sec=0.0)

    async def scenario() -> None:
        async with websockets.connect(srv.ws_url) as ws:
            await hello(ws)
            await ws.send(json.dumps({"type": "start", "text": "source", "tokens": 20}))
            source = (await next_json(ws, "end"))["take"]
            for i in range(10):
                replay = json.dumps({"type": "seek", "take": source, "frame": 2, "mode": "replay"})
                follow = {"type": "cancel"} if i % 2 else {"type": "start", "text": "next", "tokens": 2}
                await ws.send(replay)
                await ws.send(json.dumps(follow))  # same TCP segment, most likely
                end = await next_json(ws, "end", within=5)
                assert end["take"] == source and end.get("replay") is True
                if i % 2 == 0:
                    assert end["reason"] in ("replaced", "done")
                    assert (await next_json(ws, "end", within=5))["reason"] == "done"
                else:
                    assert end["reason"] in ("cancelled", "done")

    run(scenario())
