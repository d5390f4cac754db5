"""Issue 23, finding 13: FLAC that Python could not read.

``/v1/audio/speech`` with ``response_format: "flac"`` gave a stream whose STREAMINFO said 0 samples (length
unknown); ``soundfile.read()``, the most common way Python reads audio, then failed ("array is too big"). A
length larger than the samples present fails too, so it must be exact. Now every FLAC *file* the service
hands out states its true length: speech (held until the take ends, since its length is known only then),
take downloads (known before the first byte), ``moss-rt say -o x.flac``. Read back with soundfile, PyAV and,
where installed, ffprobe.
"""

from __future__ import annotations

import base64
import io
import json
import shutil
import subprocess
import wave
from collections.abc import Callable

import av
import numpy as np
import pytest
import requests
import soundfile as sf

from moss_rt.formats import AudioFormat
from moss_rt.formats.encoder import StreamEncoder, encode_all
from moss_rt.formats.flac_length import DeclaredLength, set_total_samples, total_samples
from moss_rt.protocol import FRAME_SAMPLES
from tests.helpers import RunningServer

FRAMES = 30


@pytest.fixture
def server(fast_server: Callable[..., RunningServer]) -> RunningServer:
    return fast_server(http_requests_per_sec=0.0)


def speech(server: RunningServer, **body: object) -> requests.Response:
    request = {"input": "Read me back.", "voice": "none", "response_format": "flac", "tokens": FRAMES,
               "max_new_tokens": FRAMES, "seed": 4, **body}
    r = requests.post(server.url + "/v1/audio/speech", json=request, timeout=60)
    assert r.status_code == 200, r.text
    return r


def heard_pcm(server: RunningServer, take_id: str) -> np.ndarray:
    """The take's streamed PCM as int16 [samples, channels] (its plain WAV download)."""
    r = requests.get(f"{server.url}/api/takes/{take_id}.wav", timeout=30)
    with wave.open(io.BytesIO(r.content)) as w:
        return np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").reshape(-1, w.getnchannels())


def read_everywhere(data: bytes, samples: int, rate: int, channels: int) -> np.ndarray:
    """Read ``data`` as a whole file with soundfile, PyAV and ffprobe; all must agree on its length."""
    audio, sr = sf.read(io.BytesIO(data), dtype="int16", always_2d=True)  # failed: "array is too big"
    assert (audio.shape, sr) == ((samples, channels), rate)
    assert sf.info(io.BytesIO(data)).frames == samples
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        assert stream.duration == samples  # the header's length (time base 1/rate)
        assert sum(frame.samples for frame in container.decode(stream)) == samples
    ffprobe = shutil.which("ffprobe")
    if ffprobe is not None:
        probe = subprocess.run(
            [ffprobe, "-v", "error", "-show_entries", "stream=duration_ts", "-of", "json", "-"],
            input=data, capture_output=True, check=True, timeout=30,
        )
        assert json.loads(probe.stdout)["streams"][0]["duration_ts"] == samples
    return audio


@pytest.mark.parametrize(("rate", "channels"), [(48000, 1), (24000, 2), (16000, 1)])
def test_openai_speech_flac_is_a_file_soundfile_reads(server: RunningServer, rate: int, channels: int) -> None:
    r = speech(server, sample_rate=rate, channels=channels)
    audio = read_everywhere(r.content, FRAMES * FRAME_SAMPLES * rate // 48000, rate, channels)
    if rate == 48000:  # lossless at the codec's rate: the very samples that were streamed
        assert np.array_equal(audio, heard_pcm(server, r.headers["X-Take-Id"]))


def test_openai_speech_flac_with_speed_and_as_sse(server: RunningServer) -> None:
    r = speech(server, speed=1.5)  # atempo: a length known only once encoded
    samples = sf.info(io.BytesIO(r.content)).frames
    assert abs(samples - FRAMES * FRAME_SAMPLES / 1.5) < 0.02 * FRAMES * FRAME_SAMPLES
    read_everywhere(r.content, samples, 48000, 1)

    r = speech(server, stream_format="sse")
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    data = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    assert events[-1]["type"] == "speech.audio.done"
    read_everywhere(data, FRAMES * FRAME_SAMPLES, 48000, 1)


@pytest.mark.parametrize("rate", [48000, 16000])
def test_flac_downloads_state_their_length(server: RunningServer, rate: int) -> None:
    take = speech(server, response_format="pcm", channels=2).headers["X-Take-Id"]
    r = requests.get(f"{server.url}/api/takes/{take}.wav", params={"format": "flac", "sample_rate": rate}, timeout=30)
    assert r.status_code == 200
    audio = read_everywhere(r.content, FRAMES * FRAME_SAMPLES * rate // 48000, rate, 2)
    if rate == 48000:
        assert np.array_equal(audio, heard_pcm(server, take))


def test_whole_clips_and_the_header_field() -> None:
    pcm = (np.sin(np.arange(7 * FRAME_SAMPLES) / 9.0) * 8000).astype("<i2").tobytes()
    clip = encode_all(pcm, AudioFormat("flac", 24000), 1)  # moss-rt say -o x.flac
    read_everywhere(clip, 7 * FRAME_SAMPLES // 2, 24000, 1)

    # A stream's header, as it leaves the encoder: "unknown"; the field is 36 bits, the rest is untouched.
    streamed = StreamEncoder(AudioFormat("flac"), 2)
    data = streamed.encode(pcm * 2) + streamed.finish()
    assert total_samples(data) == 0
    patched = set_total_samples(data, 2**36 - 1)
    assert total_samples(patched) == 2**36 - 1 and patched[:18] == data[:18] and patched[26:] == data[26:]
    with pytest.raises(ValueError):
        set_total_samples(b"RIFF" + bytes(60), 5)

    # Declared up front and fed through in small pieces, as the stream is produced.
    declared = DeclaredLength(123)
    out = b"".join(declared.feed(data[i : i + 5]) for i in range(0, len(data), 5)) + declared.flush()
    assert out == set_total_samples(data, 123)


def test_a_held_file_spills_to_disk_and_reads_back_with_its_new_head() -> None:
    from moss_rt.formats.held_file import HeldFile

    held = HeldFile(memory_bytes=100)
    parts = [bytes([i]) * 37 for i in range(10)]
    for part in parts:
        held.write(part)
    assert held._file._rolled  # past its memory budget: a temporary file
    held.rewrite_head(4, lambda head: head.upper() if head.isalpha() else b"HEAD")
    out = b""
    while piece := held.read(len(out), 50):
        out += piece
    held.close()
    assert out == b"HEAD" + b"".join(parts)[4:] and held.size == 370
