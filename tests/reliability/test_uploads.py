"""Upload validation and voice-id safety: every bad upload is refused clearly, nothing escapes the store."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path

import numpy as np
import pytest
import requests
import soundfile as sf

from moss_rt.protocol import Limits
from moss_rt.voices import VoiceStore
from tests.conftest import sine_wav
from tests.helpers import error_of


def encode(seconds: float, sr: int = 16000, channels: int = 1, fmt: str = "WAV", silent: bool = False) -> bytes:
    n = int(seconds * sr)
    data = (
        np.zeros((n, channels), np.float32)
        if silent
        else 0.2 * np.random.default_rng(0).standard_normal((n, channels)).astype(np.float32)
    )
    buf = io.BytesIO()
    sf.write(buf, data, sr, format=fmt)
    return buf.getvalue()


def upload(url: str, data: bytes, ext: str = "wav", **params: str) -> requests.Response:
    return requests.post(f"{url}/api/upload_ref", params={"ext": ext, **params}, data=data)


def refused(r: requests.Response, code: str = "invalid_field", status: int = 422) -> str:
    assert r.status_code == status, (r.status_code, r.text)
    err = error_of(r)
    assert err["code"] == code, err
    return err["message"]


@pytest.mark.parametrize(
    ("data", "ext", "words"),
    [
        (b"", "wav", "empty"),
        (b"this is not audio at all" * 100, "wav", "not a readable audio file"),
        (b"\x89PNG\r\n\x1a\n" + b"\0" * 4000, "wav", "not a readable audio file"),
        (b"RIFF\x24\x00\x00\x00WAVEfmt ", "wav", "not a readable audio file"),
    ],
)
def test_non_audio_and_empty_refused(fast_server, data: bytes, ext: str, words: str) -> None:
    srv = fast_server()
    message = refused(upload(srv.url, data, ext))
    assert words in message
    assert "object at 0x" not in message and "<_io" not in message, message  # said for a person, not a repr


@pytest.mark.parametrize("fmt", ["WAV", "FLAC", "MP3"])
def test_truncated_uploads_refused(fast_server, fmt: str) -> None:
    srv = fast_server()
    whole = encode(3.0, sr=16000, fmt=fmt)  # noise: half the file is about half the audio
    message = refused(upload(srv.url, whole[: len(whole) // 2], fmt.lower()))
    # libsndfile fails differently per format (mpg123 even yields NaNs); each one is refused.
    assert any(w in message for w in ("truncated", "could not be decoded", "not a readable", "non-finite")), message
    assert "object at 0x" not in message, message
    assert upload(srv.url, whole, fmt.lower()).status_code == 200


def test_too_long_and_too_short_refused(fast_server) -> None:
    srv = fast_server()
    assert "the limit is 60 s" in refused(upload(srv.url, encode(61.0, sr=8000, silent=True)))
    assert "at least 0.5 s" in refused(upload(srv.url, encode(0.2)))


@pytest.mark.parametrize(("sr", "ok"), [(4000, False), (7999, False), (8000, True), (192000, True), (384000, False)])
def test_sample_rate_range(fast_server, sr: int, ok: bool) -> None:
    srv = fast_server()
    r = upload(srv.url, encode(1.0, sr=sr, silent=True))
    if ok:
        assert r.status_code == 200, r.text
    else:
        assert "sample rate" in refused(r)


def test_many_channels_refused(fast_server) -> None:
    srv = fast_server()
    assert upload(srv.url, encode(1.0, channels=8, silent=True)).status_code == 200
    assert "channels" in refused(upload(srv.url, encode(1.0, channels=16, silent=True)))


def test_tiny_flac_declaring_hours_refused_without_decoding(fast_server, monkeypatch) -> None:
    srv = fast_server()
    # Two hours of silence at 8 kHz compresses to a few hundred KB of FLAC.
    bomb = encode(7200.0, sr=8000, fmt="FLAC", silent=True)
    assert len(bomb) < 2_000_000
    # The server runs in this process: watch whether it opens the stream for decoding at all.
    opened: list[int] = []

    class watched_soundfile(sf.SoundFile):  # noqa: N801 - stands in for the class
        def read(self, frames: int = -1, *args: object, **kwargs: object) -> object:
            opened.append(frames)
            return super().read(frames, *args, **kwargs)

    monkeypatch.setattr(sf, "SoundFile", watched_soundfile)
    assert "the limit is 60 s" in refused(upload(srv.url, bomb, "flac"))
    assert opened == []  # refused from the header: not one of the 57.6 M samples was decoded
    monkeypatch.undo()
    # The same check lets a short file through to decoding, so the spy above can see it.
    monkeypatch.setattr(sf, "SoundFile", watched_soundfile)
    assert upload(srv.url, encode(1.0, sr=8000, fmt="FLAC", silent=False), "flac").status_code == 200
    assert opened, "a valid upload is decoded through soundfile.SoundFile.read"


def test_decoded_size_limit_frames_times_channels(fast_server) -> None:
    """Within the duration limit but past frames x channels: refused from the header as too_large."""
    srv = fast_server(limits=Limits(max_upload_samples=200_000))
    data = encode(10.0, sr=16000, channels=2, fmt="FLAC", silent=True)  # 320 000 samples
    assert "samples" in refused(upload(srv.url, data, "flac"), "too_large", 413)
    assert upload(srv.url, encode(5.0, sr=16000, channels=2, fmt="FLAC", silent=True), "flac").status_code == 200


def test_bad_ext_and_name_refused(fast_server) -> None:
    srv = fast_server()
    ok = sine_wav()
    assert "ext must be one of" in refused(upload(srv.url, ok, "exe"))
    assert "ext must be one of" in refused(upload(srv.url, ok, "../../wav"))
    r = upload(srv.url, ok, name="a\x00b")
    assert r.status_code == 422 and error_of(r)["field"] == "name"
    r = upload(srv.url, ok, name="n" * 65)
    assert r.status_code == 422 and error_of(r)["field"] == "name"


def test_voice_store_capacity(fast_server) -> None:
    srv = fast_server(limits=Limits(max_stored_voices=2))
    assert upload(srv.url, encode(1.0, sr=16000)).status_code == 200
    assert upload(srv.url, encode(1.0, sr=22050)).status_code == 200
    assert "full" in refused(upload(srv.url, encode(1.0, sr=24000)), "rate_limited", 429)
    # Re-uploading a stored voice is not a new voice: still accepted.
    assert upload(srv.url, encode(1.0, sr=16000)).status_code == 200


@pytest.mark.parametrize(
    "reference",
    [
        "../../etc/passwd",
        "ref_../../../etc/passwd",
        "/etc/passwd",
        "ref_" + "0" * 24,
        "..",
        "voices/../x",
        "ref_%2e%2e",
    ],
)
def test_references_cannot_address_files(fast_server, tmp_path: Path, reference: str) -> None:
    srv = fast_server()
    r = requests.post(f"{srv.url}/api/stream", json={"text": "hi", "reference": reference})
    assert r.status_code == 404 and error_of(r) == {
        "code": "not_found",
        "message": error_of(r)["message"],
        "field": "reference",
    }


@pytest.mark.parametrize(
    "path",
    [
        "/api/takes/..%2F..%2Fetc%2Fpasswd",
        "/api/takes/../../etc/passwd.wav",
        "/api/takes/%2e%2e%2fconfig.wav",
        "/static/../moss_rt/config.py",
        "/static/%2e%2e/%2e%2e/moss_rt/config.py",
        "/static/..%2f..%2fmoss_rt%2fconfig.py",
    ],
)
def test_paths_cannot_escape(fast_server, path: str) -> None:
    srv = fast_server()
    r = requests.get(srv.url + path)
    assert r.status_code in (403, 404), (path, r.status_code)
    assert "dataclass" not in r.text and "root:" not in r.text


def test_damaged_or_hostile_records_are_skipped(tmp_path: Path) -> None:
    """Records on disk are checked: only a consistent record naming a file inside the store is a voice."""
    store_dir = tmp_path / "store"
    store_dir.mkdir()
    good = sine_wav()
    secret = tmp_path / "secret.wav"
    secret.write_bytes(good)

    async def seed_and_load() -> VoiceStore:
        store = VoiceStore(store_dir, None, Limits())
        await store.load()
        voice = await store.add_upload(good, "wav")
        base = json.loads((store_dir / f"{voice.id}.json").read_text())
        hostile = {
            "ref_" + "1" * 24: {**base, "id": "ref_" + "1" * 24, "file": "../secret.wav"},
            "ref_" + "2" * 24: {**base, "id": "ref_" + "2" * 24, "file": str(secret)},
            "ref_" + "3" * 24: {**base, "id": "../../etc", "file": voice.path.name},
            "ref_" + "4" * 24: {**base, "id": "ref_" + "4" * 24, "file": "ref_" + "4" * 24 + ".wav"},  # missing file
        }
        for name, record in hostile.items():
            (store_dir / f"{name}.json").write_text(json.dumps(record))
        (store_dir / ("ref_" + "5" * 24 + ".json")).write_text('{"id": "ref_5')  # torn write
        # Right size check: same id, file of the wrong length.
        wrong = {**base, "id": "ref_" + "6" * 24, "file": "ref_" + "6" * 24 + ".wav", "bytes": len(good) + 1}
        (store_dir / ("ref_" + "6" * 24 + ".wav")).write_bytes(good)
        (store_dir / ("ref_" + "6" * 24 + ".json")).write_text(json.dumps(wrong))
        (store_dir / ".ref_x.wav.123.tmp").write_bytes(b"partial")
        (store_dir / ("ref_" + "7" * 24 + ".wav")).write_bytes(good)  # audio whose record never landed
        fresh = VoiceStore(store_dir, None, Limits())
        await fresh.load()
        return fresh

    fresh = asyncio.run(seed_and_load())
    uploaded = [v for v in fresh.list() if v.kind == "uploaded"]
    assert len(uploaded) == 1 and uploaded[0].path.parent == store_dir
    assert not list(store_dir.glob(".*.tmp"))
    assert not (store_dir / ("ref_" + "7" * 24 + ".wav")).exists()
