"""Exact streaming decode: chunked == whole-clip, batched == individual, rebuild == uninterrupted.

The tiny codec's windows are 2, 4, 8, 16, 32, 64 tokens (= 2 frames at every decoder stage) and the
decoder has 7 attention layers, so 60 frames are many times the windows and the stacked receptive field.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from moss_rt.codec import CodecModel
from moss_rt.codec.streaming import NoFreeSlot, StreamingDecoder

N = 60
TOL = 1e-5  # fp32 max abs difference; the tiny codec's output peaks near 1


@pytest.fixture(scope="module")
def dec(tiny_codec: CodecModel) -> StreamingDecoder:
    return StreamingDecoder(tiny_codec, device="cpu", dtype=torch.float32, max_streams=6, max_chunk_frames=8)


@pytest.fixture(scope="module")
def clips(tiny_codec: CodecModel) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(7)
    out = []
    for _ in range(3):
        codes = rng.integers(0, 1024, (N, 12)).astype(np.int64)
        out.append((codes, tiny_codec.decode(torch.from_numpy(codes)[None])[0].numpy()))
    return out


def _chunks(sizes: list[int]) -> Iterator[tuple[int, int]]:
    i, k = 0, 0
    while i < N:
        n = min(sizes[k % len(sizes)], N - i)
        yield i, n
        i, k = i + n, k + 1


@pytest.mark.parametrize("sizes", [[1], [2], [5], [18], [3, 1, 7, 2, 18, 5, 1, 9]], ids=str)
def test_chunked_equals_whole(dec: StreamingDecoder, clips, sizes: list[int]) -> None:
    codes, whole = clips[0]
    state = dec.new_state()
    try:
        parts = []
        for i, n in _chunks(sizes):
            (a,) = dec.decode([state], [codes[i : i + n]])
            assert a.shape == (2, 3840 * n) and a.dtype == np.float32
            parts.append(a)
        assert state.frames == N
    finally:
        state.close()
    got = np.concatenate(parts, axis=-1)
    assert np.abs(got - whole).max() < TOL


def test_batched_streams_equal_individual(dec: StreamingDecoder, clips) -> None:
    # three streams at different ages and chunk sizes in the same calls (grouped by T internally)
    states = [dec.new_state() for _ in range(3)]
    try:
        # stagger: stream 1 starts 4 frames in (its state is older), stream 2 decodes 3-frame chunks
        (a,) = dec.decode([states[1]], [clips[1][0][:4]])
        outs: list[list[np.ndarray]] = [[], [a], []]
        pos = [0, 4, 0]
        sizes = [5, 5, 3]
        while any(p < N for p in pos):
            live = [s for s in range(3) if pos[s] < N]
            chunk = [clips[s][0][pos[s] : pos[s] + sizes[s]] for s in live]
            res = dec.decode([states[s] for s in live], chunk)
            for s, r in zip(live, res, strict=True):
                outs[s].append(r)
                pos[s] += len(chunk[live.index(s)])
        for s in range(3):
            got = np.concatenate(outs[s], axis=-1)
            assert np.abs(got - clips[s][1]).max() < TOL
    finally:
        for st in states:
            st.close()


def test_noncontiguous_slots_take_the_gather_path(dec: StreamingDecoder, clips) -> None:
    held = [dec.new_state() for _ in range(4)]
    a, b = held[0], held[3]  # slots with a gap between them
    held[1].close()
    held[2].close()
    try:
        oa, ob = [], []
        for i in range(0, N, 6):
            ra, rb = dec.decode([b, a], [clips[1][0][i : i + 6], clips[0][0][i : i + 6]])
            oa.append(rb)
            ob.append(ra)
        assert np.abs(np.concatenate(oa, -1) - clips[0][1]).max() < TOL
        assert np.abs(np.concatenate(ob, -1) - clips[1][1]).max() < TOL
    finally:
        a.close()
        b.close()


def test_rebuild_then_continue_equals_uninterrupted(dec: StreamingDecoder, clips) -> None:
    codes, whole = clips[2]
    for n in (0, 1, 23, 41):  # 41 > max_chunk_frames: the rebuild itself is chunked
        state = dec.rebuild(codes[:n])
        try:
            assert state.frames == n
            parts = [dec.decode([state], [codes[i : i + 7]])[0] for i in range(n, N, 7)]
        finally:
            state.close()
        assert np.abs(np.concatenate(parts, -1) - whole[:, n * 3840 :]).max() < TOL


def test_state_matters(dec: StreamingDecoder, clips) -> None:
    """Negative control: continuing from a fresh state instead of the real one gives different audio,
    so the equalities above are not vacuous."""
    codes, whole = clips[0]
    state = dec.new_state()
    try:
        (a,) = dec.decode([state], [codes[30:35]])
    finally:
        state.close()
    assert np.abs(a - whole[:, 30 * 3840 : 35 * 3840]).max() > 1e-2


def test_slots_are_bounded_and_released(tiny_codec: CodecModel) -> None:
    d = StreamingDecoder(tiny_codec, device="cpu", dtype=torch.float32, max_streams=2, max_chunk_frames=4)
    s1, s2 = d.new_state(), d.new_state()
    with pytest.raises(NoFreeSlot):
        d.new_state()
    s1.close()
    s1.close()  # idempotent
    s3 = d.new_state()
    assert d.free_slots == 0
    del s2  # garbage-collected states give their slot back too
    import gc

    gc.collect()
    assert d.free_slots == 1
    s3.close()
    assert d.free_slots == 2


def test_bad_input_is_rejected(dec: StreamingDecoder) -> None:
    state = dec.new_state()
    try:
        with pytest.raises(ValueError, match="no frames"):
            dec.decode([state], [np.zeros((0, 12), np.int64)])
        with pytest.raises(ValueError, match="out of range"):
            dec.decode([state], [np.full((1, 12), 1024)])
        with pytest.raises(ValueError, match=r"\[T, >= 12\]"):
            dec.decode([state], [np.zeros((2, 11), np.int64)])
        with pytest.raises(ValueError, match="twice"):
            dec.decode([state, state], [np.zeros((1, 12), np.int64)] * 2)
        assert state.frames == 0  # nothing advanced
    finally:
        state.close()
    with pytest.raises(ValueError, match="closed"):
        dec.decode([state], [np.zeros((1, 12), np.int64)])


def test_a_bad_chunk_among_many_fails_the_call_before_any_stream_advances(dec: StreamingDecoder) -> None:
    """A call's codes are checked per chunk length before any state moves: one stream's out-of-range code (in
    another length's group than the first streams') fails the whole call, and no stream advanced."""
    states = [dec.new_state() for _ in range(4)]
    try:
        good = np.zeros((3, 12), np.int64)
        bad = np.zeros((1, 12), np.int64)
        bad[0, 5] = 1024
        with pytest.raises(ValueError, match="out of range"):
            dec.decode(states, [good, good, np.zeros((1, 12), np.int32), bad])
        with pytest.raises(ValueError, match="integers"):
            dec.decode(states, [good, good, good, np.zeros((3, 12), np.float32)])
        assert [s.frames for s in states] == [0, 0, 0, 0]
    finally:
        for s in states:
            s.close()


def test_numpy_and_tensor_chunks_of_mixed_dtypes_decode_alike(
    dec: StreamingDecoder, clips: list[tuple[np.ndarray, np.ndarray]]
) -> None:
    """Host chunks (copied in one transfer a call) and tensors (each its own) give the same audio, whatever
    integer dtype they come in; extra codebook columns past the decoder's are ignored."""
    (a, _), (b, _) = clips[0], clips[1]
    as_numpy = [dec.new_state(), dec.new_state()]
    as_tensors = [dec.new_state(), dec.new_state()]
    try:
        wide = np.concatenate([b[:4], np.full((4, 2), 5000, np.int64)], axis=1)  # 14 columns: the last 2 unused
        ref = dec.decode(as_numpy, [a[:4].astype(np.int16), wide])
        out = dec.decode(as_tensors, [torch.from_numpy(a[:4]).to(torch.int32), torch.from_numpy(wide)])
        for x, y in zip(ref, out, strict=True):
            np.testing.assert_array_equal(x, y)
        assert [s.frames for s in as_numpy + as_tensors] == [4, 4, 4, 4]
    finally:
        for s in as_numpy + as_tensors:
            s.close()


def test_exact_at_real_window_sizes(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Real geometry (10 s windows: 125…4000 tokens, rings of 4000+ entries) at toy width: 132 frames cross
    the 125-frame window of every decoder stage, in mixed 9/4-frame chunks.

    Run in float64 so the check is about which keys each query sees, not about rounding: in fp32 the same
    comparison is ~5e-7 almost everywhere but reaches ~1e-5 at one ill-conditioned spot of this random
    network (frame 73), where float64 shows 1e-14."""
    from moss_rt.codec import load_codec
    from moss_rt.codec.tiny import tiny_config, write_codec

    codec = load_codec(write_codec(tmp_path_factory.mktemp("c10"), tiny_config(10.0), seed=3), decode_only=True)
    assert [s.context for s in codec.config.decoder if hasattr(s, "context")] == [125, 250, 500, 1000, 2000, 4000]
    codec = codec.double()
    codec.quantizer.build_lut()
    n = 132
    codes = np.random.default_rng(0).integers(0, 1024, (n, 12))
    whole = codec.decode(torch.from_numpy(codes)[None])[0].numpy()
    assert whole.dtype == np.float64
    dec = StreamingDecoder(codec, device="cpu", dtype=torch.float64, max_streams=1, max_chunk_frames=9)
    state = dec.new_state()
    parts, i = [], 0
    for k in range(1000):
        if i >= n:
            break
        step = min((9, 4)[k % 2], n - i)
        parts.append(dec.decode([state], [codes[i : i + step]])[0])
        i += step
    assert np.abs(np.concatenate(parts, -1) - whole).max() < 1e-10


def test_reused_slot_does_not_leak_the_previous_stream(dec: StreamingDecoder, clips) -> None:
    """A new state in a slot that just held another stream (its rings full of that stream's keys) must
    decode exactly like a fresh decoder: entries from before position 0 are masked out."""
    first = dec.new_state()
    slot = first.slot
    for i in range(0, N, 8):
        dec.decode([first], [clips[0][0][i : i + 8]])
    first.close()
    second = dec.new_state()
    try:
        assert second.slot == slot  # the free list hands the same row back
        parts = [dec.decode([second], [clips[1][0][i : i + 3]])[0] for i in range(0, 30, 3)]
    finally:
        second.close()
    assert np.abs(np.concatenate(parts, -1) - clips[1][1][:, : 30 * 3840]).max() < TOL
