"""Prefill attention through SDPA (chunk_attention): the same attention as the plain path, causal and masked, and
a prefill through it leaves the cache and the codes the plain path gives. On the CPU through the ``interpret``
switch (the CUDA default runs the same calls on the GPU; tests/gpu checks batched prefill there)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moss_rt.generation import SamplingParams
from moss_rt.model import chunk_attention
from moss_rt.model.layers import grouped_attention
from moss_rt.model.runner import PrefillRequest

GREEDY = SamplingParams(text_temperature=0.0, audio_temperature=0.0)


@pytest.fixture
def sdpa_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOSS_RT_CHUNK_SDPA", "interpret")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _qkv(batch: int, tq: int, keys: int, hq: int = 8, hkv: int = 2, dim: int = 16):
    g = torch.Generator().manual_seed(batch * 100 + tq)
    q = torch.randn(batch, tq, hq, dim, generator=g)
    k = torch.randn(batch, hkv, keys, dim, generator=g)
    v = torch.randn(batch, hkv, keys, dim, generator=g)
    return q, k, v


def test_plain_path_unless_switched(monkeypatch: pytest.MonkeyPatch) -> None:
    t = torch.zeros(1)
    assert not chunk_attention.available(t)  # CPU default: the plain path, whose rounding CPU parity pins
    monkeypatch.setenv("MOSS_RT_CHUNK_SDPA", "interpret")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert chunk_attention.available(t)
    monkeypatch.setenv("MOSS_RT_CHUNK_SDPA", "0")
    assert not chunk_attention.available(t)


def test_causal_equals_the_masked_plain_attention(sdpa_on_cpu) -> None:
    q, k, v = _qkv(3, 12, 12)
    mask = torch.ones(12, 12, dtype=torch.bool).tril()[None].expand(3, 12, 12)
    want = grouped_attention(q, k, v, mask, 0.25)
    got = chunk_attention.chunk_attention(q, k, v, mask, 0.25, causal=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # causal=True means the mask is not read: a wrong mask passed along changes nothing
    got_ignoring = chunk_attention.chunk_attention(q, k, v, torch.ones_like(mask), 0.25, causal=True)
    torch.testing.assert_close(got_ignoring, want, rtol=1e-5, atol=1e-5)


def test_masked_chunks_with_offsets_equal_the_plain_attention(sdpa_on_cpu) -> None:
    """Chunks that start past position 0 (a long prompt's later piece, a retake's kept frames): each row sees its
    own slot's keys up to its position, rows of different slots at different offsets in one pass."""
    q, k, v = _qkv(2, 5, 20)
    starts = torch.tensor([0, 15])
    positions = starts[:, None] + torch.arange(5)[None, :]
    mask = torch.arange(20)[None, None, :] <= positions[:, :, None]
    want = grouped_attention(q, k, v, mask, 0.3)
    got = chunk_attention.chunk_attention(q, k, v, mask, 0.3, causal=False)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # and the mask matters there: all-visible keys give another answer
    other = chunk_attention.chunk_attention(q, k, v, torch.ones_like(mask), 0.3, causal=False)
    assert not torch.allclose(other, want, atol=1e-3)


def _prefill_then_codes(runner, prompts, frames: int):
    slots = [runner.alloc_slot() for _ in prompts]
    runner.prefill_batch([PrefillRequest(s, p) for s, p in zip(slots, prompts, strict=True)])
    long = prompts[0]
    cut = len(long) // 2
    runner.truncate(slots[0], cut)  # then a piece from a nonzero start: the masked branch
    runner.prefill_batch([PrefillRequest(slots[0], long[cut:], start=cut)])
    return _caches_and_greedy_codes(runner, slots, frames)


def _caches_and_greedy_codes(runner, slots, frames: int):
    """What the slots' caches hold, then ``frames`` greedy frames of them all."""
    for i, s in enumerate(slots):
        runner.set_sampling(s, GREEDY, seed=i)
    caches = [runner.slot_cache(s, runner.slot_length(s)) for s in slots]
    codes = np.stack([runner.step(slots).codes for _ in range(frames)], axis=1)
    return caches, codes


def test_prefill_through_sdpa_leaves_the_plain_paths_cache_and_codes(make_runner, monkeypatch) -> None:
    r = make_runner(max_slots=1)
    prompts = [
        r.build_prompt(text="A much longer line of text, said very calmly and slowly.", instruction="Whisper."),
        r.build_prompt(text="Hi.", instruction=""),  # shorter: padded rows in the causal pass
    ]
    plain_caches, plain_codes = _prefill_then_codes(make_runner(max_slots=2), prompts, 8)
    monkeypatch.setenv("MOSS_RT_CHUNK_SDPA", "interpret")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    runner = make_runner(max_slots=2)
    runner.per_slot_eager = False  # one padded pass, as on CUDA
    sdpa_caches, sdpa_codes = _prefill_then_codes(runner, prompts, 8)
    for plain, sdpa in zip(plain_caches, sdpa_caches, strict=True):
        for x, y in zip(plain, sdpa, strict=True):
            torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(sdpa_codes, plain_codes)


def test_packed_pieces_equal_the_masked_attention_of_each_piece() -> None:
    """Pieces packed end to end, each with its own opening: query t of a piece sees its keys up to its own position
    (the causal mask aligned to the piece's last key), as the padded pass's key mask says."""
    g = torch.Generator().manual_seed(7)
    hq, hkv, dim, rows = 8, 2, 16, 5
    starts = [3, 0, 11]
    qs = [torch.randn(rows, hq, dim, generator=g) for _ in starts]
    ks = [torch.randn(s + rows, hkv, dim, generator=g) for s in starts]
    vs = [torch.randn(s + rows, hkv, dim, generator=g) for s in starts]
    cu_q = torch.tensor([0, rows, 2 * rows, 3 * rows], dtype=torch.int32)
    cu_k = torch.tensor([0, *np.cumsum([s + rows for s in starts])], dtype=torch.int32)
    spare = torch.randn(4, hkv, dim, generator=g)  # entries past the last piece: never read
    got = chunk_attention.packed_causal_attention(
        torch.cat(qs), torch.cat([*ks, spare]), torch.cat([*vs, spare]), cu_q, cu_k, rows, max(starts) + rows, 0.3,
    )
    for i, s in enumerate(starts):
        mask = torch.arange(s + rows)[None, :] <= (s + torch.arange(rows))[:, None]
        want = grouped_attention(qs[i][None], ks[i].transpose(0, 1)[None], vs[i].transpose(0, 1)[None], mask[None], 0.3)
        torch.testing.assert_close(got[i * rows : (i + 1) * rows].reshape(rows, -1), want[0], rtol=1e-5, atol=1e-5)


def _after_prefix_pass(runner, prompts, cuts, frames: int):
    """Every prompt's opening prefilled alone, then the rest of every prompt in ONE pass after those openings (pieces of
    different starts and lengths: padded rows), then greedy codes."""
    slots = [runner.alloc_slot() for _ in prompts]
    runner.prefill_batch([PrefillRequest(s, p[:c]) for s, p, c in zip(slots, prompts, cuts, strict=True)])
    runner.prefill_batch([PrefillRequest(s, p[c:], start=c) for s, p, c in zip(slots, prompts, cuts, strict=True)])
    return _caches_and_greedy_codes(runner, slots, frames)


def test_a_packed_pass_after_openings_leaves_the_masked_passes_cache_and_codes(make_runner, monkeypatch) -> None:
    """MOSS_RT_PACKED_PREFILL (the CUDA path through flash attention's variable-length forward; here its reference,
    piece by piece): one batched pass of three prompts' rows after openings of different lengths writes the cache the
    masked padded pass writes, and the takes' codes are the same."""
    r = make_runner(max_slots=1)
    prompts = [
        r.build_prompt(text="A much longer line of text, said very calmly and slowly.", instruction="Whisper."),
        r.build_prompt(text="Hi there.", instruction="Shout it."),
        r.build_prompt(text="Somewhere in between, in length.", instruction=""),
    ]
    cuts = [len(prompts[0]) // 2, 5, len(prompts[2]) - 3]

    def run(packed: str):
        monkeypatch.setenv("MOSS_RT_PACKED_PREFILL", packed)
        runner = make_runner(max_slots=3)
        runner.per_slot_eager = False  # one padded pass, as on CUDA
        return _after_prefix_pass(runner, prompts, cuts, 6)

    masked_caches, masked_codes = run("0")
    packed_caches, packed_codes = run("interpret")
    for masked, packed in zip(masked_caches, packed_caches, strict=True):
        for x, y in zip(masked, packed, strict=True):
            torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(packed_codes, masked_codes)


def test_packed_pieces_only_on_cuda_in_flash_dtypes_unless_switched(monkeypatch: pytest.MonkeyPatch) -> None:
    t = torch.zeros(1)
    monkeypatch.delenv("MOSS_RT_PACKED_PREFILL", raising=False)
    assert not chunk_attention.packed_available(t)  # the default: CUDA tensors only
    monkeypatch.setenv("MOSS_RT_PACKED_PREFILL", "interpret")
    assert chunk_attention.packed_available(t)
    if torch.cuda.is_available():
        half, single = torch.zeros(1, device="cuda", dtype=torch.bfloat16), torch.zeros(1, device="cuda")
        monkeypatch.delenv("MOSS_RT_PACKED_PREFILL")
        assert chunk_attention.packed_available(half) and not chunk_attention.packed_available(single)
        monkeypatch.setenv("MOSS_RT_PACKED_PREFILL", "0")
        assert not chunk_attention.packed_available(half)
