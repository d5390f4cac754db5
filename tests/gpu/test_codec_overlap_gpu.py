"""The codec overlapped with the model steps on the device: the same codes and PCM as inline, bit for bit.

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

from moss_rt.engine.codec_batch import CodecBatcher
from tests.engine.harness import overlap_scenario
from tests.gpu.conftest import DEVICES


@pytest.fixture
def codec_streams(monkeypatch: pytest.MonkeyPatch) -> dict[str, set[int]]:
    """The CUDA stream every batched codec decode ran on, by thread name."""
    seen: dict[str, set[int]] = {}
    real = CodecBatcher.decode_pcm

    def decode_pcm(
        self: CodecBatcher, states: list[Any], chunks: list[np.ndarray], channels: list[int]
    ) -> list[bytes]:
        if torch.cuda.is_available() and self.decoder.device.type == "cuda":
            stream = torch.cuda.current_stream(self.decoder.device).stream_id
            seen.setdefault(threading.current_thread().name, set()).add(stream)
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

    inline = overlap_scenario(tiny_data_dir, overlap=False, device=device, all_graphs=all_graphs, check=check)
    overlapped = overlap_scenario(tiny_data_dir, overlap=True, device=device, all_graphs=all_graphs, check=check)
    takes = [k for k in inline if not k.startswith("_")]
    assert len(takes) == 8
    for take_id in takes:
        assert overlapped[take_id] == inline[take_id], take_id
        assert inline[take_id]["end"][2] is None, inline[take_id]["end"]  # no take failed
    assert overlapped["_seeks"] == inline["_seeks"] == {"share": 1.0, "reprefill": 1.0}
    for result in (inline, overlapped):
        free, total = result["_free"]
        assert free == total
    if device == "cuda":
        main = threading.current_thread().name
        default = torch.cuda.default_stream().stream_id
        # Inline, decodes ran on this thread's default stream; overlapped, on the worker's own stream only.
        assert codec_streams[main] == {default}, codec_streams
        assert len(codec_streams["moss-rt-codec"]) == 1 and default not in codec_streams["moss-rt-codec"]
