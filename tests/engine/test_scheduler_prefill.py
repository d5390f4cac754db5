"""Scheduler._prepare with a recording runner: which prompt chunks go into which batched prefill pass."""

from __future__ import annotations

import weakref

import numpy as np

from moss_rt.engine.base import TakeSpec
from moss_rt.engine.metrics import EngineMetrics
from moss_rt.engine.prefill_pace import MIN_ROWS_PER_PASS, PrefillCost, measure_prefill_cost
from moss_rt.engine.scheduler import Scheduler, SchedulerConfig
from moss_rt.engine.slots import Phase, Take
from moss_rt.model.runner import PrefillRequest


class RecordingRunner:
    """Stands in for ModelRunner: records (slot, rows, start) of every pass."""

    def __init__(self) -> None:
        self.passes: list[list[tuple[int, int, int]]] = []

    def prefill_batch(self, requests: list[PrefillRequest]) -> int:
        self.passes.append([(r.slot, len(r.rows), r.start) for r in requests])
        return 1


class NoCodec:
    decoder = None


class QuietChannel:
    """A take's channel nobody cancels (the scheduler checks for cancels between prefill passes)."""

    cancel_reason = None
    paused = False

    def push(self, event: object) -> None:
        pass


def _scheduler(max_rows: int = 8192, chunk: int = 512) -> tuple[Scheduler, RecordingRunner]:
    runner = RecordingRunner()
    config = SchedulerConfig(
        max_slots=8, prefill_chunk=chunk, retain_slots=0, prefill_max_rows=max_rows
    )
    return Scheduler(runner, NoCodec(), EngineMetrics(), config), runner  # type: ignore[arg-type]


def _preparing(sched: Scheduler, lengths: list[int]) -> list[Take]:
    takes = []
    for slot, rows in enumerate(lengths):
        take = Take(TakeSpec(f"t{slot}", text="x", seed=slot), channel=QuietChannel())  # type: ignore[arg-type]
        take.phase, take.model_slot = Phase.PREPARING, slot
        take.prompt_rows = np.zeros((rows, 13), dtype=np.int64)
        sched.preparing.append(take)
        takes.append(take)
    return takes


def _ids(takes: list[Take]) -> list[str]:
    return [t.take_id for t in takes]


def test_all_prompts_share_passes_chunked_and_capped() -> None:
    sched, runner = _scheduler(max_rows=1200, chunk=512)
    takes = _preparing(sched, [400, 700, 90, 300])
    assert sched._prepare()  # one pass, then take 0 streams: one pass a round from now on
    assert sched._prepare()
    assert runner.passes == [
        # 3 chunks x 512 rows = 1536 > 1200: the 90- and 300-row prompts wait for the next pass
        [(0, 400, 0), (1, 512, 0)],
        # the oldest take left (its second chunk) picks the unit; everyone with rows left comes along
        [(1, 188, 512), (2, 90, 0), (3, 300, 0)],
    ]
    assert not sched.preparing and _ids(sched.running) == _ids(takes)
    assert all(t.phase is Phase.RUNNING and t.prefilled == len(t.prompt_rows) for t in takes)
    m = sched.metrics.registry
    assert m.get_sample_value("moss_rt_prefill_batch_size_count") == 2
    assert m.get_sample_value("moss_rt_prefill_batch_size_sum") == 5


def test_alone_on_the_device_every_pass_runs_at_once() -> None:
    sched, runner = _scheduler(chunk=512)  # only a streaming take stops the loop
    _preparing(sched, [1000, 900])
    assert sched._prepare()
    assert runner.passes == [[(0, 512, 0), (1, 512, 0)], [(0, 488, 512), (1, 388, 512)]]
    assert not sched.preparing


def test_takes_made_ready_by_a_pass_stream_before_the_next_pass() -> None:
    sched, runner = _scheduler(max_rows=800)
    takes = _preparing(sched, [400, 400, 400, 400])
    assert sched._prepare()  # one pass, then its two takes stream: one pass a round from now on
    assert runner.passes == [[(0, 400, 0), (1, 400, 0)]]
    assert _ids(sched.running) == _ids(takes[:2]) and _ids(sched.preparing) == _ids(takes[2:])
    assert sched._prepare()  # the next round: the next pass
    assert runner.passes[1] == [(2, 400, 0), (3, 400, 0)] and not sched.preparing


def test_a_take_ready_without_work_does_not_use_up_the_rounds_unit() -> None:
    """A retake that reuses its parent's cache whole (``share`` path, from frame 0) is ready at once; its
    promotion is no preparation work, so the round must still run a pass for the take behind it. While a take
    streams (one pass per round), counting the promotion as the round's work would run none at all."""
    sched, runner = _scheduler()
    waiting, cached = _preparing(sched, [300, 200])
    cached.prefilled = 200  # the parent's cache holds its whole prompt: nothing to prefill
    streaming = Take(TakeSpec("s", text="x", seed=9), channel=QuietChannel())  # type: ignore[arg-type]
    sched.running.append(streaming)  # one pass a round
    assert sched._prepare()
    assert runner.passes == [[(0, 300, 0)]]
    assert _ids(sched.running) == ["s", "t1", "t0"] and not sched.preparing


class Activations:
    """Stands in for the tensors a forward pass holds in its frames when it runs out of memory."""


def test_a_failed_pass_is_retried_after_its_memory_is_freed() -> None:
    """The takes of a failed batched pass are retried one by one, typically after running out of memory. The
    exception's traceback holds the frames of the failed forward and so its activations: the retries must
    run once it is gone, or they find the memory still taken."""
    sched, runner = _scheduler()
    _preparing(sched, [100, 100])
    held: list[weakref.ref[Activations]] = []
    alive_at_retry: list[bool] = []

    def prefill_batch(requests: list[PrefillRequest]) -> int:
        if len(requests) > 1:
            activations = Activations()
            held.append(weakref.ref(activations))
            raise RuntimeError("CUDA out of memory")
        alive_at_retry.append(held[0]() is not None)
        return 1

    runner.prefill_batch = prefill_batch  # type: ignore[method-assign]
    assert sched._prepare()
    assert alive_at_retry == [False, False]
    assert not sched.preparing and len(sched.running) == 2


def test_a_deep_reprefill_does_not_give_fresh_prompts_its_key_window() -> None:
    """Rows x longest key window is bounded too: attention scores grow with both."""
    runner = RecordingRunner()
    config = SchedulerConfig(
        max_slots=8, prefill_chunk=512, retain_slots=0, prefill_max_rows=2048,
        prefill_keys_per_row=512,  # rows x keys <= 2048 x 512 = 1 M score cells per head
    )
    sched = Scheduler(runner, NoCodec(), EngineMetrics(), config)  # type: ignore[arg-type]
    deep, *fresh = _preparing(sched, [2400, 300, 300, 300])
    deep.prefilled = 1536  # a retake re-prefilled deep into a long take: its next chunk ends at 2048
    assert sched._prepare()  # two passes; then the deep take streams: one pass a round
    assert sched._prepare()
    assert runner.passes == [
        [(0, 512, 1536)],  # with one fresh prompt: 2 x 512 rows x 2048 keys = 2 M > 1 M, so they wait
        [(0, 352, 2048)],  # the deep take's last chunk, alone for the same reason
        [(1, 300, 0), (2, 300, 0), (3, 300, 0)],  # 3 x 300 rows x 300 keys: together
    ]
    assert not sched.preparing and all(t.prefilled == len(t.prompt_rows) for t in [deep, *fresh])


def test_short_chunks_over_long_windows_count_as_head_dim_rows() -> None:
    """Eight 10-row tails after 2,000 shared positions (prompt-cache tails): the masked SDPA path repeats every
    member's keys to the query heads, so the score bound counts each pass as at least 128 rows wide."""
    runner = RecordingRunner()
    config = SchedulerConfig(
        max_slots=8, prefill_chunk=512, retain_slots=0, prefill_max_rows=2048,
        prefill_keys_per_row=512,  # 1 M cells: 128 rows x 4 members x 2,010 keys fit, 5 members do not
    )
    sched = Scheduler(runner, NoCodec(), EngineMetrics(), config)  # type: ignore[arg-type]
    takes = _preparing(sched, [2010] * 8)
    for take in takes:
        take.prefilled = 2000
    assert sched._prepare()  # one pass; its takes stream then: one pass a round
    assert sched._prepare()
    assert runner.passes == [[(s, 10, 2000) for s in range(4)], [(s, 10, 2000) for s in range(4, 8)]]


def test_prefill_cost_fits_a_line_and_sizes_passes_to_the_budget() -> None:
    cost = PrefillCost(fixed_s=0.004, per_row_s=14e-6)
    assert cost.rows_within(0.05, 8192) == 3285  # (50 - 4) ms / 14 us
    assert cost.rows_within(10.0, 8192) == 8192  # never above the cap
    assert cost.rows_within(0.001, 8192) == MIN_ROWS_PER_PASS  # never below a useful pass (the budget < fixed)
    assert PrefillCost(0.01, 0.0).rows_within(0.05, 4096) == 4096  # size costs nothing measurable: no cap


def test_prefill_cost_is_measured_past_first_use(monkeypatch) -> None:
    """A pass of n chunks of 100 rows costs 5 ms + 1 ms a chunk (10 us a row); the first run of a size costs
    three times that (first-use costs) and is left out."""
    import moss_rt.engine.prefill_pace as pace

    now, calls = [0.0], []

    def run_pass(n: int) -> None:
        calls.append(n)
        now[0] += (0.005 + 0.001 * n) * (3.0 if calls.count(n) == 1 else 1.0)

    monkeypatch.setattr(pace.time, "perf_counter", lambda: now[0])
    cost = measure_prefill_cost(run_pass, 2, 4, rows_per_chunk=100)
    assert calls == [2, 2, 2, 4, 4, 4]
    assert abs(cost.per_row_s - 10e-6) < 1e-12 and abs(cost.fixed_s - 0.005) < 1e-12


def test_a_burst_behind_running_streams_goes_in_as_chunks_one_pass_a_round() -> None:
    """While takes stream, a round runs one pass of at most stream_rows padded rows: a burst's prompts are cut into
    chunks interleaved with frames (a 400-row prompt in pieces from nonzero starts)."""
    sched, runner = _scheduler(chunk=512)  # stream_rows limits the round
    sched.stream_rows = 300
    takes = _preparing(sched, [400, 400, 400])
    streaming = Take(TakeSpec("s", text="x", seed=9), channel=QuietChannel())  # type: ignore[arg-type]
    sched.running.append(streaming)
    rounds = 0
    while sched.preparing:
        rounds += 1
        assert sched._prepare()
        assert len(runner.passes) == rounds  # one pass a round
        assert rounds < 20
    assert all(len(p) * max(n for _, n, _ in p) <= 300 for p in runner.passes)
    # the second pass: take 0's last 100 rows, and take 1 cut to what fills the pass (2 x 150 rows)
    assert runner.passes[:2] == [[(0, 300, 0)], [(0, 100, 300), (1, 150, 0)]]
    assert all(t.prefilled == 400 for t in takes) and _ids(sched.running)[0] == "s"
    # with nothing streaming the same burst goes in whole passes, all in one round
    alone, alone_runner = _scheduler(chunk=512)
    alone.stream_rows = 300
    _preparing(alone, [400, 400, 400])
    assert alone._prepare()
    assert alone_runner.passes == [[(0, 400, 0), (1, 400, 0), (2, 400, 0)]]
    assert not alone.preparing
