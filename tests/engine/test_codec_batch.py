"""CodecBatcher's graph path (padding, slot order) with a recording stand-in decoder (no CUDA needed)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moss_rt.engine.codec_batch import GRAPH_BUCKETS, CodecBatcher


@dataclass(eq=False)
class FakeState:
    slot: int
    frames: int = 0

    def close(self) -> None:
        pass


class FakeDecoder:
    max_chunk_frames = 25

    def __init__(self) -> None:
        self.cuda_graphs = True
        self.next_slot = 0
        self.calls: list[tuple[bool, list[int], int]] = []

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
    batcher = CodecBatcher(dec)  # type: ignore[arg-type]
    assert batcher.graphs and dec.next_slot == CodecBatcher.pad_streams()
    streams = [dec.new_state() for _ in range(5)]
    chunks = [np.zeros((8, 12), np.int64)] * 3 + [np.zeros((1, 12), np.int64)] * 2
    audio = batcher.decode(streams, chunks)
    assert [int(a[0, 0]) for a in audio] == [s.slot for s in streams]
    assert [a.shape[1] for a in audio] == [3840 * 8] * 3 + [3840] * 2
    for graphed, slots, _ in dec.calls:
        assert graphed and len(slots) in GRAPH_BUCKETS
        assert slots[0] == 0 and slots[1] != 1  # pad 0 first: the slot list is never a contiguous run
    assert [s.frames for s in streams] == [8, 8, 8, 1, 1]


def test_big_batches_and_long_chunks_run_eager() -> None:
    dec = FakeDecoder()
    batcher = CodecBatcher(dec)  # type: ignore[arg-type]
    streams = [dec.new_state() for _ in range(GRAPH_BUCKETS[-1])]
    audio = batcher.decode(streams, [np.zeros((8, 12), np.int64)] * len(streams))
    assert len(audio) == len(streams)
    one = batcher.decode(streams[:1], [np.zeros((30, 12), np.int64)])
    assert one[0].shape[1] == 30 * 3840
    assert [graphed for graphed, _, _ in dec.calls] == [False, False]
    assert dec.cuda_graphs  # restored after the eager calls
