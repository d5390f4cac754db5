"""The real engine (tiny model, CPU fp32) through a real server: independence, cancel, seek, disconnect."""

from __future__ import annotations

import asyncio

import numpy as np
import requests

from moss_rt.client import DirectingClient
from moss_rt.protocol import FRAME_SAMPLES
from tests.engine.helpers import LONG, metrics, take_codes
from tests.helpers import next_message, run, wait_until


def test_take_is_identical_alone_or_next_to_seven_others(moss_server) -> None:
    srv = moss_server()

    async def one(text: str, seed: int) -> tuple[str, dict[str, object], int]:
        async with DirectingClient.connect(srv.ws_url) as client:
            take = await client.speak(text, seed=seed, max_new_tokens=24, chunk_frames=3, **LONG)
            return str(take.take_id), take.end, len(take.pcm)

    async def scenario() -> None:
        alone_id, alone_end, _ = await one("The night is long.", 1234)
        crowd = await asyncio.gather(
            one("The night is long.", 1234),
            *(one(f"Someone else speaking, line {i}.", 50 + i) for i in range(7)),
        )
        crowd_id, crowd_end, crowd_pcm = crowd[0]
        assert alone_end["reason"] == crowd_end["reason"] == "max_frames"
        assert alone_end["n_frames"] == crowd_end["n_frames"] == 24
        assert crowd_pcm == 24 * FRAME_SAMPLES * 2  # mono int16, whole frames
        np.testing.assert_array_equal(take_codes(srv, alone_id), take_codes(srv, crowd_id))
        others = [take_codes(srv, tid) for tid, _, _ in crowd[1:]]
        assert all(not np.array_equal(o[:5], take_codes(srv, alone_id)[:5]) for o in others)
        for _, end, _ in crowd[1:]:
            assert end["reason"] in ("done", "max_frames")

    run(scenario())


def test_cancel_ends_take_and_frees_slot(moss_server) -> None:
    srv = moss_server(max_lead_sec=0.4)  # paced: lead of 5 frames, so the take is still running

    async def scenario() -> None:
        async with DirectingClient.connect(srv.ws_url) as client:
            await client.start("Keep talking for a while.", seed=3, max_new_tokens=400, chunk_frames=1, **LONG)
            received = 0
            while received < 5:
                item = await client.receive()
                if isinstance(item, bytes):
                    received += len(item) // (2 * FRAME_SAMPLES)
            await client.cancel()
            after = 0
            while True:
                item = await client.receive()
                if isinstance(item, bytes):
                    after += len(item) // (2 * FRAME_SAMPLES)
                elif item.type == "end":
                    break
            assert item["reason"] == "cancelled"
            # What was generated before the cancel reached the engine (at most the lead) still lands.
            assert after <= 5 + 2, after
            assert item["n_frames"] == received + after < 400
            assert len(take_codes(srv, item["take"])) == item["n_frames"]
        await wait_until(lambda: srv.engine.active_count == 0)
        m = await metrics(srv)
        assert m["moss_rt_cancels_total"] >= 1
        assert m['moss_rt_takes_total{reason="cancelled"}'] >= 1

    run(scenario())


def test_disconnect_frees_the_slot(moss_server) -> None:
    srv = moss_server(max_lead_sec=0.4)

    async def scenario() -> None:
        async with DirectingClient.connect(srv.ws_url) as client:
            await client.start("Talk until I leave.", max_new_tokens=1000, **LONG)
            await next_message(client, "start")
            assert srv.engine.active_count == 1
        await wait_until(lambda: srv.engine.active_count == 0, 3.0)
        frames = (await metrics(srv))["moss_rt_frames_total"]
        await asyncio.sleep(0.3)
        assert (await metrics(srv))["moss_rt_frames_total"] == frames  # nothing generates any more

    run(scenario())


def _wav_frames(url: str, take_id: str) -> bytes:
    resp = requests.get(f"{url}/api/takes/{take_id}.wav", timeout=30)
    assert resp.status_code == 200
    return resp.content[44:]


def test_retake_keeps_prefix_bit_identical(moss_server) -> None:
    srv = moss_server()
    n = 10

    async def scenario() -> None:
        async with DirectingClient.connect(srv.ws_url) as client:
            first = await client.speak(
                "A line to direct.", seed=7, max_new_tokens=30, chunk_frames=4, channels=2, **LONG
            )
            assert first.end["n_frames"] == 30
            a_codes = take_codes(srv, first.take_id)

            # Same direction, new seed: the retake shares the parent's cache blocks up to prompt + n frames.
            await client.seek(first.take_id, n, seed=99)
            ack = await next_message(client, "seek")
            assert (ack["frame"], ack["sample"], ack["from_take"]) == (n, n * FRAME_SAMPLES, first.take_id)
            second = await client.collect()
            assert second.take_id == ack["take"] and second.start["first_frame"] == n
            assert second.end["n_frames"] == n + 30 and second.end["new_frames"] == 30
            # Frames before n are never re-sent; the stream starts at the acknowledged sample.
            assert len(second.pcm) == 30 * FRAME_SAMPLES * 4
            b_codes = take_codes(srv, second.take_id)
            np.testing.assert_array_equal(b_codes[:n], a_codes[:n])
            assert not np.array_equal(b_codes[n : n + 5], a_codes[n : n + 5])
            a_wav, b_wav = _wav_frames(srv.url, first.take_id), _wav_frames(srv.url, second.take_id)
            prefix = n * FRAME_SAMPLES * 4
            assert a_wav[:prefix] == b_wav[:prefix]
            assert len(b_wav) == (n + 30) * FRAME_SAMPLES * 4

            # A retake with the parent's own seed from the truncated cache reproduces the parent exactly:
            # cache, repetition history and the sampler's frame counter all resume at frame n.
            await client.seek(first.take_id, n, seed=7)
            await next_message(client, "seek")
            third = await client.collect()
            c_codes = take_codes(srv, third.take_id)
            np.testing.assert_array_equal(c_codes[:30], a_codes)

            # New direction: the prompt changes, so prompt + kept frames are prefilled again.
            await client.seek(first.take_id, n, seed=5, instruction="whisper it")
            await next_message(client, "seek")
            fourth = await client.collect()
            d_codes = take_codes(srv, fourth.take_id)
            np.testing.assert_array_equal(d_codes[:n], a_codes[:n])
            assert fourth.end["n_frames"] == n + 30
            assert _wav_frames(srv.url, fourth.take_id)[:prefix] == a_wav[:prefix]
        m = await metrics(srv)
        assert m['moss_rt_seeks_total{path="share"}'] >= 1
        assert m['moss_rt_seeks_total{path="reprefill"}'] >= 1

    run(scenario())


def test_replay_and_download_send_exactly_what_was_heard(moss_server) -> None:
    srv = moss_server()

    async def scenario() -> None:
        async with DirectingClient.connect(srv.ws_url) as client:
            first = await client.speak("Replay me.", seed=11, max_new_tokens=16, chunk_frames=4, **LONG)
            await client.seek(first.take_id, 4, mode="replay")
            ack = await next_message(client, "seek")
            assert ack["take"] == first.take_id
            replay = await client.collect()
            assert bytes(replay.pcm) == bytes(first.pcm)[4 * FRAME_SAMPLES * 2 :]
            assert _wav_frames(srv.url, first.take_id) == bytes(first.pcm)

            # A retake's audio is the splice the client made: the parent's first n frames as heard,
            # then the new stream.
            n = 6
            await client.seek(first.take_id, n, seed=3)
            await next_message(client, "seek")
            second = await client.collect()
            heard = bytes(first.pcm)[: n * FRAME_SAMPLES * 2] + bytes(second.pcm)
            assert _wav_frames(srv.url, second.take_id) == heard
            await client.seek(second.take_id, 0, mode="replay")
            await next_message(client, "seek")
            assert bytes((await client.collect()).pcm) == heard
        # Both takes are held whole (ops can watch this stay under heard_audio_mb).
        m = await metrics(srv)
        assert m["moss_rt_heard_audio_bytes"] == len(first.pcm) + len(heard)

    run(scenario())


def test_without_held_audio_replays_are_rendered_from_the_codes(moss_server) -> None:
    srv = moss_server(heard_audio_mb=0)

    async def scenario() -> None:
        async with DirectingClient.connect(srv.ws_url) as client:
            first = await client.speak("Replay me.", seed=11, max_new_tokens=16, chunk_frames=4, **LONG)
            await client.seek(first.take_id, 4, mode="replay")
            await next_message(client, "seek")
            replay = await client.collect()
            assert len(replay.pcm) == 12 * FRAME_SAMPLES * 2
            # Decoded again in other chunk shapes: equal within a couple of LSB (rounding only).
            live = np.frombuffer(bytes(first.pcm), "<i2")[4 * FRAME_SAMPLES :].astype(np.int32)
            again = np.frombuffer(bytes(replay.pcm), "<i2").astype(np.int32)
            assert np.abs(live - again).max() <= 2

    run(scenario())
