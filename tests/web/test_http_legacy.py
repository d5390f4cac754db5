"""The legacy HTTP API, against a real server: byte format, metadata, uploads, bad input."""

from __future__ import annotations

import json
import struct
import wave
from pathlib import Path

import numpy as np
import requests

from moss_rt.engine.base import chunk_target
from moss_rt.protocol import FRAME_SAMPLES, LEGACY_STREAM_DEFAULTS, FrameReader
from tests.conftest import RunningServer, sine_wav


def parse_stream(body: bytes) -> list[tuple[int, bytes]]:
    reader = FrameReader()
    frames = [(f.tag, f.payload) for f in reader.feed(body)]
    reader.close()
    return frames


def test_readme_requests_client_works_unchanged(server: RunningServer, tmp_path: Path) -> None:
    """The original playground README's minimal client, verbatim in spirit: stream, parse, write WAV."""
    r = requests.post(
        f"{server.url}/api/stream",
        json={"text": "Hello there, how are you today?", "instruction": "warm"},
        stream=True,
    )
    buf = b""
    pcm = b""
    sr = 48000
    for chunk in r.iter_content(chunk_size=4096):
        buf += chunk
        while len(buf) >= 5:
            tag = buf[0]
            (length,) = struct.unpack(">I", buf[1:5])
            if len(buf) < 5 + length:
                break
            payload = buf[5 : 5 + length]
            buf = buf[5 + length :]
            if tag == 0:
                meta = json.loads(payload)
                if meta.get("type") == "start":
                    sr = meta["sr"]
            elif tag == 1:
                pcm += payload
    out = tmp_path / "out.wav"
    with wave.open(str(out), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sr)
        w.writeframes(pcm)
    with wave.open(str(out)) as w:
        assert w.getframerate() == 48000
        assert w.getnframes() > 0
        assert w.getnframes() % FRAME_SAMPLES == 0


def test_stream_metadata_and_frame_order(server: RunningServer) -> None:
    r = requests.post(f"{server.url}/api/stream", json={"text": "one two three", "seed": 11, "chunk_frames": 3})
    assert r.status_code == 200
    assert r.headers["Content-Type"] == "application/octet-stream"
    frames = parse_stream(r.content)
    tags = [t for t, _ in frames]
    assert tags[0] == 0 and tags[-1] == 0 and set(tags[1:-1]) == {1}
    start, end = json.loads(frames[0][1]), json.loads(frames[-1][1])
    assert start["type"] == "start" and start["sr"] == 48000 and isinstance(start["gpu_first_ms"], int)
    assert end["type"] == "end" and end["reason"] == "done"
    pcm = b"".join(p for t, p in frames if t == 1)
    samples = np.frombuffer(pcm, dtype="<i2")
    assert end["n_frames"] * FRAME_SAMPLES == samples.size
    assert abs(end["duration_sec"] - samples.size / 48000) < 1e-3
    assert isinstance(end["gpu_total_ms"], float)
    # Mono is the average of the scripted left (frame marker) and right (seed marker) channels.
    firsts = samples[::FRAME_SAMPLES].astype(int)
    assert list(firsts) == [((i + 1) + -(11 + 1)) // 2 for i in range(end["n_frames"])]
    # The first chunks are single frames (they fill a player's cushion fast), then whole chunk_frames chunks.
    sizes = [len(p) // (2 * FRAME_SAMPLES) for t, p in frames if t == 1]
    expected, sent = [], 0
    while sent < end["n_frames"]:
        expected.append(min(chunk_target(sent, 3), end["n_frames"] - sent))
        sent += expected[-1]
    assert sizes == expected, sizes
    assert sizes[:3] == [1, 1, 1] and set(sizes[3:-1]) <= {3}


def test_all_fields_optional(server: RunningServer) -> None:
    r = requests.post(f"{server.url}/api/stream", data=b"{}")
    assert r.status_code == 200
    assert json.loads(parse_stream(r.content)[-1][1])["reason"] == "done"


def test_legacy_client_gets_the_seed_defaults(server: RunningServer) -> None:
    """A client of the original playground that sends only text gets that API's documented values."""
    r = requests.post(f"{server.url}/api/stream", json={"text": "Only the text."})
    frames = parse_stream(r.content)
    start, end = json.loads(frames[0][1]), json.loads(frames[-1][1])
    assert start["seed"] == 0 and isinstance(start["gpu_first_ms"], int)
    summary = requests.get(f"{server.url}/api/takes/{end['take']}").json()
    request = summary["request"]
    assert summary["seed"] == 0
    assert {k: request[k] for k in LEGACY_STREAM_DEFAULTS} == {
        "audio_temperature": 1.0,
        "audio_top_p": 0.95,
        "audio_top_k": 25,
        "audio_repetition_penalty": 1.1,
        "text_temperature": 1.0,
        "text_top_p": 1.0,
        "text_top_k": 50,
        "max_new_tokens": 3200,
        "chunk_frames": 18,
        "language": "English",
        "seed": 0,
        "reference": "none",
    }
    # A field the client does send is used as sent.
    r = requests.post(f"{server.url}/api/stream", json={"text": "Mine.", "audio_temperature": 0.5, "chunk_frames": 2})
    end = json.loads(parse_stream(r.content)[-1][1])
    request = requests.get(f"{server.url}/api/takes/{end['take']}").json()["request"]
    assert (request["audio_temperature"], request["chunk_frames"], request["audio_top_p"]) == (0.5, 2, 0.95)


def test_models_health_ready_info(server: RunningServer) -> None:
    models = requests.get(f"{server.url}/api/models").json()
    assert models["default"] == "v2-best" and "v2-best" in models["models"]
    assert requests.get(f"{server.url}/healthz").json() == {"status": "ok"}
    assert requests.get(f"{server.url}/readyz").status_code == 200
    info = requests.get(f"{server.url}/api/info").json()
    assert info["engine"] == "scripted" and info["demo"] is True and info["sr"] == 48000


def test_index_served(server: RunningServer) -> None:
    r = requests.get(server.url + "/")
    assert r.status_code == 200 and "<html" in r.text.lower()


def error_of(r: requests.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"}, body
    return body["error"]


def test_bad_stream_requests_get_4xx_json(server: RunningServer) -> None:
    cases = [
        (b"{not json", 400, "bad_json"),
        (b"[1,2]", 400, "bad_message"),
        (json.dumps({"text": ""}).encode(), 422, "invalid_field"),
        (json.dumps({"text": "   "}).encode(), 422, "invalid_field"),
        (json.dumps({"text": "hi", "seed": "x"}).encode(), 422, "invalid_field"),
        (json.dumps({"text": "hi", "audio_top_p": 1.5}).encode(), 422, "invalid_field"),
        (json.dumps({"text": "hi", "audio_temperature": -1}).encode(), 422, "invalid_field"),
        (json.dumps({"text": "hi", "max_new_tokens": 0}).encode(), 422, "invalid_field"),
        (json.dumps({"text": "hi", "chunk_frames": True}).encode(), 422, "invalid_field"),
        (json.dumps({"text": "hi", "reference": "ref_doesnotexist00000000000"}).encode(), 404, "not_found"),
        (json.dumps({"text": "hi", "model": "gpt-9"}).encode(), 404, "not_found"),
        (json.dumps({"text": "x" * 6000}).encode(), 422, "invalid_field"),
        (b"{" + b" " * 300_000 + b"}", 413, "too_large"),
    ]
    for body, status, code in cases:
        r = requests.post(f"{server.url}/api/stream", data=body)
        assert r.status_code == status, (body[:40], r.text)
        assert error_of(r)["code"] == code
    # ... and the server still serves.
    assert requests.post(f"{server.url}/api/stream", json={"text": "still here"}).status_code == 200


def test_upload_reference_roundtrip_and_persistence(server: RunningServer, make_server) -> None:
    from tests.web.conftest import scripted

    wav = sine_wav(1.5)
    r = requests.post(f"{server.url}/api/upload_ref?ext=wav", data=wav)
    assert r.status_code == 200, r.text
    ref = r.json()
    assert ref["ref_id"].startswith("ref_") and abs(ref["duration"] - 1.5) < 1e-3 and ref["frames"] == 18
    # Same bytes, same id.
    assert requests.post(f"{server.url}/api/upload_ref?ext=wav", data=wav).json()["ref_id"] == ref["ref_id"]
    voices = requests.get(f"{server.url}/api/voices").json()["voices"]
    assert [v["id"] for v in voices if v["kind"] == "uploaded"] == [ref["ref_id"]]
    # The stored reference can be listened to before it is used; an unknown voice is a JSON 404.
    audio = requests.get(f"{server.url}/api/voices/{ref['ref_id']}/audio")
    assert audio.status_code == 200 and audio.headers["Content-Type"] == "audio/wav"
    assert audio.content == wav
    missing = requests.get(f"{server.url}/api/voices/ref_000000000000000000000000/audio")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    r = requests.post(f"{server.url}/api/stream", json={"text": "cloned", "reference": ref["ref_id"]})
    assert r.status_code == 200
    # A second server on the same data dir (a restart) still knows the voice.
    again = make_server(scripted, engine="scripted", data_dir=server.state.settings.data_dir, frame_ms=10.0)
    ids = [v["id"] for v in requests.get(f"{again.url}/api/voices").json()["voices"]]
    assert ref["ref_id"] in ids


def test_upload_formats(server: RunningServer) -> None:
    for ext, fmt in (("flac", "FLAC"), ("ogg", "OGG")):
        r = requests.post(f"{server.url}/api/upload_ref?ext={ext}", data=sine_wav(1.0, 44100, 2, fmt))
        assert r.status_code == 200, r.text


def test_bad_uploads_refused(server: RunningServer) -> None:
    cases = [
        ("wav", b"", 422),
        ("wav", b"this is not audio at all" * 10, 422),
        ("wav", sine_wav(1.0)[:60], 422),  # truncated
        ("wav", sine_wav(0.1), 422),  # too short
        ("exe", sine_wav(1.0), 422),
        ("wav", b"\0" * (21 * 1024 * 1024), 413),
    ]
    for ext, data, status in cases:
        r = requests.post(f"{server.url}/api/upload_ref?ext={ext}", data=data)
        assert r.status_code == status, (ext, len(data), r.text)
        assert error_of(r)["code"] in ("invalid_field", "too_large")
    assert requests.get(f"{server.url}/api/voices").json()["voices"] == []


def test_builtin_voices_listed(make_server, tmp_path: Path) -> None:
    from tests.web.conftest import scripted

    voices_dir = tmp_path / "builtin"
    voices_dir.mkdir()
    (voices_dir / "narrator.wav").write_bytes(sine_wav(2.0))
    (voices_dir / "notes.txt").write_text("not a voice")
    srv = make_server(scripted, engine="scripted", voices_dir=voices_dir, frame_ms=10.0)
    voices = requests.get(f"{srv.url}/api/voices").json()["voices"]
    assert [(v["id"], v["kind"]) for v in voices] == [("narrator", "builtin")]
    r = requests.post(f"{srv.url}/api/stream", json={"text": "hello", "reference": "narrator"})
    assert r.status_code == 200


def test_take_download(server: RunningServer) -> None:
    r = requests.post(f"{server.url}/api/stream", json={"text": "download me", "seed": 3})
    frames = parse_stream(r.content)
    start = json.loads(frames[0][1])
    pcm = b"".join(p for t, p in frames if t == 1)
    wav = requests.get(f"{server.url}/api/takes/{start['take']}.wav")
    assert wav.status_code == 200 and wav.headers["Content-Type"] == "audio/wav"
    assert wav.content[44:] == pcm
    missing = requests.get(f"{server.url}/api/takes/t_nope.wav")
    assert missing.status_code == 404 and error_of(missing)["code"] == "not_found"


def test_busy_gets_503_with_retry_after(make_server) -> None:
    """With one slot and a queue of one, a third concurrent request is refused, not queued."""
    import threading

    from tests.web.conftest import scripted

    srv = make_server(scripted, engine="scripted", frame_ms=50.0, max_slots=1, max_queue=1)
    results: list[requests.Response] = []

    def call() -> None:
        results.append(requests.post(f"{srv.url}/api/stream", json={"text": "x" * 40}))

    threads = [threading.Thread(target=call) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    statuses = sorted(r.status_code for r in results)
    assert 200 in statuses and 503 in statuses, statuses
    busy = next(r for r in results if r.status_code == 503)
    assert int(busy.headers["Retry-After"]) >= 1
    assert error_of(busy)["code"] == "busy"
