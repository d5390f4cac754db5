"""Retakes from shared codec state (moss_rt/codec/paged_state.py, StreamingDecoder.detach/resume): a retake from
frame N continues from its parent's blocks without decoding a frame, copies a shared block only when it first
writes into it, and gives the same audio as the whole-clip decode, as a rebuild from the codes and as the parent
itself; every reference comes back.

CPU, fp32, the tiny codec (windows of 2 frames, rings of about 10 frames at every stage), so a parent's ring goes
round after a few frames: retakes close to the parent's end share, earlier ones must be rebuilt.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from moss_rt.codec import CodecModel
from moss_rt.codec.streaming import StreamingDecoder

N = 40
TOL = 1e-5


@pytest.fixture(scope="module")
def codes() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(5)
    parent = rng.integers(0, 1024, (N, 12)).astype(np.int64)
    other = rng.integers(0, 1024, (N, 12)).astype(np.int64)
    return parent, other


def _decoder(codec: CodecModel, **kw: object) -> StreamingDecoder:
    return StreamingDecoder(codec, device="cpu", dtype=torch.float32, max_streams=6, max_chunk_frames=8, **kw)


def _stream(dec: StreamingDecoder, state, codes: np.ndarray, start: int, sizes=(1, 1, 3, 8)) -> np.ndarray:
    """Decode ``codes[start:]`` into ``state`` in chunks of the given sizes (cycled); the audio, concatenated."""
    parts, i, k = [], start, 0
    while i < len(codes):
        n = min(sizes[k % len(sizes)], len(codes) - i)
        parts.append(dec.decode([state], [codes[i : i + n]])[0])
        i, k = i + n, k + 1
    return np.concatenate(parts, -1)


def test_a_retake_from_shared_blocks_decodes_nothing_and_equals_rebuild_whole_and_parent(
    tiny_codec: CodecModel, codes
) -> None:
    parent_codes, other = codes
    dec = _decoder(tiny_codec)
    run_before = dec._run
    forwards: list[int] = []

    def counting_run(states, chunk, **kwargs):  # type: ignore[no-untyped-def]
        forwards.append(chunk.shape[1])
        return run_before(states, chunk, **kwargs)

    dec._run = counting_run  # type: ignore[method-assign]
    length, n = 13, 5  # the parent decoded 13 frames in chunks 1, 1, 3, 8; the retake branches at 5 (in its ring)
    parent = dec.new_state()
    parent_audio = _stream(dec, parent, parent_codes[:length], 0)
    kept = dec.detach(parent)
    assert parent.closed and dec.free_slots == 6
    assert dec.can_resume(kept, n) and not dec.can_resume(kept, length + 1)

    # The same codes again from n: exactly what the parent itself produced from n (same chunk shapes, bit for bit).
    forwards.clear()
    same = dec.resume(kept, n)
    assert same.frames == n and forwards == []  # nothing decoded to get there
    again = _stream(dec, same, parent_codes[:length], n, sizes=(8,))
    np.testing.assert_array_equal(again, parent_audio[:, n * 3840 :])
    same.close()

    # Other codes from n (a retake's new frames): equal to the whole-clip decode and to a state rebuilt from codes.
    branch = np.concatenate([parent_codes[:n], other[: N - n]])
    whole = tiny_codec.decode(torch.from_numpy(branch)[None])[0].numpy()
    retake = dec.resume(kept, n)
    shared_audio = _stream(dec, retake, branch, n)
    assert dec.copies > 0  # its writes copied the blocks it shared
    rebuilt = dec.rebuild(branch[:n])
    rebuilt_audio = _stream(dec, rebuilt, branch, n)
    for state in (retake, rebuilt):
        state.close()
    assert np.abs(shared_audio - whole[:, n * 3840 :]).max() < TOL
    assert np.abs(shared_audio - rebuilt_audio).max() < TOL
    # ...and the parent's frames before n, kept in the shared blocks, were never touched by the retakes' writes:
    # a third retake from the same point repeats the second one bit for bit.
    third = dec.resume(kept, n)
    np.testing.assert_array_equal(_stream(dec, third, branch, n), shared_audio)
    third.close()
    dec.drop(kept)


def test_a_retake_past_what_the_ring_still_holds_cannot_share(tiny_codec: CodecModel, codes) -> None:
    """The parent went round its ring since frame n: the keys frame n needs are gone, so no sharing (the engine
    rebuilds from the codes instead), and resume refuses rather than decode from the wrong keys."""
    parent_codes, _ = codes
    dec = _decoder(tiny_codec)
    parent = dec.new_state()
    _stream(dec, parent, parent_codes, 0)
    kept = dec.detach(parent)
    assert dec.can_resume(kept, N - 2)
    assert not dec.can_resume(kept, 5)
    with pytest.raises(ValueError):
        dec.resume(kept, 5)
    dec.drop(kept)
    assert not dec.can_resume(kept, N - 2)  # given back: nothing to share


@pytest.mark.slow  # started first in parallel runs (tests/conftest.py)
def test_references_come_back_after_random_retakes_cancels_and_drops(tiny_codec: CodecModel, codes) -> None:
    """Parents kept, retakes branching from them (some several times, some decoding until their own end and kept
    in turn), streams closed mid-way, kept states dropped or just forgotten: every block's references return to
    their start and the audio of every retake stays exact."""
    parent_codes, other = codes
    dec = _decoder(tiny_codec, block_frames=1)  # small blocks: many shared/copied blocks per retake
    start_free, start_unreserved = dec.free_blocks, dec.unreserved_blocks
    rng = np.random.default_rng(3)
    kept: list[tuple[object, np.ndarray]] = []  # (KeptBlocks, its codes)
    checked = shared = 0
    for _ in range(100):
        if kept and rng.random() < 0.7:
            ref, ref_codes = kept[int(rng.integers(len(kept)))]
            n = int(rng.integers(1, ref.frames + 1))  # type: ignore[attr-defined]
            if not dec.can_resume(ref, n):  # type: ignore[arg-type]
                continue
            state = dec.resume(ref, n, max_frames=N)  # type: ignore[arg-type]
            shared += 1
            mine = np.concatenate([ref_codes[:n], other[int(rng.integers(0, 10)) :][: N - n]])
        else:
            state, n = dec.new_state(max_frames=N), 0
            mine = parent_codes
        end = int(rng.integers(n + 1, N + 1))
        audio = _stream(dec, state, mine[:end], n, sizes=(int(rng.integers(1, 9)),))
        if rng.random() < 0.3:  # the whole take, checked against the whole-clip decode
            whole = tiny_codec.decode(torch.from_numpy(mine[:end])[None])[0].numpy()
            assert np.abs(audio - whole[:, n * 3840 :]).max() < TOL
            checked += 1
        action = rng.random()
        if action < 0.5:
            kept.append((dec.detach(state), mine[:end]))
        elif action < 0.8:
            state.close()
        else:
            del state  # dropped without close: its finalizer gives it back
        if len(kept) > 4:
            ref, _ = kept.pop(int(rng.integers(len(kept))))
            if rng.random() < 0.5:
                dec.drop(ref)  # type: ignore[arg-type]
            del ref  # else: forgotten, collected
        gc.collect(0)  # young objects: a forgotten state is freed by its count; the final collect gets the rest
    for ref, _ in kept:
        dec.drop(ref)  # type: ignore[arg-type]
    kept.clear()
    gc.collect()
    assert shared >= 20 and checked >= 5 and dec.copies > 0
    assert dec.free_slots == 6
    assert dec.free_blocks == start_free and dec.unreserved_blocks == start_unreserved
    tables = dec._tables
    for i, g in enumerate(tables.geoms):
        assert all(tables.refcount(i, b) == 0 for b in range(g.scratch_blocks, tables.n_blocks[i]))
