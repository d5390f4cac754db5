"""Script renders on a real server (scripted engine, whose audio encodes frame index and seed): the endpoints,
server-sent events in order and resumable, the zip (the mix equals the lines joined with their gaps and pauses, to
the sample), a line retake and an accepted studio take updating the export, failures retried once, and a render
that resumes after a restart without rendering its finished lines again.

Every request carries the director's identity (the owner cookie this keyless server gives, tests/helpers.py
``OwnerJar``): a script is its session's, and its session the director's (tests/reliability/test_script_owners.py
has what everyone else gets)."""

from __future__ import annotations

import asyncio
import io
import json
import time
import wave
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests

from moss_rt.config import Settings
from moss_rt.engine.scripted import ScriptedEngine
from moss_rt.protocol import FRAME_SAMPLES, Limits
from tests.ecosystem.audio_check import decode_samples
from tests.helpers import OwnerJar, RunningServer, ServerThread, error_of, free_port
from tests.web.conftest import scripted

SCRIPT = """\
@title Test scene
@gap 250ms
@scene_gap 1s
@cast ANNA instruction="warm"
# six lines, a pause and a scene break
ANNA: (softly) Good morning, Ben.
BEN: Morning. Did you sleep?
[pause 0.5s]
ANNA: Not a wink.

BEN: (later) Coffee, then.
ANNA: Coffee.
BEN: Two sugars.
"""
GAP, PAUSE, SCENE_GAP = 12000, 24000, 48000  # samples at 48 kHz
# What comes before each line in the mix (line 1 starts it).
BEFORE = {1: 0, 2: GAP, 3: PAUSE + GAP, 4: SCENE_GAP, 5: GAP, 6: GAP}


def start_server(tmp: Path, **overrides: Any) -> ServerThread:
    """A scripted-engine server; without a word aligner (captions by word are tests/web/test_words.py's)."""
    factory = overrides.pop("engine_factory", scripted)
    settings = Settings(
        host="127.0.0.1", port=free_port(), data_dir=tmp / "data", voices_dir=tmp / "voices", engine="scripted",
        frame_ms=2.0, max_lead_sec=0.0, aligner="none",
    ).replace(**overrides)  # fmt: skip
    thread = ServerThread(settings, factory(settings))
    thread.start()
    return thread


@pytest.fixture(scope="module")
def jar() -> OwnerJar:
    """The director of the module's server (its first post gives it an owner cookie)."""
    return OwnerJar()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    thread = start_server(
        tmp_path_factory.mktemp("scripts"), limits=Limits(max_session_takes=40, max_script_bytes=32 * 1024)
    )
    assert thread.server is not None
    yield thread.server
    thread.stop()


def post(jar: OwnerJar, url: str, body: Any, *, text: bool = True, **params: str) -> requests.Response:
    if text:
        return jar.request("POST", f"{url}/api/scripts", data=body.encode(), params=params,
                           headers={"Content-Type": "text/plain; charset=utf-8"})  # fmt: skip
    return jar.request("POST", f"{url}/api/scripts", json=body, params=params)


def events(
    jar: OwnerJar, url: str, script_id: str, *, last_id: str | None = None, until: str = "done", **params: str
) -> list[dict[str, Any]]:
    """Server-sent events of the script, parsed, up to the first ``until`` event (or a first ``state`` that says
    the script is already done, when waiting for ``done``)."""
    headers = jar.headers({"Last-Event-ID": last_id} if last_id else {})
    out: list[dict[str, Any]] = []
    with requests.get(f"{url}/api/scripts/{script_id}/events", headers=headers, params=params, stream=True,
                      timeout=30) as r:  # fmt: skip
        assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        event: dict[str, Any] = {}
        for line in r.iter_lines(decode_unicode=True):
            if not line:
                if "data" in event:
                    out.append(event)
                    if event["event"] == until:
                        return out
                    if until == "done" and event["event"] == "state" and event["data"]["state"] == "done":
                        return out
                event = {}
                continue
            name, _, value = line.partition(": ")
            if name == "data":
                event["data"] = json.loads(value)
            elif name in ("id", "event"):
                event[name] = value
    return out


def wait_done(jar: OwnerJar, url: str, script_id: str, within: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        state = jar.request("GET", f"{url}/api/scripts/{script_id}").json()
        if state["state"] in ("done", "failed"):
            return state
        time.sleep(0.02)
    raise AssertionError(f"script {script_id} not done within {within} s")


def pcm_of(data: bytes) -> np.ndarray:
    with wave.open(io.BytesIO(data)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (48000, 1, 2)
        return np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")


def export(jar: OwnerJar, url: str, script_id: str, **params: str) -> zipfile.ZipFile:
    r = jar.request("GET", f"{url}/api/scripts/{script_id}.zip", params=params, timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["Content-Type"] == "application/zip"
    return zipfile.ZipFile(io.BytesIO(r.content))


def expected_mix(lines: dict[int, np.ndarray]) -> np.ndarray:
    parts = []
    for n in sorted(lines):
        parts += [np.zeros(BEFORE[n], dtype="<i2"), lines[n]]
    return np.concatenate(parts)


@pytest.fixture(scope="module")
def rendered(server: RunningServer, jar: OwnerJar) -> dict[str, Any]:
    """The test scene, rendered once, with the events of its render (the stream opened right after the post)."""
    r = post(jar, server.url, SCRIPT)
    assert r.status_code == 201, r.text
    assert jar.cookie is not None  # the post gave the director an identity: the new session is its
    body = r.json()
    assert r.headers["Location"] == f"/api/scripts/{body['script']}"
    stream = events(jar, server.url, body["script"], last_id=body["event_id"])  # every event, from the first
    return {**body, "events": stream, "state": wait_done(jar, server.url, body["script"])}


# --------------------------------------------------------------------------- endpoints


def test_a_posted_script_renders_every_line_as_a_take_of_its_session(
    server: RunningServer, rendered: dict, jar: OwnerJar
) -> None:
    assert rendered["lines"] == 6 and rendered["script"].startswith("sc_") and rendered["session"].startswith("s_")
    state = rendered["state"]
    assert state["state"] == "done" and state["lines_done"] == 6 and state["lines_failed"] == 0
    assert state["title"] == "Test scene" and state["session"] == rendered["session"]
    lines = state["lines"]
    assert [(x["line"], x["who"], x["scene"]) for x in lines] == [
        (1, "ANNA", 1), (2, "BEN", 1), (3, "ANNA", 1), (4, "BEN", 2), (5, "ANNA", 2), (6, "BEN", 2),
    ]  # fmt: skip
    assert lines[0]["instruction"] == "warm. softly" and lines[1]["instruction"] == ""
    assert all(x["status"] == "done" and x["take"] and x["attempts"] == 1 and x["error"] is None for x in lines)
    assert all(x["duration_sec"] > 0 and isinstance(x["seed"], int) for x in lines)
    # Each line is a take of the director's session, kept like any other.
    session = jar.request("GET", f"{server.url}/api/sessions/{rendered['session']}").json()
    takes = {t["take_id"]: t for t in session["takes"]}
    for x in lines:
        take = takes[x["take"]]
        assert take["title"] == f"Line {x['line']} · {x['who']}" and take["seed"] == x["seed"]
        assert take["request"]["text"] == x["text"] and take["request"]["instruction"] == x["instruction"]
        assert take["n_frames"] / 12.5 == pytest.approx(x["duration_sec"])
    listing = jar.request("GET", f"{server.url}/api/scripts", params={"session": rendered["session"]}).json()
    assert [s["script"] for s in listing["scripts"]] == [rendered["script"]]


def test_the_json_form_and_a_cast_given_alongside(server: RunningServer, jar: OwnerJar) -> None:
    body = {
        "title": "JSON",
        "cast": {"ANNA": {"instruction": "bright"}},
        "lines": [{"who": "ANNA", "text": "One.", "seed": 42}, {"pause": 0.2}, {"who": "BEN", "text": "Two."}],
    }
    r = post(jar, server.url, body, text=False)
    assert r.status_code == 201, r.text
    state = wait_done(jar, server.url, r.json()["script"])
    assert state["lines"][0]["seed"] == 42 and state["lines"][0]["instruction"] == "bright"
    # The plain-text form with its cast given alongside, into the same session.
    alongside = {"script": "ANNA: Three.\nBEN: Four.", "cast": {"ben": {"instruction": "gruff"}},
                 "session": state["session"]}  # fmt: skip
    r = post(jar, server.url, alongside, text=False)
    assert r.status_code == 201 and r.json()["session"] == state["session"], r.text
    state = wait_done(jar, server.url, r.json()["script"])
    assert [x["who"] for x in state["lines"]] == ["ANNA", "ben"] and state["lines"][1]["instruction"] == "gruff"


def test_bad_scripts_get_clear_errors(server: RunningServer, rendered: dict, jar: OwnerJar) -> None:
    r = post(jar, server.url, "ANNA: fine\nBEN fine\n")
    assert r.status_code == 422 and error_of(r)["message"].startswith("line 2: expected a cue"), r.text
    r = post(jar, server.url, {"lines": [{"who": "A", "text": "x"}, {"who": "B"}]}, text=False)
    assert r.status_code == 422 and error_of(r)["message"].startswith("lines[1]: "), r.text
    r = jar.request("POST", f"{server.url}/api/scripts", data=b"A: x", headers={"Content-Type": "text/html"})
    assert r.status_code == 415 and error_of(r)["code"] == "unsupported_media_type"
    r = post(jar, server.url, "A: " + "x" * 3000 + "\n" + "A: " + "y" * 3000 + "\n" * 30000)
    assert r.status_code == 413 and error_of(r)["code"] == "too_large"
    r = post(jar, server.url, "@cast A voice=nobody\nA: hi")
    assert r.status_code == 404 and error_of(r)["field"] == "voice" and "cast.A" in error_of(r)["message"]
    r = post(jar, server.url, "A: hi", session="s_" + "x" * 24)
    assert r.status_code == 404 and error_of(r)["field"] == "session"
    r = post(jar, server.url, "".join(f"A: line {n}\n" for n in range(41)))
    assert r.status_code == 413 and "room for" in error_of(r)["message"]  # the session keeps 40 takes here
    missing = "sc_" + "x" * 24
    for method, path in (("get", ""), ("get", ".zip"), ("get", "/events"), ("delete", "")):
        r = jar.request(method, f"{server.url}/api/scripts/{missing}{path}")
        assert r.status_code == 404 and error_of(r)["code"] == "not_found", (method, path)
    base = f"{server.url}/api/scripts/{rendered['script']}/lines"
    r = jar.request("POST", f"{base}/7/retake", json={})
    assert r.status_code == 404 and error_of(r)["field"] == "line"
    r = jar.request("POST", f"{base}/1/retake", json={"frame": 10_000})
    assert r.status_code == 422 and error_of(r)["field"] == "frame"
    r = jar.request("POST", f"{base}/1/retake", json={"text": "  "})
    assert r.status_code == 422 and error_of(r)["field"] == "text"
    r = jar.request("POST", f"{base}/1/accept", json={"take": "t_nosuchtake"})
    assert r.status_code == 404
    r = jar.request("GET", f"{server.url}/api/scripts")
    assert r.status_code == 422 and error_of(r)["field"] == "session"
    r = jar.request("GET", f"{server.url}/api/scripts/{rendered['script']}.zip", params={"format": "ogg"})
    assert r.status_code == 422 and error_of(r)["field"] == "format"


# --------------------------------------------------------------------------- events


def test_events_arrive_in_order_and_a_reconnect_resumes(server: RunningServer, rendered: dict, jar: OwnerJar) -> None:
    stream = rendered["events"]
    assert stream[0]["event"] == "progress" and stream[-1]["event"] == "done"
    assert [e["event"] for e in stream].count("done") == 1
    seqs = [int(e["id"].rsplit("-", 1)[1]) for e in stream]
    assert seqs == list(range(1, len(stream) + 1))  # every event, in order, none missing
    by_line: dict[int, list[str]] = {}
    for e in stream:
        if e["event"] == "line":
            by_line.setdefault(e["data"]["line"], []).append(e["data"]["status"])
    assert all(by_line[n][-1] == "done" for n in range(1, 7)), by_line
    assert all(statuses[0] == "rendering" for statuses in by_line.values() if len(statuses) > 1)
    done_counts = [e["data"]["lines_done"] for e in stream if e["event"] == "progress"]
    assert done_counts == sorted(done_counts) and stream[-1]["data"]["lines_done"] == 6
    # A reconnect with Last-Event-ID gets exactly what followed that event, in order.
    middle = stream[len(stream) // 2]
    again = events(jar, server.url, rendered["script"], last_id=middle["id"])
    assert [e["id"] for e in again] == [e["id"] for e in stream[len(stream) // 2 + 1 :]]
    # No id, or one it does not know (another server life): the current state first.
    for last_id in (None, "feedbeef-3"):
        again = events(jar, server.url, rendered["script"], last_id=last_id, until="state")
        assert again[0]["event"] == "state" and again[0]["data"]["state"] == "done"
        assert again[0]["data"]["lines"] == rendered["state"]["lines"]
        assert again[0]["id"] == stream[-1]["id"]  # a reconnect from the snapshot misses nothing


# --------------------------------------------------------------------------- the export


def test_the_zip_holds_every_line_and_a_mix_joined_to_the_sample(
    server: RunningServer, rendered: dict, jar: OwnerJar
) -> None:
    z = export(jar, server.url, rendered["script"])
    names = sorted(z.namelist())
    assert names == sorted([
        "lines/001-ANNA.wav", "lines/002-BEN.wav", "lines/003-ANNA.wav", "lines/004-BEN.wav", "lines/005-ANNA.wav",
        "lines/006-BEN.wav", "mix.wav", "cues.csv", "cues.json", "captions/lines.srt", "captions/lines.vtt",
        "captions/words.srt", "captions/words.vtt", "script.json",
    ])  # fmt: skip
    lines = {int(name[6:9]): pcm_of(z.read(name)) for name in names if name.startswith("lines/")}
    state = rendered["state"]
    for x in state["lines"]:
        take_wav = jar.request("GET", f"{server.url}/api/sessions/{state['session']}/takes/{x['take']}.wav")
        assert np.array_equal(lines[x["line"]], pcm_of(take_wav.content))  # the take as stored, exactly
        assert len(lines[x["line"]]) == round(x["duration_sec"] * 12.5) * FRAME_SAMPLES
    mix = pcm_of(z.read("mix.wav"))
    assert np.array_equal(mix, expected_mix(lines))
    cues = json.loads(z.read("cues.json"))
    assert cues["samples"] == len(mix) and cues["sample_rate"] == 48000 and cues["missing"] == []
    for row, x in zip(cues["lines"], state["lines"], strict=True):
        assert (row["line"], row["character"], row["take"], row["seed"]) == (x["line"], x["who"], x["take"], x["seed"])
        assert np.array_equal(mix[row["start_sample"] : row["end_sample"]], lines[row["line"]])
        assert row["start"] == pytest.approx(row["start_sample"] / 48000, abs=1e-6)
    csv_rows = z.read("cues.csv").decode().splitlines()
    assert csv_rows[0] == "line,scene,character,start,end,take,seed,start_sample,end_sample,file,text"
    assert len(csv_rows) == 7 and csv_rows[4].startswith("4,2,BEN,")
    srt = z.read("captions/lines.srt").decode()
    assert srt.startswith("1\n00:00:00,000 --> ") and "\nANNA: Good morning, Ben.\n" in srt and srt.count(" --> ") == 6
    assert z.read("captions/lines.vtt").decode().startswith("WEBVTT\n\n00:00:00.000 --> ")
    # No aligner on this server: captions by word fall back to one cue per line.
    assert z.read("captions/words.srt") == z.read("captions/lines.srt")
    assert z.read("captions/words.vtt") == z.read("captions/lines.vtt")
    assert json.loads(z.read("script.json"))["rendered"] == state["lines"]
    # FLAC is lossless: the same samples, encoded.
    flac = export(jar, server.url, rendered["script"], format="flac")
    assert "mix.flac" in flac.namelist() and "lines/006-BEN.flac" in flac.namelist()
    assert np.array_equal(decode_samples(flac.read("mix.flac"), "flac")[:, 0], mix)


def test_an_unfinished_script_exports_only_when_asked_for_a_partial_zip(tmp_path: Path) -> None:
    jar = OwnerJar()
    thread = start_server(tmp_path, frame_ms=20.0, max_slots=2)
    try:
        assert thread.server is not None
        url = thread.server.url
        script_id = post(jar, url, "A: one two three four five\nB: six seven eight nine ten").json()["script"]
        r = jar.request("GET", f"{url}/api/scripts/{script_id}.zip")
        assert r.status_code == 503 and error_of(r)["code"] == "busy" and "partial" in error_of(r)["message"]
        assert r.headers["Retry-After"]
        z = export(jar, url, script_id, partial="true")
        assert "mix.wav" in z.namelist() and len(json.loads(z.read("cues.json"))["missing"]) >= 1
    finally:
        thread.stop()


def test_exports_at_once_are_bounded(tmp_path: Path) -> None:
    from tests.reliability.conftest import raw_http, read_head

    jar = OwnerJar()
    thread = start_server(tmp_path, max_script_exports=1)
    try:
        assert thread.server is not None
        url, port = thread.server.url, thread.settings.port
        # About 13 MB of zip: far more than socket buffers hold.
        script_id = post(jar, url, "".join(f"A: line {n} " + "and more words " * 8 + "\n" for n in range(8))).json()[
            "script"
        ]
        wait_done(jar, url, script_id)
        # A client that asks for the zip and never reads it holds the one export place (a small window).
        cookie = f"Cookie: {OwnerJar.NAME}={jar.cookie}\r\n"
        stalled = raw_http(
            port, f"GET /api/scripts/{script_id}.zip HTTP/1.1\r\nHost: 127.0.0.1\r\n{cookie}\r\n", rcvbuf=4096
        )
        assert read_head(stalled)[0] == 200
        deadline = time.monotonic() + 10
        while (r := jar.request("GET", f"{url}/api/scripts/{script_id}.zip")).status_code == 200:
            assert time.monotonic() < deadline  # the stalled export may still be starting
        assert r.status_code == 503 and error_of(r)["code"] == "busy" and r.headers["Retry-After"]
        stalled.close()
        deadline = time.monotonic() + 30  # the stalled one ends (its write fails) and frees the place
        while jar.request("GET", f"{url}/api/scripts/{script_id}.zip").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        thread.stop()


# --------------------------------------------------------------------------- directing a line


def test_a_line_retake_replaces_that_line_in_the_next_export(server: RunningServer, jar: OwnerJar) -> None:
    script_id = post(jar, server.url, SCRIPT).json()["script"]
    before = wait_done(jar, server.url, script_id)
    old = export(jar, server.url, script_id)
    r = jar.request("POST", f"{server.url}/api/scripts/{script_id}/lines/2/retake",
                      json={"seed": 777, "instruction": "hoarse"}, timeout=10)  # fmt: skip
    assert r.status_code == 202 and r.json()["line"]["status"] == "rendering", r.text
    stream = events(jar, server.url, script_id, last_id=r.json()["event_id"])
    assert stream[0]["event"] == "line" and stream[0]["data"]["status"] == "rendering"
    assert any(e["event"] == "line" and e["data"]["line"] == 2 and e["data"]["status"] == "done" for e in stream)
    after = wait_done(jar, server.url, script_id)
    changed = after["lines"][1]
    assert changed["take"] != before["lines"][1]["take"] and changed["seed"] == 777
    assert changed["instruction"] == "hoarse" and changed["attempts"] == 2
    assert [x["take"] for i, x in enumerate(after["lines"]) if i != 1] == [
        x["take"] for i, x in enumerate(before["lines"]) if i != 1
    ]  # nothing else was rendered again
    session = jar.request("GET", f"{server.url}/api/sessions/{after['session']}").json()
    take = next(t for t in session["takes"] if t["take_id"] == changed["take"])
    assert take["parent"] == before["lines"][1]["take"] and take["seed"] == 777
    new = export(jar, server.url, script_id)
    for name in old.namelist():
        if name.startswith("lines/") and name != "lines/002-BEN.wav":
            assert old.read(name) == new.read(name), name
    assert old.read("lines/002-BEN.wav") != new.read("lines/002-BEN.wav")
    lines = {int(n[6:9]): pcm_of(new.read(n)) for n in new.namelist() if n.startswith("lines/")}
    assert np.array_equal(pcm_of(new.read("mix.wav")), expected_mix(lines))
    # A retake from a frame keeps the take's audio up to that frame, sample for sample.
    r = jar.request("POST", f"{server.url}/api/scripts/{script_id}/lines/2/retake", json={"frame": 5, "seed": 9})
    assert r.status_code == 202, r.text
    events(jar, server.url, script_id, until="done")
    third = wait_done(jar, server.url, script_id)["lines"][1]
    partial = pcm_of(export(jar, server.url, script_id).read("lines/002-BEN.wav"))
    assert np.array_equal(partial[: 5 * FRAME_SAMPLES], lines[2][: 5 * FRAME_SAMPLES])
    assert not np.array_equal(partial[5 * FRAME_SAMPLES :][:100], lines[2][5 * FRAME_SAMPLES :][:100])
    assert third["seed"] == 9


def test_a_take_directed_in_the_studio_is_accepted_as_the_line(server: RunningServer, jar: OwnerJar) -> None:
    script_id = post(jar, server.url, SCRIPT).json()["script"]
    state = wait_done(jar, server.url, script_id)
    line3 = state["lines"][2]

    async def direct() -> str:
        # The studio's way: bind to the session, retake the line's take from frame 3, keep the result.
        async with await jar.connect(server.ws_url, max_size=None) as ws:
            await ws.send(json.dumps({"type": "resume", "session": state["session"]}))
            await ws.send(json.dumps({"type": "seek", "take": line3["take"], "frame": 3, "seed": 5,
                                      "text": "Not a single wink."}))  # fmt: skip
            while True:
                data = await ws.recv()
                if data[0] == 0:
                    msg = json.loads(data[5:])
                    assert msg["type"] != "error", msg
                    if msg["type"] == "end":
                        return str(msg["take"])

    new_take = asyncio.run(asyncio.wait_for(direct(), 30))
    r = jar.request("POST", f"{server.url}/api/scripts/{script_id}/lines/3/accept", json={"take": new_take})
    assert r.status_code == 200, r.text
    line = r.json()["line"]
    assert line["take"] == new_take and line["status"] == "done" and line["text"] == "Not a single wink."
    z = export(jar, server.url, script_id)
    rows = json.loads(z.read("cues.json"))["lines"]
    assert rows[2]["take"] == new_take and rows[2]["text"] == "Not a single wink."
    assert "Not a single wink." in z.read("captions/lines.srt").decode()
    take_wav = jar.request("GET", f"{server.url}/api/sessions/{state['session']}/takes/{new_take}.wav")
    assert np.array_equal(pcm_of(z.read("lines/003-ANNA.wav")), pcm_of(take_wav.content))


def test_resume_again_brings_the_lines_rendered_since_onto_the_socket(server: RunningServer, jar: OwnerJar) -> None:
    """The studio's Script panel: a socket bound to the session before a render's lines were stored does not hold
    them (a seek is not_found); a second `resume` of the same session lists them and adopts them, and a seek on a
    line's take then retakes it."""
    first = post(jar, server.url, "ANNA: Hello there.\n").json()
    session = wait_done(jar, server.url, first["script"])["session"]

    async def scenario() -> tuple[dict[str, Any], set[str], str]:
        async with await jar.connect(server.ws_url, max_size=None) as ws:

            async def next_json() -> dict[str, Any]:
                while True:
                    data = await ws.recv()
                    if data[0] == 0:
                        return dict(json.loads(data[5:]))

            await ws.send(json.dumps({"type": "resume", "session": session}))
            while (msg := await next_json())["type"] != "session":
                pass
            # A render into the bound session, after the socket resumed it.
            later = post(jar, server.url, "BEN: Later on.\nANNA: Much later.\n", session=session).json()
            line = (await asyncio.to_thread(wait_done, jar, server.url, later["script"]))["lines"][0]
            await ws.send(json.dumps({"type": "seek", "take": line["take"], "frame": 0, "mode": "replay"}))
            while (refused := await next_json())["type"] != "error":
                pass
            await ws.send(json.dumps({"type": "resume", "session": session}))
            while (again := await next_json())["type"] != "session":
                pass
            listed = {t["take_id"] for t in again["takes"]}
            await ws.send(json.dumps({"type": "seek", "take": line["take"], "frame": 2, "seed": 3}))
            while (msg := await next_json())["type"] != "end":
                assert msg["type"] != "error", msg
            return refused, listed, line["take"]

    refused, listed, line_take = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert refused["code"] == "not_found" and refused.get("field") == "take"
    assert line_take in listed


def test_delete_stops_the_render_and_keeps_the_takes(tmp_path: Path) -> None:
    jar = OwnerJar()
    thread = start_server(tmp_path, frame_ms=20.0, max_slots=2)
    try:
        assert thread.server is not None
        url = thread.server.url
        body = post(jar, url, "".join(f"A: line number {n}\n" for n in range(8))).json()
        deadline = time.monotonic() + 20
        while jar.request("GET", f"{url}/api/scripts/{body['script']}").json()["lines_done"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        r = jar.request("DELETE", f"{url}/api/scripts/{body['script']}")
        assert r.status_code == 200 and r.json() == {"deleted": body["script"]}
        assert jar.request("GET", f"{url}/api/scripts/{body['script']}").status_code == 404
        assert thread.server.state.scripts is not None and thread.server.state.scripts.share.in_use == 0
        takes = jar.request("GET", f"{url}/api/sessions/{body['session']}").json()["takes"]
        assert 1 <= len(takes) < 8  # the lines made so far stay in the session
    finally:
        thread.stop()


def test_deleting_its_session_ends_a_render_with_an_error_event(tmp_path: Path) -> None:
    jar = OwnerJar()
    thread = start_server(tmp_path, frame_ms=20.0, max_slots=2)
    try:
        assert thread.server is not None
        url = thread.server.url
        body = post(jar, url, "".join(f"A: line number {n}\n" for n in range(8))).json()
        deadline = time.monotonic() + 20
        while jar.request("GET", f"{url}/api/scripts/{body['script']}").json()["lines_done"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        store = thread.server.state.sessions
        assert store is not None
        with jar.request("GET", f"{url}/api/scripts/{body['script']}/events", stream=True, timeout=30) as r:
            assert r.status_code == 200  # listening before the session goes
            store.delete_session(body["session"])  # as the director's delete (or retention) would
            lines = [line for line in r.iter_lines(decode_unicode=True) if line]  # the stream ends after it
        assert lines[-2] == "event: error" and json.loads(lines[-1][6:])["code"] == "not_found"
        assert "session" in json.loads(lines[-1][6:])["message"]
        assert jar.request("GET", f"{url}/api/scripts/{body['script']}").status_code == 404
        assert thread.server.state.scripts is not None and thread.server.state.scripts.share.in_use == 0
    finally:
        thread.stop()


# --------------------------------------------------------------------------- failures


class FailingEngine(ScriptedEngine):
    """Fails a take whose text says FAIL_ONCE the first time it is asked for, and FAIL_ALWAYS every time."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.failed: list[str] = []

    async def submit(self, spec: Any) -> Any:
        if "FAIL_ALWAYS" in spec.text or ("FAIL_ONCE" in spec.text and spec.take_id not in self.failed):
            self.failed.append(spec.take_id)
            from moss_rt.protocol import ErrorCode, ProtocolError

            raise ProtocolError(ErrorCode.INVALID_FIELD, "this engine refuses the line", field="text")
        return await super().submit(spec)


def test_a_failed_line_is_retried_once_then_marked_failed_and_the_rest_goes_on(tmp_path: Path) -> None:
    jar = OwnerJar()

    def factory(settings: Settings) -> FailingEngine:
        return FailingEngine(frame_ms=settings.frame_ms, max_slots=settings.max_slots, max_queue=settings.max_queue,
                             max_lead_sec=settings.max_lead_sec)  # fmt: skip

    thread = start_server(tmp_path, engine_factory=factory)
    try:
        assert thread.server is not None
        url = thread.server.url
        script_id = post(jar, url, "A: first\nB: FAIL_ONCE second\nA: FAIL_ALWAYS third\nB: fourth").json()["script"]
        stream = events(jar, url, script_id)
        state = wait_done(jar, url, script_id)
        assert state["state"] == "done" and state["lines_done"] == 3 and state["lines_failed"] == 1
        lines = state["lines"]
        assert [x["status"] for x in lines] == ["done", "done", "failed", "done"]
        assert [x["attempts"] for x in lines] == [1, 2, 2, 1]
        assert lines[2]["take"] is None and lines[2]["error"] == "this engine refuses the line"
        failed = [e["data"] for e in stream if e["event"] == "line" and e["data"]["status"] == "failed"]
        assert [x["line"] for x in failed] == [3] and stream[-1]["data"]["lines_failed"] == 1
        z = export(jar, url, script_id)
        assert "lines/003-A.wav" not in z.namelist()
        assert [m["line"] for m in json.loads(z.read("cues.json"))["missing"]] == [3]
        # A retake of the failed line (now the engine accepts it) makes it whole.
        r = jar.request("POST", f"{url}/api/scripts/{script_id}/lines/3/retake", json={"text": "third"})
        assert r.status_code == 202
        events(jar, url, script_id)
        assert wait_done(jar, url, script_id)["lines"][2]["status"] == "done"
    finally:
        thread.stop()


# --------------------------------------------------------------------------- restarts


def test_a_render_resumes_after_a_restart_without_rendering_finished_lines_again(tmp_path: Path) -> None:
    jar = OwnerJar()
    thread = start_server(tmp_path, frame_ms=15.0, max_slots=2)  # one line at a time
    assert thread.server is not None
    url = thread.server.url
    body = post(jar, url, SCRIPT).json()
    deadline = time.monotonic() + 30
    while (state := jar.request("GET", f"{url}/api/scripts/{body['script']}").json())["lines_done"] < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    thread.stop()
    finished = {x["line"]: x for x in state["lines"] if x["status"] == "done"}
    assert 2 <= len(finished) < 6

    thread = start_server(tmp_path, frame_ms=2.0)
    try:
        assert thread.server is not None
        url = thread.server.url
        after = wait_done(jar, url, body["script"])
        assert after["state"] == "done" and after["lines_done"] == 6
        for n, x in finished.items():
            assert after["lines"][n - 1] == x  # same take, seed, attempts: not rendered again
        takes = jar.request("GET", f"{url}/api/sessions/{body['session']}").json()["takes"]
        assert sorted(t["take_id"] for t in takes) == sorted(x["take"] for x in after["lines"])
        z = export(jar, url, body["script"])
        lines = {int(n[6:9]): pcm_of(z.read(n)) for n in z.namelist() if n.startswith("lines/")}
        assert np.array_equal(pcm_of(z.read("mix.wav")), expected_mix(lines))
    finally:
        thread.stop()
