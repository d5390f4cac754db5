"""The voice store survives SIGKILL mid-upload: acknowledged voices stay, damaged ones never appear."""

from __future__ import annotations

import hashlib
import io
import signal
import threading
import time
from pathlib import Path

import numpy as np
import requests
import soundfile as sf

from tests.helpers import parse_frames

ROUNDS = 3
UPLOADERS = 4


def distinct_wav(i: int) -> bytes:
    """~1.9 MB of stereo 48 kHz audio unique to ``i`` (big enough that kills land mid-write)."""
    rng = np.random.default_rng(i)
    data = (0.1 * rng.standard_normal((48000 * 10, 2))).astype(np.float32)
    buf = io.BytesIO()
    sf.write(buf, data, 48000, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def upload_loop(url: str, first: int, acked: dict[str, bytes], lock: threading.Lock, stop: threading.Event) -> None:
    i = first
    while not stop.is_set():
        data = distinct_wav(i)
        i += UPLOADERS
        try:
            r = requests.post(f"{url}/api/upload_ref?ext=wav", data=data, timeout=10)
        except requests.RequestException:
            return  # the server died under us: this upload was never acknowledged
        if r.status_code == 200:
            with lock:
                acked[r.json()["ref_id"]] = data


def test_sigkill_during_uploads_loses_no_acknowledged_voice(server_process, tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    acked: dict[str, bytes] = {}
    lock = threading.Lock()
    for round_no in range(ROUNDS):
        proc = server_process(data_dir=data_dir)
        stop = threading.Event()
        threads = [
            threading.Thread(target=upload_loop, args=(proc.url, 1000 * round_no + k, acked, lock, stop))
            for k in range(UPLOADERS)
        ]
        before = len(acked)
        for t in threads:
            t.start()
        # Kill once this round has had some uploads acknowledged, while others are mid-flight.
        deadline = time.monotonic() + 20
        while len(acked) < before + 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05 * round_no)
        proc.signal(signal.SIGKILL)
        proc.wait(10)
        stop.set()
        for t in threads:
            t.join(15)
        assert len(acked) > before, "no upload was acknowledged before the kill"

    # Restart on the same data: every acknowledged voice is listed, intact and usable.
    proc = server_process(data_dir=data_dir)
    listed = {v["id"]: v for v in requests.get(f"{proc.url}/api/voices").json()["voices"] if v["kind"] == "uploaded"}
    missing = set(acked) - set(listed)
    assert not missing, f"acknowledged but lost: {missing}"
    store = data_dir / "voices"
    for voice_id in listed:
        audio = next(p for p in store.glob(f"{voice_id}.*") if p.suffix != ".json")
        # Ids are content hashes, so an intact file hashes back to its own id.
        assert "ref_" + hashlib.sha256(audio.read_bytes()).hexdigest()[:24] == voice_id, f"damaged: {voice_id}"
        if voice_id in acked:
            assert audio.read_bytes() == acked[voice_id]
    assert not list(store.glob(".*.tmp")), "temporaries of interrupted writes were not cleaned up"
    # Usable: a take with each acknowledged voice as reference streams to its end.
    for voice_id in list(acked)[:6]:
        r = requests.post(f"{proc.url}/api/stream", json={"text": "hi", "tokens": 2, "reference": voice_id})
        assert r.status_code == 200
        assert parse_frames(r.content)[-1][1]["reason"] == "done"
    # And uploads keep working after the crashes.
    r = requests.post(f"{proc.url}/api/upload_ref?ext=wav", data=distinct_wav(999_999))
    assert r.status_code == 200
