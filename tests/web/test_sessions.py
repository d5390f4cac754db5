"""Directing sessions that survive: ``resume`` on the WebSocket and the /api/sessions routes, on a real server
(scripted engine, whose stereo audio encodes frame index and seed), across a reconnect and a restart."""

from __future__ import annotations

import asyncio
import io
import json
import time
import wave
from typing import Any

import numpy as np
import requests
import websockets

from moss_rt.protocol import FRAME_SAMPLES, Limits
from tests.conftest import RunningServer
from tests.helpers import OwnerJar
from tests.web.conftest import FRAME_MS, scripted
from tests.web.helpers import expected_stereo, stereo_frames


def run(coro):  # noqa: ANN001, ANN201 - tiny sync wrapper for async scenarios
    return asyncio.run(asyncio.wait_for(coro, 60))


class Channel:
    """A raw directing socket: control messages out, (json messages, PCM) in."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws

    async def send(self, **msg: Any) -> None:
        await self.ws.send(json.dumps(msg))

    async def until(self, kind: str) -> dict[str, Any]:
        while True:
            data = await self.ws.recv()
            if data[0] == 0:
                msg = json.loads(data[5:])
                if msg["type"] == kind:
                    return msg
                if msg["type"] == "error" and kind != "error":
                    raise AssertionError(msg)

    async def take(self, **start: Any) -> tuple[dict[str, Any], bytes]:
        """Run a start to its end; the end message and the PCM."""
        await self.send(**start)
        return await self.to_end()

    async def to_end(self) -> tuple[dict[str, Any], bytes]:
        pcm = bytearray()
        while True:
            data = await self.ws.recv()
            if data[0] == 1:
                pcm += data[5:]
            else:
                msg = json.loads(data[5:])
                if msg["type"] == "error":
                    raise AssertionError(msg)
                if msg["type"] == "end":
                    return msg, bytes(pcm)


async def connect(server: RunningServer, session: str | None, jar: OwnerJar) -> tuple[Any, Channel, dict[str, Any]]:
    """A directing socket as the owner ``jar`` holds (given the owner cookie on its first connection)."""
    ws = await jar.connect(server.ws_url, max_size=None)
    ch = Channel(ws)
    hello = await ch.until("hello")
    assert hello["sessions"] is True
    await ch.send(type="resume", **({"session": session} if session else {}))
    return ws, ch, await ch.until("session")


def test_a_session_resumes_after_a_reconnect_and_a_restart_with_every_take_retakeable(make_server) -> None:
    server = make_server(scripted, engine="scripted", frame_ms=FRAME_MS, max_lead_sec=0.0)
    jar = OwnerJar()

    async def first_visit() -> tuple[str, str, bytes]:
        ws, ch, session = await connect(server, None, jar)
        assert session["resumed"] is False and session["takes"] == [] and session["session"].startswith("s_")
        end, pcm = await ch.take(type="start", text="the first line", seed=3, channels=2, tokens=12)
        await ws.close()
        return session["session"], end["take"], pcm

    sid, take_id, heard = run(first_visit())

    async def visit(srv: RunningServer) -> None:
        ws, ch, session = await connect(srv, sid, jar)
        assert session["resumed"] is True and session["session"] == sid
        [record] = [t for t in session["takes"] if t["take_id"] == take_id]
        assert (record["seed"], record["n_frames"], record["channels"], record["reason"]) == (3, 12, 2, "done")
        assert record["request"]["text"] == "the first line"
        # The stored audio is the audio as heard.
        r = await asyncio.to_thread(jar.request, "GET", f"{srv.url}/api/sessions/{sid}/takes/{take_id}.wav")
        with wave.open(io.BytesIO(r.content)) as w:
            assert w.readframes(w.getnframes()) == heard
        # A retake of a take from an earlier connection (or before the restart): its prefix is the old audio.
        await ch.send(type="seek", take=take_id, frame=5, seed=9)
        ack = await ch.until("seek")
        assert ack["from_take"] == take_id and ack["frame"] == 5
        end, pcm = await ch.to_end()
        assert end["take"] == ack["take"] and end["reason"] == "done"
        assert stereo_frames(pcm) == expected_stereo(5, 12, 9)  # the scripted engine: tokens new frames
        await ws.close()

    run(visit(server))  # a reconnect
    server_data = server.state.settings.data_dir
    again = make_server(scripted, engine="scripted", frame_ms=FRAME_MS, max_lead_sec=0.0, data_dir=server_data)
    run(visit(again))  # a restart: a second service on the same data dir
    listed: list[dict[str, Any]] = []
    for _ in range(100):  # the last retake is stored right after its end frame went out
        listed = jar.request("GET", f"{again.url}/api/sessions/{sid}").json()["takes"]
        if len(listed) == 3:
            break
        time.sleep(0.05)
    assert [t["take_id"] for t in listed][0] == take_id and len(listed) == 3  # the first take and two retakes
    assert all(t["parent"] == take_id and t["branch_frame"] == 5 for t in listed[1:])


def test_notes_delete_export_import_and_a_full_session(make_server) -> None:
    server = make_server(
        scripted, engine="scripted", frame_ms=FRAME_MS, max_lead_sec=0.0, limits=Limits(max_session_takes=2)
    )
    jar = OwnerJar()

    async def scenario() -> tuple[str, list[str]]:
        ws, ch, session = await connect(server, None, jar)
        ids = []
        for n in range(2):
            end, _ = await ch.take(type="start", text=f"line {n}", seed=n + 1, tokens=6)
            ids.append(end["take"])
        await ch.send(type="start", text="one too many", tokens=6)
        err = await ch.until("error")
        assert err["code"] == "too_large" and "2 takes" in err["message"] and "delete" in err["message"]
        await ws.close()
        return session["session"], ids

    sid, ids = run(scenario())
    base = f"{server.url}/api/sessions/{sid}"
    r = jar.request("PATCH", f"{base}/takes/{ids[0]}", json={"title": "Keeper", "starred": True})
    assert r.status_code == 200 and r.json()["title"] == "Keeper"
    bad = jar.request("PATCH", f"{base}/takes/{ids[0]}", json={"starred": "yes"})
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "starred"
    assert jar.request("DELETE", f"{base}/takes/{ids[1]}").status_code == 200
    assert jar.request("GET", f"{base}/takes/{ids[1]}.wav").status_code == 404

    archive = jar.request("GET", f"{base}/archive")
    assert archive.headers["Content-Type"] == "application/zip"
    imported = jar.request("POST", f"{server.url}/api/sessions/import", data=archive.content).json()
    assert imported["session"] != sid and [t["title"] for t in imported["takes"]] == ["Keeper"]
    new_id = imported["takes"][0]["take_id"]
    a = jar.request("GET", f"{base}/takes/{ids[0]}.wav").content
    b = jar.request("GET", f"{server.url}/api/sessions/{imported['session']}/takes/{new_id}.wav").content
    assert a == b
    junk = jar.request("POST", f"{server.url}/api/sessions/import", data=b"not a zip")
    assert junk.status_code == 422 and "not a zip" in junk.json()["error"]["message"]
    assert requests.get(f"{server.url}/api/sessions/s_{'x' * 20}", timeout=10).status_code == 404


def test_an_unknown_session_is_not_found_and_the_socket_stays_usable(server: RunningServer) -> None:
    async def scenario() -> None:
        async with websockets.connect(server.ws_url) as ws:
            ch = Channel(ws)
            await ch.until("hello")
            await ch.send(type="resume", session="s_" + "A" * 24)
            err = await ch.until("error")
            assert err["code"] == "not_found" and err["field"] == "session" and not err["fatal"]
            end, pcm = await ch.take(type="start", text="still here", tokens=4)
            assert end["reason"] == "done" and len(pcm) == 4 * FRAME_SAMPLES * 2
            assert np.frombuffer(pcm, "<i2").size == 4 * FRAME_SAMPLES

    run(scenario())


def test_a_stored_take_keeps_its_request_as_asked_so_a_random_seed_stays_random(make_server) -> None:
    """Issue 27 (6): a stored take's request holds a seed only when the director gave one; the record's ``seed``
    is the take's seed either way. Kept across a resume, a restart of the socket, a retake and an archive."""
    server = make_server(scripted, engine="scripted", frame_ms=FRAME_MS, max_lead_sec=0.0)
    jar = OwnerJar()

    async def scenario() -> tuple[str, dict[str, str]]:
        ws, ch, session = await connect(server, None, jar)
        fixed, _ = await ch.take(type="start", text="a fixed seed", seed=42, tokens=4)
        rand, _ = await ch.take(type="start", text="the server picks", tokens=4)
        await ch.send(type="seek", take=fixed["take"], frame=2)  # a retake with a new random seed
        retake_random, _ = await ch.to_end()
        await ch.send(type="seek", take=rand["take"], frame=2, seed=7)  # a retake with a given seed
        retake_fixed, _ = await ch.to_end()
        await ws.close()
        ids = {"fixed": fixed["take"], "random": rand["take"], "retake_random": retake_random["take"],
               "retake_fixed": retake_fixed["take"]}  # fmt: skip
        return session["session"], ids

    sid, ids = run(scenario())

    async def resumed() -> list[dict[str, Any]]:
        ws, _ch, session = await connect(server, sid, jar)
        await ws.close()
        return session["takes"]

    def asked(records: list[dict[str, Any]], id_of: dict[str, str]) -> dict[str, bool]:
        by_id = {r["take_id"]: r for r in records}
        assert all(isinstance(r["seed"], int) for r in records)  # every take has its one seed
        return {name: "seed" in by_id[take_id]["request"] for name, take_id in id_of.items()}

    expected = {"fixed": True, "random": False, "retake_random": False, "retake_fixed": True}
    records = run(resumed())
    assert asked(records, ids) == expected
    assert {r["take_id"]: r["request"].get("seed") for r in records}[ids["fixed"]] == 42
    # Through an archive: the imported takes (new ids, same order) keep their requests as asked.
    archive = jar.request("GET", f"{server.url}/api/sessions/{sid}/archive")
    imported = jar.request("POST", f"{server.url}/api/sessions/import", data=archive.content).json()["takes"]
    assert ["seed" in t["request"] for t in imported] == [expected[k] for k in ids]
