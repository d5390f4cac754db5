"""The real engine (tiny model and codec, bf16 on CUDA with model and codec CUDA graphs) through a real server.

The ``cpu`` variants run the same bodies against the CPU engine (fp32), like tests/engine does.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
import requests

from moss_rt.client import DirectingClient
from moss_rt.protocol import FRAME_SAMPLES, SAMPLE_RATE
from tests.engine.helpers import LONG, metrics, take_codes
from tests.engine.test_engine_streams import _wav_frames
from tests.gpu.conftest import DEVICES
from tests.helpers import next_message, run


def _settings(device: str) -> dict[str, Any]:
    # Small so that warm-up (a model graph per batch bucket x key bucket, codec graphs per batch x chunk) is quick;
    # dtype stays "auto": bf16 on CUDA, as served.
    return {"device": device, "max_slots": 8, "max_queue": 8, "max_seq_len": 256, "max_lead_sec": 0.0}


def _summary(url: str, take_id: str) -> dict[str, Any]:
    resp = requests.get(f"{url}/api/takes/{take_id}", timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _check_engine_info(url: str, device: str) -> None:
    info = requests.get(url + "/api/info", timeout=30).json()
    assert info["ready"] is True and info["device"].startswith(device), info
    details = info["details"]
    assert details["model"] == "tiny" and details["codec"] == "tiny"
    if device == "cuda":
        assert details["dtype"] == "bfloat16"
        assert details["cuda_graphs"] == "true" and details["codec_cuda_graphs"] == "true", details


@pytest.mark.parametrize("device", DEVICES)
def test_websocket_take_completes_with_audio_of_the_right_length(device, moss_server) -> None:
    srv = moss_server(**_settings(device))
    _check_engine_info(srv.url, device)
    frames = 20

    async def scenario() -> None:
        async with DirectingClient.connect(srv.ws_url) as client:
            take = await client.speak(
                "Hello from the device.", seed=3, max_new_tokens=frames, chunk_frames=4, channels=2, **LONG
            )
        assert take.start["sr"] == SAMPLE_RATE and take.start["gpu_first_ms"] > 0
        assert take.end["reason"] == "max_frames" and take.end["n_frames"] == frames
        assert len(take.pcm) == frames * FRAME_SAMPLES * 2 * 2  # stereo int16, whole frames
        pcm = np.frombuffer(bytes(take.pcm), "<i2")
        assert np.count_nonzero(pcm) > len(pcm) // 2  # the random codec's noise, not silence
        assert take_codes(srv, take.take_id).shape == (frames, 12)
        summary = _summary(srv.url, take.take_id)
        assert (summary["status"], summary["reason"], summary["n_frames"]) == ("ended", "max_frames", frames)
        assert len(_wav_frames(srv.url, take.take_id)) == frames * FRAME_SAMPLES * 2 * 2

        m = await metrics(srv)
        assert m["moss_rt_frames_total"] >= frames
        # sized at warm-up on CUDA (timed passes), within [64, prefill_max_rows]; prefill_max_rows on the CPU
        assert 64 <= m["moss_rt_prefill_stream_rows"] <= 8192
        assert m["moss_rt_step_seconds_count"] >= frames
        assert m["moss_rt_codec_seconds_count"] >= 1
        assert m["moss_rt_gpu_first_seconds_count"] >= 1
        assert m['moss_rt_takes_total{reason="max_frames"}'] >= 1
        assert m.get('moss_rt_takes_total{reason="error"}', 0.0) == 0

    run(scenario())


@pytest.mark.parametrize("device", DEVICES)
def test_retake_keeps_the_first_frames_codes_and_pcm_bit_identical(device, moss_server) -> None:
    srv = moss_server(**_settings(device))
    n = 10
    prefix = n * FRAME_SAMPLES * 2 * 2  # bytes of n stereo int16 frames

    async def retake(client: DirectingClient, parent: str, **overrides: Any) -> Any:
        await client.seek(parent, n, **overrides)
        ack = await next_message(client, "seek")
        assert (ack["frame"], ack["sample"], ack["from_take"]) == (n, n * FRAME_SAMPLES, parent)
        take = await client.collect()
        assert take.take_id == ack["take"] and take.start["first_frame"] == n
        assert take.end["reason"] == "max_frames"
        assert (take.end["n_frames"], take.end["new_frames"]) == (n + 30, 30)
        assert len(take.pcm) == 30 * FRAME_SAMPLES * 2 * 2  # frames before n are not re-sent
        summary = _summary(srv.url, take.take_id)
        assert (summary["parent"], summary["branch_frame"], summary["n_frames"]) == (parent, n, n + 30)
        assert summary["status"] == "ended"
        return take

    async def scenario() -> None:
        async with DirectingClient.connect(srv.ws_url) as client:
            first = await client.speak(
                "A line to direct.", seed=7, max_new_tokens=30, chunk_frames=4, channels=2, **LONG
            )
            assert first.end["n_frames"] == 30
            a_codes = take_codes(srv, first.take_id)
            a_wav = _wav_frames(srv.url, first.take_id)
            assert len(a_wav) == 30 * FRAME_SAMPLES * 2 * 2

            # The parent's own seed from its cache cut back to frame n: cache, repetition history and the sampler's
            # counter resume exactly, so the parent's frames come out again (same graphs, same slot).
            same = await retake(client, first.take_id, seed=7)
            np.testing.assert_array_equal(take_codes(srv, same.take_id)[:30], a_codes)
            assert (await metrics(srv))['moss_rt_seeks_total{path="share"}'] >= 1

            # A new seed, and a new direction: frames before n are kept, codes and rendered PCM bit for bit.
            for overrides in ({"seed": 99}, {"seed": 5, "instruction": "whisper it"}):
                other = await retake(client, first.take_id, **overrides)
                codes = take_codes(srv, other.take_id)
                assert codes.shape == (n + 30, 12)
                np.testing.assert_array_equal(codes[:n], a_codes[:n])
                assert not np.array_equal(codes[n : n + 5], a_codes[n : n + 5])
                wav = _wav_frames(srv.url, other.take_id)
                assert len(wav) == (n + 30) * FRAME_SAMPLES * 2 * 2
                assert wav[:prefix] == a_wav[:prefix]
        m = await metrics(srv)
        assert m['moss_rt_seeks_total{path="reprefill"}'] >= 1

    run(scenario())


@pytest.mark.parametrize("device", DEVICES)
def test_a_take_of_a_kept_prompt_repeats_its_first_run_bit_for_bit(device, moss_server) -> None:
    """The same line and seed again: the second take shares every prompt block the first one computed (the
    partial last one too), prefills nothing, and its codes and PCM equal the first run's bit for bit. Another
    line of the same direction shares the opening rows only, and runs to its end."""
    srv = moss_server(**_settings(device))
    line = {"seed": 11, "max_new_tokens": 24, "chunk_frames": 4, "instruction": "Slow, close to the mic."}

    async def scenario() -> None:
        async with DirectingClient.connect(srv.ws_url) as client:
            first = await client.speak("Once more, with feeling.", **line, **LONG)
            before = await metrics(srv)
            again = await client.speak("Once more, with feeling.", **line, **LONG)
            after = await metrics(srv)
            other = await client.speak("Then the lights went out.", **line, **LONG)
            last = await metrics(srv)
        source = 'moss_rt_prompt_rows_total{{source="{}"}}'
        assert after[source.format("prefill")] == before[source.format("prefill")]
        assert after[source.format("cache")] > before.get(source.format("cache"), 0.0)
        assert last[source.format("prefill")] > after[source.format("prefill")]  # its own text
        assert last[source.format("cache")] > after[source.format("cache")]  # the shared opening
        np.testing.assert_array_equal(take_codes(srv, again.take_id), take_codes(srv, first.take_id))
        assert bytes(again.pcm) == bytes(first.pcm)
        assert other.end["n_frames"] == 24

    run(scenario())


@pytest.mark.parametrize("device", DEVICES)
def test_eight_concurrent_takes_complete(device, moss_server) -> None:
    srv = moss_server(**_settings(device))
    frames = 16

    async def one(i: int) -> tuple[str, dict[str, Any], int]:
        async with DirectingClient.connect(srv.ws_url) as client:
            take = await client.speak(
                f"Someone speaking, line {i}.", seed=50 + i, max_new_tokens=frames, chunk_frames=4, **LONG
            )
            return str(take.take_id), take.end, len(take.pcm)

    async def scenario() -> None:
        results = await asyncio.gather(*(one(i) for i in range(8)))
        for take_id, end, pcm in results:
            assert end["reason"] == "max_frames" and end["n_frames"] == frames, end
            assert pcm == frames * FRAME_SAMPLES * 2  # mono int16
            assert take_codes(srv, take_id).shape == (frames, 12)
        m = await metrics(srv)
        assert m["moss_rt_frames_total"] >= 8 * frames
        assert m.get('moss_rt_takes_total{reason="error"}', 0.0) == 0
        assert m["moss_rt_step_batch_size_sum"] >= 8 * frames  # every frame was made by a (batched) step

    run(scenario())


@pytest.mark.parametrize("device", DEVICES)
def test_the_engine_serves_its_steps_on_the_highest_priority_stream(device, moss_server, monkeypatch) -> None:
    """engine/gpu_streams: on CUDA the served model steps run on a stream of the device's highest priority, ahead of the
    codec's bulk calls (the CPU has no streams: the same take, nothing recorded)."""
    import torch

    from moss_rt.engine import gpu_streams
    from moss_rt.model import ModelRunner

    priorities: list[int | None] = []
    real = ModelRunner.step

    def step(self: ModelRunner, *args: Any, **kwargs: Any) -> Any:
        cuda = self.device.type == "cuda"
        priorities.append(torch.cuda.current_stream(self.device).priority if cuda else None)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "step", step)
    srv = moss_server(**_settings(device))
    frames = 6

    async def scenario() -> None:
        async with DirectingClient.connect(srv.ws_url) as client:
            take = await client.speak("Hello from the device.", seed=3, max_new_tokens=frames, **LONG)
        assert take.end["n_frames"] == frames

    before = len(priorities)  # the warm-up's steps ran before serving, on the loading thread's stream
    run(scenario())
    served = priorities[before:]
    assert len(served) >= frames
    if device == "cuda":
        highest = torch.cuda.Stream(priority=gpu_streams.HIGHEST).priority
        assert highest < 0 and set(served) == {highest}, served
    else:
        assert set(served) == {None}
