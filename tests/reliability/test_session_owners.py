"""Sessions have owners (issue 23, finding 12): the identity that created a session (an API key's principal, or
a keyless server's signed owner cookie) is the only one that reaches it; everyone else is told it does not
exist. The owner can delete it and share it read-only through a revocable token, and no session id, take id or
token reaches the access log whole."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pytest
import requests
import websockets

from moss_rt.session_records import StoredTake
from tests.helpers import OwnerJar, error_of, run, wait_until
from tests.reliability.archives import valid_archive

KEY = "k" * 32


def make_session(url: str, jar: OwnerJar) -> tuple[str, str]:
    """A session of two imported takes owned by ``jar``: (session id, a take id)."""
    r = jar.request("POST", f"{url}/api/sessions/import", data=valid_archive(2, 3))
    assert r.status_code == 200, r.text
    body = r.json()
    return body["session"], body["takes"][0]["take_id"]


def everything(url: str, sid: str, tid: str) -> list[tuple[str, str, dict[str, Any]]]:
    """Every session route, as (method, url, request kwargs)."""
    base = f"{url}/api/sessions/{sid}"
    return [
        ("GET", base, {}),
        ("GET", f"{base}/takes/{tid}.wav", {}),
        ("GET", f"{base}/archive", {}),
        ("PATCH", f"{base}/takes/{tid}", {"json": {"title": "mine now"}}),
        ("DELETE", f"{base}/takes/{tid}", {}),
        ("POST", f"{base}/share", {}),
        ("DELETE", f"{base}/share", {}),
        ("DELETE", base, {}),
    ]


async def resume(ws_url: str, sid: str, jar: OwnerJar) -> dict[str, Any]:
    ws = await jar.connect(ws_url)
    try:
        while json.loads((await ws.recv())[5:])["type"] != "hello":
            pass
        await ws.send(json.dumps({"type": "resume", "session": sid}))
        while True:
            msg = json.loads((await ws.recv())[5:])
            if msg["type"] in ("session", "error"):
                return msg
    finally:
        await ws.close()


def test_only_the_owner_reaches_a_session(fast_server) -> None:
    srv = fast_server()
    owner = OwnerJar()
    sid, tid = make_session(srv.url, owner)
    assert owner.cookie is not None
    forged = OwnerJar()
    forged.cookie = owner.cookie.split(".")[0] + ".AAAA"  # the owner's id with a made-up signature
    for stranger in (OwnerJar(), forged):
        for method, url, kwargs in everything(srv.url, sid, tid):
            r = stranger.request(method, url, **kwargs)
            assert r.status_code == 404 and error_of(r)["code"] == "not_found", (method, url, r.status_code, r.text)
            assert error_of(r)["message"] == "no such session (it may have been deleted)"  # as for an unknown id
        msg = asyncio.run(resume(srv.ws_url, sid, stranger))
        assert msg["type"] == "error" and msg["code"] == "not_found" and msg["field"] == "session"
    # Nothing was changed by them; the owner reaches all of it, over HTTP and the WebSocket.
    listed = owner.request("GET", f"{srv.url}/api/sessions/{sid}").json()
    assert [t["title"] for t in listed["takes"]] == ["", ""]
    assert owner.request("GET", f"{srv.url}/api/sessions/{sid}/takes/{tid}.wav").status_code == 200
    msg = asyncio.run(resume(srv.ws_url, sid, owner))
    assert msg["type"] == "session" and msg["session"] == sid and len(msg["takes"]) == 2
    assert [s["session"] for s in owner.request("GET", f"{srv.url}/api/sessions").json()["sessions"]] == [sid]
    assert OwnerJar().request("GET", f"{srv.url}/api/sessions").json()["sessions"] == []


def test_the_owner_cookie_is_signed_http_only_and_given_with_the_studio(fast_server, tmp_path) -> None:
    static = tmp_path / "static"
    static.mkdir()
    (static / "index.html").write_text("<!doctype html><title>studio</title>")
    srv = fast_server(static_dir=static)
    r = requests.get(srv.url + "/", timeout=5)
    cookie = r.headers["Set-Cookie"]
    assert cookie.startswith("moss_rt_owner=") and "HttpOnly" in cookie and "SameSite=Lax" in cookie
    assert "Path=/" in cookie and "Max-Age=" in cookie
    jar = OwnerJar()
    jar.keep(r.headers)
    again = jar.request("GET", srv.url + "/")
    assert "Set-Cookie" not in again.headers  # a valid cookie is kept, not replaced
    # The same identity is used by the WebSocket: a session made there is the page's.
    sid = asyncio.run(_new_session_over_ws(srv.ws_url, jar))
    assert jar.request("GET", f"{srv.url}/api/sessions/{sid}").status_code == 200
    # The secret lives in the data dir (restarts keep every owner), readable by the service only.
    secret = srv.state.settings.data_dir / "owner_secret"
    assert secret.stat().st_mode & 0o077 == 0


async def _new_session_over_ws(ws_url: str, jar: OwnerJar) -> str:
    ws = await jar.connect(ws_url)
    try:
        await ws.recv()
        await ws.send(json.dumps({"type": "resume"}))
        while True:
            msg = json.loads((await ws.recv())[5:])
            if msg["type"] == "session":
                return str(msg["session"])
    finally:
        await ws.close()


def test_under_an_api_key_the_principal_owns_and_no_cookie_is_used(fast_server) -> None:
    srv = fast_server(api_key=KEY)
    auth = {"Authorization": f"Bearer {KEY}"}
    r = requests.post(f"{srv.url}/api/sessions/import", data=valid_archive(1, 2), headers=auth, timeout=10)
    assert r.status_code == 200 and "Set-Cookie" not in r.headers
    sid = r.json()["session"]
    token = requests.post(f"{srv.url}/api/token", headers=auth, timeout=5).json()["token"]
    # A browser token bought with the key acts as the key's principal (header or ?token= on GETs).
    bearer = {"Authorization": f"Bearer {token}"}
    assert requests.get(f"{srv.url}/api/sessions/{sid}", headers=bearer, timeout=5).status_code == 200
    assert requests.get(f"{srv.url}/api/sessions/{sid}/archive?token={token}", timeout=5).status_code == 200
    assert requests.get(f"{srv.url}/api/sessions/{sid}", timeout=5).status_code == 401
    # An owner cookie from elsewhere is no credential here.
    other = requests.get(f"{srv.url}/api/sessions/{sid}", cookies={"moss_rt_owner": "x.y"}, timeout=5)
    assert other.status_code == 401


def test_a_session_from_before_owners_is_adopted_by_its_first_opener(fast_server) -> None:
    srv = fast_server()
    store = srv.state.sessions
    assert store is not None
    sid = store.create()  # no owner: as stored by an older version
    store.put_take(sid, StoredTake("t_old", {"text": "x"}, 1, 1, 1), [[1] * 12], b"\0" * 7680)
    first, second = OwnerJar(), OwnerJar()
    first.request("POST", f"{srv.url}/api/sessions")  # gets a cookie
    assert first.request("GET", f"{srv.url}/api/sessions/{sid}").status_code == 200
    assert second.request("GET", f"{srv.url}/api/sessions/{sid}").status_code == 404
    assert first.request("GET", f"{srv.url}/api/sessions/{sid}").status_code == 200


def test_delete_and_a_revocable_read_only_share(fast_server) -> None:
    srv = fast_server()
    owner, reader = OwnerJar(), OwnerJar()
    sid, tid = make_session(srv.url, owner)
    share = owner.request("POST", f"{srv.url}/api/sessions/{sid}/share").json()
    assert share["share"].startswith("sh_") and share["path"] == f"/api/sessions/{sid}?share={share['share']}"
    assert owner.request("POST", f"{srv.url}/api/sessions/{sid}/share").json()["share"] == share["share"]
    q = {"share": share["share"]}
    base = f"{srv.url}/api/sessions/{sid}"
    # Read-only: list, audio, archive ...
    assert reader.request("GET", base, params=q).json()["session"] == sid
    assert reader.request("GET", f"{base}/takes/{tid}.wav", params=q).status_code == 200
    assert reader.request("GET", f"{base}/archive", params=q).status_code == 200
    # ... but never a change, nor resharing; a wrong token is nothing.
    for method, url, kwargs in everything(srv.url, sid, tid)[3:]:
        r = reader.request(method, url, params=q, **kwargs)
        assert r.status_code == 404, (method, url, r.status_code)
    assert reader.request("GET", base, params={"share": "sh_" + "x" * 24}).status_code == 404
    # Revoked: gone for its holders.
    assert owner.request("DELETE", f"{base}/share").json()["revoked"] is True
    assert reader.request("GET", base, params=q).status_code == 404
    # Deleted: gone for everyone, files included.
    folder = srv.state.settings.data_dir / "sessions" / sid
    assert folder.is_dir()
    assert owner.request("DELETE", base).json() == {"deleted": sid}
    assert owner.request("GET", base).status_code == 404
    assert not folder.exists()
    assert owner.request("DELETE", base).status_code == 404


def test_no_session_id_take_id_or_token_in_the_access_log(fast_server, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="aiohttp.access")
    srv = fast_server()
    owner = OwnerJar()
    sid, tid = make_session(srv.url, owner)
    share = owner.request("POST", f"{srv.url}/api/sessions/{sid}/share").json()["share"]
    secrets_in_query = {"share": share, "token": "v1.9.x"}
    owner.request("GET", f"{srv.url}/api/sessions/{sid}/takes/{tid}.wav", params=secrets_in_query)
    owner.request("PATCH", f"{srv.url}/api/sessions/{sid}/takes/{tid}", params=secrets_in_query, json={"note": "n"})
    owner.request("GET", f"{srv.url}/api/sessions/{sid}", headers={"Referer": f"{srv.url}/?session={sid}"})
    patch = f"PATCH /api/sessions/{sid[:6]}…/takes/{tid[:6]}…?share=…&token=… "
    get = f"GET /api/sessions/{sid[:6]}… "

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "aiohttp.access"]

    # Waited for: answers logged as soon as they are sent. A streamed answer (the .wav) is logged once its handler
    # returns, and not at all when the client closes the connection first (aiohttp cancels the handler then).
    run(wait_until(lambda: all(any(want in line for line in lines()) for want in (patch, get)), within=10))
    logged = lines()
    assert any("/api/sessions/s_" in line for line in logged), logged  # the requests were logged ...
    for secret in (sid, tid, share, "v1.9.x", sid[2:12], tid[2:10]):
        assert not any(secret in line for line in logged), (secret, logged)  # ... without the secrets


def test_websocket_owner_cookie_on_upgrade(fast_server) -> None:
    srv = fast_server()

    async def scenario() -> tuple[str | None, str | None]:
        ws = await websockets.connect(srv.ws_url)
        try:
            assert ws.response is not None
            return ws.response.headers.get("Set-Cookie"), None
        finally:
            await ws.close()

    cookie, _ = asyncio.run(scenario())
    assert cookie is not None and cookie.startswith("moss_rt_owner=") and "HttpOnly" in cookie
