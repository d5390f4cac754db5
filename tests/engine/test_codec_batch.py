"""CodecBatcher's graph path (padding, slot order) with a recording stand-in decoder (no CUDA needed)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moss_rt.engine.codec_batch import CodecBatcher, graph_buckets


@dataclass(eq=False)
class FakeState:
    slot: int
    frames: int = 0

    def close(self) -> None:
        pass


class FakeDecoder:
    max_chunk_frames = 25
    max_streams = 200

    def __init__(self) -> None:
        self.cuda_graphs = True
        self.next_slot = 0
        self.calls: list[tuple[bool, list[int], int]] = []
        self.captured: list[tuple[int, int]] = []

    def warmup(self, batch_sizes: list[int], chunk_frames: list[int], contiguous_from: int | None = 0) -> None:
        assert contiguous_from is None
        self.captured += [(b, t) for b in batch_sizes for t in chunk_frames]

    def scratch_state(self) -> FakeState:
        return FakeState(self.max_streams)

    def new_state(self) -> FakeState:
        self.next_slot += 1
        return FakeState(self.next_slot - 1)

    def decode(self, states: list[FakeState], codes: list[np.ndarray]) -> list[np.ndarray]:
        assert len({id(s) for s in states}) == len(states)
        t = codes[0].shape[0]
        assert all(c.shape[0] == t for c in codes)
        self.calls.append((self.cuda_graphs, [s.slot for s in states], t))
        for s in states:
            s.frames += t
        # Audio that names its stream: channel 0 holds the slot number.
        return [np.full((2, 3840 * t), float(s.slot), dtype=np.float32) for s in states]


def test_small_batches_are_padded_and_never_contiguous() -> None:
    dec = FakeDecoder()
    batcher = CodecBatcher(dec, 64)  # type: ignore[arg-type]
    # Padding rows share the decoder's scratch row: they hold no stream slot (no stream memory).
    assert batcher.graphs and dec.next_slot == 0 and CodecBatcher.pad_streams(64) == 18
    batcher.warm_up()
    assert (2, 5) in dec.captured and (66, 8) in dec.captured and (66, 5) not in dec.captured
    streams = [dec.new_state() for _ in range(5)]
    chunks = [np.zeros((8, 12), np.int64)] * 3 + [np.zeros((1, 12), np.int64)] * 2
    audio = batcher.decode(streams, chunks)
    assert [int(a[0, 0]) for a in audio] == [s.slot for s in streams]
    assert [a.shape[1] for a in audio] == [3840 * 8] * 3 + [3840] * 2
    for graphed, slots, _ in dec.calls:
        assert graphed and len(slots) in graph_buckets(64)
        # A padding row first: the slot list is never a contiguous run; padding only uses the scratch row.
        assert slots[0] == dec.max_streams and set(slots) - {s.slot for s in streams} == {dec.max_streams}
    assert [s.frames for s in streams] == [8, 8, 8, 1, 1]


def test_unwarmed_shapes_run_eager_and_full_batches_fit() -> None:
    dec = FakeDecoder()
    batcher = CodecBatcher(dec, 64)  # type: ignore[arg-type]
    batcher.warm_up()
    streams = [dec.new_state() for _ in range(64)]
    audio = batcher.decode(streams, [np.zeros((8, 12), np.int64)] * 64)  # graphed: bucket 66
    assert len(audio) == 64 and [int(a[0, 0]) for a in audio] == [s.slot for s in streams]
    batcher.decode(streams[:40], [np.zeros((5, 12), np.int64)] * 40)  # (48, 5) has no graph: eager
    one = batcher.decode(streams[:1], [np.zeros((30, 12), np.int64)])  # longer than any graph: eager
    assert one[0].shape[1] == 30 * 3840
    assert [(graphed, len(slots)) for graphed, slots, _ in dec.calls] == [(True, 66), (False, 40), (False, 1)]
    assert dec.cuda_graphs  # restored after the eager calls
    # What the engine's per-shape codec metric reports for those calls.
    assert batcher.graphed(64, 8) and not batcher.graphed(40, 5) and not batcher.graphed(1, 30)


def test_many_streams_are_decoded_in_bounded_calls() -> None:
    dec = FakeDecoder()
    batcher = CodecBatcher(dec, 150)  # type: ignore[arg-type]
    batcher.warm_up()
    assert max(b for b, _ in dec.captured) == 130  # no graph (and no call) wider than 128 streams + padding
    streams = [dec.new_state() for _ in range(150)]
    audio = batcher.decode(streams, [np.zeros((8, 12), np.int64)] * 150)
    assert [int(a[0, 0]) for a in audio] == [s.slot for s in streams]
    assert [len(slots) for _, slots, _ in dec.calls] == [130, 32]  # 128 + 22 streams, padded to buckets
    assert all(s.frames == 8 for s in streams)


def test_a_server_full_of_takes_decodes_its_cadence_in_one_call_with_little_padding() -> None:
    """64, 96 or 128 takes due on the same cadence step: one graphed call each, padded by one or two rows only (a
    64-stream call padded to 96 rows cost the 64-take bench 8 % of its aggregate on an H200)."""
    dec = FakeDecoder()
    batcher = CodecBatcher(dec, 209)  # type: ignore[arg-type]
    batcher.warm_up(main_only=True)
    assert graph_buckets(128) == (2, 4, 8, 16, 32, 48, 66, 98, 130)
    streams = [dec.new_state() for _ in range(128)]
    for n in (64, 96, 128):
        dec.calls.clear()
        audio = batcher.decode(streams[:n], [np.zeros((8, 12), np.int64)] * n)
        assert len(audio) == n and [(graphed, len(slots)) for graphed, slots, _ in dec.calls] == [(True, n + 2)]
    assert batcher.streams_per_call(8, 255) == 128 and batcher.streams_per_call(1, 255) == 128
    assert batcher.streams_per_call(5, 255) == 15  # odd lengths: graphs in the small buckets only


def test_a_shape_that_keeps_coming_under_load_is_captured_after_a_few_eager_calls() -> None:
    """Idle capture never happens on a server under steady load: a graphable shape not yet captured runs
    eagerly only EAGER_CALLS_BEFORE_CAPTURE - 1 times, then gets its graph; shapes with no graph stay eager."""
    from moss_rt.engine.codec_batch import EAGER_CALLS_BEFORE_CAPTURE

    dec = FakeDecoder()
    batcher = CodecBatcher(dec, 64)  # type: ignore[arg-type]
    batcher.warm_up(limit=1)  # as before ready: only the likeliest graph
    streams = [dec.new_state() for _ in range(40)]
    for _ in range(EAGER_CALLS_BEFORE_CAPTURE + 2):
        batcher.decode(streams, [np.zeros((8, 12), np.int64)] * 40)  # bucket 48, 8 frames: graphable
        batcher.decode(streams, [np.zeros((5, 12), np.int64)] * 40)  # (48, 5): no graph ever
    full = [graphed for graphed, slots, t in dec.calls if t == 8]
    odd = [graphed for graphed, slots, t in dec.calls if t == 5]
    assert full == [False] * (EAGER_CALLS_BEFORE_CAPTURE - 1) + [True] * 3 and (48, 8) in dec.captured
    assert not any(odd) and (48, 5) not in dec.captured
    assert all(s.frames == (8 + 5) * (EAGER_CALLS_BEFORE_CAPTURE + 2) for s in streams)


def test_deferred_captures_are_counted_at_hand_over_and_captured_between_calls() -> None:
    """With the codec on a worker thread, the scheduler counts a call when it hands it over (note_call) and
    has the wanted graphs captured between rounds: decode itself never captures (nor counts)."""
    from moss_rt.engine.codec_batch import EAGER_CALLS_BEFORE_CAPTURE

    dec = FakeDecoder()
    batcher = CodecBatcher(dec, 64, defer_captures=True)  # type: ignore[arg-type]
    batcher.warm_up(limit=1)
    streams = [dec.new_state() for _ in range(40)]
    full = [np.zeros((8, 12), np.int64)] * 40
    for _ in range(3 * EAGER_CALLS_BEFORE_CAPTURE):
        batcher.decode(streams, full)  # not handed over through note_call: never counted
    assert batcher.wanted == [] and (48, 8) not in dec.captured
    for i in range(EAGER_CALLS_BEFORE_CAPTURE):
        batcher.note_call(full)
        assert batcher.wanted == ([(48, 8)] if i == EAGER_CALLS_BEFORE_CAPTURE - 1 else [])
        batcher.decode(streams, full)
    assert (48, 8) not in dec.captured and not any(graphed for graphed, _, _ in dec.calls)
    assert batcher.capture_wanted() and (48, 8) in dec.captured and batcher.wanted == []
    assert not batcher.capture_wanted()
    batcher.note_call(full)
    batcher.decode(streams, full)
    assert dec.calls[-1][0] and len(dec.calls[-1][1]) == 48 and batcher.wanted == []


def test_the_start_captures_buckets_up_to_64_streams_and_the_larger_ones_come_first_while_idle() -> None:
    """Before ready the engine captures the first- and full-chunk graphs of buckets up to READY_MAX_BUCKET (each
    larger one costs a start an eager call of up to 130 streams); idle captures then take the larger ones first."""
    from moss_rt.engine.codec_batch import READY_MAX_BUCKET

    dec = FakeDecoder()
    batcher = CodecBatcher(dec, 209)  # type: ignore[arg-type]
    batcher.warm_up(main_only=True, max_bucket=READY_MAX_BUCKET)
    assert sorted(dec.captured) == sorted((b, t) for b in (2, 4, 8, 16, 32, 48, 66) for t in (1, 8))
    assert batcher.capture_next(main_only=True) and dec.captured[-1] == (98, 1)
    batcher.warm_up(main_only=True)
    assert dec.captured[-3:] == [(98, 8), (130, 1), (130, 8)]
    assert not batcher.capture_next(main_only=True) and batcher.pending()  # the odd chunk lengths are left


def test_main_shapes_can_be_captured_before_the_odd_chunk_lengths() -> None:
    dec = FakeDecoder()
    batcher = CodecBatcher(dec, 64)  # type: ignore[arg-type]
    while batcher.capture_next(main_only=True):
        pass
    # first chunks (T=1) and full chunks (T=8) of every batch bucket, nothing else yet
    assert sorted(dec.captured) == sorted((b, t) for b in graph_buckets(64) for t in (1, 8))
    assert batcher.pending() and all(t not in (1, 8) for _, t in batcher.pending())
    assert batcher.capture_next() and dec.captured[-1][1] not in (1, 8)
