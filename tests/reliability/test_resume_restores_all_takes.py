"""Issue 23, finding 6: resume restored only the newest 32 takes of a 40-take session.

The stored takes were adopted into the connection's history while it still had the limit of a connection
without a session (``max_takes_kept``, 32), before resume raised it to the session's (``max_session_takes``):
the 8 oldest were dropped again at once and answered ``not_found``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest
import websockets

from moss_rt.protocol import Limits
from tests.helpers import OwnerJar, RunningServer, decode, hello, run

TAKES = 40


@pytest.fixture
def server(fast_server: Callable[..., RunningServer]) -> RunningServer:
    return fast_server(limits=Limits(ws_messages_per_sec=1000.0, ws_message_burst=1000))


async def until(ws: websockets.ClientConnection, kind: str) -> dict[str, Any]:
    while True:
        tag, obj = decode(await asyncio.wait_for(ws.recv(), 10))
        if tag == 0 and obj["type"] == "error":
            raise AssertionError(obj)
        if tag == 0 and obj["type"] == kind:
            return obj


def test_a_session_of_more_takes_than_a_connection_keeps_resumes_whole(server: RunningServer) -> None:
    assert TAKES > server.state.settings.limits.max_takes_kept

    jar = OwnerJar()  # the session's owner (its cookie), on both connections

    async def scenario() -> None:
        async with await jar.connect(server.ws_url, max_size=None) as ws:
            await hello(ws)
            await ws.send(json.dumps({"type": "resume"}))
            session = (await until(ws, "session"))["session"]
            for n in range(TAKES):
                await ws.send(json.dumps({"type": "start", "text": f"line {n}", "tokens": 2, "seed": n}))
                await until(ws, "end")
        async with await jar.connect(server.ws_url, max_size=None) as ws:
            await hello(ws)
            await ws.send(json.dumps({"type": "resume", "session": session}))
            takes = (await until(ws, "session"))["takes"]
            assert len(takes) == TAKES
            for take in takes:  # every one, the oldest first, is this connection's take again
                await ws.send(json.dumps({"type": "seek", "take": take["take_id"], "frame": 0, "mode": "replay"}))
                end = await until(ws, "end")
                assert (end["take"], end["reason"], end["n_frames"]) == (take["take_id"], "done", 2)

    run(scenario())
