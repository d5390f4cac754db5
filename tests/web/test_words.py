"""Word timing on a real server with the tiny model (issue 25): ``words`` messages on the WebSocket, retakes from a
word, the words/SRT/VTT routes (also for stored session takes) and ``POST /api/align`` with its errors.

The tiny model's audio is noise, so its words are estimated (flagged ``interpolated``); these tests hold the
structure, order and timing rules. Accuracy on real speech is tests/align/test_accuracy.py.
"""

from __future__ import annotations

import asyncio
import io
import json
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
        aligner="pocketsphinx", limits=Limits(max_align_seconds=20.0),
    )  # fmt: skip
    thread = ServerThread(settings, MossEngine(settings))
    yield thread.start(ready_timeout=180)
    thread.stop()


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
