"""The paged KV cache: same codes as the contiguous cache, blocks given back, retakes share their parent's blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moss_rt.model.blocks import BlockPool, PoolExhausted
from moss_rt.model.state import SlotState
from moss_rt.model.tiny import tiny_config
from tests.model.paged_scenario import GOLDEN, make_runner, run_scenario


@pytest.mark.parametrize("block_size", [16, 5])  # the default, and one that splits prompts mid-block
def test_paged_cache_gives_the_contiguous_cache_codes(block_size: int) -> None:
    with np.load(GOLDEN) as data:
        golden = {k: data[k] for k in data.files}
    runner = make_runner(block_size=block_size)
    codes = run_scenario(runner)
    assert codes.keys() == golden.keys()
    for key in golden:
        np.testing.assert_array_equal(codes[key], golden[key], err_msg=f"take {key}, block size {block_size}")
    assert runner.free_blocks < runner.blocks.num_blocks - 1  # the scenario's takes still hold blocks


def test_block_pool_refcounts_copy_on_write_and_reservations() -> None:
    pool = BlockPool(num_blocks=10, block_size=4, max_slots=3, max_blocks_per_slot=8)
    assert pool.free_blocks == 9  # block 0 is scratch
    assert pool.prepare_write(0, 0, 10) == []  # 3 fresh blocks
    ref = pool.detach(0, 10)
    assert pool.free_blocks == 6 and ref.blocks == [1, 2, 3]
    pool.attach(1, ref, 6)  # a retake from position 6 shares blocks 1 and 2
    assert pool.free_blocks == 6
    copies = pool.prepare_write(1, 6, 7)  # writing into shared block 2 copies it
    assert copies == [(2, 4)] and pool.slot_blocks(1) == [1, 4]
    pool.release(1)
    pool.drop(ref)
    assert pool.free_blocks == 9
    assert pool.reserve(2, 9) and not pool.reserve(1, 1)  # all promised to slot 2
    with pytest.raises(PoolExhausted):
        pool.prepare_write(1, 0, 1)
    pool.unreserve(2)
    assert pool.available == 9


def test_copy_blocks_copies_every_pair_in_one_batch_and_touches_nothing_else() -> None:
    """Copy on write of several shared blocks at once (a burst of retakes' first step): each destination block gets
    its source's keys, values and hidden states, sources and every other position stay as they were."""
    bs = 4
    state = SlotState.allocate(tiny_config(), 3, 32, torch.device("cpu"), torch.float32, num_blocks=12, block_size=bs)
    gen = torch.Generator().manual_seed(0)
    for t in (state.k_cache, state.v_cache, state.hidden):
        t.copy_(torch.randn(t.shape, generator=gen))
    before = [t.clone() for t in (state.k_cache, state.v_cache, state.hidden)]
    pairs = [(2, 7), (5, 3), (9, 10)]
    state.copy_blocks(pairs)
    expected = [t.clone() for t in before]
    for src, dst in pairs:
        s, d = slice(src * bs, (src + 1) * bs), slice(dst * bs, (dst + 1) * bs)
        expected[0][:, d], expected[1][:, d], expected[2][d] = before[0][:, s], before[1][:, s], before[2][s]
    for got, want in zip((state.k_cache, state.v_cache, state.hidden), expected, strict=True):
        assert torch.equal(got, want)
    assert not torch.equal(expected[2], before[2])  # the copies changed something
    state.copy_blocks([])  # nothing to copy: nothing changes
    assert torch.equal(state.hidden, expected[2])
