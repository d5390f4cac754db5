"""A script is its session's (issue 23 meets issue 26): only the session's owner reaches a script rendered into it,
on every script route; everyone else is told it does not exist, exactly as for an unknown id. The session's share
token opens the read-only routes and nothing else. Script ids stay out of the access log, and script renders
count against the session caps and storage budgets like any other takes."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from typing import Any

import pytest
import requests

from moss_rt.config import Settings
from moss_rt.engine.scripted import ScriptedEngine
from moss_rt.protocol import Limits
from tests.helpers import OwnerJar, RunningServer, error_of, run, wait_until

KEY = "k" * 32
SCRIPT = "ANNA: Good morning.\nBEN: Morning to you.\nANNA: Coffee?\n"
NO_SCRIPT = "no such script (it may have been deleted)"
NO_SESSION = "no such session (it may have been deleted)"


def post(url: str, jar: OwnerJar, text: str = SCRIPT, **params: str) -> requests.Response:
    return jar.request("POST", f"{url}/api/scripts", data=text.encode(), params=params,
                       headers={"Content-Type": "text/plain"})  # fmt: skip


def wait_done(url: str, jar: OwnerJar, script_id: str, **params: str) -> dict[str, Any]:
    states: list[dict[str, Any]] = []

    def done() -> bool:
        states.append(jar.request("GET", f"{url}/api/scripts/{script_id}", params=params).json())
        return states[-1].get("state") in ("done", "failed")

    run(wait_until(done, within=30, interval=0.02))
    return states[-1]


def first_event(url: str, jar: OwnerJar, script_id: str, **params: str) -> tuple[int, dict[str, Any]]:
    """The status of the event stream, and its first event (parsed) when it opened."""
    with requests.get(f"{url}/api/scripts/{script_id}/events", params=params, headers=jar.headers(), stream=True,
                      timeout=10) as r:  # fmt: skip
        if r.status_code != 200:
            return r.status_code, r.json()
        event: dict[str, Any] = {}
        for line in r.iter_lines(decode_unicode=True):
            name, _, value = line.partition(": ")
            if name in ("event", "id"):
                event[name] = value
            elif name == "data":
                event["data"] = json.loads(value)
                return 200, event
    raise AssertionError("the event stream ended without an event")


def routes(url: str, script_id: str, session_id: str, take_id: str) -> list[tuple[str, str, dict[str, Any]]]:
    """Every script route that names a script (or its session), as (method, url, request kwargs)."""
    base = f"{url}/api/scripts/{script_id}"
    return [
        ("GET", base, {}),
        ("GET", f"{base}.zip", {}),
        ("GET", f"{base}/events", {}),
        ("POST", f"{base}/lines/1/retake", {"json": {"seed": 5}}),
        ("POST", f"{base}/lines/1/accept", {"json": {"take": take_id}}),
        ("DELETE", base, {}),
        ("GET", f"{url}/api/scripts", {"params": {"session": session_id}}),
    ]


@pytest.fixture
def rendered(fast_server) -> tuple[RunningServer, OwnerJar, dict[str, Any]]:
    """A keyless server, a director (its owner cookie) and a script of theirs, rendered."""
    srv = fast_server(frame_ms=2.0)
    director = OwnerJar()
    r = post(srv.url, director)
    assert r.status_code == 201, r.text
    assert director.cookie is not None  # the post gave the director an identity
    return srv, director, wait_done(srv.url, director, r.json()["script"])


def test_only_the_sessions_owner_reaches_its_scripts(rendered) -> None:
    srv, director, state = rendered
    script_id, session_id, take_id = state["script"], state["session"], state["lines"][0]["take"]
    forged = OwnerJar()
    forged.cookie = director.cookie.split(".")[0] + ".AAAA"  # the director's id with a made-up signature
    for stranger in (OwnerJar(), forged):
        for method, url, kwargs in routes(srv.url, script_id, session_id, take_id):
            r = stranger.request(method, url, **kwargs)
            assert r.status_code == 404 and error_of(r)["code"] == "not_found", (method, url, r.status_code, r.text)
            # The same answer as for an id that does not exist.
            assert error_of(r)["message"] == (NO_SESSION if "session" in kwargs.get("params", {}) else NO_SCRIPT)
        # Posting into the director's session is as for a session that does not exist.
        r = post(srv.url, stranger, "A: mine now", session=session_id)
        assert r.status_code == 404 and error_of(r)["field"] == "session" and error_of(r)["message"] == NO_SESSION
        body = {"script": "A: mine now", "session": session_id}
        r = stranger.request("POST", f"{srv.url}/api/scripts", json=body)
        assert r.status_code == 404 and error_of(r)["field"] == "session"
    # Nothing was changed by them: no retake, no accept, no delete, no script added to the session.
    assert wait_done(srv.url, director, script_id)["lines"] == state["lines"]
    listing = director.request("GET", f"{srv.url}/api/scripts", params={"session": session_id}).json()
    assert [s["script"] for s in listing["scripts"]] == [script_id]
    # The director reaches every route.
    assert first_event(srv.url, director, script_id)[1]["event"] == "state"
    assert director.request("GET", f"{srv.url}/api/scripts/{script_id}.zip").status_code == 200
    r = director.request("POST", f"{srv.url}/api/scripts/{script_id}/lines/2/retake", json={"seed": 5})
    assert r.status_code == 202, r.text
    assert wait_done(srv.url, director, script_id)["lines"][1]["seed"] == 5
    r = director.request("POST", f"{srv.url}/api/scripts/{script_id}/lines/1/accept", json={"take": take_id})
    assert r.status_code == 200, r.text
    r = post(srv.url, director, "A: one more", session=session_id)  # into the director's own session
    assert r.status_code == 201 and r.json()["session"] == session_id
    assert "Set-Cookie" not in r.headers  # a valid owner cookie is kept, not replaced
    assert director.request("DELETE", f"{srv.url}/api/scripts/{script_id}").json() == {"deleted": script_id}


def test_the_sessions_share_token_reads_its_scripts_and_changes_nothing(rendered) -> None:
    srv, director, state = rendered
    script_id, session_id, take_id = state["script"], state["session"], state["lines"][0]["take"]
    share = director.request("POST", f"{srv.url}/api/sessions/{session_id}/share").json()["share"]
    reader = OwnerJar()
    q = {"share": share}
    # Read-only: the state, the events, the zip, the session's listing ...
    assert reader.request("GET", f"{srv.url}/api/scripts/{script_id}", params=q).json()["lines"] == state["lines"]
    status, event = first_event(srv.url, reader, script_id, share=share)
    assert status == 200 and event["event"] == "state" and event["data"]["state"] == "done"
    z = reader.request("GET", f"{srv.url}/api/scripts/{script_id}.zip", params=q)
    assert z.status_code == 200 and z.headers["Content-Type"] == "application/zip"
    listing = reader.request("GET", f"{srv.url}/api/scripts", params={"session": session_id, **q}).json()
    assert [s["script"] for s in listing["scripts"]] == [script_id]
    # ... never a change; a share token is no way to post into the session either; a wrong token is nothing.
    for method, url, kwargs in routes(srv.url, script_id, session_id, take_id)[3:6]:
        r = reader.request(method, url, params=q, **kwargs)
        assert r.status_code == 404 and error_of(r)["message"] == NO_SCRIPT, (method, url, r.status_code)
    assert post(srv.url, reader, "A: hi", session=session_id, share=share).status_code == 404
    bad = {"share": "sh_" + "x" * 24}
    assert reader.request("GET", f"{srv.url}/api/scripts/{script_id}", params=bad).status_code == 404
    # Revoked: gone for its holders, at once.
    assert director.request("DELETE", f"{srv.url}/api/sessions/{session_id}/share").json()["revoked"] is True
    assert reader.request("GET", f"{srv.url}/api/scripts/{script_id}", params=q).status_code == 404
    assert first_event(srv.url, reader, script_id, share=share)[0] == 404
    assert reader.request("GET", f"{srv.url}/api/scripts/{script_id}.zip", params=q).status_code == 404


def test_an_event_stream_opened_with_a_share_ends_once_it_is_revoked(rendered, monkeypatch) -> None:
    from moss_rt.web import scripts_api

    monkeypatch.setattr(scripts_api, "KEEPALIVE_SEC", 0.1)  # how often an open stream looks at its share again
    srv, director, state = rendered
    script_id, session_id = state["script"], state["session"]
    share = director.request("POST", f"{srv.url}/api/sessions/{session_id}/share").json()["share"]
    with requests.get(f"{srv.url}/api/scripts/{script_id}/events", params={"share": share}, stream=True,
                      timeout=10) as r:  # fmt: skip
        assert r.status_code == 200
        lines = r.iter_lines(decode_unicode=True)
        assert next(line for line in lines if line.startswith("event: ")) == "event: state"
        assert next(line for line in lines if line.startswith(":")) == ": keep-alive"  # open, and quiet
        director.request("DELETE", f"{srv.url}/api/sessions/{session_id}/share")
        deadline, rest, ended = time.monotonic() + 10, [], True
        for line in lines:  # keep-alives come every 0.1 s while it stays open
            rest.append(line)
            if time.monotonic() > deadline:
                ended = False
                break
    assert ended, "the stream stayed open after its share was revoked"
    assert not any(line.startswith("event: ") for line in rest), rest
    # The owner's own stream is not the share's: it stays open.
    with requests.get(f"{srv.url}/api/scripts/{script_id}/events", headers=director.headers(), stream=True,
                      timeout=10) as r:  # fmt: skip
        lines = r.iter_lines(decode_unicode=True)
        keep_alives = (line for line in lines if line == ": keep-alive")
        assert [next(keep_alives) for _ in range(3)] == [": keep-alive"] * 3


def test_under_an_api_key_the_keys_principal_owns_scripts(fast_server) -> None:
    srv = fast_server(frame_ms=2.0, api_key=KEY)
    auth = {"Authorization": f"Bearer {KEY}"}
    r = requests.post(f"{srv.url}/api/scripts", data=SCRIPT.encode(),
                      headers={**auth, "Content-Type": "text/plain"}, timeout=10)  # fmt: skip
    assert r.status_code == 201 and "Set-Cookie" not in r.headers, r.text
    script_id = r.json()["script"]
    # A browser token bought with the key acts as the key (a header, or ?token= where an EventSource needs it).
    token = requests.post(f"{srv.url}/api/token", headers=auth, timeout=5).json()["token"]
    bearer = {"Authorization": f"Bearer {token}"}
    assert requests.get(f"{srv.url}/api/scripts/{script_id}", headers=bearer, timeout=5).status_code == 200
    status, event = first_event(srv.url, OwnerJar(), script_id, token=token)
    assert status == 200 and event["event"] == "state"
    assert requests.get(f"{srv.url}/api/scripts/{script_id}", timeout=5).status_code == 401
    # An owner cookie is no credential here.
    r = requests.get(f"{srv.url}/api/scripts/{script_id}", cookies={"moss_rt_owner": "x.y"}, timeout=5)
    assert r.status_code == 401


def test_no_script_id_in_the_access_log(rendered, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="aiohttp.access")
    srv, director, state = rendered
    script_id, other = state["script"], "sc_" + "Zq9" * 8  # a script that does not exist
    director.request("GET", f"{srv.url}/api/scripts/{script_id}", headers={"Referer": f"{srv.url}/?s={script_id}"})
    director.request("GET", f"{srv.url}/api/scripts/{other}.zip", params={"share": "sh_" + "x" * 24})  # 404
    director.request("POST", f"{srv.url}/api/scripts/{script_id}/lines/9/retake", json={})  # 404 (no line 9)
    wanted = (
        f"GET /api/scripts/{script_id[:7]}… ",
        f"GET /api/scripts/{other[:7]}….zip?share=… ",
        f"POST /api/scripts/{script_id[:7]}…/lines/9/retake ",
    )

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "aiohttp.access"]

    # Answers that are not streamed are logged as soon as they are sent (a streamed one may never be: aiohttp
    # cancels its handler when the client closes the connection right after the last byte).
    run(wait_until(lambda: all(any(want in line for line in lines()) for want in wanted), within=10))
    logged = lines()
    for secret in (script_id, script_id[3:12], other, "xxxxxxxx"):
        assert not any(secret in line for line in logged), (secret, logged)


# --------------------------------------------------------------------------- caps and budgets


def test_a_scripts_new_session_counts_against_the_session_caps(fast_server) -> None:
    srv = fast_server(frame_ms=2.0, limits=Limits(max_sessions_per_client=1, max_session_takes=4))
    director = OwnerJar()

    def sessions() -> list[str]:
        return [s["session"] for s in director.request("GET", f"{srv.url}/api/sessions").json()["sessions"]]

    r = post(srv.url, director, "".join(f"A: line {n}\n" for n in range(5)))
    assert r.status_code == 413 and "room for 4" in error_of(r)["message"]
    assert srv.state.sessions is not None and srv.state.sessions.usage()["sessions"] == 0  # none left behind
    first = post(srv.url, director)
    assert first.status_code == 201, first.text
    r = post(srv.url, director)  # a second new session for this client
    assert r.status_code == 429 and error_of(r)["code"] == "rate_limited" and r.headers["Retry-After"]
    assert "max_sessions_per_client" in error_of(r)["message"]
    assert sessions() == [first.json()["session"]]
    # Into the session the client has, it goes (its room permitting).
    r = post(srv.url, director, "A: the fourth take", session=first.json()["session"])
    assert r.status_code == 201, r.text
    r = post(srv.url, director, "A: a fifth take", session=first.json()["session"])
    assert r.status_code == 413 and "room for 0" in error_of(r)["message"]


def test_a_line_stored_but_not_yet_recorded_counts_once_against_the_session_room(fast_server) -> None:
    """Between storing a line's take in the session and recording the line done, the take is in the session and the
    line still renders: the room a new script gets counts it once, not twice (a spurious 413 before)."""
    srv = fast_server(frame_ms=2.0, limits=Limits(max_session_takes=2))
    assert srv.state.scripts is not None
    store = srv.state.scripts.store
    finish_line = store.finish_line
    release = threading.Event()

    def held_finish_line(*args: Any, **kwargs: Any) -> Any:
        release.wait(30)  # a worker thread of the server: holds the line between its take stored and recorded
        return finish_line(*args, **kwargs)

    store.finish_line = held_finish_line  # type: ignore[method-assign]
    director = OwnerJar()
    try:
        first = post(srv.url, director, "A: the first line")
        assert first.status_code == 201, first.text
        session = first.json()["session"]
        sessions = srv.state.sessions
        assert sessions is not None
        run(wait_until(lambda: sessions.count(session) == 1, within=30))  # its take is stored; the line waits
        r = post(srv.url, director, "A: the second line", session=session)
        assert r.status_code == 201, r.text  # room for one more: 2 - the stored take
    finally:
        release.set()
    wait_done(srv.url, director, r.json()["script"])
    assert sessions.count(session) == 2


def test_a_script_is_refused_when_the_service_keeps_all_the_sessions_it_may(fast_server) -> None:
    srv = fast_server(frame_ms=2.0, limits=Limits(max_sessions=1))
    assert post(srv.url, OwnerJar()).status_code == 201
    r = post(srv.url, OwnerJar())
    assert r.status_code == 507 and error_of(r)["code"] == "insufficient_storage"
    assert "max_sessions" in error_of(r)["message"]


class GatedEngine(ScriptedEngine):
    """The scripted engine, holding every take whose text says "later" at its submit until ``gate`` is set."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.gate = threading.Event()
        self.texts: list[str] = []

    async def submit(self, spec: Any) -> Any:
        # The gate is set from the test's thread (a threading.Event), so it is looked at, not awaited.
        while "later" in spec.text and not self.gate.is_set():  # noqa: ASYNC110
            await asyncio.sleep(0.005)
        self.texts.append(spec.text)
        return await super().submit(spec)


def test_a_render_whose_takes_cannot_be_kept_fails_its_lines_without_rendering_them(make_server) -> None:
    engines: list[GatedEngine] = []

    def factory(settings: Settings) -> GatedEngine:
        engines.append(GatedEngine(frame_ms=settings.frame_ms, max_slots=settings.max_slots,
                                   max_queue=settings.max_queue, max_lead_sec=settings.max_lead_sec))  # fmt: skip
        return engines[-1]

    # 1 MB for the client's sessions; each line is 60 frames (about 467 kB as stored): two fit, the third not.
    # Two slots: the client's renders hold one, so the lines go one after another.
    srv = make_server(factory, engine="scripted", frame_ms=2.0, max_lead_sec=0.0, max_slots=2,
                      session_storage_per_client_mb=1)  # fmt: skip
    director = OwnerJar()
    texts = ["line 1", "line 2", "line 3", "later 4", "later 5", "later 6"]
    lines = [{"who": "A", "text": text, "tokens": 60} for text in texts]
    r = director.request("POST", f"{srv.url}/api/scripts", json={"lines": lines})
    assert r.status_code == 201, r.text
    script_id = r.json()["script"]

    def third_failed() -> bool:
        state = director.request("GET", f"{srv.url}/api/scripts/{script_id}").json()
        return bool(state["lines"][2]["status"] == "failed")

    # The engine holds line 4 (if it got that far) until line 3's take has been refused.
    run(wait_until(third_failed, within=30, interval=0.02))
    engines[0].gate.set()
    state = wait_done(srv.url, director, script_id)
    assert state["state"] == "done" and state["lines_done"] == 2 and state["lines_failed"] == 4
    attempts = [x["attempts"] for x in state["lines"]]
    assert [x["status"] for x in state["lines"]] == ["done", "done"] + ["failed"] * 4
    # Line 3 was made and refused, and not tried again (it would be refused again). Lines 5 and 6 never reached
    # the engine (0 attempts): their takes could not be kept either. Line 4 may have been in the engine already.
    assert attempts[:3] == [1, 1, 1] and attempts[3] in (0, 1) and attempts[4:] == [0, 0], attempts
    assert engines[0].texts.count("line 3") == 1 and "later 5" not in engines[0].texts
    assert all(x["error"].startswith("not enough storage") for x in state["lines"][2:]), state["lines"]
    takes = director.request("GET", f"{srv.url}/api/sessions/{state['session']}").json()["takes"]
    assert len(takes) == 2
    # Room made (a take deleted): a retake of a failed line makes it whole.
    gone = state["lines"][0]["take"]
    assert director.request("DELETE", f"{srv.url}/api/sessions/{state['session']}/takes/{gone}").status_code == 200
    r = director.request("POST", f"{srv.url}/api/scripts/{script_id}/lines/3/retake", json={})
    assert r.status_code == 202, r.text
    assert wait_done(srv.url, director, script_id)["lines"][2]["status"] == "done"
