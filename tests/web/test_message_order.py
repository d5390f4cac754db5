"""Barge-in keeps its order while the replaced take is being stored (issue 27, the studio's rare "not busy" flake).

docs/protocol.md ("Barge-in"): a replaced take's ``end`` is sent before anything of the new take. On a socket bound to
a session, a take is stored before its ``end`` goes out; the session meanwhile answers new requests. When storing
took a while (a busy disk), a second ``start`` ended the waiting take ahead of it and the next one began: the page
saw ``start``/``end`` of later takes before the replaced take's ``end``. A store slowed down here makes that certain.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from moss_rt.session_store import SessionStore
from tests.helpers import OwnerJar
from tests.web.conftest import FRAME_MS, scripted

STORE_DELAY_SEC = 0.8


def test_a_replaced_take_ends_before_anything_of_the_next_while_it_is_stored(make_server, monkeypatch) -> None:
    put_take = SessionStore.put_take

    def slow_put_take(self: SessionStore, session_id: str, take: Any, *args: Any, **kwargs: Any) -> Any:
        if take.n_frames < 10:  # the replaced takes: stored slowly (a worker thread: the loop goes on)
            time.sleep(STORE_DELAY_SEC)
        return put_take(self, session_id, take, *args, **kwargs)

    monkeypatch.setattr(SessionStore, "put_take", slow_put_take)
    server = make_server(scripted, engine="scripted", frame_ms=FRAME_MS * 4, max_lead_sec=0.0)
    jar = OwnerJar()

    async def scenario() -> list[tuple[str, str | None]]:
        ws = await jar.connect(server.ws_url, max_size=None)
        events: list[tuple[str, str | None]] = []

        async def until(kind: str, label: str | None = None) -> None:
            while True:
                data = await ws.recv()
                if data[0] != 0:
                    continue
                msg = json.loads(data[5:])
                if msg["type"] in ("start", "end"):
                    events.append((msg["type"], msg.get("label") if msg["type"] == "start" else msg.get("take")))
                if msg["type"] == "error":
                    raise AssertionError(msg)
                if msg["type"] == kind and (label is None or msg.get("label") == label):
                    return

        await until("hello")
        await ws.send(json.dumps({"type": "resume"}))
        await until("session")
        await ws.send(json.dumps({"type": "start", "text": "the first line", "tokens": 40, "take": "one"}))
        await until("start", "one")
        for label in ("two", "three"):  # barge in twice: "two" is replaced while "one" is being stored
            await ws.send(json.dumps({"type": "start", "text": f"line {label}", "tokens": 6, "take": label}))
            await asyncio.sleep(0.05)
        while sum(kind == "end" for kind, _ in events) < 3:  # every take ends
            await until("end")
        await ws.close()
        return events

    events = asyncio.run(asyncio.wait_for(scenario(), 60))
    # One take at a time on the wire: start, end, start, end, ... (every end before the next start).
    assert [kind for kind, _ in events] == ["start", "end"] * 3, events
    assert [label for kind, label in events if kind == "start"] == ["one", "two", "three"], events
