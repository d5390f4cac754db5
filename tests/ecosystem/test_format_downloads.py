"""Take downloads in every format (``GET /api/takes/{id}.wav?format=&sample_rate=``) from a real tiny-model server."""

from __future__ import annotations

import io
import wave

import numpy as np
import pytest
import requests

from moss_rt.formats import FORMATS
from moss_rt.protocol import FRAME_SAMPLES
from tests.ecosystem.audio_check import assert_length, decode, decode_samples, opus_input_rate
from tests.ecosystem.conftest import EXACT
from tests.helpers import RunningServer

FRAMES = 12


@pytest.fixture(scope="module")
def server(tiny_server_factory) -> RunningServer:  # type: ignore[no-untyped-def]
    return tiny_server_factory()


@pytest.fixture(scope="module")
def take_id(server: RunningServer) -> str:
    """A finished stereo take of exactly FRAMES frames."""
    r = requests.post(
        server.url + "/v1/audio/speech",
        json={"model": "v2-best", "voice": "none", "input": "Keep this one.", "response_format": "pcm",
              "max_new_tokens": FRAMES, "channels": 2, **EXACT},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.headers["X-Take-Id"]


def download(server: RunningServer, take_id: str, **query: object) -> requests.Response:
    return requests.get(f"{server.url}/api/takes/{take_id}.wav", params=query, timeout=60)


def test_plain_download_is_still_the_exact_wav(server: RunningServer, take_id: str) -> None:
    r = download(server, take_id)
    assert r.status_code == 200 and r.headers["Content-Type"] == "audio/wav"
    with wave.open(io.BytesIO(r.content)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getnframes()) == (48000, 2, FRAMES * FRAME_SAMPLES)


@pytest.mark.parametrize("rate", [48000, 24000, 16000])
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_and_rate(server: RunningServer, take_id: str, fmt: str, rate: int) -> None:
    r = download(server, take_id, format=fmt, sample_rate=rate)
    assert r.status_code == 200, r.text
    assert r.headers["Content-Disposition"].endswith(f'.{"opus" if fmt == "opus" else fmt}"')
    decoded = decode(r.content, fmt, pcm_rate=rate, pcm_channels=2)
    out_rate = 48000 if fmt == "opus" else rate
    assert (decoded.sample_rate, decoded.channels) == (out_rate, 2)
    if fmt == "opus":
        assert opus_input_rate(r.content) == rate
    assert_length(decoded, fmt, FRAMES * FRAME_SAMPLES * out_rate // 48000)


def test_lossless_download_has_the_streamed_samples(server: RunningServer, take_id: str) -> None:
    with wave.open(io.BytesIO(download(server, take_id).content)) as w:
        wav = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").reshape(-1, 2)
    flac = decode_samples(download(server, take_id, format="flac").content, "flac")
    assert np.array_equal(flac, wav)


@pytest.mark.parametrize(("query", "field"), [({"format": "ogg"}, "format"), ({"sample_rate": "44100"}, "sample_rate")])
def test_bad_format_is_a_422_naming_the_field(server: RunningServer, take_id: str, query: dict, field: str) -> None:
    r = download(server, take_id, **query)
    assert r.status_code == 422 and r.json()["error"]["field"] == field
