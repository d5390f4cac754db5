"""PromptCache on its own: the keys a prompt's blocks are kept under, matching, keeping, claims and eviction."""

from __future__ import annotations

import numpy as np
import pytest

from moss_rt.engine.prompt_cache import PromptCache, PromptKeys, prompt_keys
from moss_rt.model.blocks import BlockPool

BS = 4


def _rows(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1000, size=(n, 13), dtype=np.int64)


def _pool(blocks: int = 32, slots: int = 4) -> BlockPool:
    return BlockPool(blocks, BS, slots, 16)


def _filled(pool: BlockPool, slot: int, rows: int) -> list[int]:
    """A slot whose first ``rows`` positions were written (as a prefill pass leaves it)."""
    pool.reserve(slot, pool.blocks_for(rows))
    pool.prepare_write(slot, 0, rows)
    return pool.slot_blocks(slot)


def _one_prompt(n: int) -> tuple[BlockPool, PromptCache, np.ndarray, list[int], PromptKeys | None]:
    """A cache on a fresh pool, and an ``n``-row prompt written into slot 0 (not kept yet)."""
    pool = _pool()
    cache = PromptCache(pool)
    rows = _rows(n)
    return pool, cache, rows, _filled(pool, 0, n), cache.keys(rows)


def test_keys_name_every_row_up_to_each_block_end() -> None:
    a = _rows(10)
    b = a.copy()
    b[5, 3] += 1  # a change in the second block
    ka, kb = prompt_keys(a, BS), prompt_keys(b, BS)
    assert ka.length == 10 and len(ka.full) == 2 and ka.whole is not None
    assert ka.full[0] == kb.full[0] and ka.full[1] != kb.full[1] and ka.whole != kb.whole
    assert ka.common_blocks(kb) == 1
    assert prompt_keys(a[:8], BS).full == ka.full and prompt_keys(a[:8], BS).whole is None  # ends on a block
    assert prompt_keys(a[:9], BS).whole != ka.whole  # a whole prompt's key names its length too
    assert prompt_keys(a, BS) == prompt_keys(a.copy(), BS)


def test_a_kept_prompt_is_matched_whole_and_by_its_opening_blocks() -> None:
    pool, cache, rows, blocks, keys = _one_prompt(10)
    assert cache.match(keys).length == 0
    assert cache.wants_whole(keys, 10)
    cache.keep(keys, blocks, 10, with_whole=True)
    assert len(cache) == 3 and all(pool.refcount[b] == 2 for b in blocks)
    assert cache.match(keys).blocks == tuple(blocks) and cache.match(keys).length == 10

    other = rows.copy()
    other[9] += 1  # the same opening blocks, another last row
    m = cache.match(cache.keys(other))
    assert m.blocks == tuple(blocks[:2]) and m.length == 8
    longer = np.concatenate([rows, _rows(6, 1)])  # the kept prompt is its first 10 rows
    assert cache.match(cache.keys(longer)).length == 8  # the partial block is kept for the whole prompt only


def test_only_computed_blocks_are_kept_and_the_partial_one_only_when_asked() -> None:
    pool, cache, rows, blocks, keys = _one_prompt(10)
    cache.keep(keys, blocks, 5, with_whole=True)  # a first chunk of 5 rows: one full block computed
    assert cache.match(keys).length == 4
    cache.keep(keys, blocks, 10, with_whole=False)
    assert cache.match(keys).length == 8 and len(cache) == 2
    cache.keep(keys, blocks, 10, with_whole=True)
    assert cache.match(keys).length == 10 and not cache.wants_whole(keys, 10)


def test_eviction_gives_back_least_recently_used_leaves_first_and_never_shared_blocks() -> None:
    pool = _pool(blocks=16)
    cache = PromptCache(pool)
    a, b = _rows(12, 1), _rows(8, 2)
    ka, kb = cache.keys(a), cache.keys(b)
    blocks_a, blocks_b = _filled(pool, 0, 12), _filled(pool, 1, 8)
    cache.keep(ka, blocks_a, 12, with_whole=False)
    cache.keep(kb, blocks_b, 8, with_whole=False)
    pool.release(0)
    assert pool.available == 15 - 5  # a's 3 blocks kept by the cache alone, b's 2 by slot 1 and the cache
    cache.match(ka)  # a is the most recent now, and b's blocks are still the slot's
    assert cache.evict(need=pool.available + 2) == 2
    assert cache.match(ka).length == 4  # its two last blocks went, its first is kept (leaves first)
    assert cache.match(kb).length == 8  # shared with a running take: dropping them would free nothing
    pool.release(1)
    first = cache.match(ka).blocks[0]
    assert cache.evict(need=pool.available + 5, spare=frozenset({first})) == 2  # b's blocks; a's spared one stays
    assert cache.match(ka).length == 4 and cache.match(kb).length == 0
    cache.clear()
    assert len(cache) == 0 and pool.available == 15 and pool.free_blocks == 15


def test_a_block_being_computed_is_claimed_until_kept_or_given_up() -> None:
    pool = _pool()
    cache = PromptCache(pool)
    rows = _rows(12)
    keys = cache.keys(rows)
    cache.claim("leader", keys, 0)
    cache.claim("follower", keys, 0)  # claimed already: stays the leader's
    assert [cache.claimant(keys, i) for i in range(4)] == ["leader", "leader", "leader", None]
    blocks = _filled(pool, 0, 12)
    cache.keep(keys, blocks, 8, with_whole=False)  # the leader's first chunk: two blocks kept
    assert cache.claimant(keys, 1) is None and cache.claimant(keys, 2) == "leader"
    cache.unclaim("leader")
    assert cache.claimant(keys, 2) is None


def test_a_disabled_cache_keeps_and_matches_nothing() -> None:
    pool = _pool()
    cache = PromptCache(pool, enabled=False)
    keys = cache.keys(_rows(10))
    assert keys is None
    cache.keep(keys, _filled(pool, 0, 10), 10, with_whole=True)
    assert len(cache) == 0 and cache.match(keys).length == 0 and cache.claimant(keys, 0) is None
    assert not PromptCache(None).enabled


def test_holding_a_block_needs_it_allocated() -> None:
    pool = _pool()
    with pytest.raises(ValueError, match="not allocated"):
        pool.hold(3)
