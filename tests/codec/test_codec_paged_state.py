"""Paged codec state (moss_rt/codec/paged_state.py): blocks by age, reservations, exact decode through blocks.

CPU, fp32, the tiny codec (0.16 s windows: 2 frames at every stage, rings of ~10 frames), so 60 frames wrap every
stream's ring many times; the attention runs the SDPA path over rings gathered through the block table (the kernel
reads the same table: tests/codec/test_window_attention.py).
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from moss_rt.codec import CodecModel
from moss_rt.codec.config import CodecConfig
from moss_rt.codec.paged_state import geometries, scratch_state_bytes, stream_state_bytes
from moss_rt.codec.streaming import NoFreeBlocks, NoFreeSlot, StreamingDecoder
from moss_rt.codec.tiny import full_size_config

N = 60
TOL = 1e-5


@pytest.fixture(scope="module")
def clip(tiny_codec: CodecModel) -> tuple[np.ndarray, np.ndarray]:
    codes = np.random.default_rng(21).integers(0, 1024, (N, 12)).astype(np.int64)
    return codes, tiny_codec.decode(torch.from_numpy(codes)[None])[0].numpy()


@pytest.mark.parametrize("block_frames", [None, 1, 3])
@pytest.mark.parametrize("size", [1, 5, 7])
def test_paged_streaming_equals_whole(tiny_codec: CodecModel, clip, size: int, block_frames: int | None) -> None:
    codes, whole = clip
    dec = StreamingDecoder(tiny_codec, device="cpu", max_streams=2, max_chunk_frames=8, block_frames=block_frames)
    geoms = list(geometries(tiny_codec, 8, torch.float32, block_frames).values())
    assert all(g.ring_blocks >= 2 for g in geoms) and min(g.ring // g.tokens_per_frame for g in geoms) < N // 4
    st = dec.new_state()
    parts = []
    for i in range(0, N, size):
        parts.append(dec.decode([st], [codes[i : i + size]])[0])
        # what the stream holds is what its age needs, never more than its ring
        assert dec.state_bytes(st) == stream_state_bytes(tiny_codec, 8, torch.float32, st.frames, block_frames)
        assert dec.state_bytes(st) <= dec.stream_bytes
    st.close()
    assert np.abs(np.concatenate(parts, -1) - whole).max() < TOL


def test_blocks_come_back_after_many_streams(tiny_codec: CodecModel, clip) -> None:
    """Many streams of different lengths opened, decoded in shared calls, closed (or dropped) in random order:
    the free and unreserved block counts return to their starting values, and decoding stays exact."""
    codes, whole = clip
    dec = StreamingDecoder(tiny_codec, device="cpu", max_streams=5, max_chunk_frames=8, block_frames=1)
    start_free, start_unreserved = dec.free_blocks, dec.unreserved_blocks
    assert start_free == start_unreserved
    rng = np.random.default_rng(0)
    live: list[dict] = []  # {"state", "length", "audio"}
    opened = peak = 0
    for _ in range(150):
        if dec.free_slots and opened < 40 and rng.random() < 0.6:
            live.append({"state": dec.new_state(), "length": int(rng.integers(1, N + 1)), "audio": []})
            opened += 1
        if not live:
            continue
        batch = [e for e in live if rng.random() < 0.8] or live[:1]
        t = int(rng.integers(1, 9))
        chunks = [codes[e["state"].frames : min(e["length"], e["state"].frames + t)] for e in batch]
        for e, a in zip(batch, dec.decode([e["state"] for e in batch], chunks), strict=True):
            e["audio"].append(a)
        peak = max(peak, sum(start_free) - sum(dec.free_blocks))
        for e in [e for e in live if e["state"].frames >= e["length"]]:
            assert np.abs(np.concatenate(e["audio"], -1) - whole[:, : e["length"] * 3840]).max() < TOL
            live.remove(e)
            if rng.random() < 0.5:
                e["state"].close()
            else:
                e.clear()  # dropped: its finalizer gives the blocks back
        del batch, chunks
    for e in live:
        e["state"].close()
    live.clear()
    gc.collect()
    assert opened >= 30 and peak > 0
    assert dec.free_slots == 5
    assert dec.free_blocks == start_free and dec.unreserved_blocks == start_unreserved


def test_reservations_admit_short_streams_and_never_fail_halfway(tiny_codec: CodecModel, clip) -> None:
    """A pool smaller than one window per slot: a stream is admitted only with its blocks reserved; short streams
    (max_frames) reserve less, so more fit; one that outgrows its reservation with no spare block fails its call
    before anything advances, and the others keep decoding."""
    codes, whole = clip
    dec = StreamingDecoder(tiny_codec, device="cpu", max_streams=4, max_chunk_frames=8, pool_streams=2,
                           block_frames=1)
    a, b = dec.new_state(), dec.new_state()  # two whole windows: the pool is fully promised
    assert not dec.can_open() and not dec.can_open(max_frames=1)
    with pytest.raises(NoFreeBlocks):
        dec.new_state()
    assert dec.free_slots == 2  # the failed admission took no slot
    b.close()
    # the second window's worth of blocks admits several short streams (2 frames each need 2 blocks at most)
    geoms = list(geometries(tiny_codec, 8, torch.float32, 1).values())
    per_short = [g.blocks_for(2) for g in geoms]
    fits = min(g.ring_blocks // n for g, n in zip(geoms, per_short, strict=True))
    assert fits >= 2
    shorts = [dec.new_state(max_frames=2) for _ in range(min(fits, 3))]
    outs = dec.decode([a, *shorts], [codes[:2]] * (1 + len(shorts)))
    for o in outs:
        assert np.abs(o - whole[:, : 2 * 3840]).max() < TOL
    # a short stream going past its reservation: fine while spare blocks exist, refused when none are left
    over = shorts[0]
    while True:
        try:
            dec.decode([over], [codes[over.frames : over.frames + 1]])
        except NoFreeBlocks:
            break
        assert over.frames < N
    frames = over.frames
    with pytest.raises(NoFreeBlocks):
        dec.decode([a, over], [codes[2:3], codes[frames : frames + 1]])
    assert (a.frames, over.frames) == (2, frames)  # nothing advanced
    (ra,) = dec.decode([a], [codes[2:10]])  # the stream with its window reserved carries on, exactly
    assert np.abs(ra - whole[:, 2 * 3840 : 10 * 3840]).max() < TOL
    for s in (a, *shorts):
        s.close()
    assert dec.unreserved_blocks == dec.free_blocks


def test_slot_exhaustion_still_raises_no_free_slot(tiny_codec: CodecModel) -> None:
    dec = StreamingDecoder(tiny_codec, device="cpu", max_streams=1, max_chunk_frames=4)
    s = dec.new_state()
    with pytest.raises(NoFreeSlot):
        dec.new_state()
    s.close()
    dec.new_state().close()


def test_full_size_bytes_grow_with_age() -> None:
    """The real shapes (bf16, 10 s windows, 8-frame chunks): a young stream holds a fraction of the window, a
    stream past the window holds its ring, less than the 342.9 MB every stream held before paging."""
    with torch.device("meta"):
        codec = CodecModel(CodecConfig.from_dict(full_size_config()), with_encoder=False)
    full = stream_state_bytes(codec, 8, torch.bfloat16)
    by_age = {s: stream_state_bytes(codec, 8, torch.bfloat16, frames=round(12.5 * s)) for s in (2, 10, 60)}
    assert by_age[2] < 0.25 * full < by_age[10] <= by_age[60] == full < 342.9e6
    assert scratch_state_bytes(codec, 8, torch.bfloat16) < 0.15 * full


def test_pool_is_what_the_memory_plan_counts(tiny_codec: CodecModel) -> None:
    """The memory plan budgets max_streams whole rings plus the scratch blocks (engine/memory_costs.py): exactly
    the pools a default decoder allocates."""
    for dtype in (torch.float32, torch.bfloat16):
        codec = CodecModel(tiny_codec.config, with_encoder=False)
        dec = StreamingDecoder(codec, device="cpu", dtype=dtype, max_streams=3, max_chunk_frames=8)
        per_stream = stream_state_bytes(codec, 8, dtype)
        assert dec.stream_bytes == per_stream
        assert dec.pool_bytes == 3 * per_stream + scratch_state_bytes(codec, 8, dtype)


def test_compile_passes_on_the_scratch_row_change_no_stream(tiny_codec: CodecModel, clip) -> None:
    """StreamingDecoder.compile_shape (the kernels of a graph shape compiled ahead of its capture, several shapes on
    threads at once: engine/warm_compile.py) runs on the scratch row only: open streams decode exactly as without."""
    import threading

    codes, _ = clip

    def run(compile_between: bool) -> list[np.ndarray]:
        dec = StreamingDecoder(tiny_codec, device="cpu", max_streams=3, max_chunk_frames=8, block_frames=1)
        a, b = dec.new_state(), dec.new_state()
        out = []
        for i in range(0, 40, 8):
            out += dec.decode([a, b], [codes[i : i + 8], codes[i + 1 : i + 9]])
            if compile_between:
                threads = [threading.Thread(target=dec.compile_shape, args=bt) for bt in ((2, 1), (3, 8), (1, 5))]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
        a.close()
        b.close()
        return out

    plain, with_passes = run(False), run(True)
    assert all(np.array_equal(x, y) for x, y in zip(plain, with_passes, strict=True))
