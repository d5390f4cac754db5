"""Stops that arrive while a take is still being admitted (slow engine admission) are not lost."""

from __future__ import annotations

import asyncio
import json
import threading

import websockets

from moss_rt.config import Settings
from moss_rt.engine.base import TakeSpec
from moss_rt.engine.channel import TakeChannel
from moss_rt.engine.scripted import ScriptedEngine
from tests.helpers import decode, hello, next_json, run, wait_until

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


class GatedAdmission(ScriptedEngine):
    """The scripted engine whose admission of takes whose text starts with "gated" blocks until the
    test opens the gate (a reference voice still encoding while the engine is busy, made certain)."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.gate = threading.Event()
        self.waiting = threading.Event()
        self.admitted: list[str] = []

    async def submit(self, spec: TakeSpec) -> TakeChannel:
        if spec.text.startswith("gated"):
            self.waiting.set()
            while not self.gate.is_set():  # noqa: ASYNC110 - set from the test's thread, not this loop
                await asyncio.sleep(0.005)
        channel = await super().submit(spec)
        self.admitted.append(spec.text)
        return channel


def test_a_start_during_a_blocked_admission_never_gives_two_takes(make_server) -> None:
    """Issue 16, finding 2: start A (its admission blocks), start B, cancel, start C, then let A's
    admission finish. Every take gets one end, A's before anything of B; no A audio ever; never
    more than one engine slot for the socket."""

    def gated(settings: Settings) -> GatedAdmission:
        return GatedAdmission(frame_ms=settings.frame_ms, max_slots=8, max_queue=8, max_lead_sec=settings.max_lead_sec)

    srv = make_server(gated, engine="scripted", frame_ms=10.0, max_lead_sec=0.0)
    engine = srv.engine
    assert isinstance(engine, GatedAdmission)
    seen: list[tuple[str, str | None, str | None]] = []  # (type or "pcm", take, reason)
    most_active = 0

    async def read_until(ws: websockets.ClientConnection, kind: str = "end") -> dict:
        nonlocal most_active
        while True:
            tag, obj = decode(await asyncio.wait_for(ws.recv(), 10))
            if not engine.gate.is_set():
                # Once the gate opens, A's admission completes while C streams: the engine holds A's slot
                # for the instant until the session's Stop reaches it (it never speaks; checked below).
                most_active = max(most_active, engine.active_count)
            if tag == 1:
                seen.append(("pcm", None, None))
                continue
            seen.append((obj["type"], obj.get("take"), obj.get("reason")))
            if obj["type"] == kind:
                return obj

    async def scenario() -> None:
        async with websockets.connect(srv.ws_url) as ws:
            await hello(ws)
            await ws.send(json.dumps({"type": "start", "text": "gated A", "tokens": 400}))
            await wait_until(engine.waiting.is_set, 5)
            await ws.send(json.dumps({"type": "start", "text": "B " * 50, "tokens": 400}))
            end_a = await read_until(ws)
            assert end_a["reason"] == "replaced"
            take_a = end_a["take"]
            await read_until(ws, "start")  # B streams
            await ws.send(json.dumps({"type": "cancel"}))
            end_b = await read_until(ws)
            assert end_b["reason"] == "cancelled" and end_b["take"] != take_a
            await ws.send(json.dumps({"type": "start", "text": "C", "tokens": 30}))
            await asyncio.sleep(0.05)
            engine.gate.set()  # A's admission completes while C streams
            end_c = await read_until(ws)
            assert end_c["reason"] == "done" and end_c["n_frames"] == 30
            # A was admitted late and stopped at once: its slot is given back and it never speaks.
            await wait_until(lambda: "gated A" in engine.admitted, 5)
            await wait_until(lambda: engine.active_count == 0, 5)
            await ws.send(json.dumps({"type": "ping"}))
            assert (await next_json(ws, "pong", within=5))["type"] == "pong"
        takes = [take for kind, take, _ in seen if kind == "start"]
        ends = [(take, reason) for kind, take, reason in seen if kind == "end"]
        assert takes == [take_a, end_b["take"], end_c["take"]]
        assert ends == [(take_a, "replaced"), (end_b["take"], "cancelled"), (end_c["take"], "done")]
        # Nothing of A but its start and end, both before anything of B.
        assert seen[:2] == [("start", take_a, None), ("end", take_a, "replaced")]
        assert most_active <= 1

    run(scenario())
    assert srv.state.client_takes.running("127.0.0.1") == 0
