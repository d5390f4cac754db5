"""``/v1/audio/speech`` and ``/v1/models`` through the real ``openai`` SDK against a real tiny-model server.

The tiny model's audio is noise, so what is checked is what a client of OpenAI's API relies on: every
``response_format`` decodes back (FFmpeg through PyAV) to the take's length at the right rate and
channel count, streaming delivers bytes while the take still runs, SSE events carry the same audio,
errors come in OpenAI's shape and as the SDK's exception classes, and the API key is enforced.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator

import openai
import pytest
import requests

from moss_rt.formats import FORMATS
from moss_rt.protocol import FRAME_SAMPLES
from tests.ecosystem.audio_check import assert_length, decode, opus_input_rate
from tests.ecosystem.conftest import EXACT
from tests.helpers import RunningServer

FRAMES = 10
API_KEY = "sk-test-eco-key"


@pytest.fixture(scope="module")
def server(tiny_server_factory) -> RunningServer:  # type: ignore[no-untyped-def]
    return tiny_server_factory()


@pytest.fixture(scope="module")
def client(server: RunningServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused-without-a-server-key", max_retries=0) as c:
        yield c


def extra(frames: int = FRAMES, **more: object) -> dict[str, object]:
    """Our own parameters, as extra body fields: a greedy stop head makes the take exactly ``frames`` long."""
    return {"max_new_tokens": frames, "seed": 7, **EXACT, **more}


def expected_samples(frames: int, rate: int) -> int:
    return frames * FRAME_SAMPLES * rate // 48000


def test_models_list_and_retrieve(client: openai.OpenAI) -> None:
    models = client.models.list()
    # Ours, then OpenAI's model names, accepted as aliases of the default model (docs/openai.md).
    assert [m.id for m in models.data] == ["v2-best", "tts-1", "tts-1-hd", "gpt-4o-mini-tts"]
    assert models.data[0].owned_by == "moss_rt"
    assert client.models.retrieve("v2-best").id == "v2-best"
    assert client.models.retrieve("tts-1").model_extra == {"alias_of": "v2-best"}
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("tts-2")


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_response_format_decodes_to_the_take(client: openai.OpenAI, server: RunningServer, fmt: str) -> None:
    raw = client.audio.speech.with_raw_response.create(
        model="v2-best",
        voice="none",
        input="Well... I didn't expect you back so soon.",
        instructions="tired, amused",
        response_format=fmt,  # type: ignore[arg-type]
        extra_body=extra(),
    )
    data = raw.content
    take = server.state.takes.get(raw.headers["x-take-id"])
    assert take is not None and take.n_frames == FRAMES and take.reason == "max_frames"
    assert take.request.instruction == "tired, amused"
    # OpenAI's raw pcm is 24 kHz; every other format defaults to the codec's 48 kHz.
    rate = 24000 if fmt == "pcm" else 48000
    assert raw.headers["x-sample-rate"] == str(rate)
    decoded = decode(data, fmt, pcm_rate=rate)
    assert (decoded.sample_rate, decoded.channels) == (rate, 1)
    assert_length(decoded, fmt, expected_samples(FRAMES, rate))


@pytest.mark.parametrize(
    ("fmt", "rate"), [("pcm", 16000), ("pcm", 48000), ("wav", 24000), ("mp3", 16000), ("opus", 24000)]
)
def test_resampled_rates(client: openai.OpenAI, fmt: str, rate: int) -> None:
    data = client.audio.speech.create(
        model="v2-best", voice="none", input="Hello there.", response_format=fmt,  # type: ignore[arg-type]
        extra_body=extra(sample_rate=rate),
    ).content
    decoded = decode(data, fmt, pcm_rate=rate)
    if fmt == "opus":  # Opus decodes at 48 kHz; the encoded rate is in the Ogg Opus header
        assert opus_input_rate(data) == rate and decoded.sample_rate == 48000
        assert_length(decoded, fmt, expected_samples(FRAMES, 48000))
    else:
        assert decoded.sample_rate == rate
        assert_length(decoded, fmt, expected_samples(FRAMES, rate))


def test_stereo_take_in_flac(client: openai.OpenAI) -> None:
    data = client.audio.speech.create(
        model="v2-best", voice="none", input="Left and right.", response_format="flac", extra_body=extra(channels=2)
    ).content
    decoded = decode(data, "flac")
    assert (decoded.channels, decoded.sample_rate, decoded.samples) == (2, 48000, expected_samples(FRAMES, 48000))


@pytest.mark.parametrize("fmt", ["opus", "mp3", "pcm"])
def test_streaming_response_sends_bytes_before_the_take_ends(tiny_server_factory, fmt: str) -> None:  # type: ignore[no-untyped-def]
    # Paced to real time (at most 0.3 s ahead), a 40-frame take lasts at least 2.9 s: the first
    # chunk must reach the client while the server still reports the take as running.
    paced = tiny_server_factory(max_lead_sec=0.3)
    frames = 40
    with openai.OpenAI(base_url=paced.url + "/v1", api_key="x", max_retries=0) as c:
        with c.audio.speech.with_streaming_response.create(
            model="v2-best", voice="none", input="One, two, three, four.", response_format=fmt,  # type: ignore[arg-type]
            extra_body=extra(frames, chunk_frames=2),
        ) as response:
            take_id = response.headers["x-take-id"]
            chunks = response.iter_bytes()
            first = next(chunks)
            take = paced.state.takes.get(take_id)
            assert take is not None
            status_at_first_bytes = take.status
            data = first + b"".join(chunks)
    assert first and status_at_first_bytes == "running"
    assert take.status == "ended" and take.n_frames == frames
    decoded = decode(data, fmt, pcm_rate=24000)
    rate = 24000 if fmt == "pcm" else 48000
    assert_length(decoded, fmt, expected_samples(frames, rate))


@pytest.mark.parametrize("fmt", ["pcm", "mp3"])
def test_sse_stream_format(client: openai.OpenAI, fmt: str) -> None:
    events: list[dict[str, object]] = []
    with client.audio.speech.with_streaming_response.create(
        model="v2-best", voice="none", input="Events, please.", response_format=fmt,  # type: ignore[arg-type]
        stream_format="sse", extra_body=extra(chunk_frames=2),
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: ") :]))
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert len(deltas) >= 3 and events[-1]["type"] == "speech.audio.done"
    assert all(e["type"] == "speech.audio.delta" for e in events[:-1])
    assert events[-1]["usage"]["output_tokens"] == FRAMES  # type: ignore[index]
    audio = b"".join(base64.b64decode(str(e["audio"])) for e in deltas)
    rate = 24000 if fmt == "pcm" else 48000
    assert_length(decode(audio, fmt, pcm_rate=rate), fmt, expected_samples(FRAMES, rate))


@pytest.mark.parametrize("speed", [0.5, 2.0])
def test_speed_is_honoured(client: openai.OpenAI, speed: float) -> None:
    data = client.audio.speech.create(
        model="v2-best", voice="none", input="Faster or slower.", response_format="pcm", speed=speed,
        extra_body=extra(),
    ).content
    expected = expected_samples(FRAMES, 24000) / speed
    assert abs(len(data) // 2 - expected) <= 0.03 * expected + 480


def test_uploaded_voice_by_ref_id(client: openai.OpenAI, server: RunningServer) -> None:
    from tests.conftest import sine_wav

    ref_id = requests.post(server.url + "/api/upload_ref?ext=wav", data=sine_wav(2.0), timeout=60).json()["ref_id"]
    for voice in (ref_id, {"id": ref_id}):
        raw = client.audio.speech.with_raw_response.create(
            model="v2-best", voice=voice, input="In your voice.", response_format="wav", extra_body=extra(4)  # type: ignore[arg-type]
        )
        take = server.state.takes.get(raw.headers["x-take-id"])
        assert take is not None and take.request.reference == ref_id


def openai_error(exc: openai.APIStatusError) -> dict[str, object]:
    body = exc.body
    assert isinstance(body, dict), body
    assert set(body) >= {"message", "type", "param", "code"}, body  # the SDK unwraps {"error": ...}
    return body


def test_unknown_voice_is_a_400_listing_the_valid_ones(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.audio.speech.create(model="v2-best", voice="bogus", input="Hi")
    body = openai_error(exc.value)
    assert body["param"] == "voice" and body["type"] == "invalid_request_error" and body["code"] == "invalid_field"
    message = str(body["message"])
    assert "'bogus'" in message and "none" in message and "alloy" in message  # OpenAI's names are accepted


@pytest.mark.parametrize(
    ("changes", "param"),
    [
        ({"speed": 4.5}, "speed"),
        ({"speed": 0.1}, "speed"),
        ({"response_format": "ogg"}, "response_format"),
        ({"response_format": ""}, "response_format"),
        ({"stream_format": "chunks"}, "stream_format"),
        ({"input": ""}, "input"),
        ({"input": "x" * 6000}, "input"),
        ({"extra_body": {"audio_temperature": -1}}, "audio_temperature"),
        ({"extra_body": {"sample_rate": 44100}}, "sample_rate"),
    ],
)
def test_bad_parameters_are_400s_naming_the_parameter(
    client: openai.OpenAI, changes: dict[str, object], param: str
) -> None:
    kwargs: dict[str, object] = {"model": "v2-best", "voice": "none", "input": "Hi", **changes}
    with pytest.raises(openai.BadRequestError) as exc:
        client.audio.speech.create(**kwargs)  # type: ignore[arg-type]
    assert openai_error(exc.value)["param"] == param


def test_unknown_model_is_a_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as exc:
        client.audio.speech.create(model="tts-2", voice="none", input="Hi")
    assert openai_error(exc.value)["param"] == "model"


def test_malformed_json_is_an_openai_error(server: RunningServer) -> None:
    resp = requests.post(server.url + "/v1/audio/speech", data=b"{not json", timeout=30)
    assert resp.status_code == 400
    assert resp.json()["error"]["code"] == "bad_json" and resp.json()["error"]["type"] == "invalid_request_error"


def test_bearer_api_key(tiny_server_factory) -> None:  # type: ignore[no-untyped-def]
    secured = tiny_server_factory(api_key=API_KEY)
    with openai.OpenAI(base_url=secured.url + "/v1", api_key="sk-wrong", max_retries=0) as wrong:
        with pytest.raises(openai.AuthenticationError) as exc:
            wrong.audio.speech.create(model="v2-best", voice="none", input="Hi")
        assert openai_error(exc.value)["code"] == "unauthorized"
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
    with openai.OpenAI(base_url=secured.url + "/v1", api_key=API_KEY, max_retries=0) as right:
        assert [m.id for m in right.models.list().data][0] == "v2-best"
        data = right.audio.speech.create(
            model="v2-best", voice="none", input="Hi", response_format="wav", extra_body=extra(3)
        ).content
        assert decode(data, "wav").samples == expected_samples(3, 48000)
