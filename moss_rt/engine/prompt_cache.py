"""Prompt prefixes kept in the KV pool, so a take whose prompt opens like an earlier one's skips that prefill.

Takes of one voice and one direction share most of their prompt rows: the user turn with the reference
codes and the instruction fields come before the line's text (model/prompt.py). After a prefill pass the
blocks its rows filled stay in the pool under keys that name every row up to each block's end (a chain
of digests: a position's keys and values depend on every row before it), and the block holding a whole
prompt's last rows under that prompt's key. A later take shares (reference counted, copy on write) the
longest run of kept blocks its own rows name, and prefills only what follows; a take whose whole prompt is
kept prefills nothing.

Within a burst nothing is kept yet, so a take whose next block another preparing take is computing waits
for it (:meth:`PromptCache.claimant`) instead of computing the same rows in the same pass.

Kept blocks cost nothing until the room is needed: :meth:`PromptCache.evict` gives back blocks held only by
the cache, least recently used first (a chain's deepest block before its parents), when a take's
reservation needs them.

Numbers: a whole-prompt match reuses exactly what the first take of that prompt computed. A partial match
gives the take keys and values computed in another pass, equal to its own to float rounding (the caveat
batched prefill already has on CUDA), so its sampled codes may differ from a run that prefilled it all.

Host-side bookkeeping only (no tensors): the scheduler owns one and calls it on its worker thread.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from moss_rt.engine.kept_digests import KeptDigests
from moss_rt.model.blocks import SCRATCH_BLOCK, BlockPool

_DIGEST_BYTES = 16


@dataclass(frozen=True)
class PromptKeys:
    """What a prompt's blocks are kept under: one chained digest per full block, and its whole rows'."""

    length: int  # rows of the prompt
    full: tuple[bytes, ...]  # full[i] names rows [0, (i+1) * block_size)
    whole: bytes | None  # names rows [0, length) when the last block is partial; None when it is full

    def common_blocks(self, other: PromptKeys) -> int:
        """Leading full blocks both prompts share."""
        n = 0
        for a, b in zip(self.full, other.full, strict=False):
            if a != b:
                break
            n += 1
        return n


@dataclass(frozen=True)
class Match:
    """Kept blocks holding a prompt's first ``length`` rows (length 0: nothing kept)."""

    blocks: tuple[int, ...]
    length: int


def prompt_keys(rows: np.ndarray, block_size: int) -> PromptKeys:
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    digest = hashlib.blake2b(f"{rows.shape[1]}".encode(), digest_size=_DIGEST_BYTES).digest()
    full = []
    whole_blocks = len(rows) // block_size
    for i in range(whole_blocks):
        digest = hashlib.blake2b(digest + rows[i * block_size : (i + 1) * block_size].tobytes(),
                                 digest_size=_DIGEST_BYTES).digest()
        full.append(digest)
    whole = None
    if len(rows) % block_size:
        # Marked so a whole prompt's key never equals a full-block key of a longer prompt.
        whole = hashlib.blake2b(digest + rows[whole_blocks * block_size :].tobytes() + b"whole",
                                digest_size=_DIGEST_BYTES).digest()
    return PromptKeys(len(rows), tuple(full), whole)


class PromptCache:
    def __init__(self, pool: BlockPool | None, *, enabled: bool = True) -> None:
        self.pool: BlockPool = pool  # type: ignore[assignment]  # None only when disabled: never read then
        self.enabled = enabled and pool is not None
        self._kept: OrderedDict[bytes, int] = OrderedDict()  # key -> block; the last entries are the most recent
        self._claims: dict[bytes, str] = {}  # full-block key -> the take computing it now
        self._claimed_by: dict[str, list[bytes]] = {}
        # Told every key kept and given back, when a cluster replica reports them to its front ends' routers.
        self.journal: KeptDigests | None = None

    def __len__(self) -> int:
        """Blocks kept (each holds one reference)."""
        return len(self._kept)

    def blocks(self) -> list[int]:
        """The blocks kept (least recently used first)."""
        return list(self._kept.values())

    def keys(self, rows: np.ndarray) -> PromptKeys | None:
        return prompt_keys(rows, self.pool.block_size) if self.enabled else None

    # ------------------------------------------------------------------ lookups
    def match(self, keys: PromptKeys | None) -> Match:
        """The longest kept prefix of the prompt (marked recently used)."""
        if keys is None:
            return Match((), 0)
        blocks: list[int] = []
        used: list[bytes] = []
        for key in keys.full:
            block = self._kept.get(key)
            if block is None:
                break
            blocks.append(block)
            used.append(key)
        length = len(blocks) * self.pool.block_size
        if len(blocks) == len(keys.full) and keys.whole is not None and keys.whole in self._kept:
            blocks.append(self._kept[keys.whole])
            used.append(keys.whole)
            length = keys.length
        for key in reversed(used):  # parents end up more recent than their children: leaves go first
            self._kept.move_to_end(key)
        return Match(tuple(blocks), length)

    # ------------------------------------------------------------------ keeping
    def keep(self, keys: PromptKeys | None, blocks: list[int], filled: int, *, with_whole: bool) -> None:
        """The prompt's rows [0, filled) are in ``blocks`` (a slot's table): keep its full blocks, and with
        ``with_whole`` (the caller made room for the copy on write the slot's next write then needs) the
        partial block of a whole prompt. Already kept keys keep their block."""
        if keys is None:
            return
        named = list(zip(keys.full[: filled // self.pool.block_size], blocks, strict=False))
        if with_whole and filled >= keys.length and keys.whole is not None:
            named.append((keys.whole, blocks[len(keys.full)]))
        for key, block in named:
            self._put(key, block)
        for key, _ in reversed(named):  # parents end up more recent than their children: leaves go first
            self._kept.move_to_end(key)

    def wants_whole(self, keys: PromptKeys | None, filled: int) -> bool:
        """Whether :meth:`keep` would take the partial block of this fully filled prompt."""
        return keys is not None and keys.whole is not None and filled >= keys.length and keys.whole not in self._kept

    def _put(self, key: bytes, block: int) -> None:
        self._claims.pop(key, None)  # kept now: nobody waits for its computation any more
        if key in self._kept or block == SCRATCH_BLOCK:
            return
        self.pool.hold(block)
        self._kept[key] = block
        if self.journal is not None:
            self.journal.add(key)

    # ------------------------------------------------------------------ room
    def evict(self, need: int, spare: frozenset[int] = frozenset()) -> int:
        """Give back blocks only the cache holds, least recently used first, until the pool can promise
        ``need`` blocks (or nothing is left to give). Blocks running takes share are kept (dropping them
        would free nothing), and so are those in ``spare`` (a match about to be shared). Returns the blocks
        given back."""
        freed = 0
        for key in list(self._kept):
            if self.pool.available >= need:
                break
            block = self._kept[key]
            if self.pool.refcount[block] == 1 and block not in spare:
                del self._kept[key]
                self.pool.drop_ref(block)
                freed += 1
                if self.journal is not None:
                    self.journal.discard(key)
        return freed

    def clear(self) -> None:
        for block in self._kept.values():
            self.pool.drop_ref(block)
        self._kept.clear()
        self._claims.clear()
        self._claimed_by.clear()
        if self.journal is not None:
            self.journal.clear()

    # ------------------------------------------------------------------ takes computing blocks now
    def claim(self, take_id: str, keys: PromptKeys | None, from_block: int) -> None:
        """``take_id`` is about to compute its full blocks from ``from_block`` on: takes that need the same
        blocks wait for them (those another take claimed first stay that take's)."""
        if keys is None:
            return
        mine = self._claimed_by.setdefault(take_id, [])
        for key in keys.full[from_block:]:
            if key not in self._claims and key not in self._kept:
                self._claims[key] = take_id
                mine.append(key)

    def claimant(self, keys: PromptKeys | None, block: int) -> str | None:
        """The take computing the prompt's ``block``-th full block now, if another take is."""
        if keys is None or block >= len(keys.full):
            return None
        return self._claims.get(keys.full[block])

    def unclaim(self, take_id: str) -> None:
        """The take's claims end (its blocks are kept, or it ended)."""
        for key in self._claimed_by.pop(take_id, []):
            if self._claims.get(key) == take_id:
                del self._claims[key]
