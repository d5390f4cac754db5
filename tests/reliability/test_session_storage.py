"""Stored sessions are bounded (issue 23, finding 2): a cap on their number in all (507) and per client (429),
a byte budget for the data dir in all and per client (507 ``insufficient_storage``, for imports and for takes a
socket would keep), a retention after which an unused session is deleted by the service's own sweep, and
``DELETE /api/sessions/{id}`` (tests/reliability/test_session_owners.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import requests

from moss_rt.protocol import Limits
from moss_rt.session_records import StoredTake
from moss_rt.session_store import SessionStore, StoreBudget
from tests.helpers import OwnerJar, error_of, run, wait_until
from tests.reliability.archives import valid_archive

PROXY = ("127.0.0.1",)


def client(n: int) -> dict[str, str]:
    return {"X-Forwarded-For": f"10.0.0.{n}"}  # another client, through the trusted proxy 127.0.0.1


def test_sessions_are_capped_in_all_and_per_client(fast_server) -> None:
    srv = fast_server(limits=Limits(max_sessions=5, max_sessions_per_client=2), trusted_proxies=PROXY)
    jar = OwnerJar()
    made = [jar.request("POST", f"{srv.url}/api/sessions", headers=client(1)) for _ in range(2)]
    assert all(r.status_code == 200 for r in made)
    r = jar.request("POST", f"{srv.url}/api/sessions", headers=client(1))
    assert r.status_code == 429 and error_of(r)["code"] == "rate_limited" and "max_sessions_per_client" in r.text
    r = jar.request("POST", f"{srv.url}/api/sessions/import", data=valid_archive(1, 2), headers=client(1))
    assert r.status_code == 429  # an import is a new session too
    # Deleting one makes room again.
    assert jar.request("DELETE", f"{srv.url}/api/sessions/{made[0].json()['session']}").status_code == 200
    assert jar.request("POST", f"{srv.url}/api/sessions", headers=client(1)).status_code == 200
    # Other clients have their own; past the service's cap everyone gets 507.
    for n in (2, 2, 3):
        assert jar.request("POST", f"{srv.url}/api/sessions", headers=client(n)).status_code == 200
    r = jar.request("POST", f"{srv.url}/api/sessions", headers=client(4))
    assert r.status_code == 507 and error_of(r)["code"] == "insufficient_storage" and "max_sessions" in r.text


def test_a_socket_cannot_keep_takes_past_the_budget(fast_server) -> None:
    srv = fast_server(session_storage_per_client_mb=1)

    async def scenario() -> list[dict[str, Any]]:
        jar = OwnerJar()
        ws = await jar.connect(srv.ws_url)
        seen: list[dict[str, Any]] = []
        try:
            await ws.send(json.dumps({"type": "resume"}))
            for _ in range(4):  # 80 frames of mono each: 0.6 MB; the second passes 1 MB
                await ws.send(json.dumps({"type": "start", "text": "a line", "tokens": 80}))
                while True:
                    data = await ws.recv()
                    if data[0] != 0:
                        continue
                    msg = json.loads(data[5:])
                    if msg["type"] in ("end", "error"):
                        seen.append(msg)
                    if msg["type"] == "end" or (msg["type"] == "error" and not msg.get("take")):
                        break
        finally:
            await ws.close()
        return seen

    seen = run(scenario())
    errors = [m for m in seen if m["type"] == "error"]
    assert errors and {m["code"] for m in errors} == {"insufficient_storage"}, seen
    assert "not enough storage" in errors[0]["message"]
    assert srv.state.sessions is not None
    assert srv.state.sessions.usage()["bytes"] <= 1024 * 1024


def test_unused_sessions_are_deleted_after_the_retention(fast_server) -> None:
    # 0.9 s of retention; the sweep then runs every second.
    srv = fast_server(session_retention_days=1e-5)
    jar = OwnerJar()
    sid = jar.request("POST", f"{srv.url}/api/sessions/import", data=valid_archive(1, 2)).json()["session"]
    folder = srv.state.settings.data_dir / "sessions" / sid
    assert folder.is_dir()

    async def gone() -> None:
        await wait_until(lambda: jar.request("GET", f"{srv.url}/api/sessions/{sid}").status_code == 404, within=10)
        await wait_until(lambda: not folder.exists(), within=10)  # the files go right after the records

    run(gone())


def test_retention_counts_from_the_last_use(tmp_path: Path) -> None:
    store = SessionStore(tmp_path, budget=StoreBudget())
    old, used = store.create(), store.create()
    store.put_take(used, StoredTake("t_a", {"text": "x"}, 1, 1, 1), [[0] * 12], b"\0" * 7680)
    cutoff = time.time()
    store.touch(used)
    assert store.expire(cutoff) == 1  # the one not used since the cutoff
    assert not store.exists(old) and store.exists(used)


def test_data_dir_budget_in_all(fast_server) -> None:
    srv = fast_server(session_storage_mb=1, trusted_proxies=PROXY)
    jar = OwnerJar()
    ok = jar.request("POST", f"{srv.url}/api/sessions/import", data=valid_archive(1, 100), headers=client(1))
    assert ok.status_code == 200  # 0.77 MB
    r = jar.request("POST", f"{srv.url}/api/sessions/import", data=valid_archive(1, 100), headers=client(2))
    assert r.status_code == 507 and error_of(r)["code"] == "insufficient_storage"
    assert requests.get(f"{srv.url}/healthz", timeout=5).status_code == 200
