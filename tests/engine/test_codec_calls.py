"""How a round's chunks become codec calls (engine/codec_calls.py), with a stand-in codec and worker (no model, no
threads): which chunks share a call, which lane each call takes, a render's calls' patience, and a withdrawn stream."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from moss_rt.engine import codec_calls
from moss_rt.engine.codec_calls import Chunk, CodecCalls
from moss_rt.engine.codec_worker import CodecCall
from moss_rt.engine.metrics import EngineMetrics
from moss_rt.generation import N_CODEBOOKS


class StandInCodec:
    """Holds at most ``max_batch`` streams a call; ``decoder.scratch_state()`` is the padding row's state."""

    def __init__(self, max_batch: int = 255) -> None:
        self.max_batch = max_batch
        self.scratch = object()
        self.decoder = SimpleNamespace(scratch_state=lambda: self.scratch, max_chunk_frames=8)
        self.noted: list[list[int]] = []

    def streams_per_call(self, t: int, cap: int) -> int:
        return max(1, min(cap, self.max_batch))

    def note_call(self, chunks: list[np.ndarray]) -> None:
        self.noted.append([int(c.shape[0]) for c in chunks])


@dataclass
class RecordingWorker:
    """Keeps every hand-over (its calls and lane) instead of running it."""

    handed: list[tuple[bool, list[CodecCall]]] = field(default_factory=list)

    def submit_all(self, calls: list[CodecCall], *, priority: bool, wait: bool) -> list[int]:
        if not calls:
            return []  # as the worker: no calls, no hand-over
        self.handed.append((priority, calls))
        return [len(self.handed)] * len(calls)

    def has_room(self, priority: bool) -> bool:
        return True


@dataclass(eq=False)
class StandInTake:
    """What the codec calls read of a take: its frames (codes), what was handed over, whether it is a render's line,
    whether a listener waits on its ramp."""

    take_id: str
    frames: int
    batch: bool = False
    in_ramp: bool = False
    flushed: int = 0
    codec_error: str | None = None
    first_chunk_at: float | None = None
    codec_seq: int = 0
    decoder: object = field(default_factory=object)

    @property
    def pending(self) -> int:
        return self.frames - self.flushed

    def flushed_on(self, step: int) -> None:
        self.flushed = self.frames

    def codes_array(self, start: int, end: int) -> np.ndarray:
        return np.full((end - start, N_CODEBOOKS), start, dtype=np.int64)


def make_calls(starting: bool = False, call_streams: int = 255, max_batch: int = 255) -> tuple[CodecCalls, Any]:
    worker = RecordingWorker()
    calls = CodecCalls(StandInCodec(max_batch), worker, EngineMetrics(), starting=lambda: starting,  # type: ignore[arg-type]
                       call_streams=call_streams, batch_patience_s=0.3)
    return calls, worker


def handed(worker: RecordingWorker) -> list[tuple[bool, list[list[str]]]]:
    """Each hand-over as (priority lane, the take ids of each of its calls)."""
    out = []
    for priority, calls in worker.handed:
        out.append((priority, [[c.take.take_id for c in call.fn.args[0]] for call in calls]))  # type: ignore[attr-defined]
    return out


def test_ramp_chunks_go_in_the_priority_lane_the_rest_in_bulk_calls_of_equal_lengths() -> None:
    calls, worker = make_calls()
    ramp = [StandInTake(f"d{i}", frames=1, in_ramp=True) for i in range(3)]
    steady = [StandInTake(f"s{i}", frames=4) for i in range(3)] + [StandInTake("s3", frames=2)]
    calls.send([*ramp, *steady], 0)
    assert handed(worker) == [(True, [["d0", "d1", "d2"]]), (False, [["s0", "s1", "s2"], ["s3"]])]
    # Everything due was handed over: nothing pending, and each take knows the hand-over its chunk is in.
    assert all(t.pending == 0 and t.first_chunk_at is not None for t in [*ramp, *steady])
    assert [t.codec_seq for t in ramp] == [1, 1, 1] and [t.codec_seq for t in steady] == [2, 2, 2, 2]


def test_a_renders_chunks_never_share_a_call_with_a_listened_stream_and_wait_longer() -> None:
    calls, worker = make_calls()
    takes = [StandInTake("s0", frames=4), StandInTake("b0", frames=4, batch=True), StandInTake("s1", frames=4),
             StandInTake("b1", frames=4, batch=True)]
    calls.send(takes, 0)
    (lane, made), = worker.handed
    assert not lane
    assert sorted([c.take.take_id for c in call.fn.args[0]] for call in made) == [["b0", "b1"], ["s0", "s1"]]
    patience = {call.fn.args[0][0].take.take_id[0]: call.patience_s for call in made}
    assert patience == {"b": 0.3, "s": None}  # None: the worker's own patience for listened streams


def test_bulk_calls_are_capped_and_shorter_while_a_director_is_starting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(codec_calls, "STARTING_CALL_STREAMS", 2)
    steady = [StandInTake(f"s{i}", frames=4) for i in range(5)]
    calls, worker = make_calls(call_streams=3)
    calls.send(steady, 0)
    assert [len(c) for c in handed(worker)[0][1]] == [3, 2]
    calls, worker = make_calls(call_streams=3, starting=True)
    calls.send([StandInTake(f"s{i}", frames=4) for i in range(5)], 0)
    assert [len(c) for c in handed(worker)[0][1]] == [2, 2, 1]
    # A priority call holds what one call of the codec can, whatever the bulk cap.
    calls, worker = make_calls(call_streams=1, starting=True, max_batch=4)
    calls.send([StandInTake(f"d{i}", frames=1, in_ramp=True) for i in range(6)], 0)
    assert [len(c) for c in handed(worker)[0][1]] == [4, 2]


def test_a_renders_bulk_calls_hold_fewer_streams_than_listened_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """A director's first chunk waits for the bulk call running when it comes: a render's calls stay at
    RENDER_CALL_STREAMS while listened streams' go up to the codec's largest call."""
    monkeypatch.setattr(codec_calls, "RENDER_CALL_STREAMS", 2)
    calls, worker = make_calls(call_streams=4)
    render = [StandInTake(f"b{i}", frames=4, batch=True) for i in range(5)]
    listened = [StandInTake(f"s{i}", frames=4) for i in range(5)]
    calls.send([*render, *listened], 0)
    sizes = sorted((c[0][0], len(c)) for c in handed(worker)[0][1])
    assert sizes == [("b", 1), ("b", 2), ("b", 2), ("s", 1), ("s", 4)]
    calls, worker = make_calls(call_streams=4, starting=True)
    monkeypatch.setattr(codec_calls, "STARTING_CALL_STREAMS", 3)
    calls.send([StandInTake(f"b{i}", frames=4, batch=True) for i in range(5)], 0)
    assert [len(c) for c in handed(worker)[0][1]] == [2, 2, 1]  # the smaller of the two caps


def test_nothing_is_handed_over_for_takes_with_nothing_due_a_failed_codec_or_no_codec_state() -> None:
    calls, worker = make_calls()
    calls.send([StandInTake("done", frames=4, flushed=4), StandInTake("failed", frames=4, codec_error="boom"),
                StandInTake("no-state", frames=4, decoder=None)], 0)
    assert worker.handed == []


def test_a_withdrawn_stream_leaves_its_call_for_a_padding_row() -> None:
    calls, _ = make_calls()
    a, b = StandInTake("a", frames=2), StandInTake("b", frames=2)
    chunks = [Chunk(a, a.decoder, 0, a.codes_array(0, 2)), Chunk(b, b.decoder, 0, b.codes_array(0, 2) + 7)]  # type: ignore[arg-type]
    call = calls.codec_call(calls.decode_and_push, chunks)
    assert call.keys == (a.decoder, b.decoder) and call.withdraw is not None
    call.withdraw(b.decoder)
    assert chunks[1].withdrawn and chunks[1].state is calls.codec.decoder.scratch_state()
    assert not chunks[1].codes.any() and chunks[1].codes.shape == (2, N_CODEBOOKS)
    assert not chunks[0].withdrawn and chunks[0].state is a.decoder  # the other stream is untouched


@dataclass(eq=False)
class RebuildingTake(StandInTake):
    """A retake rebuilding its codec state from ``kept`` frames (``rebuilt`` of them handed over so far)."""

    kept: int = 0
    rebuilt: int = 0

    @property
    def rebuild_left(self) -> int:
        return self.kept - self.rebuilt


def test_rebuilds_go_a_full_chunk_a_round_interactive_ones_in_the_priority_lane() -> None:
    calls, worker = make_calls()
    director = RebuildingTake("d", frames=0, kept=11)
    other = RebuildingTake("e", frames=0, kept=8)
    line = RebuildingTake("b", frames=0, kept=3, batch=True)
    assert calls.rebuild([director, other, line])
    # Chunks of one length together (the codec's full chunk, 8, or what is left), the director's in the priority lane.
    assert handed(worker) == [(True, [["d", "e"]]), (False, [["b"]])]
    assert (director.rebuilt, other.rebuilt, line.rebuilt) == (8, 8, 3)
    worker.handed.clear()
    assert calls.rebuild([director, other, line])  # the next round: what is left of the director's
    assert handed(worker) == [(True, [["d"]])] and director.rebuilt == 11
    assert not calls.rebuild([director, other, line])  # nothing left to rebuild


class PushingTake(StandInTake):
    """A take whose decoded chunks reach a channel (what ``decode_and_push`` writes to)."""

    def __init__(self, take_id: str, frames: int) -> None:
        super().__init__(take_id, frames)
        self.out_lock = threading.Lock()
        self.muted = False
        self.first_audio: float | None = None
        self.first_decode_at: float | None = None
        self.admitted = 0.0
        self.sent = 0
        self.spec = SimpleNamespace(channels=1)
        self.pushed: list[Any] = []
        self.channel = SimpleNamespace(push=self.pushed.append)


def test_decode_calls_are_timed_by_chunk_length_and_by_whether_a_graph_ran_them() -> None:
    calls, _ = make_calls()
    codec = calls.codec
    codec.decode_pcm = lambda states, chunks, channels: [b"\0\0" * len(c) for c in chunks]  # type: ignore[attr-defined]
    codec.graphed = lambda n, t: t in (1, 8) and n <= 4  # type: ignore[attr-defined]

    def decode(frames: int, streams: int) -> None:
        takes = [PushingTake(f"t{i}", frames) for i in range(streams)]
        calls.decode_and_push([Chunk(t, t.decoder, 0, t.codes_array(0, frames)) for t in takes])  # type: ignore[arg-type]
        assert all(t.pushed for t in takes)  # every take got its audio

    decode(1, 2)
    decode(1, 3)
    decode(5, 2)
    decode(8, 6)

    def calls_of(frames: str, graphed: str) -> float:
        registry = calls.metrics.registry
        return registry.get_sample_value("moss_rt_codec_call_shape_seconds_count",
                                         {"frames": frames, "graphed": graphed}) or 0.0

    assert (calls_of("1", "1"), calls_of("5", "0"), calls_of("8", "0")) == (2.0, 1.0, 1.0)
    assert calls_of("8", "1") == 0.0 and calls_of("1", "0") == 0.0
