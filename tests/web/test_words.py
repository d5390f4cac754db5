"""Word timing on a real server with the tiny model (issue 25): ``words`` messages on the WebSocket, retakes from a
word, the words/SRT/VTT routes (also for stored session takes), ``POST /api/align`` with its errors, and a script
export's captions by word (its lines' words kept as they render, aligned on demand for an accepted take).

The tiny model's audio is noise, so its words are estimated (flagged ``interpolated``); these tests hold the
structure, order and timing rules. Accuracy on real speech is tests/align/test_accuracy.py.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import io
import json
import re
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
import soundfile as sf
import websockets

from moss_rt.config import Settings
from moss_rt.engine.moss import MossEngine
from moss_rt.protocol import FRAME_RATE, Limits, frame_at_time
from tests.helpers import OwnerJar, RunningServer, ServerThread, decode, error_of, free_port

pytest.importorskip("pocketsphinx")

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "words"
ALIGNER_WORKERS = 2
TEXT = "Forty ships (a soft laugh) sailed home, [pause] 3 days late."
SPOKEN = ["Forty", "ships", "sailed", "home", "3", "days", "late"]
# Greedy stop head: the tiny model runs to max_new_tokens, long enough for every word of TEXT.
TAKE = {"text": TEXT, "seed": 1, "max_new_tokens": 45, "text_temperature": 0.0, "words": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    data = tmp_path_factory.mktemp("words-data")
    settings = Settings(
        host="127.0.0.1", port=free_port(), engine="moss", model="tiny", codec="tiny", device="cpu",
        data_dir=data, voices_dir=data / "builtin", max_slots=4, max_queue=8, max_seq_len=1024, max_lead_sec=0.0,
        aligner="pocketsphinx", aligner_workers=ALIGNER_WORKERS, limits=Limits(max_align_seconds=20.0),
    )  # fmt: skip
    thread = ServerThread(settings, MossEngine(settings))
    running = thread.start(ready_timeout=180)
    _warm_aligner(running)
    yield running
    thread.stop()


def _warm_aligner(server: RunningServer) -> None:
    """The aligner's worker processes start with the first alignment (a server never asked for words spends nothing
    on them): one start each, here, so that tests timing words against the audio see the aligner as it serves, not
    its start-up (on a loaded 2-core machine a cold worker took longer than a whole tiny take)."""
    audio, _ = sf.read(FIXTURE / "espeak_16k.flac", dtype="float32")
    speech = flac(audio[: 16000 * 2])
    with concurrent.futures.ThreadPoolExecutor(ALIGNER_WORKERS) as pool:  # at once: every worker process starts
        answers = list(pool.map(lambda _: requests.post(f"{server.url}/api/align", params={"text": "Forty ships"},
                                                        data=speech, timeout=120), range(ALIGNER_WORKERS)))
    assert all(r.status_code == 200 for r in answers), [r.text for r in answers]


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 120))


async def frames(ws: Any, until: str = "end") -> list[tuple[str, Any]]:
    """("pcm", bytes) and (type, message) items up to the first message of type ``until``."""
    out: list[tuple[str, Any]] = []
    while True:
        tag, obj = decode(await ws.recv())
        if tag == 1:
            out.append(("pcm", obj))
            continue
        if obj["type"] == "error":
            raise AssertionError(obj)
        out.append((obj["type"], obj))
        if obj["type"] == until:
            return out


def words_of(items: list[tuple[str, Any]]) -> list[dict[str, Any]]:
    """The take's words from its ``words`` messages, checking their order rules on the way."""
    words: list[dict[str, Any]] = []
    kinds = [kind for kind, _ in items]
    batches = [msg for kind, msg in items if kind == "words"]
    assert batches and batches[-1].get("final") is True
    assert all(not b.get("final") for b in batches[:-1])
    assert kinds.index("start") < kinds.index("words"), "words come after the take's start"
    assert max(i for i, k in enumerate(kinds) if k == "words") < kinds.index("end"), "all words before the end"
    for batch in batches:
        assert batch["index"] == len(words), "batches in order, none lost or repeated"
        words += batch["words"]
    return words


def check_times(words: list[dict[str, Any]], duration: float) -> None:
    for w in words:
        assert set(w) <= {"word", "start", "end", "flags"}
        assert 0 <= w["start"] < w["end"] <= duration + 0.05
    assert all(a["end"] <= b["start"] for a, b in zip(words, words[1:], strict=False))


def test_words_stream_with_the_take_in_order_before_its_end(server: RunningServer) -> None:
    async def scenario() -> tuple[str, list[dict[str, Any]]]:
        async with websockets.connect(server.ws_url, max_size=None) as ws:
            hello = json.loads((await ws.recv())[5:])
            assert hello["words"] is True and hello["aligner"] == "pocketsphinx"
            await ws.send(json.dumps({"type": "start", **TAKE}))
            items = await frames(ws)
            end = items[-1][1]
            words = words_of(items)
            assert [w["word"] for w in words] == SPOKEN  # the direction's cues are not words
            check_times(words, end["duration_sec"])
            assert all(w.get("flags") == ["interpolated"] for w in words)  # noise: estimated, and said so
            # Most words go out while the audio still streams, not at the end.
            first_words = next(i for i, (k, _) in enumerate(items) if k == "words")
            assert any(k == "pcm" for k, _ in items[first_words:])
            return end["take"], words

    take, words = run(scenario())
    summary = requests.get(f"{server.url}/api/takes/{take}/words", timeout=30).json()
    assert summary == {"take": take, "complete": True, "words": words}


def test_retake_from_a_word_keeps_the_prefix_and_its_words(server: RunningServer) -> None:
    async def scenario() -> None:
        async with websockets.connect(server.ws_url, max_size=None) as ws:
            await ws.recv()
            await ws.send(json.dumps({"type": "start", **TAKE}))
            first = await frames(ws)
            parent, words = first[-1][1]["take"], words_of(first)
            await ws.send(json.dumps({"type": "seek", "take": parent, "word": 3, "seed": 9}))
            items = await frames(ws)
            ack = next(msg for kind, msg in items if kind == "seek")
            frame = frame_at_time(words[3]["start"])
            assert ack["frame"] == frame and ack["from_take"] == parent
            start = next(msg for kind, msg in items if kind == "start")
            assert start["first_frame"] == frame
            retake_words = words_of(items)
            kept = [w for w in words if w["end"] <= frame / FRAME_RATE]
            assert retake_words[: len(kept)] == kept, "the kept prefix keeps its words"
            assert [w["word"] for w in retake_words] == SPOKEN
            check_times(retake_words, items[-1][1]["duration_sec"])
            # Past the last word, or a take without words yet: clear errors, the socket stays usable.
            await ws.send(json.dumps({"type": "seek", "take": parent, "word": 99}))
            error = json.loads((await ws.recv())[5:])
            assert (error["type"], error["code"], error["field"]) == ("error", "invalid_field", "word")
            await ws.send(json.dumps({"type": "seek", "take": parent, "word": 1, "frame": 3}))
            error = json.loads((await ws.recv())[5:])
            assert (error["code"], error["field"]) == ("invalid_field", "frame")

    run(scenario())


def test_a_take_made_without_words_is_aligned_on_demand(server: RunningServer) -> None:
    async def scenario() -> str:
        async with websockets.connect(server.ws_url, max_size=None) as ws:
            await ws.recv()
            await ws.send(json.dumps({"type": "start", **{**TAKE, "words": False}}))
            items = await frames(ws)
            assert "words" not in [kind for kind, _ in items]
            take = items[-1][1]["take"]
            # seek by word aligns it first.
            await ws.send(json.dumps({"type": "seek", "take": take, "word": 2, "mode": "replay"}))
            ack = (await frames(ws, "seek"))[-1][1]
            assert ack["frame"] > 0
            await frames(ws)
            return take

    take = run(scenario())
    body = requests.get(f"{server.url}/api/takes/{take}/words", timeout=60).json()
    assert [w["word"] for w in body["words"]] == SPOKEN
    srt = requests.get(f"{server.url}/api/takes/{take}.srt", timeout=60)
    assert srt.status_code == 200 and srt.headers["Content-Type"].startswith("application/x-subrip")
    assert srt.text.startswith("1\n00:00:") and "Forty ships sailed home," in srt.text
    vtt = requests.get(f"{server.url}/api/takes/{take}.vtt", timeout=60)
    assert vtt.headers["Content-Type"].startswith("text/vtt") and vtt.text.startswith("WEBVTT\n\n00:00:")
    assert "(a soft laugh)" not in srt.text + vtt.text
    for path in ("/api/takes/t_nope/words", "/api/takes/t_nope.srt", "/api/takes/t_nope.vtt"):
        r = requests.get(server.url + path, timeout=10)
        assert r.status_code == 404 and error_of(r)["code"] == "not_found"


def test_streamed_text_gets_words_before_its_end(server: RunningServer) -> None:
    async def scenario() -> None:
        async with websockets.connect(server.ws_url, max_size=None) as ws:
            await ws.recv()
            start = {"type": "start", "stream_text": True, "words": True, "seed": 2, "text_temperature": 0.0}
            await ws.send(json.dumps({**start, "max_new_tokens": 60, "text": "Forty ships. "}))
            await ws.send(json.dumps({"type": "append", "text": "Three days late. "}))
            await ws.send(json.dumps({"type": "end_of_text"}))
            items = await frames(ws)
            words = words_of(items)
            assert [w["word"] for w in words] == ["Forty", "ships", "Three", "days", "late"][: len(words)]
            assert len(words) >= 2
            check_times(words, items[-1][1]["duration_sec"])

    run(scenario())


def test_words_stored_with_the_session_take_and_restored(server: RunningServer) -> None:
    jar = OwnerJar()  # stored sessions belong to the owner cookie the first connection gets

    async def scenario() -> tuple[str, str, list[dict[str, Any]]]:
        async with await jar.connect(server.ws_url, max_size=None) as ws:
            await ws.recv()
            await ws.send(json.dumps({"type": "resume"}))
            session = (await frames(ws, "session"))[-1][1]["session"]
            await ws.send(json.dumps({"type": "start", **TAKE}))
            items = await frames(ws)
            return session, items[-1][1]["take"], words_of(items)

    session, take, words = run(scenario())
    store = server.state.sessions
    assert store is not None
    stored = store.words(session, take)
    assert [{k: v for k, v in w.items() if k not in ("text", "chars")} for w in stored] == words

    async def resume() -> None:
        async with await jar.connect(server.ws_url, max_size=None) as ws:
            await ws.recv()
            await ws.send(json.dumps({"type": "resume", "session": session}))
            await frames(ws, "session")
            await ws.send(json.dumps({"type": "seek", "take": take, "word": 1, "mode": "replay"}))
            ack = (await frames(ws, "seek"))[-1][1]
            assert ack["frame"] == frame_at_time(words[1]["start"])  # from the stored words
            await frames(ws)

    run(resume())
    r = jar.request("GET", f"{server.url}/api/sessions/{session}/takes/{take}/words", timeout=30)
    assert r.status_code == 200 and r.json()["words"] == words
    r = jar.request("GET", f"{server.url}/api/sessions/{session}/takes/{take}.vtt", timeout=30)
    assert r.status_code == 200 and r.text.startswith("WEBVTT")
    # Someone else (no owner cookie, no share token) gets nothing, like the session's other reads.
    r = requests.get(f"{server.url}/api/sessions/{session}/takes/{take}/words", timeout=30)
    assert r.status_code == 404 and error_of(r)["code"] == "not_found"


def flac(audio: np.ndarray, rate: int = 16000) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, audio, rate, format="FLAC")
    return buf.getvalue()


def test_align_endpoint_on_real_speech(server: RunningServer) -> None:
    truth = json.loads((FIXTURE / "espeak_16k.json").read_text())
    audio, _ = sf.read(FIXTURE / "espeak_16k.flac", dtype="float32")
    cut = 7.5  # after the first sentence (the server allows 20 s)
    first = [w for w in truth["words"] if w["end"] < cut]
    text = "Forty ships sailed across the quiet silver harbor before dawn."
    speech = flac(audio[: int(16000 * cut)])
    r = requests.post(f"{server.url}/api/align", params={"text": text}, data=speech, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["aligner"] == "pocketsphinx" and abs(body["duration"] - cut) < 0.01
    assert [w["word"] for w in body["words"]] == [w["word"] for w in first]
    assert all(abs(w["start"] - t["start"]) <= 0.1 for w, t in zip(body["words"], first, strict=True))
    # The same with a multipart form: the audio part and a JSON part.
    files = {"audio": ("take.flac", speech), "json": (None, json.dumps({"text": text}))}
    r2 = requests.post(f"{server.url}/api/align", files=files, timeout=60)
    assert r2.status_code == 200 and r2.json()["words"] == body["words"]


@pytest.mark.parametrize(
    ("params", "data", "field", "code"),
    [
        ({"text": ""}, "speech", "text", "invalid_field"),
        ({}, "speech", "text", "invalid_field"),
        ({"text": "(a soft laugh) [pause] ..."}, "speech", "text", "invalid_field"),
        ({"text": "x" * 4001}, "speech", "text", "invalid_field"),
        ({"text": "hello"}, "garbage", "audio", "invalid_field"),
        ({"text": "hello"}, "empty", "audio", "invalid_field"),
        ({"text": "hello"}, "long", "audio", "invalid_field"),
    ],
)
def test_align_endpoint_refuses_bad_input_clearly(server: RunningServer, params, data, field, code) -> None:
    bodies = {
        "speech": flac(np.zeros(16000, np.float32)),
        "garbage": b"this is not audio at all",
        "empty": b"",
        "long": flac(np.zeros(16000 * 25, np.float32)),  # this server allows 20 s
    }
    r = requests.post(f"{server.url}/api/align", params=params, data=bodies[data], timeout=30)
    assert r.status_code == 422
    error = error_of(r)
    assert (error["code"], error["field"]) == (code, field)
    assert error["message"]


def test_words_need_the_websocket_on_the_legacy_stream(server: RunningServer) -> None:
    r = requests.post(f"{server.url}/api/stream", json={"text": "hi", "words": True}, timeout=10)
    assert r.status_code == 422 and error_of(r)["field"] == "words"


# --------------------------------------------------------------------------- scripts: captions by word

SCRIPT = {
    "title": "Words",
    "lines": [
        {"who": "ANNA", "text": "Forty ships sailed home. Three days late.", "seed": 1, "max_new_tokens": 60},
        {"who": "BEN", "text": "Not a single wink.", "seed": 2, "max_new_tokens": 40},
    ],
}
SEED = 5  # a retake seed whose tiny-model take does not end at once
SRT_CUE = re.compile(r"(\d+)\n(\d\d):(\d\d):(\d\d),(\d{3}) --> (\d\d):(\d\d):(\d\d),(\d{3})\n(.+)", re.S)


def srt_cues(text: str) -> list[tuple[float, float, str]]:
    """(start, end, text on one line) of each cue of a SubRip file, checking its numbering."""
    cues = []
    for n, block in enumerate(text.strip().split("\n\n"), start=1):
        m = SRT_CUE.fullmatch(block)
        assert m and int(m.group(1)) == n, block
        h1, m1, s1, ms1, h2, m2, s2, ms2 = (int(g) for g in m.groups()[1:9])
        start, end = h1 * 3600 + m1 * 60 + s1 + ms1 / 1000, h2 * 3600 + m2 * 60 + s2 + ms2 / 1000
        cues.append((start, end, " ".join(m.group(10).split("\n"))))
    return cues


def script_done(jar: OwnerJar, url: str, script_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        state = jar.request("GET", f"{url}/api/scripts/{script_id}").json()
        if state["state"] in ("done", "failed"):
            return state
        time.sleep(0.05)
    raise AssertionError(f"script {script_id} not done")


def script_zip(jar: OwnerJar, url: str, script_id: str) -> zipfile.ZipFile:
    r = jar.request("GET", f"{url}/api/scripts/{script_id}.zip", timeout=120)
    assert r.status_code == 200, r.text
    return zipfile.ZipFile(io.BytesIO(r.content))


def stored_words(server: RunningServer, session: str, take: str) -> list[dict[str, Any]] | None:
    assert server.state.sessions is not None
    return server.state.sessions.words(session, take)


def check_word_captions(z: zipfile.ZipFile, words: dict[int, list[dict[str, Any]]]) -> None:
    """captions/words.srt holds each line's stored words, grouped, where the cue sheet places the line."""
    sheet = json.loads(z.read("cues.json"))["lines"]
    cues = srt_cues(z.read("captions/words.srt").decode())
    assert len(srt_cues(z.read("captions/lines.srt").decode())) == len(sheet)  # by line: one cue each
    for i, row in enumerate(sheet):
        label = row["character"] + ": "
        next_start = sheet[i + 1]["start"] if i + 1 < len(sheet) else float("inf")
        mine = [c for c in cues if row["start"] - 0.001 <= c[0] < next_start]
        said = words[row["line"]]
        assert said, "the tiny model's audio is noise, but its words are estimated over it"
        assert all(text.startswith(label) for _, _, text in mine)
        assert " ".join(text[len(label) :] for _, _, text in mine) == " ".join(w["text"] for w in said)
        assert mine[0][0] == pytest.approx(row["start"] + said[0]["start"], abs=0.0011)
        assert all(end <= next_start + 0.001 for _, end, _ in mine)
        if len(said) > 4:  # "home." closes a cue: a sentence end
            assert any(text.endswith("home.") for _, _, text in mine)
    vtt = z.read("captions/words.vtt").decode()
    first = words[sheet[0]["line"]][0]["text"]
    assert vtt.startswith("WEBVTT\n\n") and f"<v {sheet[0]['character']}>{first}" in vtt


def test_a_script_exports_captions_by_word_kept_as_its_lines_render(server: RunningServer) -> None:
    jar = OwnerJar()
    r = jar.request("POST", f"{server.url}/api/scripts", json=SCRIPT)
    assert r.status_code == 201, r.text
    state = script_done(jar, server.url, r.json()["script"])
    assert state["lines_done"] == 2
    session = state["session"]
    # Done means the words are kept with each line's take: the export aligns nothing.
    words = {x["line"]: stored_words(server, session, x["take"]) for x in state["lines"]}
    assert all(w is not None for w in words.values())
    z = script_zip(jar, server.url, state["script"])
    check_word_captions(z, words)  # type: ignore[arg-type]

    # A retake of line 1 from a frame keeps the frames before it, and their words (shifted with nothing: the
    # stored retake starts with its parent's audio, as the export plays it).
    parent_take, parent_words = state["lines"][0]["take"], words[1]
    assert parent_words is not None
    frame = frame_at_time(parent_words[2]["end"]) + 1
    retake_url = f"{server.url}/api/scripts/{state['script']}/lines/1/retake"
    r = jar.request("POST", retake_url, json={"frame": frame, "seed": SEED})
    assert r.status_code == 202, r.text
    state = script_done(jar, server.url, state["script"])
    retake = state["lines"][0]["take"]
    assert retake != parent_take, state["lines"][0]["error"]
    retake_words = stored_words(server, session, retake)
    assert retake_words is not None
    kept = [w for w in parent_words if w["end"] <= frame / FRAME_RATE]
    assert len(kept) >= 3 and retake_words[: len(kept)] == kept
    check_word_captions(script_zip(jar, server.url, state["script"]), {1: retake_words, 2: words[2]})  # type: ignore[dict-item]


def test_an_accepted_take_without_words_is_aligned_for_the_export(server: RunningServer) -> None:
    jar = OwnerJar()
    r = jar.request("POST", f"{server.url}/api/scripts", json={"lines": SCRIPT["lines"][1:]})  # type: ignore[index]
    assert r.status_code == 201, r.text
    state = script_done(jar, server.url, r.json()["script"])
    session = state["session"]

    async def studio_take() -> str:
        async with await jar.connect(server.ws_url, max_size=None) as ws:
            await ws.recv()
            await ws.send(json.dumps({"type": "resume", "session": session}))
            await frames(ws, "session")
            await ws.send(json.dumps({"type": "start", **{**TAKE, "text": "Not one wink, no.", "words": False}}))
            return str((await frames(ws))[-1][1]["take"])

    take = run(studio_take())
    assert stored_words(server, session, take) is None  # made without words
    r = jar.request("POST", f"{server.url}/api/scripts/{state['script']}/lines/1/accept", json={"take": take})
    assert r.status_code == 200, r.text
    z = script_zip(jar, server.url, state["script"])  # waits for its alignment (begun when it was accepted)
    words = stored_words(server, session, take)
    assert words is not None and [w["word"] for w in words] == ["Not", "one", "wink", "no"]
    check_word_captions(z, {1: words})
