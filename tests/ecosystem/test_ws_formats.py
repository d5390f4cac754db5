"""A take's ``format`` on the frame transports: tag-2 frames that form one file, on the WebSocket and /api/stream."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import requests

from moss_rt.client import DirectingClient, EncodedAudio
from moss_rt.formats import FORMATS
from moss_rt.protocol import TAG_AUDIO, TAG_PCM, FrameReader
from tests.ecosystem.audio_check import assert_length, decode, opus_input_rate
from tests.ecosystem.conftest import EXACT
from tests.helpers import RunningServer, next_message
from tests.web.conftest import scripted

FRAME = 3840


def run(coro: Any, timeout: float = 120.0) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


@pytest.fixture
def server(make_server: Callable[..., RunningServer]) -> RunningServer:
    return make_server(scripted, engine="scripted", frame_ms=5.0, max_lead_sec=0.0)


def check_file(data: bytes, fmt: str, rate: int, channels: int, frames: int) -> None:
    decoded = decode(data, fmt, pcm_rate=rate, pcm_channels=channels)
    out_rate = 48000 if fmt == "opus" else rate
    assert (decoded.sample_rate, decoded.channels) == (out_rate, channels)
    if fmt == "opus":
        assert opus_input_rate(data) == rate
    assert_length(decoded, fmt, frames * FRAME * out_rate // 48000)


@pytest.mark.parametrize(
    ("fmt", "rate"), [(f, 48000) for f in FORMATS if f != "pcm"] + [("pcm", 16000), ("mp3", 24000)]
)
def test_websocket_start_with_a_format(server: RunningServer, fmt: str, rate: int) -> None:
    async def scenario() -> Any:
        async with DirectingClient.connect(server.ws_url) as client:
            return await client.speak("A line in another format.", format=fmt, sample_rate=rate, channels=2)

    take = run(scenario())
    assert take.start["format"] == fmt and take.start["sample_rate"] == rate
    assert take.end["reason"] == "done" and not take.pcm  # tag 2 instead of tag 1
    check_file(bytes(take.encoded), fmt, rate, 2, take.end["n_frames"])


def test_native_pcm_is_unchanged(server: RunningServer) -> None:
    async def scenario() -> Any:
        async with DirectingClient.connect(server.ws_url) as client:
            assert client.hello["formats"] == list(FORMATS) and client.hello["sample_rates"] == [48000, 24000, 16000]
            return await client.speak("Plain.", format="pcm", sample_rate=48000)

    take = run(scenario())
    assert "format" not in take.start and not take.encoded
    assert len(take.pcm) == take.end["n_frames"] * FRAME * 2


def test_first_encoded_bytes_arrive_while_the_take_runs(make_server: Callable[..., RunningServer]) -> None:
    paced = make_server(scripted, engine="scripted", frame_ms=5.0, max_lead_sec=0.3)

    async def scenario() -> None:
        async with DirectingClient.connect(paced.ws_url) as client:
            await client.start("x" * 60, format="opus", chunk_frames=2)  # 54 frames: over 4 s when paced
            started = await next_message(client, "start")
            while not isinstance(item := await client.receive(), EncodedAudio):
                pass
            record = paced.state.takes.get(started["take"])
            assert item.data and record is not None and record.status == "running"
            await client.cancel()
            await next_message(client, "end")

    run(scenario())


def test_retake_and_replay_keep_the_format(server: RunningServer) -> None:
    async def scenario() -> None:
        async with DirectingClient.connect(server.ws_url) as client:
            first = await client.speak("Retake me from the middle, please.", format="wav", sample_rate=24000)
            n = first.end["n_frames"]
            await client.seek(first.take_id, n // 2)
            await next_message(client, "seek")
            retake = await client.collect()
            # The retake's file starts where it branched (the client already holds what came before).
            assert retake.start["format"] == "wav"
            check_file(bytes(retake.encoded), "wav", 24000, 1, retake.end["n_frames"] - n // 2)
            await client.seek(first.take_id, 3, mode="replay")
            await next_message(client, "seek")
            replay = await client.collect()
            check_file(bytes(replay.encoded), "wav", 24000, 1, n - 3)

    run(scenario())


def test_legacy_stream_with_a_format(server: RunningServer) -> None:
    r = requests.post(server.url + "/api/stream", json={"text": "Legacy, but MP3.", "format": "mp3"}, timeout=60)
    assert r.status_code == 200
    reader = FrameReader()
    frames = reader.feed(r.content)
    tags = {f.tag for f in frames}
    assert TAG_PCM not in tags and TAG_AUDIO in tags
    end = frames[-1].json()
    check_file(b"".join(f.payload for f in frames if f.tag == TAG_AUDIO), "mp3", 48000, 1, end["n_frames"])


def test_tiny_model_take_in_opus(tiny_server_factory) -> None:  # type: ignore[no-untyped-def]
    tiny = tiny_server_factory()

    async def scenario() -> Any:
        async with DirectingClient.connect(tiny.ws_url) as client:
            return await client.speak("Opus from the model.", format="opus", max_new_tokens=15, seed=2, **EXACT)

    take = run(scenario(), timeout=300)
    assert take.end["n_frames"] == 15
    check_file(bytes(take.encoded), "opus", 48000, 1, 15)
