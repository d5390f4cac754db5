"""The codec overlapped with the model steps on the device: the same codes and PCM as inline, bit for bit, with the
codec's lanes on streams of their own priorities (engine/gpu_streams) or on one stream.

The engine's parts are driven round by round (tests/engine/harness.py: six takes with one-frame, ramped,
3/8/10-frame chunks, then a shared-cache and a re-prefilled retake), once with ``codec_overlap`` off and once
on. ``graphed``: every model and codec graph captured first; ``lazy``: only the warm-up's, so model step
graphs are captured in the middle of the run (the codec worker drained first: a capture must not run next to
the codec's thread) and codec graphs under load between rounds. The ``cpu`` variant runs the same body.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import torch

from moss_rt.engine import gpu_streams
from moss_rt.engine.codec_batch import CodecBatcher
from tests.engine.harness import overlap_scenario
from tests.gpu.conftest import DEVICES


@pytest.fixture
def codec_streams(monkeypatch: pytest.MonkeyPatch) -> dict[str, set[tuple[int, int]]]:
    """The CUDA stream (id, priority) every batched codec decode ran on, by thread name."""
    seen: dict[str, set[tuple[int, int]]] = {}
    real = CodecBatcher.decode_pcm

    def decode_pcm(
        self: CodecBatcher, states: list[Any], chunks: list[np.ndarray], channels: list[int]
    ) -> list[bytes]:
        if torch.cuda.is_available() and self.decoder.device.type == "cuda":
            stream = torch.cuda.current_stream(self.decoder.device)
            seen.setdefault(threading.current_thread().name, set()).add((stream.stream_id, stream.priority))
        return real(self, states, chunks, channels)

    monkeypatch.setattr(CodecBatcher, "decode_pcm", decode_pcm)
    return seen


@pytest.mark.parametrize("all_graphs", [True, False], ids=["graphed", "lazy"])
@pytest.mark.parametrize("device", DEVICES)
def test_overlapped_codec_gives_the_same_codes_and_pcm_as_inline(device, all_graphs, tiny_data_dir,
                                                                  codec_streams) -> None:
    def check(engine: Any) -> None:
        if device != "cuda":
            return
        assert engine._runner.use_cuda_graphs and engine._batcher.graphs
        # Model step graphs and codec graphs never share a memory pool (their streams run concurrently).
        runner_pool, codec_pool = engine._runner._pool, engine._decoder._graph_pool
        assert runner_pool is not None and codec_pool is not None and runner_pool != codec_pool

    streams: dict[str, dict[str, set[tuple[int, int]]]] = {}
    results: dict[str, dict[str, Any]] = {}
    # Overlapped with stream priorities (the default: the priority lane's calls on the highest-priority stream, bulk
    # calls on a normal one) and without (every call on the worker's one stream).
    for name, overrides in (("inline", {"overlap": False}), ("overlapped", {"overlap": True}),
                            ("one stream", {"overlap": True, "stream_priorities": False})):
        codec_streams.clear()
        results[name] = overlap_scenario(tiny_data_dir, device=device, all_graphs=all_graphs, check=check,
                                         **overrides)
        streams[name] = dict(codec_streams)
    inline = results["inline"]
    takes = [k for k in inline if not k.startswith("_")]
    assert len(takes) == 8
    for take_id in takes:
        for name in ("overlapped", "one stream"):
            assert results[name][take_id] == inline[take_id], (name, take_id)
        assert inline[take_id]["end"][2] is None, inline[take_id]["end"]  # no take failed
    for result in results.values():
        assert result["_seeks"] == {"share": 1.0, "reprefill": 1.0}
        free, total = result["_free"]
        assert free == total
    if device == "cuda":
        main = threading.current_thread().name
        default = torch.cuda.default_stream()
        highest = torch.cuda.Stream(priority=gpu_streams.HIGHEST).priority  # the device's highest
        assert highest < 0
        # Inline, decodes ran on this thread's default stream; overlapped, on the worker's own streams only: one per
        # lane (the priority lane's at the device's highest priority, the bulk lane's at the normal one), or one.
        assert streams["inline"][main] == {(default.stream_id, default.priority)}, streams
        lanes = streams["overlapped"]["moss-rt-codec"]
        assert {priority for _, priority in lanes} == {highest, 0} and len(lanes) == 2, lanes
        one = streams["one stream"]["moss-rt-codec"]
        assert len(one) == 1 and default.stream_id not in {sid for sid, _ in one}, one
