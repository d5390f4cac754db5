"""The order of the engine's idle-time CUDA graph captures: the codec's first- and full-chunk shapes, then the model's
step graphs, then the codec's odd chunk lengths (a burst meeting a missing codec shape waits longest)."""

from __future__ import annotations

from typing import Any

import torch

from moss_rt.engine.codec_batch import CodecBatcher, graph_buckets
from moss_rt.engine.codec_worker import CodecWorker
from moss_rt.engine.metrics import EngineMetrics
from moss_rt.engine.moss import MossEngine
from tests.engine.test_codec_batch import FakeDecoder


class StepGraphs:
    """Stands in for ModelRunner's idle captures: three missing step graphs."""

    def __init__(self, log: list[Any]) -> None:
        self.missing = [(1, 512), (16, 512), (64, 1024)]
        self.log = log

    def pending_graphs(self) -> list[tuple[int, int]]:
        return list(self.missing)

    def pending_prefill_graphs(self) -> list[tuple[int, int]]:
        return []  # capture_next takes them among the step graphs (tests/model/test_prefill_graphs.py)

    def capture_next(self) -> bool:
        if not self.missing:
            return False
        self.log.append(("step", self.missing.pop(0)))
        return True


def test_idle_captures_take_the_codecs_main_shapes_first() -> None:
    log: list[Any] = []
    dec = FakeDecoder()
    batcher = CodecBatcher(dec, 64)  # type: ignore[arg-type]
    real_warmup = dec.warmup

    def warmup(batch_sizes: list[int], chunk_frames: list[int], contiguous_from: int | None = 0) -> None:
        log.append(("codec", (batch_sizes[0], chunk_frames[0])))
        real_warmup(batch_sizes, chunk_frames, contiguous_from)

    dec.warmup = warmup  # type: ignore[method-assign]
    engine: Any = object.__new__(MossEngine)  # only what _capture_idle touches
    engine._graphs_done = False
    engine._compile_workers = engine._workers_retire_at = None
    engine._runner, engine._batcher = StepGraphs(log), batcher
    engine._codec_worker = CodecWorker(threaded=False)
    engine.metrics = EngineMetrics()
    engine._device = torch.device("cpu")
    engine.memory_plan = None
    while engine._capture_idle():
        pass
    kinds = [kind for kind, _ in log]
    main = 2 * len(graph_buckets(64))  # T = 1 and 8 for every batch bucket
    assert kinds[:main] == ["codec"] * main and all(t in (1, 8) for _, (_, t) in log[:main])
    assert kinds[main : main + 3] == ["step"] * 3
    assert kinds[main + 3 :] and set(kinds[main + 3 :]) == {"codec"}  # then the odd chunk lengths
    assert engine._graphs_done and engine.metrics.registry.get_sample_value("moss_rt_graphs_pending") == 0


def test_an_idle_capture_waits_for_a_quiet_second() -> None:
    """Right after ready a capture may start at once; after any work (a take, a job) only once the engine has had
    nothing to do for IDLE_CAPTURE_QUIET_S, so takes arriving one after another never meet one each time."""
    from moss_rt.engine.moss import IDLE_CAPTURE_QUIET_S

    engine: Any = object.__new__(MossEngine)
    engine._busy_at = 0.0
    start = 1000.0
    assert engine._idle_capture_due(False, True, start)  # ready, nothing has run yet
    assert not engine._idle_capture_due(True, True, start)  # a round did work
    assert not engine._idle_capture_due(False, False, start + 5)  # a take is waiting or running
    assert not engine._idle_capture_due(False, True, start + 5 + IDLE_CAPTURE_QUIET_S / 2)
    assert engine._idle_capture_due(False, True, start + 5 + IDLE_CAPTURE_QUIET_S)
