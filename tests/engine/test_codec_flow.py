"""A round never blocks on the codec's bulk lane (engine/codec_flow), prefill passes sized to the graphs while
directors work (prefill_pace), and admissions timed by part.

The codec is held on its worker by the test (a decode waits until the test lets it go), so "the bulk lane is full"
is a state the test makes, not a race; every round is run from the test's thread, in a helper thread joined with a
generous limit only so that a round that blocks (the old behaviour) fails the test instead of hanging it.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from moss_rt.engine.base import RAMP_FRAMES, EndReason, TakePriority, TakeSpec
from moss_rt.engine.codec_calls import Chunk, CodecCalls
from moss_rt.engine.codec_flow import STARTING_PARKED_HANDOVERS
from moss_rt.engine.metrics import EngineMetrics
from moss_rt.engine.moss import MossEngine
from moss_rt.engine.scheduler import PREFILL_ROUND_PASSES, Scheduler, SchedulerConfig
from moss_rt.engine.slots import Phase, Take
from moss_rt.model.prefill_graphs import PrefillGraphs
from moss_rt.model.runner import PrefillRequest
from tests.engine.harness import Rounds, assert_heard_whole, engine_settings, loaded_engine, spec

TEXT = "The rain had stopped an hour ago, and the street was quiet."


def _sample(engine: MossEngine, name: str, **labels: str) -> float:
    return engine.metrics.registry.get_sample_value(name, labels or None) or 0.0


def _round(sched: Scheduler) -> bool:
    """One scheduling round, which must come back without waiting for the codec."""
    out: list[bool] = []
    runner = threading.Thread(target=lambda: out.append(sched.iterate()), daemon=True)
    runner.start()
    runner.join(30.0)
    assert not runner.is_alive(), "the round waited for the codec's bulk lane"
    return out[0]


class CodecGate:
    """Holds the next decode on the codec worker until released (``arm`` first)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.armed, self.holding, self.release = threading.Event(), threading.Event(), threading.Event()
        real = CodecCalls.decode_and_push
        gate = self

        def decode_and_push(self: CodecCalls, chunks: list[Chunk]) -> None:
            if gate.armed.is_set():
                gate.armed.clear()
                gate.holding.set()
                gate.release.wait(60)
            real(self, chunks)

        monkeypatch.setattr(CodecCalls, "decode_and_push", decode_and_push)


@contextmanager
def _stream_with_its_codec_held(data_dir: Path, gate: CodecGate) -> Iterator[tuple[MossEngine, Rounds, Take]]:
    """The tiny engine with one take "a" past its ramp (a bulk chunk every step) and its next codec call held on the
    worker by ``gate`` (released by the test)."""
    with loaded_engine(engine_settings(data_dir, overlap=True, max_seq_len=512)) as engine:
        rounds = Rounds(engine)
        (a,) = rounds.add(spec("a", 1, 300, 1, text=TEXT))
        rounds.until(lambda: a.frames >= RAMP_FRAMES + 2)  # past its ramp: one bulk chunk a step
        rounds.sched.worker.drain()
        gate.armed.set()
        rounds.until(gate.holding.is_set)
        yield engine, rounds, a


def test_a_director_is_admitted_and_prepared_while_the_bulk_lane_is_full_and_no_audio_is_lost(
    tiny_data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream sends a bulk chunk every step; its codec call is held, the bulk lane fills and one more hand-over
    is parked. A director's take arriving then is admitted and prefilled in the very next round (before: that round
    blocked in its flush until the codec made room). While the codec stays held the model runs at most a bounded
    number of hand-overs ahead (the step is held instead), and rounds keep coming back. Released, every chunk
    arrives in order and the stream's audio is the whole-clip decode of its codes."""
    gate = CodecGate(monkeypatch)
    with _stream_with_its_codec_held(tiny_data_dir, gate) as (engine, rounds, a):
        sched, worker = rounds.sched, rounds.sched.worker
        rounds.until(lambda: worker.parked(False) >= 1)  # one running, one queued (the bound), one parked
        assert worker.handovers(False) == worker.max_pending
        (d,) = rounds.add(spec("d", 2, 6, 2, text=f"{TEXT} A director cuts in."))
        _round(sched)
        assert d.phase is Phase.RUNNING and d.prefilled == len(d.prompt_rows)  # admitted and prepared: this round
        for _ in range(6):  # the codec stays held: the model does not run away from it
            _round(sched)
        assert worker.parked(False) <= STARTING_PARKED_HANDOVERS
        held_at = a.frames
        assert not _round(sched) and a.frames == held_at  # nothing else to do: the round says so, the engine waits
        assert _sample(engine, "moss_rt_steps_held_total") > 0
        gate.release.set()
        rounds.until(lambda: d.channel.finished)
        a.channel.cancel()
        rounds.until(lambda: a.channel.finished and not sched.draining)
        assert_heard_whole(engine, [a, d])  # every chunk in frame order, nothing after the end, the whole clip
        assert d.channel.end.reason is EndReason.MAX_FRAMES  # type: ignore[attr-defined]
        assert _sample(engine, "moss_rt_codec_wait_seconds_count") > 0  # the hold is reported as a wait
        for part in ("match", "room", "kv", "sampling", "codec", "apply"):  # admissions timed by part (apply: a round)
            assert _sample(engine, "moss_rt_admit_part_seconds_count", part=part) >= 2, part
        assert worker.parked(False) == 0 and worker.pending == 0


def test_a_directors_first_frames_are_made_while_the_step_is_held_for_the_bulk_lane(
    tiny_data_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bulk lane is full and the step held (a stream's calls held on the codec): a director arriving then gets
    its first frames made at once, its one-frame chunks queued in the priority lane up to that lane's bound, while the
    held stream makes none (before: the director's take waited in the held step for the bulk lane's room). Released,
    both takes' audio arrives whole and in order."""
    gate = CodecGate(monkeypatch)
    with _stream_with_its_codec_held(tiny_data_dir, gate) as (engine, rounds, a):
        sched, worker = rounds.sched, rounds.sched.worker
        for _ in range(20):  # until the round has nothing left to do: the step is held
            if not _round(sched):
                break
        held_at = a.frames
        assert not _round(sched) and worker.parked(False) >= 1
        steps_held = _sample(engine, "moss_rt_steps_held_total")
        (d,) = rounds.add(spec("d", 2, 24, 2, text=f"{TEXT} A director cuts in."))
        for _ in range(8):
            _round(sched)
        # While a director starts, the bulk lane may park one more hand-over (codec_flow.STARTING_PARKED_HANDOVERS):
        # the held stream steps once more with it, then never; the director's ramp goes on alone (before: both stopped).
        assert a.frames <= held_at + 1
        assert d.phase is Phase.RUNNING and d.frames > a.frames - held_at
        assert worker.handovers(True) == worker.max_pending  # its chunks wait in the priority lane, up to its bound
        assert _sample(engine, "moss_rt_steps_held_total") > steps_held
        gate.release.set()
        rounds.until(lambda: d.channel.finished)
        a.channel.cancel()
        rounds.until(lambda: a.channel.finished and not sched.draining)
        assert_heard_whole(engine, [a, d])
        assert d.channel.end.reason is EndReason.MAX_FRAMES  # type: ignore[attr-defined]


# ----------------------------------------------------------------------------- graph-sized prefill passes


class GraphRunner:
    """Records passes like test_scheduler_prefill's runner, and fits them to the real prefill graphs' shapes (an
    H200-sized runner: 16 slots, 2,048 positions, --prefill-graph-rows 2048: the largest batched graphs)."""

    def __init__(self) -> None:
        self.passes: list[list[tuple[int, int, int]]] = []
        state = SimpleNamespace(max_seq_len=2048)
        self.graphs = PrefillGraphs(None, state, None, max_rows=2048, pool=None, max_pieces=16,  # type: ignore[arg-type]
                                    max_padded_rows=2048)

    def prefill_batch(self, requests: list[PrefillRequest]) -> int:
        self.passes.append([(r.slot, len(r.rows), r.start) for r in requests])
        return 1

    def prefill_graph_rule(self) -> Any:
        return lambda widths, starts: self.graphs.shape_for_pass(list(widths), list(starts)) is not None

    def fits(self, p: list[tuple[int, int, int]]) -> bool:
        return self.graphs.shape_for_pass([n for _, n, _ in p], [s for _, _, s in p]) is not None


class QuietChannel:
    cancel_reason = None
    paused = False

    def push(self, event: object) -> None:
        pass


def _take(name: str, rows: int, *, batch: bool = False) -> Take:
    priority = TakePriority.BATCH if batch else TakePriority.INTERACTIVE
    take = Take(TakeSpec(name, text="x", seed=1, priority=priority), channel=QuietChannel())  # type: ignore[arg-type]
    take.prompt_rows = np.zeros((rows, 13), dtype=np.int64)
    return take


def _graph_scheduler(
    takes: list[Take], streaming: Take, *, round_passes: int = PREFILL_ROUND_PASSES, stream_rows: int = 3480
) -> tuple[Scheduler, GraphRunner]:
    runner = GraphRunner()
    config = SchedulerConfig(max_slots=16, prefill_chunk=512, retain_slots=0, prefill_round_passes=round_passes)
    sched = Scheduler(runner, SimpleNamespace(decoder=None), EngineMetrics(), config)  # type: ignore[arg-type]
    sched.stream_rows = stream_rows  # 3,480: what prefill_pace sizes on an H200, far past any graph
    for slot, take in enumerate(takes):
        take.phase, take.model_slot = Phase.PREPARING, slot
        sched.preparing.append(take)
    sched.running.append(streaming)
    return sched, runner


GRAPH_PASSES = [[(i, 190, 0) for i in range(8)], [*((i, 190, 0) for i in range(8, 12)), (12, 256, 0)],
                [(12, 444, 256)]]


def _passes_by_round(sched: Scheduler, runner: GraphRunner) -> list[int]:
    """Prepare round by round until every take is ready: how many passes each round ran."""
    by_round: list[int] = []
    while sched.preparing:
        before = len(runner.passes)
        assert sched._prepare()
        by_round.append(len(runner.passes) - before)
        assert len(by_round) < 10
    return by_round


@pytest.mark.parametrize(
    ("round_passes", "stream_rows", "by_round"),
    [
        (PREFILL_ROUND_PASSES, 3480, [3]),  # 1,520 + 5 x 256 + 444 = 3,244 padded rows: one round
        (PREFILL_ROUND_PASSES, 2800, [2, 1]),  # 1,520 + 1,280 = 2,800: the third would pass stream_rows
        (2, 3480, [2, 1]),  # at most two a round
        (1, 3480, [1, 1, 1]),  # one a round: a step between every two
    ],
)
def test_passes_fit_a_prefill_graph_while_directors_work_and_others_stream(
    round_passes: int, stream_rows: int, by_round: list[int]
) -> None:
    """Twelve new lines (190 rows each, no retake) and a long prompt arrive while a take streams: every pass fits one
    graph (8 pieces of 190 rows pad to 8 x 256 rows; the 700-row prompt rides along cut to 256 rows, then goes on
    alone, a lone piece's graph holding its 444 rows left), and every row goes in. A round runs graph-sized passes
    back to back while their padded rows (takes x widest chunk) stay within stream_rows, at most prefill_round_passes
    of them: the running take waits for no more rows than one budget-sized pass held, and a burst of new lines does
    not wait for a step between every few of them. With only batch work about, passes still fill stream_rows."""
    takes = [_take(f"r{i}", 190) for i in range(12)] + [_take("long", 700)]
    sched, runner = _graph_scheduler(takes, _take("streaming", 10), round_passes=round_passes,
                                     stream_rows=stream_rows)
    assert _passes_by_round(sched, runner) == by_round
    assert all(runner.fits(p) for p in runner.passes), runner.passes
    assert runner.passes == GRAPH_PASSES  # the same passes however many a round: codes do not follow the setting
    assert all(t.prefilled == len(t.prompt_rows) for t in takes)

    lines = [_take(f"b{i}", 190, batch=True) for i in range(12)]
    alone, alone_runner = _graph_scheduler(lines, _take("line", 10, batch=True))
    assert alone._prepare()
    assert alone_runner.passes == [[(i, 190, 0) for i in range(12)]]  # 12 x 190 rows: no graph holds it


@pytest.mark.parametrize("where", ["preparing", "running"])
def test_while_a_director_is_mid_session_a_round_runs_one_pass(where: str) -> None:
    """The same lines while a director's retake waits for its prompt rows or streams: one pass a round, as before (a
    burst of retakes keeps its streams' pace); the passes themselves are the same."""
    takes = [_take(f"r{i}", 190) for i in range(12)] + [_take("long", 700)]
    retake = _take("retake", 10 if where == "running" else 64)
    retake.spec = dataclasses.replace(retake.spec, parent_take="parent")
    assert retake.admission_class == 0
    if where == "preparing":  # its rows ride in the first pass (interactive, oldest first: it goes last)
        takes.append(retake)
        sched, runner = _graph_scheduler(takes, _take("streaming", 10))
    else:
        sched, runner = _graph_scheduler(takes, retake)
    assert _passes_by_round(sched, runner) == [1] * len(runner.passes)
    if where == "running":
        assert runner.passes == GRAPH_PASSES


def test_takes_arriving_during_a_round_of_graph_sized_passes_are_admitted_before_the_next() -> None:
    """New takes arrive while the round's first pass runs: the round stops there (control, admissions and cancels,
    before any further pass), and the next round goes on with the rest."""
    takes = [_take(f"r{i}", 190) for i in range(12)] + [_take("long", 700)]
    sched, runner = _graph_scheduler(takes, _take("streaming", 10))
    sched._arrivals = lambda: len(runner.passes) == 1  # arrivals wait once the first pass is done
    assert sched._prepare()
    assert len(runner.passes) == 1
    assert _passes_by_round(sched, runner) == [2]  # then the rest, back to back
    assert runner.passes == GRAPH_PASSES


def test_a_renders_passes_stay_one_a_round_while_a_director_streams() -> None:
    """A render's lines prepare while a director's take streams: their passes hold at most batch_pass_share of
    stream_rows (a director arriving during one waits for less), and a round runs one of them, however many
    prefill_round_passes allows for interactive rows."""
    lines = [_take(f"b{i}", 190, batch=True) for i in range(12)]
    sched, runner = _graph_scheduler(lines, _take("director", 10))
    by_round = _passes_by_round(sched, runner)
    assert len(runner.passes) > 1 and by_round == [1] * len(runner.passes)
    assert all(len(p) * max(n for _, n, _ in p) <= 3480 * sched.config.batch_pass_share for p in runner.passes)
