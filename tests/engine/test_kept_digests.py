"""KeptDigests: what a prompt cache keeps, as deltas for a poller (a cluster's router), and the cache's journal."""

from __future__ import annotations

import numpy as np

from moss_rt.engine.kept_digests import KeptDigests
from moss_rt.engine.prompt_cache import PromptCache
from moss_rt.model.blocks import BlockPool


def test_a_poller_gets_a_snapshot_then_only_the_changes() -> None:
    kept = KeptDigests()
    kept.add(b"a")
    kept.add(b"b")
    first = kept.since()  # a new poller: everything
    assert first.full and set(first.added) == {b"a", b"b"}
    kept.add(b"c")
    kept.discard(b"a")
    kept.add(b"a")  # given back and kept again: net, it is held
    kept.discard(b"b")
    kept.add(b"b")
    kept.discard(b"b")
    delta = kept.since(first.epoch, first.seq)
    assert not delta.full
    assert set(delta.added) == {b"a", b"c"} and set(delta.removed) == {b"b"}
    nothing = kept.since(delta.epoch, delta.seq)
    assert not nothing.full and nothing.added == () and nothing.removed == ()
    kept.add(b"c")  # already held: no change
    assert kept.since(delta.epoch, delta.seq).added == ()


def test_a_cleared_cache_or_a_stale_cursor_gets_a_full_snapshot() -> None:
    kept = KeptDigests(max_changes=4)
    kept.add(b"a")
    cursor = kept.since()
    for key in (b"b", b"c", b"d", b"e", b"f"):  # more changes than remembered
        kept.add(key)
    late = kept.since(cursor.epoch, cursor.seq)
    assert late.full and set(late.added) == {b"a", b"b", b"c", b"d", b"e", b"f"}
    kept.clear()
    after = kept.since(late.epoch, late.seq)
    assert after.full and after.added == () and after.epoch != late.epoch
    assert kept.since("someone else's epoch", 3).full


def test_the_prompt_cache_journals_what_it_keeps_and_gives_back() -> None:
    pool = BlockPool(16, 4, 2, 8)
    cache = PromptCache(pool)
    kept = KeptDigests()
    cache.journal = kept
    rows = np.arange(10 * 13, dtype=np.int64).reshape(10, 13)
    keys = cache.keys(rows)
    assert keys is not None
    pool.reserve(0, pool.blocks_for(10))
    pool.prepare_write(0, 0, 10)
    cache.keep(keys, pool.slot_blocks(0), 10, with_whole=True)
    assert keys.whole is not None
    assert set(kept.since().added) == {*keys.full, keys.whole}
    pool.release(0)  # the take ended: only the cache holds the blocks now
    cursor = kept.since()
    cache.evict(pool.num_blocks)  # room needed: everything only the cache holds goes
    delta = kept.since(cursor.epoch, cursor.seq)
    assert set(delta.removed) == {*keys.full, keys.whole} and len(kept) == 0
    pool.reserve(1, pool.blocks_for(10))
    pool.prepare_write(1, 0, 10)
    cache.keep(keys, pool.slot_blocks(1), 10, with_whole=False)
    assert len(kept) == len(keys.full)
    cache.clear()
    assert len(kept) == 0
