"""The CUDA-graph bookkeeping of the CTC aligner (moss_rt/align/ctc_graphs.py) with a stand-in for the capture (CUDA
graphs need a GPU: tests/align/test_ctc_gpu.py replays real ones), the shapes batches are padded to, and the
service's load-dependent gather."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np

from moss_rt.align.base import AlignJob, AlignResult
from moss_rt.align.ctc import length_groups, padded_shape
from moss_rt.align.ctc_graphs import ShapeGraphs
from moss_rt.align.service import BUSY_JOBS_PER_SEC, AlignService, gather_time


class _Captures:
    """Stands in for the capture: a token per call, remembering what was captured; fails for ``refuse``."""

    def __init__(self, refuse: tuple[int, int] | None = None) -> None:
        self.calls: list[tuple[int, int]] = []
        self.refuse = refuse

    def __call__(self, shape: tuple[int, int]) -> str:
        self.calls.append(shape)
        if shape == self.refuse:
            raise RuntimeError("operation not permitted when stream is capturing")
        return f"graph{len(self.calls)}"


def test_a_shape_is_captured_once_then_replayed() -> None:
    capture = _Captures()
    graphs = ShapeGraphs(capture, max_rows=8, max_elements=8 * 100)
    first = graphs.graph((4, 100))
    assert graphs.graph((4, 100)) == first and graphs.graph((8, 50)) != first
    assert graphs.graph((4, 100)) == first
    assert capture.calls == [(4, 100), (8, 50)]
    assert (graphs.stats.captures, graphs.stats.replays, graphs.stats.eager) == (2, 4, 0)


def test_shapes_past_the_bounds_run_eagerly_and_hold_no_graph() -> None:
    capture = _Captures()
    graphs = ShapeGraphs(capture, max_rows=8, max_elements=8 * 100)
    assert graphs.graph((8, 101)) is None  # more samples than the pool is sized for
    assert graphs.graph((16, 10)) is None  # more rows than the input buffers hold
    assert graphs.graph((1, 800)) is not None  # one long row within the budget
    assert capture.calls == [(1, 800)] and graphs.stats.eager == 2 and len(graphs) == 1


def test_the_least_recently_used_graph_makes_room() -> None:
    capture = _Captures()
    graphs = ShapeGraphs(capture, max_rows=8, max_elements=800, max_graphs=2)
    graphs.graph((1, 100))
    graphs.graph((2, 100))
    graphs.graph((1, 100))  # used again: (2, 100) is now the oldest
    graphs.graph((4, 100))
    assert graphs.shapes() == [(1, 100), (4, 100)] and graphs.stats.evicted == 1
    graphs.graph((2, 100))  # captured again when it comes back
    assert capture.calls == [(1, 100), (2, 100), (4, 100), (2, 100)] and len(graphs) == 2


def test_a_failed_capture_runs_eagerly_and_is_not_retried() -> None:
    capture = _Captures(refuse=(4, 100))
    graphs = ShapeGraphs(capture, max_rows=8, max_elements=800)
    assert graphs.graph((4, 100)) is None and graphs.graph((4, 100)) is None
    assert capture.calls == [(4, 100)] and graphs.stats.failed == 1 and graphs.stats.eager == 2
    assert graphs.graph((2, 100)) is not None  # other shapes still capture


def test_padded_shapes_and_calls_split_by_what_they_compute() -> None:
    step = 100
    assert [padded_shape(r, 1, step)[0] for r in (1, 2, 3, 5, 8, 9, 17, 33, 57, 64)] == [
        1, 2, 4, 8, 8, 16, 24, 40, 64, 64,
    ]  # fmt: skip
    assert padded_shape(3, 101, step) == (4, 200)
    shape = lambda rows, samples: padded_shape(rows, samples, step)  # noqa: E731
    # Nine equal windows: one call computes 16 padded rows; 8 + 1 computes 9 rows for one more call.
    assert sorted(b - a for a, b in length_groups([step] * 9, 64, 2 * step, shape=shape)) == [1, 8]
    assert length_groups([step] * 9, 64, 8 * step, shape=shape) == [(0, 9)]  # a call costs more than 7 rows
    assert length_groups([step] * 9, 64, 2 * step) == [(0, 9)]  # unpadded rows: nothing to save
    # Lengths pad to the step: 1.01 and 1.99 steps compute the same, no reason to split them.
    assert length_groups([101, 199], 64, 0, shape=shape) == [(0, 2)]


def test_the_gather_grows_with_the_rate_of_jobs() -> None:
    assert gather_time(0.15, 0.35, 0.0) == 0.15  # a lone take: the base
    assert gather_time(0.15, 0.35, BUSY_JOBS_PER_SEC) == 0.35
    assert gather_time(0.15, 0.35, 10 * BUSY_JOBS_PER_SEC) == 0.35  # never past the most
    half = gather_time(0.15, 0.35, BUSY_JOBS_PER_SEC / 2)
    assert 0.15 < half < 0.35
    assert gather_time(0.0, 0.0, 1000.0) == 0.0  # an aligner that never gathers (PocketSphinx)
    assert gather_time(0.2, 0.1, 1000.0) == 0.2  # a most below the base: the base


class _Recording:
    """Answers at once, remembering each batch's size; its first call waits for ``release``."""

    name, sample_rate, device, workers, demo = "recording", 16000, "cpu", 1, True

    def __init__(self, *, max_batch: int, gather_sec: float, max_gather_sec: float) -> None:
        self.max_batch, self.gather_sec, self.max_gather_sec = max_batch, gather_sec, max_gather_sec
        self.batches: list[int] = []
        self.release = threading.Event()

    def load(self) -> None:
        pass

    def align_batch(self, jobs: Any) -> list[AlignResult]:
        self.batches.append(len(jobs))
        self.release.wait(20)
        return [AlignResult([None] * len(job.words)) for job in jobs]

    def close(self) -> None:
        pass


async def _until(condition: Any) -> None:
    for _ in range(4000):  # 20 s
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the condition never came")


def test_a_lone_job_goes_at_once_and_a_busy_stream_waits_to_fill_its_calls() -> None:
    """Base gather 0, most 30 s: a lone job runs at once (with the most it would wait 30 s); after a burst of jobs
    (a rate past BUSY_JOBS_PER_SEC) the burst's last, partial batch waits for later jobs to fill it (with the base
    it would run at once, half full)."""
    aligner = _Recording(max_batch=4, gather_sec=0.0, max_gather_sec=30.0)
    service = AlignService(aligner, max_pending=128)  # type: ignore[arg-type]
    service.start()
    job = AlignJob(np.zeros(160, np.float32), ("a",))

    async def scenario() -> None:
        await service.wait_loaded()
        lone = asyncio.ensure_future(service.align(job))
        await _until(lambda: len(aligner.batches) == 1)  # the lone job is in the aligner at once, alone
        burst = [asyncio.ensure_future(service.align(job)) for _ in range(70)]
        await _until(lambda: service._queue.qsize() == 70)  # all queued behind it
        aligner.release.set()
        await asyncio.wait_for(lone, 20)
        await _until(lambda: service.jobs_done == 1 + 68)  # 17 full batches went; the last 2 jobs gather
        late = [asyncio.ensure_future(service.align(job)) for _ in range(2)]
        await asyncio.wait_for(asyncio.gather(*burst, *late), 20)  # filled: runs long before 30 s

    try:
        asyncio.run(scenario())
        assert aligner.batches == [1] + [4] * 17 + [4]
    finally:
        service.close()
