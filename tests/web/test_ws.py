"""The WebSocket directing channel against a real server on the scripted engine."""

from __future__ import annotations

import asyncio
import json
import time

import msgpack
import numpy as np
import pytest
import requests
import websockets

from moss_rt.client import DirectingClient, ServerError
from moss_rt.protocol import FRAME_SAMPLES, ServerMessage
from tests import helpers
from tests.helpers import RunningServer, next_message
from tests.web.helpers import expected_stereo, stereo_frames


def run(coro):  # noqa: ANN001, ANN201 - the scenarios of this module get a minute each
    return helpers.run(coro, timeout=60)


def test_hello_then_take(server: RunningServer) -> None:
    async def scenario() -> None:
        async with DirectingClient.connect(server.ws_url) as client:
            h = client.hello
            assert (h["protocol"], h["sr"], h["frame_samples"]) == (1, 48000, 3840)
            assert h["default_model"] == "v2-best" and h["demo"] is True
            assert h["limits"]["max_text_chars"] > 0
            take = await client.speak("abcdefghij", seed=5, channels=2, take="line-1", chunk_frames=4)
            assert take.start["take"].startswith("t_") and take.start["seed"] == 5 and take.channels == 2
            assert take.start["label"] == "line-1"
            assert h["sampling_defaults"]["audio_temperature"] == 1.7
            assert take.end["reason"] == "done" and take.end["take"] == take.start["take"]
            n = take.end["n_frames"]
            assert stereo_frames(bytes(take.pcm)) == expected_stereo(0, n, 5)
            for key in ("gpu_total_ms", "duration_sec", "ttfa_ms", "rtf"):
                assert key in take.end

    run(scenario())


def test_msgpack_control_messages(server: RunningServer) -> None:
    async def scenario() -> None:
        async with DirectingClient.connect(server.ws_url) as client:
            await client.ws.send(msgpack.packb({"type": "ping", "t": 1.5}))
            pong = await next_message(client, "pong")
            assert pong["t"] == 1.5 and pong["server_t"] > 0
            await client.ws.send(msgpack.packb({"type": "start", "text": "msgpack take", "seed": 1}))
            take = await client.collect()
            assert take.end["reason"] == "done"

    run(scenario())


def test_cancel_stops_within_a_frame(make_server) -> None:
    from tests.web.conftest import scripted

    srv = make_server(scripted, engine="scripted", frame_ms=40.0, max_lead_sec=0.0)

    async def scenario() -> None:
        async with DirectingClient.connect(srv.ws_url) as client:
            await client.start("x" * 200, chunk_frames=1, channels=2)
            received = 0
            while received < 5:
                item = await client.receive()
                if isinstance(item, bytes):
                    received += len(item) // (4 * FRAME_SAMPLES)
            await client.cancel()
            after = 0
            while True:
                item = await client.receive()
                if isinstance(item, bytes):
                    after += len(item) // (4 * FRAME_SAMPLES)
                elif item.type == "end":
                    break
            assert item["reason"] == "cancelled"
            # Frames already in flight may land, but generation stops at the next step.
            assert after <= 2, after
            assert item["n_frames"] <= received + 2

    run(scenario())


def test_seek_retake_keeps_prefix_and_splices_at_ack(server: RunningServer) -> None:
    async def scenario() -> None:
        async with DirectingClient.connect(server.ws_url) as client:
            first = await client.speak("a" * 30, seed=7, channels=2)
            original = stereo_frames(bytes(first.pcm))
            n = first.end["n_frames"]
            await client.seek(first.take_id, 10, seed=99, instruction="angrier")
            ack = await next_message(client, "seek")
            assert ack["from_take"] == first.take_id and ack["frame"] == 10 and ack["sample"] == 10 * FRAME_SAMPLES
            new_id = ack["take"]
            assert new_id != first.take_id
            second = await client.collect()
            assert second.take_id == new_id and second.start["first_frame"] == 10
            continuation = stereo_frames(bytes(second.pcm))
            # New audio starts exactly at the acknowledged frame, with the new seed.
            assert continuation == expected_stereo(10, len(continuation), 99)
            assert second.end["n_frames"] == 10 + len(continuation)
            # The spliced take's download: frames before 10 bit-identical to the original.
            wav = (await asyncio.to_thread(requests.get, f"{server.url}/api/takes/{new_id}.wav")).content[44:]
            spliced = stereo_frames(wav)
            assert spliced[:10] == original[:10]
            assert spliced[10:] == continuation
            assert n > 10

    run(scenario())


def test_seek_by_time_and_replay(server: RunningServer) -> None:
    async def scenario() -> None:
        async with DirectingClient.connect(server.ws_url) as client:
            first = await client.speak("b" * 30, seed=4, channels=2)
            await client.send({"type": "seek", "take": first.take_id, "time_sec": 0.4, "mode": "replay"})
            ack = await next_message(client, "seek")
            assert ack["take"] == first.take_id and ack["frame"] == 5 and ack["sample"] == 5 * FRAME_SAMPLES
            replay = await client.collect()
            assert bytes(replay.pcm) == bytes(first.pcm)[5 * FRAME_SAMPLES * 4 :]
            assert replay.end["replay"] is True

    run(scenario())


def test_new_start_replaces_running_take(make_server) -> None:
    from tests.web.conftest import scripted

    srv = make_server(scripted, engine="scripted", frame_ms=30.0, max_lead_sec=0.0)

    async def scenario() -> None:
        async with DirectingClient.connect(srv.ws_url) as client:
            await client.start("c" * 200, seed=1)
            first_start = await next_message(client, "start")
            await client.start("second take", seed=2)
            ends, starts = [], []
            while len(ends) < 2:
                item = await client.receive()
                if isinstance(item, ServerMessage):
                    (ends if item.type == "end" else starts if item.type == "start" else []).append(item)
            assert ends[0]["take"] == first_start["take"] and ends[0]["reason"] == "replaced"
            assert ends[1]["reason"] == "done" and starts[0]["seed"] == 2
            assert ends[1]["take"] == starts[0]["take"] != first_start["take"]

    run(scenario())


def test_disconnect_stops_generation(make_server) -> None:
    from tests.web.conftest import scripted

    srv = make_server(scripted, engine="scripted", frame_ms=20.0, max_lead_sec=0.0)

    async def scenario() -> None:
        async with DirectingClient.connect(srv.ws_url) as client:
            await client.start("d" * 400)
            await next_message(client, "start")
            assert srv.engine.active_count == 1
        deadline = time.monotonic() + 2.0
        # The engine exposes no event for this; a bounded poll is what a monitoring client would do.
        while srv.engine.active_count and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        assert srv.engine.active_count == 0

    run(scenario())


def test_concurrent_clients_are_independent(server: RunningServer) -> None:
    async def one(i: int) -> None:
        async with DirectingClient.connect(server.ws_url) as client:
            take = await client.speak("e" * (20 + i), seed=100 + i, channels=2)
            assert stereo_frames(bytes(take.pcm)) == expected_stereo(0, take.end["n_frames"], 100 + i)

    async def scenario() -> None:
        await asyncio.gather(*(one(i) for i in range(8)))

    run(scenario())


@pytest.mark.parametrize(
    ("message", "code", "field"),
    [
        ("{not json", "bad_json", None),
        ("[1]", "bad_message", None),
        (json.dumps({"text": "no type"}), "bad_message", "type"),
        (json.dumps({"type": "dance"}), "unknown_type", "type"),
        (json.dumps({"type": "start", "text": ""}), "invalid_field", "text"),
        (json.dumps({"type": "start", "text": "x", "seed": -1}), "invalid_field", "seed"),
        (json.dumps({"type": "start", "text": "x", "audio_top_k": 2.5}), "invalid_field", "audio_top_k"),
        (json.dumps({"type": "start", "text": "x", "channels": 3}), "invalid_field", "channels"),
        (json.dumps({"type": "seek", "take": "t_missing", "frame": 1}), "not_found", "take"),
        (json.dumps({"type": "seek", "take": "t_x"}), "invalid_field", "frame"),
        (json.dumps({"type": "ping", "t": "x" * 70000}), "too_large", None),
    ],
)
def test_bad_messages_get_error_and_socket_stays_usable(
    server: RunningServer, message: str, code: str, field: str | None
) -> None:
    async def scenario() -> None:
        async with DirectingClient.connect(server.ws_url) as client:
            await client.ws.send(message)
            err = await next_message(client, "error")
            assert err["code"] == code and err["fatal"] is False
            assert err.get("field") == field
            pong = await client.ping()
            assert pong.type == "pong"

    run(scenario())


def test_unknown_reference_is_a_take_error(server: RunningServer) -> None:
    async def scenario() -> None:
        async with DirectingClient.connect(server.ws_url) as client:
            with pytest.raises(ServerError) as info:
                await client.speak("hello", reference="nobody")
            assert info.value.code == "not_found"
            take = await client.speak("hello again")
            assert take.end["reason"] == "done"

    run(scenario())


def test_seek_past_end_is_refused(server: RunningServer) -> None:
    async def scenario() -> None:
        async with DirectingClient.connect(server.ws_url) as client:
            first = await client.speak("short")
            await client.seek(first.take_id, first.end["n_frames"] + 1)
            err = await next_message(client, "error")
            assert err["code"] == "invalid_field" and err["field"] == "frame"

    run(scenario())


def test_raw_websocket_frames_are_single_frames(server: RunningServer) -> None:
    """Every binary message is exactly one frame; nothing is sent as text."""

    async def scenario() -> None:
        async with websockets.connect(server.ws_url) as ws:
            await ws.send(json.dumps({"type": "start", "text": "frames", "chunk_frames": 2}))
            while True:
                data = await ws.recv()
                assert isinstance(data, bytes)
                tag, length = data[0], int.from_bytes(data[1:5], "big")
                assert len(data) == 5 + length
                if tag == 1:
                    assert length % (2 * FRAME_SAMPLES) == 0
                    assert np.frombuffer(data[5:], "<i2").size == length // 2
                elif json.loads(data[5:])["type"] == "end":
                    break

    run(scenario())


def test_service_gauges_follow_connections_takes_and_held_audio(server: RunningServer) -> None:
    def gauges() -> dict[str, float]:
        text = requests.get(f"{server.url}/metrics", timeout=10).text
        return {
            line.split()[0]: float(line.split()[1])
            for line in text.splitlines()
            if line.startswith(("moss_rt_heard_audio_bytes", "moss_rt_takes_stored", "moss_rt_websocket_connections"))
        }

    before = gauges()
    assert before["moss_rt_websocket_connections"] == 0

    async def scenario() -> None:
        async with DirectingClient.connect(server.ws_url) as client:
            take = await client.speak("count me", tokens=5)
            now = await asyncio.to_thread(gauges)
            assert now["moss_rt_websocket_connections"] == 1
            assert now["moss_rt_takes_stored"] == before["moss_rt_takes_stored"] + 1
            assert now["moss_rt_heard_audio_bytes"] == before["moss_rt_heard_audio_bytes"] + len(take.pcm)

    run(scenario())
