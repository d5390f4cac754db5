"""The real engine (tiny model) through a real server: pause/resume, admission, metrics, HTTP, voices."""

from __future__ import annotations

import asyncio
import socket
import time

import aiohttp
import requests

from moss_rt.client import DirectingClient, ServerError, http_stream
from moss_rt.protocol import FRAME_SAMPLES, SAMPLE_RATE
from tests.conftest import sine_wav
from tests.engine.helpers import LONG, metrics, take_codes
from tests.helpers import next_message, run, wait_until


def small_window_socket(url: str) -> socket.socket:
    """A TCP connection to the server whose receive window is tiny: a client that stops reading holds the server's
    sends back after a few kilobytes, not after the megabytes a loopback socket would otherwise buffer."""
    host, port = url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: it sets the window offered
    sock.connect((host, int(port)))
    return sock


def test_slow_client_pauses_its_slot_and_resumes(moss_server) -> None:
    # A client that does not read: the server's sends block once the socket buffers are full, the take's audio
    # waits unconsumed past the lead of 0.16 s (2 frames), and the slot pauses (stops stepping) however fast or
    # slow the engine runs (a client merely paced to real time pauses only an engine faster than real time). Once
    # the client reads again, the take resumes and delivers every frame, still paced to real time.
    # The server's send buffer fixed at 16 kB (the kernel doubles it): the first few kB go, then its sends block.
    srv = moss_server(max_lead_sec=0.16, send_buffer_bytes=16384)
    registry = srv.engine.metrics.registry
    frames, channels = 40, 2  # 40 stereo frames: 600 kB, three times what the buffers on the way hold

    def sample(name: str) -> float:
        return registry.get_sample_value(name) or 0.0

    async def scenario() -> None:
        # max_queue=1: the client library buffers one message, not 16, before it stops reading the socket.
        async with DirectingClient.connect(srv.ws_url, sock=small_window_socket(srv.ws_url), max_queue=1) as client:
            t0 = time.monotonic()
            await client.start("Take your time.", seed=2, max_new_tokens=frames, chunk_frames=4, channels=channels,
                               **LONG)
            # Not reading: the take pauses before it has made its frames (the wait ends either way, so a take that
            # never pauses fails here at once, not after a timeout).
            await wait_until(lambda: sample("moss_rt_pauses_total") >= 1
                             or sample("moss_rt_frames_total") >= frames, 60.0)
            assert sample("moss_rt_pauses_total") >= 1 and sample("moss_rt_paused_slots") == 1
            assert sample("moss_rt_frames_total") < frames
            pcm = 0
            while True:
                item = await client.receive()
                if isinstance(item, bytes):
                    pcm += len(item)
                elif item.type == "end":
                    end = item
                    break
            wall = time.monotonic() - t0
        assert end["reason"] == "max_frames" and end["n_frames"] == frames
        assert pcm == frames * FRAME_SAMPLES * 2 * channels
        # 3.2 s of audio, at most 0.16 s ahead of real time: the take cannot end much sooner.
        assert wall >= frames * FRAME_SAMPLES / SAMPLE_RATE - 0.16 - 0.3, wall
        m = await metrics(srv)
        assert m["moss_rt_pauses_total"] >= 1 and m["moss_rt_paused_slots"] == 0
        # While paused the slot did not step: far fewer steps than a free-running engine would make.
        assert m["moss_rt_step_seconds_count"] <= frames + 3 + 1

    run(scenario())


def test_admission_limit_answers_busy(moss_server) -> None:
    srv = moss_server(max_slots=1, max_queue=1, max_lead_sec=0.4)

    async def scenario() -> None:
        async with (
            DirectingClient.connect(srv.ws_url) as a,
            DirectingClient.connect(srv.ws_url) as b,
            DirectingClient.connect(srv.ws_url) as c,
        ):
            await a.start("first", max_new_tokens=200, **LONG)
            await next_message(a, "start")  # holds the only slot (paced, so it keeps running)
            await b.start("second", max_new_tokens=200, **LONG)
            for _ in range(100):  # b waits in the queue
                if srv.engine.queued_count == 1:
                    break
                await asyncio.sleep(0.01)
            assert srv.engine.queued_count == 1
            await c.start("third", max_new_tokens=10)
            err = await next_message(c, "error")
            assert err["code"] == "busy"
            async with aiohttp.ClientSession() as http, http.post(srv.url + "/api/stream", json={"text": "x"}) as resp:
                assert resp.status == 503
                assert int(resp.headers["Retry-After"]) >= 1
                assert (await resp.json())["error"]["code"] == "busy"
            # Capacity frees up again: cancel a, then b gets the slot and c can start.
            await a.cancel()
            await next_message(a, "end")
            await next_message(b, "start")
            await b.cancel()
            await next_message(b, "end")
            take = await c.speak("third again", max_new_tokens=6)
            assert take.end["reason"] in ("done", "max_frames")
        m = await metrics(srv)
        assert m["moss_rt_busy_rejections_total"] >= 2

    run(scenario())


def test_metrics_exposed(moss_server) -> None:
    srv = moss_server()

    async def scenario() -> None:
        async with DirectingClient.connect(srv.ws_url) as client:
            take = await client.speak("Count me.", max_new_tokens=12, **LONG)
        m = await metrics(srv)
        assert m["moss_rt_frames_total"] >= take.end["n_frames"] == 12
        assert m["moss_rt_gpu_first_seconds_count"] >= 1
        assert m["moss_rt_step_seconds_count"] >= 12
        # one interval between each two consecutive steps of the running take
        assert m["moss_rt_step_interval_seconds_count"] >= 11
        # on the CPU prefill passes are not sized to a budget (they run slot by slot): prefill_max_rows
        assert m["moss_rt_prefill_stream_rows"] == 8192
        assert m["moss_rt_codec_seconds_count"] >= 1
        assert m['moss_rt_takes_total{reason="max_frames"}'] >= 1
        for name in ("moss_rt_active_slots", "moss_rt_queued_takes", "moss_rt_frames_per_second",
                     "moss_rt_cancels_total", "moss_rt_pauses_total", "moss_rt_prefill_seconds_count",
                     "moss_rt_prefill_batch_size_count", "moss_rt_prefill_call_seconds_count"):
            assert name in m, name

    run(scenario())


def test_legacy_http_stream_and_download(moss_server) -> None:
    srv = moss_server()

    async def scenario() -> None:
        take = await http_stream(srv.url, text="Legacy client.", seed=9, max_new_tokens=10, **LONG)
        assert take.start["sr"] == 48000 and take.start["gpu_first_ms"] > 0
        assert take.end["n_frames"] == 10 and take.end["reason"] == "max_frames"
        assert len(take.pcm) == 10 * FRAME_SAMPLES * 2
        assert take.end["gpu_total_ms"] >= take.start["gpu_first_ms"]
        assert len(take_codes(srv, take.end["take"])) == 10
        # The end says where the first audio's time went: the prompt built at submit, then the engine's parts of it.
        parts = ("queue_ms", "prefill_ms", "to_first_frame_ms", "to_codec_ms", "codec_queue_ms", "decode_ms")
        assert all(take.end[k] >= 0 for k in ("prompt_ms", *parts)), take.end
        assert sum(take.end[k] for k in parts) <= take.start["gpu_first_ms"] + 1

    run(scenario())


def test_uploaded_voice_is_encoded_and_cloned(moss_server) -> None:
    srv = moss_server()
    resp = requests.post(f"{srv.url}/api/upload_ref?ext=wav", data=sine_wav(1.2), timeout=30)
    assert resp.status_code == 200, resp.text
    ref = resp.json()

    async def scenario() -> None:
        async with DirectingClient.connect(srv.ws_url) as client:
            plain = await client.speak("Same words.", seed=4, max_new_tokens=8, **LONG)
            cloned = await client.speak("Same words.", seed=4, max_new_tokens=8, reference=ref["ref_id"], **LONG)
        assert cloned.end["n_frames"] == 8
        # The reference enters the prompt, so the same seed gives other codes.
        assert (take_codes(srv, plain.take_id) != take_codes(srv, cloned.take_id)).any()

    run(scenario())


def test_prompt_longer_than_the_cache_is_refused_as_bad_input(moss_server) -> None:
    srv = moss_server(max_seq_len=200)
    # Legacy HTTP: refused before the stream starts, as a 422 naming the field.
    r = requests.post(f"{srv.url}/api/stream", json={"text": "x " * 200, "max_new_tokens": 5}, timeout=30)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_field" and error["field"] == "text"
    assert "holds 200" in error["message"]  # says how much the cache holds

    async def scenario() -> None:
        async with DirectingClient.connect(srv.ws_url) as client:
            try:
                await client.speak("x " * 200, max_new_tokens=5)
            except ServerError as err:
                assert err.code == "invalid_field" and err.message.get("field") == "text", err.message
            else:  # pragma: no cover - the prompt cannot fit 200 positions
                raise AssertionError("expected an error")
            take = await client.speak("ok", max_new_tokens=3, **LONG)
            assert take.end["n_frames"] >= 1, take.end
        assert srv.engine.active_count == 0 and srv.engine.queued_count == 0

    run(scenario())


def test_a_failing_step_ends_its_takes_and_the_engine_keeps_serving(moss_server) -> None:
    srv = moss_server()
    runner = srv.engine._runner
    real_step = runner.step
    calls = {"n": 0}

    def flaky(slots: list[int]):  # noqa: ANN202 - stands in for ModelRunner.step
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device fell over")
        return real_step(slots)

    runner.step = flaky

    async def scenario() -> None:
        async with DirectingClient.connect(srv.ws_url) as client:
            try:
                await client.speak("This one breaks.", max_new_tokens=10, **LONG)
            except ServerError as err:
                assert err.code == "internal"
                assert (await next_message(client, "end"))["reason"] == "error"
            else:  # pragma: no cover
                raise AssertionError("expected an error")
            take = await client.speak("This one works.", max_new_tokens=5, **LONG)
            assert take.end["reason"] == "max_frames" and take.end["n_frames"] == 5
        assert srv.engine.active_count == 0

    run(scenario())


def test_prefill_passes_while_streaming_follow_the_setting(moss_server) -> None:
    srv = moss_server(prefill_stream_rows=300)

    async def scenario() -> None:
        m = await metrics(srv)
        assert m["moss_rt_prefill_stream_rows"] == 300  # the gauge reports what the scheduler holds

    run(scenario())
