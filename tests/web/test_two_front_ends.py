"""Two front ends, one session store (issue 29): a session written through one is resumed, retaken, noted,
exported and deleted through the other, on both backends (PostgreSQL with a shared files folder and a data dir
each; SQLite with one data dir on one machine). And the loss of the database: session calls answer 503 ``busy``
while it is away, the service keeps serving, and they work again once it is back."""

from __future__ import annotations

import io
import time
import wave
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.conftest import RunningServer
from tests.helpers import OwnerJar, error_of
from tests.postgres import PostgresCluster, why_no_postgres
from tests.web.conftest import FRAME_MS, scripted
from tests.web.helpers import expected_stereo, stereo_frames
from tests.web.test_sessions import connect, run


def _front_ends(make_server: Any, tmp_path: Path, backend: str, url: str) -> tuple[RunningServer, RunningServer]:
    common: dict[str, Any] = dict(engine="scripted", frame_ms=FRAME_MS, max_lead_sec=0.0)
    if backend == "postgresql":
        shared = {"session_store": url, "session_files": str(tmp_path / "shared-sessions")}
        return (make_server(scripted, **common, **shared, data_dir=tmp_path / "fe-a"),
                make_server(scripted, **common, **shared, data_dir=tmp_path / "fe-b"))  # fmt: skip
    return (make_server(scripted, **common, data_dir=tmp_path / "data"),
            make_server(scripted, **common, data_dir=tmp_path / "data"))  # fmt: skip


def _takes(jar: OwnerJar, server: RunningServer, sid: str, count: int) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 10
    while True:  # a take is stored right after its end frame went out
        takes: list[dict[str, Any]] = jar.request("GET", f"{server.url}/api/sessions/{sid}").json()["takes"]
        if len(takes) >= count or time.monotonic() > deadline:
            return takes
        time.sleep(0.05)


@pytest.fixture
def store_url(backend: str, request: pytest.FixtureRequest) -> str:
    """The PostgreSQL database of the ``postgresql`` run ("" for SQLite). Asked for before ``make_server``, so the
    database is dropped after the front ends stopped: dropped first, their closing would wait for it (seconds)."""
    return str(request.getfixturevalue("postgres_url")) if backend == "postgresql" else ""


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_session_written_through_one_front_end_is_resumed_through_the_other(
    store_url: str, make_server: Any, tmp_path: Path, backend: str
) -> None:
    url = store_url
    a, b = _front_ends(make_server, tmp_path, backend, url)
    jar = OwnerJar()  # one director, whose requests the balancer sends to either front end

    async def through_a() -> tuple[str, str, bytes]:
        ws, ch, session = await connect(a, None, jar)
        end, pcm = await ch.take(type="start", text="the first line", seed=3, channels=2, tokens=12)
        await ws.close()
        return session["session"], end["take"], pcm

    sid, take_id, heard = run(through_a())
    assert len(_takes(jar, a, sid, 1)) == 1

    async def through_b() -> str:
        ws, ch, session = await connect(b, sid, jar)  # the owner cookie a minted is valid on b
        assert session["resumed"] is True and [t["take_id"] for t in session["takes"]] == [take_id]
        await ch.send(type="seek", take=take_id, frame=5, seed=9)  # rebuilt from the codes a stored
        await ch.until("seek")
        end, pcm = await ch.to_end()
        assert stereo_frames(pcm) == expected_stereo(5, 12, 9)
        await ws.close()
        return str(end["take"])

    retake = run(through_b())
    r = jar.request("GET", f"{b.url}/api/sessions/{sid}/takes/{take_id}.wav")
    with wave.open(io.BytesIO(r.content)) as w:
        assert w.readframes(w.getnframes()) == heard  # b serves the audio a heard
    listed = _takes(jar, a, sid, 2)
    assert [t["take_id"] for t in listed] == [take_id, retake] and listed[1]["parent"] == take_id
    assert jar.request("PATCH", f"{a.url}/api/sessions/{sid}/takes/{retake}", json={"title": "Keeper"}).ok
    assert _takes(jar, b, sid, 2)[1]["title"] == "Keeper"
    assert [s["session"] for s in jar.request("GET", f"{b.url}/api/sessions").json()["sessions"]] == [sid]
    # Exported through b, imported through a, deleted through b.
    archive = jar.request("GET", f"{b.url}/api/sessions/{sid}/archive").content
    imported = jar.request("POST", f"{a.url}/api/sessions/import", data=archive).json()["session"]
    assert len(_takes(jar, b, imported, 2)) == 2
    assert jar.request("DELETE", f"{b.url}/api/sessions/{imported}").ok
    assert jar.request("GET", f"{a.url}/api/sessions/{imported}").status_code == 404
    assert OwnerJar().request("GET", f"{b.url}/api/sessions/{sid}").status_code == 404  # still only its owner's


def test_the_loss_of_the_database_is_503_and_the_service_recovers(
    make_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reason = why_no_postgres()
    if reason is not None:
        pytest.skip(reason)
    from moss_rt.storage import postgres

    monkeypatch.setattr(postgres, "POOL_WAIT_SEC", 1.0)  # a call's wait for the database (5 s in service)
    cluster = PostgresCluster().init().start()  # its own server: this test stops it
    try:
        server = make_server(scripted, engine="scripted", frame_ms=FRAME_MS, max_lead_sec=0.0,
                             session_store=cluster.url(), session_files=str(tmp_path / "files"))  # fmt: skip
        jar = OwnerJar()
        sid = jar.request("POST", f"{server.url}/api/sessions").json()["session"]
        cluster.stop()
        r = jar.request("GET", f"{server.url}/api/sessions/{sid}")
        assert r.status_code == 503 and error_of(r)["code"] == "busy" and r.headers.get("Retry-After")
        assert "session store is unavailable" in error_of(r)["message"]
        assert requests.get(f"{server.url}/healthz", timeout=5).status_code == 200
        speech = requests.post(f"{server.url}/api/stream", json={"text": "still speaking", "tokens": 4}, timeout=30)
        assert speech.status_code == 200 and speech.content  # takes without a session do not need the store

        async def resume_refused() -> dict[str, Any]:
            ws, ch, _ = await connect_no_session(server, jar)
            await ch.send(type="resume", session=sid)
            err = await ch.until("error")
            await ws.close()
            return err

        assert run(resume_refused())["code"] == "busy"
        cluster.start()
        deadline = time.monotonic() + 20
        while (r := jar.request("GET", f"{server.url}/api/sessions/{sid}")).status_code != 200:
            assert time.monotonic() < deadline, r.text
            time.sleep(0.1)
        assert r.json()["takes"] == []
    finally:
        cluster.remove()


async def connect_no_session(server: RunningServer, jar: OwnerJar) -> tuple[Any, Any, dict[str, Any]]:
    from tests.web.test_sessions import Channel

    ws = await jar.connect(server.ws_url, max_size=None)
    ch = Channel(ws)
    return ws, ch, await ch.until("hello")
