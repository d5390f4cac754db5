"""Issue 23, finding 5: a take interrupted by a reload or a network drop was not kept.

A ``cancel`` was kept, but a take whose socket was closed (a page reload) or reset (a network drop) while its
audio was going out vanished from its directing session, although the README says a reload brings every take
back. Now it is stored as heard, ``cancelled``, and a resume right after the disconnect finds it.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import websockets

from moss_rt.engine.scripted import seed_marker
from moss_rt.session import Phase
from tests.helpers import OwnerJar, RunningServer, decode, hello, run, wait_until


@pytest.fixture
def server(fast_server: Callable[..., RunningServer]) -> RunningServer:
    # Paced (the client may be 0.5 s ahead): a long take is still streaming when the client goes.
    return fast_server(max_lead_sec=0.5)


async def resume(ws: websockets.ClientConnection, session: str | None = None) -> dict[str, Any]:
    await ws.send(json.dumps({"type": "resume", **({"session": session} if session else {})}))
    while True:
        tag, obj = decode(await asyncio.wait_for(ws.recv(), 10))
        if tag == 0 and obj["type"] == "session":
            return obj


async def interrupted_take(
    server: RunningServer, jar: OwnerJar, leave: str, **fields: object
) -> tuple[str, str, bytes]:
    """Start a long take in a new session (owned by ``jar``'s cookie), hear some of it, then leave (``close``
    or ``reset``). Returns the session, the take and the PCM heard."""
    ws = await jar.connect(server.ws_url, max_size=None)
    await hello(ws)
    session = (await resume(ws))["session"]
    start = {"type": "start", "text": "a long line", "tokens": 300, "max_new_tokens": 300, "channels": 2,
             "chunk_frames": 2, "seed": 5, **fields}
    await ws.send(json.dumps(start))
    heard = bytearray()
    take = ""
    while len(heard) < 10 * 3840 * 4:  # ten frames
        tag, obj = decode(await asyncio.wait_for(ws.recv(), 10))
        if tag == 0 and obj["type"] == "start":
            take = obj["take"]
        elif tag == 1:
            heard += obj
    if leave == "close":
        await ws.close()  # a page reload: the browser closes the socket
    else:
        sock = ws.transport.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        ws.transport.abort()  # a network drop: a TCP reset
    return session, take, bytes(heard)


@pytest.mark.parametrize("leave", ["close", "reset"])
def test_a_take_cut_off_by_a_disconnect_is_kept_as_heard(server: RunningServer, leave: str) -> None:
    jar = OwnerJar()  # the same browser before and after the reload

    async def scenario() -> tuple[dict[str, Any], str, bytes]:
        session, take, heard = await interrupted_take(server, jar, leave)
        # The server has seen the client go (its connection left the registry); its take may still be being
        # stored: the resume waits for that, as a reload would.
        await wait_until(lambda: not server.state.connections, within=10)
        ws = await jar.connect(server.ws_url, max_size=None)
        async with ws:
            await hello(ws)
            resumed = await resume(ws, session)
        return resumed, take, heard

    resumed, take, heard = run(scenario())
    (stored,) = resumed["takes"]
    assert stored["take_id"] == take and stored["reason"] == "cancelled"
    assert 10 <= stored["n_frames"] < 300
    wav = jar.request("GET", f"{server.url}/api/sessions/{resumed['session']}/takes/{take}.wav")
    assert wav.status_code == 200
    pcm = wav.content[44:]
    assert len(pcm) == stored["n_frames"] * 3840 * 4
    assert pcm[: len(heard)] == heard  # what the client heard, exactly
    assert np.all(np.frombuffer(pcm, dtype="<i2").reshape(-1, 2)[:, 1] == seed_marker(5))


def test_a_take_fed_with_text_cut_off_while_waiting_is_kept(server: RunningServer) -> None:
    """A take fed with text (``stream_text``) that spoke a sentence and then waited for more text."""

    jar = OwnerJar()

    async def scenario() -> tuple[dict[str, Any], str]:
        ws = await jar.connect(server.ws_url, max_size=None)
        await hello(ws)
        session = (await resume(ws))["session"]
        await ws.send(json.dumps({"type": "start", "stream_text": True, "text": "One sentence. ", "channels": 2,
                                  "tokens": 8, "seed": 9}))
        take = ""
        frames = 0
        while frames < 8:
            tag, obj = decode(await asyncio.wait_for(ws.recv(), 10))
            if tag == 0 and obj["type"] == "start":
                take = obj["take"]
            elif tag == 1:
                frames += len(obj) // (3840 * 4)
        await wait_until(lambda: all(c.lifecycle.phase is Phase.WAITING for c in server.state.connections))
        await ws.close()
        await wait_until(lambda: not server.state.connections, within=10)
        ws2 = await jar.connect(server.ws_url, max_size=None)
        async with ws2:
            await hello(ws2)
            return await resume(ws2, session), take

    resumed, take = run(scenario())
    (stored,) = resumed["takes"]
    assert (stored["take_id"], stored["reason"], stored["n_frames"]) == (take, "cancelled", 8)
