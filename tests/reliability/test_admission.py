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
