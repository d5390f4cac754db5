"""Retakes from shared codec state on the device (issue 22): exact, through the codec's CUDA graphs.

The engine's parts are driven round by round (tests/engine/harness.py) with the codec overlapped, as served. A take,
then retakes of it from frame n: its own seed again (the same frames come again: their PCM must be the parent's bit
for bit, the codec state being the parent's own blocks), a new seed and direction (its PCM must equal the whole-clip
decode of its codes), and the same retake with the parent's codec state given back (rebuilt from the codes in
batched, graphed calls: the same audio to float rounding). Frames before n are the parent's: codes and rendered PCM
bit for bit. fp32 on both devices (so "equal to float rounding" means at most one step of int16), and a bf16 check
of the bit-for-bit part, the dtype served on a GPU. The ``cpu`` variants run the same bodies.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from moss_rt.audio import to_int16_pcm
from moss_rt.engine.base import EndReason
from moss_rt.engine.jobs import RenderJob
from moss_rt.engine.moss import MossEngine
from moss_rt.protocol import FRAME_SAMPLES
from tests.engine.harness import Driven, drive, engine_settings, loaded_engine, spec
from tests.gpu.conftest import DEVICES, GPU

TEXT = "The rain had stopped an hour ago, and the street was quiet."


def _pcm(data: bytes) -> np.ndarray:
    return np.frombuffer(data, "<i2").astype(np.int32)


def _ok(driven: Driven) -> None:
    for take_id, ch in driven.channels.items():
        assert not ch.problems, (take_id, ch.problems)
        assert ch.end.reason is EndReason.MAX_FRAMES, (take_id, ch.end)


def _sample(engine: MossEngine, name: str, **labels: str) -> float:
    return engine.metrics.registry.get_sample_value(name, labels or None) or 0.0


def _whole(engine: MossEngine, codes: np.ndarray) -> np.ndarray:
    """Whole-clip decode of ``codes`` (the codec model, no streaming state) as mono int16 PCM."""
    codec: Any = engine._codec
    with torch.no_grad():
        audio = codec.decode(torch.from_numpy(np.ascontiguousarray(codes)).to(codec.device)[None])[0]
    return _pcm(to_int16_pcm(audio.float().cpu().numpy(), 1))


def _render(engine: MossEngine, codes: np.ndarray) -> bytes:
    """What a replay or download of these codes sends (a RenderJob on the codec worker, as the engine runs it)."""
    worker: Any = engine._codec_worker
    job = RenderJob(np.asarray(codes, dtype=np.int64), 1, engine._batcher)  # type: ignore[arg-type]
    assert job.begin()
    while not worker.call(job.advance):
        pass
    return job.future.result()  # type: ignore[return-value]


def _forget_codec_state(engine: MossEngine, take_id: str) -> None:
    sched: Any = engine._scheduler
    item = sched.retained.get(take_id)
    assert item is not None and item.codec is not None
    sched.decoder.drop(item.codec)
    item.codec = None


@pytest.mark.parametrize("device", DEVICES)
def test_retakes_from_shared_codec_blocks_are_exact(device, tiny_data_dir) -> None:
    length, n = 24, 20  # within what the tiny codec's ring keeps of the parent's end: shared
    settings = engine_settings(tiny_data_dir, overlap=True, device=device, dtype="float32")
    with loaded_engine(settings, all_graphs=True) as engine:
        if device == "cuda":
            assert engine._batcher is not None and engine._batcher.graphs
        first = drive(engine, [spec("a", 3, length, 1, text=TEXT)])
        _ok(first)
        a = first.channels["a"]
        parent_pcm = _pcm(a.pcm)

        # The parent's seed again: its frames come again, and so does their audio, bit for bit.
        same = drive(engine, [spec("a.1", 3, length - n, 1, text=TEXT, prefix_codes=a.codes[:n], parent_take="a")])
        _ok(same)
        assert _sample(engine, "moss_rt_codec_states_total", source="shared") == 1
        np.testing.assert_array_equal(same.channels["a.1"].codes, a.codes[n:])
        np.testing.assert_array_equal(_pcm(same.channels["a.1"].pcm), parent_pcm[n * FRAME_SAMPLES :])

        # A new seed and direction: streaming from the shared state == the whole-clip decode of its codes.
        other = drive(engine, [spec("a.2", 9, 16, 4, text=TEXT, instruction="Whisper it.", prefix_codes=a.codes[:n],
                                    parent_take="a")])
        _ok(other)
        b = other.channels["a.2"]
        assert _sample(engine, "moss_rt_codec_states_total", source="shared") == 2
        b_codes = np.concatenate([a.codes[:n], b.codes])
        assert not np.array_equal(b.codes[:4], a.codes[n : n + 4])
        assert np.abs(_pcm(b.pcm) - _whole(engine, b_codes)[n * FRAME_SAMPLES :]).max() <= 1
        # Frames before n: the parent's codes, and the rendered PCM of those frames bit for bit.
        assert _render(engine, b_codes)[: n * FRAME_SAMPLES * 2] == _render(engine, a.codes)[: n * FRAME_SAMPLES * 2]

        # The same retake with the parent's codec state given back: rebuilt in batched (graphed) calls.
        _forget_codec_state(engine, "a")
        calls = _sample(engine, "moss_rt_codec_rebuild_calls_total")
        rebuilt = drive(engine, [spec("a.3", 9, 16, 4, text=TEXT, instruction="Whisper it.",
                                      prefix_codes=a.codes[:n], parent_take="a")])
        _ok(rebuilt)
        c = rebuilt.channels["a.3"]
        assert _sample(engine, "moss_rt_codec_rebuild_calls_total") - calls == 3  # 8 + 8 + 4 frames
        np.testing.assert_array_equal(c.codes, b.codes)
        assert np.abs(_pcm(c.pcm) - _pcm(b.pcm)).max() <= 1


@pytest.mark.parametrize("device", DEVICES)
def test_a_burst_of_retakes_rebuilt_together_is_exact(device, tiny_data_dir) -> None:
    """Five retakes from frame 10 of takes that went on to 30 frames (past the ring: rebuilt), their codec states
    rebuilt together in batched calls (graphed on the device): each one's audio equals the whole-clip decode."""
    n, length = 10, 30
    settings = engine_settings(tiny_data_dir, overlap=True, device=device, dtype="float32")
    with loaded_engine(settings, all_graphs=True) as engine:
        parents = drive(engine, [spec(f"p{i}", i, length, 8, text=f"{TEXT} Line {i}.") for i in range(5)])
        _ok(parents)
        codes = {k: ch.codes for k, ch in parents.channels.items()}
        retakes = drive(engine, [
            spec(f"p{i}.r", 100 + i, 12, 8, text=f"{TEXT} Line {i}.", prefix_codes=codes[f"p{i}"][:n],
                 parent_take=f"p{i}")
            for i in range(5)
        ])
        _ok(retakes)
        assert _sample(engine, "moss_rt_codec_rebuild_calls_total") == 2  # every take's 8 frames, then 2
        assert _sample(engine, "moss_rt_codec_states_total", source="rebuilt") == 5
        for i in range(5):
            ch = retakes.channels[f"p{i}.r"]
            full = np.concatenate([codes[f"p{i}"][:n], ch.codes])
            assert np.abs(_pcm(ch.pcm) - _whole(engine, full)[n * FRAME_SAMPLES :]).max() <= 1, i


@pytest.mark.parametrize("device", [pytest.param("cuda", id="cuda", marks=GPU)])
def test_in_bf16_a_retake_from_shared_blocks_repeats_the_parent_bit_for_bit(device, tiny_data_dir) -> None:
    """As served on a GPU (bf16, graphs, the codec overlapped): the parent's seed again from frame n gives the
    parent's frames and PCM again, bit for bit."""
    length, n = 24, 19
    with loaded_engine(engine_settings(tiny_data_dir, overlap=True, device=device), all_graphs=True) as engine:
        assert engine._decoder is not None and engine._decoder.dtype == torch.bfloat16  # type: ignore[attr-defined]
        first = drive(engine, [spec("a", 5, length, 1, text=TEXT)])
        _ok(first)
        a = first.channels["a"]
        same = drive(engine, [spec("a.1", 5, length - n, 1, text=TEXT, prefix_codes=a.codes[:n], parent_take="a")])
        _ok(same)
        assert _sample(engine, "moss_rt_codec_states_total", source="shared") == 1
        np.testing.assert_array_equal(same.channels["a.1"].codes, a.codes[n:])
        np.testing.assert_array_equal(_pcm(same.channels["a.1"].pcm), _pcm(a.pcm)[n * FRAME_SAMPLES :])
