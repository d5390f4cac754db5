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
from moss_rt.align.ctc_graphs import MAX_RESETS, ShapeGraphs
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


def _cost(shape: tuple[int, int]) -> int:
    """A stand-in pass's bytes: one per row-sample."""
    return shape[0] * shape[1]


class _Pool:
    """Stands in for the allocator's graph pool on one stream: a capture takes what its pass needs beyond the
    biggest pass captured before in this pool (its freed blocks are reused), ``extra`` more for shapes in it (the
    estimate was wrong); ``drop`` starts an empty pool."""

    def __init__(self, extra: dict[tuple[int, int], int] | None = None) -> None:
        self.extra = extra or {}
        self.held = 0
        self.dropped = 0
        self.capture = _Captures()

    def __call__(self, shape: tuple[int, int]) -> str:
        token = self.capture(shape)
        self.held = max(self.held, _cost(shape) + self.extra.get(shape, 0))
        return token

    def measure(self) -> int:
        return self.held

    def drop(self) -> None:
        self.held = 0
        self.dropped += 1


def _graphs(pool: _Pool, *, rows: int = 8, samples: int = 100, budget: int = 800, **kw: Any) -> ShapeGraphs[str]:
    return ShapeGraphs(pool, max_rows=rows, max_samples=samples, budget_bytes=budget, estimate=_cost,
                       pool_bytes=pool.measure, new_pool=pool.drop, **kw)  # fmt: skip


def test_a_fresh_pool_captures_its_largest_shape_first_then_each_shape_once() -> None:
    pool = _Pool()
    graphs = _graphs(pool)
    first = graphs.graph((4, 100))
    assert pool.capture.calls == [(8, 100), (4, 100)]  # the envelope, then the shape asked for
    assert graphs.graph((4, 100)) == first and graphs.graph((8, 50)) != first
    assert graphs.graph((4, 100)) == first and graphs.graph((8, 100)) is not None  # the envelope replays too
    assert pool.capture.calls == [(8, 100), (4, 100), (8, 50)]
    assert (graphs.stats.captures, graphs.stats.replays, graphs.stats.eager) == (3, 5, 0)
    assert graphs.stats.pool_bytes == graphs.stats.pool_peak_bytes == 800  # the envelope's pass, not the sum


def test_shapes_past_the_region_run_eagerly_and_hold_no_graph() -> None:
    pool = _Pool()
    graphs = _graphs(pool)
    assert graphs.graph((8, 101)) is None  # more samples than the graphs take
    assert graphs.graph((16, 10)) is None  # more rows than the input buffers hold
    assert graphs.graph((1, 100)) is not None
    assert pool.capture.calls == [(8, 100), (1, 100)] and graphs.stats.eager == 2 and len(graphs) == 2


def test_the_region_has_the_most_rows_whose_envelope_fits_the_budget() -> None:
    pool = _Pool()
    graphs = _graphs(pool, rows=64, samples=100, budget=3000, rows_ladder=[64, 56, 48, 40, 32, 24, 16, 8, 4, 2, 1])
    assert graphs.max_rows == 24 and graphs.envelope == (24, 100)  # 24 × 100 ≤ 3000 < 32 × 100
    assert graphs.graph((32, 100)) is None and graphs.graph((24, 100)) is not None
    assert graphs.stats.pool_peak_bytes <= 3000
    none_fit = _graphs(_Pool(), rows=8, samples=100, budget=50)
    assert none_fit.stats.disabled and none_fit.graph((1, 10)) is None  # not even one row: all eager


def test_a_pool_past_the_budget_is_dropped_with_its_graphs() -> None:
    pool = _Pool(extra={(2, 100): 1100})  # this capture needs more than estimated
    graphs = _graphs(pool)
    assert graphs.graph((4, 100)) is not None and len(graphs) == 2
    assert graphs.graph((2, 100)) is None  # 1300 > 800: every graph and the pool dropped, this call eager
    assert len(graphs) == 0 and pool.dropped == 1 and graphs.stats.resets == 1 and pool.held == 0
    assert graphs.stats.pool_peak_bytes == 1300  # what it went to is reported
    assert graphs.graph((4, 100)) is not None  # a fresh pool: the envelope first again
    assert pool.capture.calls[-2:] == [(8, 100), (4, 100)] and pool.held == 800


def test_an_envelope_past_the_budget_shrinks_the_region_and_resets_are_bounded() -> None:
    pool = _Pool(extra={(8, 100): 100})  # the envelope alone measures 900 > 800
    graphs = _graphs(pool)
    assert graphs.graph((8, 50)) is None  # the envelope went past: dropped, rows shrink to 4
    assert graphs.max_rows == 4 and graphs.stats.resets == 1 and not graphs.stats.disabled
    assert graphs.graph((8, 50)) is None  # outside the region now: eager, no capture
    assert graphs.graph((4, 100)) is not None and pool.held == 400
    always = _Pool(extra={shape: 10_000 for shape in [(r, 100) for r in (8, 4, 2, 1)]})
    capped = _graphs(always)
    for _ in range(2 * MAX_RESETS):
        capped.graph((1, 100))
    assert capped.stats.disabled and capped.stats.resets <= MAX_RESETS and len(capped) == 0


def test_the_least_recently_used_graph_makes_room() -> None:
    pool = _Pool()
    graphs = _graphs(pool, max_graphs=2)
    graphs.graph((1, 100))  # the envelope (8, 100) and (1, 100)
    graphs.graph((2, 100))  # (8, 100) goes
    graphs.graph((1, 100))  # used again: (2, 100) is now the oldest
    graphs.graph((4, 100))
    assert graphs.shapes() == [(1, 100), (4, 100)] and graphs.stats.evicted == 2
    graphs.graph((2, 100))  # captured again when it comes back
    assert pool.capture.calls == [(8, 100), (1, 100), (2, 100), (4, 100), (2, 100)] and len(graphs) == 2
    assert pool.held == 800  # evictions free nothing, and nothing grows past the envelope's pass


def test_a_failed_capture_runs_eagerly_and_is_not_retried() -> None:
    pool = _Pool()
    pool.capture.refuse = (4, 100)
    graphs = _graphs(pool)
    assert graphs.graph((4, 100)) is None and graphs.graph((4, 100)) is None
    assert pool.capture.calls == [(8, 100), (4, 100)] and graphs.stats.failed == 1 and graphs.stats.eager == 2
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
    # A memory bound: no call past 4 padded rows × 100 samples, however costly a call; a lone row always goes.
    fits = lambda rows, samples: rows * samples <= 400  # noqa: E731
    groups = length_groups([step] * 9 + [250], 64, 100 * step, shape=shape, fits=fits)
    assert sorted(b - a for a, b in groups) == [1, 1, 4, 4] and groups[-1] == (9, 10)
    assert length_groups([step] * 9, 64, 100 * step, shape=shape) == [(0, 9)]  # unbounded: one call


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
