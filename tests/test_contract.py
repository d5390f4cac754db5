"""The engine contract, as a client sees it: the same scenarios on the scripted engine and the real one
(tiny model). Whatever an engine does inside, both transports must look the same to clients."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import requests

from moss_rt.client import DirectingClient, TakeAudio
from moss_rt.protocol import FRAME_SAMPLES, FrameReader, ServerMessage
from tests.engine.conftest import moss_server, tiny_data_dir  # noqa: F401 - fixtures
from tests.helpers import RunningServer, next_message, run
from tests.web.conftest import scripted

FRAMES = 12
# Long enough that the scripted engine would speak more than FRAMES frames; the tiny model's stop
# head is greedy and biased to continue. So on both engines a take runs to max_new_tokens.
TEXT = "A line long enough to outlast the frame budget of these takes."
REQUEST: dict[str, Any] = {"max_new_tokens": FRAMES, "text_temperature": 0.0, "chunk_frames": 4}


@pytest.fixture(params=["scripted", "tiny"])
def server(request: pytest.FixtureRequest, make_server: Callable[..., RunningServer]) -> RunningServer:
    if request.param == "scripted":
        return make_server(scripted, engine="scripted", frame_ms=10.0, max_lead_sec=0.0)
    return request.getfixturevalue("moss_server")()


def frames_of(take: TakeAudio) -> int:
    bytes_per_frame = FRAME_SAMPLES * 2 * take.channels
    assert len(take.pcm) % bytes_per_frame == 0, "PCM comes in whole 80 ms frames"
    return len(take.pcm) // bytes_per_frame


def test_take_cancel_and_barge_in(server: RunningServer) -> None:
    async def scenario() -> None:
        async with DirectingClient.connect(server.ws_url) as client:
            assert (client.hello.sr, client.hello.frame_samples) == (48000, FRAME_SAMPLES)
            assert client.hello["sampling_defaults"]["audio_top_k"] == 25
            # A take runs to its frame budget.
            take = await client.speak(TEXT, seed=5, channels=2, take="line", **REQUEST)
            assert (take.start["seed"], take.start["channels"], take.start["first_frame"]) == (5, 2, 0)
            assert take.start["label"] == "line"
            assert (take.end["reason"], take.end["n_frames"], take.end["new_frames"]) == ("max_frames", 12, 12)
            assert take.end["duration_sec"] == 0.96 and frames_of(take) == FRAMES
            # A cancel ends a long take early: its end follows the frames it sent (none after it).
            await client.start(TEXT, **{**REQUEST, "max_new_tokens": 400})
            await next_message(client, "start")
            await client.cancel()
            cancelled = await client.collect()
            assert cancelled.end["reason"] == "cancelled" and cancelled.end["n_frames"] < 400
            # Barge-in: a start while a take runs ends that one ("replaced") before the new one begins.
            await client.start(TEXT, **{**REQUEST, "max_new_tokens": 400})
            first = await next_message(client, "start")
            await client.start(TEXT, **REQUEST)
            replaced = await client.collect()
            assert replaced.end["take"] == first["take"] and replaced.end["reason"] == "replaced"
            second = await client.collect()
            assert second.start["take"] != first["take"] and second.end["reason"] == "max_frames"
            assert frames_of(second) == FRAMES

    run(scenario())


def test_retake_replay_http_and_errors(server: RunningServer) -> None:
    async def scenario() -> None:
        async with DirectingClient.connect(server.ws_url) as client:
            source = await client.speak(TEXT, seed=3, channels=2, **REQUEST)
            take_id = source.take_id
            assert take_id is not None
            # A retake from frame 5 keeps frames 0..4 and generates the rest with the new seed.
            await client.seek(take_id, 5, seed=9)
            ack = await next_message(client, "seek")
            assert (ack["from_take"], ack["frame"], ack["sample"]) == (take_id, 5, 5 * FRAME_SAMPLES)
            retake = await client.collect()
            assert retake.start["take"] == ack["take"] != take_id
            assert (retake.start["first_frame"], retake.start["seed"]) == (5, 9)
            # max_new_tokens counts new frames: the retake has 5 kept + 12 new.
            assert (retake.end["n_frames"], retake.end["new_frames"], frames_of(retake)) == (17, 12, 12)
            # A replay re-sends the take's audio from a frame, bit for bit what was heard.
            await client.seek(take_id, 4, mode="replay")
            ack = await next_message(client, "seek")
            assert (ack["take"], ack["frame"]) == (take_id, 4)
            replay = await client.collect()
            assert replay.start["replay"] is True and replay.end["replay"] is True
            offset = 4 * FRAME_SAMPLES * 2 * 2
            assert replay.end["reason"] == "done" and bytes(replay.pcm) == bytes(source.pcm[offset:])
            # Errors leave the socket usable.
            await client.seek("t_nonexistent", 0)
            error = await next_message(client, "error")
            assert (error["code"], error["fatal"]) == ("not_found", False)
            assert isinstance(await client.ping(), ServerMessage)

    run(scenario())
    # The legacy HTTP stream: the same frames (start, whole-frame PCM, end) for the same request.
    body = requests.post(server.url + "/api/stream", data=json.dumps({"text": TEXT, **REQUEST}), timeout=60)
    assert body.status_code == 200 and body.headers["Content-Type"] == "application/octet-stream"
    reader = FrameReader()
    frames = list(reader.feed(body.content))
    reader.close()
    start, end = frames[0].json(), frames[-1].json()
    assert (start["type"], start["sr"], end["type"], end["reason"], end["n_frames"]) == (
        "start", 48000, "end", "max_frames", FRAMES
    )
    pcm = b"".join(f.payload for f in frames[1:-1])
    assert len(pcm) == FRAMES * FRAME_SAMPLES * 2 and all(f.tag == 1 for f in frames[1:-1])
