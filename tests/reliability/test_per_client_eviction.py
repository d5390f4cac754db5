"""Eviction is per client (issue 23, finding 10): another client's traffic cannot evict a victim's take.

The red team made a victim's take download answer 404 with 64 requests in 2.3 s and no generation: every
resumed session adopts its stored takes into the service's take store, which evicted its oldest takes whoever
owned them. Now the store evicts from the client that holds the most, and the renders' budget has a per-client
share, so a flood of one client pushes out (or turns away) only its own.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from moss_rt.engine.base import EngineBusy
from moss_rt.protocol import StartTake
from moss_rt.session import RecentTakes, TakeRecord, TakeStatus
from moss_rt.web.renders import SharedRenders
from tests.helpers import OwnerJar, run
from tests.reliability.archives import valid_archive

ATTACKER = {"X-Forwarded-For": "10.0.0.66"}  # another client, through the trusted proxy 127.0.0.1


def ended(take_id: str) -> TakeRecord:
    return TakeRecord(take_id, StartTake(text="x", seed=1), status=TakeStatus.ENDED)


def test_the_store_evicts_from_the_client_that_holds_the_most() -> None:
    store = RecentTakes(capacity=10)
    for i in range(3):
        store.add(ended(f"t_victim{i}"), "victim")
    for i in range(100):
        store.add(ended(f"t_flood{i}"), "attacker")
    assert all(store.get(f"t_victim{i}") is not None for i in range(3))
    assert len(store) == 10 and store.held_by("attacker") == 7
    assert store.get("t_flood99") is not None and store.get("t_flood0") is None  # its own oldest went
    # A running take is never evicted, whoever holds it.
    running = TakeRecord("t_running", StartTake(text="x", seed=1))
    store.add(running, "attacker")
    for i in range(20):
        store.add(ended(f"t_more{i}"), "attacker")
    assert store.get("t_running") is not None and store.held_by("victim") == 3
    # A client whose takes all run (it cannot give any up) still never evicts one that holds fewer.
    busy = RecentTakes(capacity=4)
    for i in range(2):
        busy.add(ended(f"t_victim{i}"), "victim")
    for i in range(5):
        busy.add(TakeRecord(f"t_run{i}", StartTake(text="x", seed=1)), "attacker")
    assert busy.held_by("victim") == 2 and len(busy) == 7


def test_renders_have_a_per_client_share() -> None:
    async def scenario() -> None:
        renders = SharedRenders(max_bytes=100)

        async def render() -> bytes:
            return b"x"

        async with renders.hold("t_a", 40, render, client="attacker"):
            with pytest.raises(EngineBusy):  # past half the budget for this client
                async with renders.hold("t_b", 40, render, client="attacker"):
                    pass
            async with renders.hold("t_c", 40, render, client="victim"):  # another client still renders
                async with renders.hold("t_a", 40, render, client="victim"):  # joining a render is free
                    assert renders.client_bytes("victim") == 40 and renders.client_bytes("attacker") == 40
        assert renders.nbytes == 0 and renders.client_bytes("attacker") == 0

    asyncio.run(scenario())


def test_another_clients_resumes_cannot_evict_a_victims_download(fast_server) -> None:
    srv = fast_server(trusted_proxies=("127.0.0.1",))

    async def shrink() -> None:
        srv.state.takes.capacity = 8  # the service keeps 1024 takes; 8 makes the flood short

    asyncio.run_coroutine_threadsafe(shrink(), srv.loop).result(5)
    victim = OwnerJar()
    take = victim.request("POST", f"{srv.url}/api/stream", json={"text": "mine", "tokens": 3})
    take_id = json.loads(take.content[5 : 5 + int.from_bytes(take.content[1:5], "big")])["take"]
    assert victim.request("GET", f"{srv.url}/api/takes/{take_id}.wav").status_code == 200
    # The attacker: sessions of stored takes (no generation), resumed again and again from fresh sockets.
    attacker = OwnerJar()
    sessions = [
        attacker.request("POST", f"{srv.url}/api/sessions/import", data=valid_archive(6, 1), headers=ATTACKER).json()
        for _ in range(4)
    ]

    async def flood() -> None:
        for body in sessions:
            ws = await attacker.connect(srv.ws_url, headers=ATTACKER)
            try:
                await ws.send(json.dumps({"type": "resume", "session": body["session"]}))
                while json.loads((await ws.recv())[5:])["type"] != "session":
                    pass
            finally:
                await ws.close()

    run(flood())
    assert srv.state.takes.held_by("10.0.0.66") >= 6  # the flood did reach the store ...
    r = victim.request("GET", f"{srv.url}/api/takes/{take_id}.wav")
    assert r.status_code == 200, r.text  # ... and pushed out only the attacker's own takes
