"""Host-side bookkeeping of the paged backbone cache: fixed-size blocks, reference counts, block tables.

The device holds one pool of ``num_blocks`` blocks of ``block_size`` positions (keys, values and the
hidden state of each position; see state.py). A slot's block table maps its position p to block
``table[p // block_size]``, offset ``p % block_size``. Blocks are handed out as a take grows and given
back when it ends, is cut back (a seek) or is dropped. A block may appear in several tables (a retake
shares its parent's prompt and prefix blocks): it is reference-counted, and the first write into a
shared block copies it first (copy on write), so sharing never changes anyone's numbers.

Block 0 is never handed out: it is the scratch block that rows which take part in a batched step
without being advanced (and padded prefill rows) write into, and what unused table entries point at.

Admission is by reservation, so a running take can never find the pool empty: each slot reserves the
blocks it may still need for its whole budget (prompt + frame cap), and a take is only admitted when
the blocks that are free and not promised to others cover its reservation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

SCRATCH_BLOCK = 0


class PoolExhausted(RuntimeError):
    """No free block although one was needed (a reservation was wrong: a bug, never a normal outcome)."""


@dataclass
class BlockRef:
    """Blocks kept alive without a slot (a finished take kept for retakes): drop it to give them back."""

    blocks: list[int]
    length: int  # positions the blocks hold
    dropped: bool = False


@dataclass
class _SlotTable:
    blocks: list[int] = field(default_factory=list)
    reserved: int = 0  # blocks this slot may still allocate (its promise from the pool)


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, max_slots: int, max_blocks_per_slot: int) -> None:
        if num_blocks < 2:
            raise ValueError("the pool needs at least 2 blocks (one is scratch)")
        self.num_blocks = int(num_blocks)
        self.block_size = int(block_size)
        self.max_blocks_per_slot = int(max_blocks_per_slot)
        self.refcount = np.zeros(self.num_blocks, dtype=np.int32)
        self.refcount[SCRATCH_BLOCK] = 1  # never free
        self._free = list(range(self.num_blocks - 1, 0, -1))  # pop() hands out low ids first
        self._slots = [_SlotTable() for _ in range(max_slots)]
        self.promised = 0  # sum of every slot's outstanding reservation
        # Host copy of every slot's table; rows whose entries changed are pushed to the device by the runner.
        self.table = np.zeros((max_slots, self.max_blocks_per_slot), dtype=np.int64)
        self.dirty: set[int] = set()

    # ------------------------------------------------------------------ figures
    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def available(self) -> int:
        """Free blocks not promised to a running slot: what a new take may reserve."""
        return len(self._free) - self.promised

    def blocks_for(self, positions: int) -> int:
        return -(-int(positions) // self.block_size)

    def slot_blocks(self, slot: int) -> list[int]:
        return list(self._slots[slot].blocks)

    # ------------------------------------------------------------------ reservation
    def reserve(self, slot: int, blocks: int) -> bool:
        """Promise ``blocks`` more to ``slot`` if available (False: the caller waits or refuses)."""
        if blocks > self.available:
            return False
        self._slots[slot].reserved += blocks
        self.promised += blocks
        return True

    def unreserve(self, slot: int) -> None:
        st = self._slots[slot]
        self.promised -= st.reserved
        st.reserved = 0

    # ------------------------------------------------------------------ allocation
    def _alloc(self, slot: int) -> int:
        st = self._slots[slot]
        if st.reserved > 0:
            st.reserved -= 1
            self.promised -= 1
        elif len(self._free) <= self.promised:  # would take a block promised to someone else
            raise PoolExhausted(f"slot {slot} needs a block beyond its reservation and none is spare")
        if not self._free:
            raise PoolExhausted("the KV block pool is empty")
        block = self._free.pop()
        self.refcount[block] = 1
        return block

    def _decref(self, block: int) -> None:
        if block == SCRATCH_BLOCK:
            return
        self.refcount[block] -= 1
        if self.refcount[block] == 0:
            self._free.append(block)
        elif self.refcount[block] < 0:  # pragma: no cover - a bookkeeping bug
            raise RuntimeError(f"block {block} freed twice")

    def _set(self, slot: int, index: int, block: int) -> None:
        self.table[slot, index] = block
        self.dirty.add(slot)

    def prepare_write(self, slot: int, start: int, end: int) -> list[tuple[int, int]]:
        """Make positions [start, end) of ``slot`` writable: allocate missing blocks, copy shared ones.

        Returns (source, destination) block copies the caller must do on the device before writing.
        """
        if end > self.max_blocks_per_slot * self.block_size:
            raise PoolExhausted(f"slot {slot} would grow past {self.max_blocks_per_slot} blocks")
        st = self._slots[slot]
        copies = []
        for index in range(start // self.block_size, self.blocks_for(end)):
            if index < len(st.blocks):
                block = st.blocks[index]
                if self.refcount[block] > 1:  # shared with a parent or a sibling: copy on write
                    fresh = self._alloc(slot)
                    copies.append((block, fresh))
                    self._decref(block)
                    st.blocks[index] = fresh
                    self._set(slot, index, fresh)
            else:
                while len(st.blocks) < index:  # pragma: no cover - writes are always contiguous
                    st.blocks.append(SCRATCH_BLOCK)
                fresh = self._alloc(slot)
                st.blocks.append(fresh)
                self._set(slot, index, fresh)
        return copies

    def truncate(self, slot: int, length: int) -> None:
        """Keep the blocks holding positions [0, length); the rest go back to the pool."""
        st = self._slots[slot]
        keep = self.blocks_for(length)
        for index in range(keep, len(st.blocks)):
            self._decref(st.blocks[index])
            self._set(slot, index, SCRATCH_BLOCK)
        del st.blocks[keep:]

    def release(self, slot: int) -> None:
        """The slot ends: every block reference and its reservation go back."""
        self.truncate(slot, 0)
        self.unreserve(slot)

    # ------------------------------------------------------------------ sharing
    def detach(self, slot: int, length: int) -> BlockRef:
        """Move the slot's blocks for [0, length) into a BlockRef (the slot is left empty)."""
        self.truncate(slot, length)
        st = self._slots[slot]
        ref = BlockRef(list(st.blocks), length)
        for index in range(len(st.blocks)):
            self._set(slot, index, SCRATCH_BLOCK)
        st.blocks = []
        self.unreserve(slot)
        return ref

    def attach(self, slot: int, ref: BlockRef, length: int) -> int:
        """The empty ``slot`` shares ``ref``'s blocks for [0, length). Returns the blocks shared."""
        if ref.dropped or length > ref.length:
            raise ValueError("cannot share positions the reference does not hold")
        st = self._slots[slot]
        if st.blocks:
            raise ValueError(f"slot {slot} is not empty")
        shared = ref.blocks[: self.blocks_for(length)]
        for index, block in enumerate(shared):
            self.refcount[block] += 1
            self._set(slot, index, block)
        st.blocks = list(shared)
        return len(shared)

    def hold(self, block: int) -> None:
        """One more reference to an allocated block (a cache of prompt prefixes keeps it)."""
        if block == SCRATCH_BLOCK or self.refcount[block] < 1:
            raise ValueError(f"block {block} is not allocated")
        self.refcount[block] += 1

    def drop_ref(self, block: int) -> None:
        """Give back one reference taken with :meth:`hold` (the block is free once nobody holds it)."""
        self._decref(block)

    def drop(self, ref: BlockRef) -> None:
        if not ref.dropped:
            ref.dropped = True
            for block in ref.blocks:
                self._decref(block)
