"""Paged streaming-decoder state: K/V blocks handed to a stream as its tokens reach them, returned on close.

Why: a stream's state is, per decoder stage and layer, the keys/values of its last ``context`` tokens (plus one
chunk of headroom). Allocating that whole window per stream up front costs the same ~343 MB (full-size codec,
bf16, 10 s windows) for a 2 s take as for a 60 s one. Here every stage has one pool of fixed-size blocks shared
by all streams (all layers of a stage share one block table: a block id names the same rows in every layer's
pool), and a stream holds only the blocks its age has reached, at most ``ring_blocks`` of them: past that its
keys go round a ring over its own block list (key position ``p`` lives in its block ``(p // block) %
ring_blocks``, row ``p % block``).

Admission never fails halfway: opening a stream *reserves* the blocks it may ever hold (its whole ring, or
fewer for a take known to be short, ``max_frames``), and taking a block later only turns reservation into use,
so a stream that was admitted always gets its blocks. The pool holds ``pool_streams`` whole rings (by default
one per slot: the memory plan's promise that every take can grow to the full window).

Block size: a whole number of frames per stage (4..8 frames, the size whose ring of ``context + chunk - 1``
tokens wastes least), so a stream's holdings grow in steps of about half a second.

Sharing (retakes): blocks are reference-counted, like the backbone's paged KV cache (model/blocks.py). A stream that
ends can leave its blocks behind as a :class:`KeptBlocks` (no slot: :meth:`BlockTables.detach`); a retake from frame
N opens a stream that shares them (:meth:`BlockTables.attach`) and continues at N without decoding anything, as long
as every key its first queries can see is still there (:meth:`BlockTables.can_resume`: the parent's ring has not
gone round over positions ``N * tpf - context .. N * tpf - 1`` at any stage). The first write into a shared block
copies it first (copy on write: :meth:`BlockTables.grow` returns the copies to make on the device before the
chunk's keys are written), so sharing never changes anyone's numbers. Keys a shared block holds past N (the
parent's later frames) are never seen by the retake: the window kernel reads only positions the stream has reached,
and the masked path counts those entries as older (out of the window) or never written.

Host bookkeeping only (no torch work but the table copy). The decoder's worker thread decodes; the scheduler's
thread opens, shares and closes streams: every method holds :attr:`BlockTables.lock`, and :meth:`sync` holds it
while it copies the table, so a change made by the other thread is never half copied nor lost.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from .config import TransformerSpec
from .kv_quant import value_bytes
from .model import CodecModel
from .modules import ProjectedTransformer

__all__ = [
    "BlockTables",
    "KeptBlocks",
    "NoFreeBlocks",
    "StageGeometry",
    "geometries",
    "scratch_state_bytes",
    "stream_state_bytes",
]

BLOCK_FRAME_CHOICES = range(4, 9)
# A block size whose ring wastes at most this much more than the least wasteful one is preferred when the attention
# kernel's key tiles divide it (fewer, contiguous reads: 2x faster at the last full-size stage; window_attention.py).
ALIGNED_WASTE_SLACK = 0.03


class NoFreeBlocks(RuntimeError):
    """The codec state pools cannot promise a new stream the blocks it may need; close one first."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def tile_divisor(block: int, largest: int = 128) -> int:
    """The largest power of two up to ``largest`` that divides ``block`` (a key tile that never straddles blocks)."""
    return min(largest, block & -block)


@dataclass(frozen=True)
class StageGeometry:
    """Block geometry of one decoder transformer stage."""

    tokens_per_frame: int
    context: int  # attention window in tokens
    block: int  # tokens per block
    ring_blocks: int  # the most blocks one stream holds: its ring holds >= context + one chunk - 1 tokens
    scratch_blocks: int  # blocks of the scratch row (one chunk from position 0: graph capture, padding rows)
    token_bytes: int  # K + V bytes of one token over every layer of the stage

    @property
    def ring(self) -> int:
        return self.block * self.ring_blocks

    def blocks_for(self, frames: int) -> int:
        """Blocks a stream holds once ``frames`` frames are decoded (its chunk's keys written)."""
        return min(self.ring_blocks, _cdiv(max(0, frames) * self.tokens_per_frame, self.block))

    @property
    def block_bytes(self) -> int:
        return self.block * self.token_bytes


def stage_geometry(
    spec: TransformerSpec, frame_rate: float, max_chunk_frames: int, dtype: torch.dtype,
    block_frames: int | None = None,
) -> StageGeometry:
    """``dtype``: the pools' storage dtype (fp8 rows carry a scale each: kv_quant.value_bytes)."""
    tpf = int(round(spec.rate_hz / frame_rate))
    need = spec.context + max_chunk_frames * tpf - 1  # keys a chunk's queries see, its own included
    if block_frames is None:
        # The block size (in whole frames) whose ring wastes least, or nearly least with a larger power-of-two key
        # tile dividing it; the larger on a tie (fewer table entries).
        held = {f: _cdiv(need, f * tpf) * f for f in BLOCK_FRAME_CHOICES}
        least = min(held.values())
        near = [f for f, h in held.items() if h <= least * (1 + ALIGNED_WASTE_SLACK)]
        block_frames = max(near, key=lambda f: (tile_divisor(f * tpf), -held[f], f))
    block = block_frames * tpf
    return StageGeometry(
        tokens_per_frame=tpf,
        context=spec.context,
        block=block,
        ring_blocks=_cdiv(need, block),
        scratch_blocks=_cdiv(max_chunk_frames * tpf, block),
        token_bytes=2 * spec.num_layers * spec.num_heads * value_bytes(spec.head_dim, dtype),
    )


def geometries(
    codec: CodecModel, max_chunk_frames: int, dtype: torch.dtype, block_frames: int | None = None
) -> dict[int, StageGeometry]:
    """Geometry of every decoder transformer stage, keyed by its index in ``codec.decoder``; ``dtype`` is the K/V
    pools' storage dtype (the compute dtype, or kv_quant.FP8)."""
    return {
        idx: stage_geometry(m.spec, codec.config.frame_rate, max_chunk_frames, dtype, block_frames)
        for idx, m in enumerate(codec.decoder)
        if isinstance(m, ProjectedTransformer)
    }


def stream_state_bytes(
    codec: CodecModel, max_chunk_frames: int, dtype: torch.dtype, frames: int | None = None,
    block_frames: int | None = None,
) -> int:
    """Bytes of K/V blocks one stream holds after ``frames`` frames (None: the most it can hold, its whole ring,
    which is what the pools reserve per stream), in storage ``dtype`` (kv_quant.FP8: values and their scales).
    Allocates nothing."""
    total = 0
    for g in geometries(codec, max_chunk_frames, dtype, block_frames).values():
        total += (g.ring_blocks if frames is None else g.blocks_for(frames)) * g.block_bytes
    return total


def scratch_state_bytes(
    codec: CodecModel, max_chunk_frames: int, dtype: torch.dtype, block_frames: int | None = None
) -> int:
    """Bytes of the scratch row's blocks (graph capture and padding rows of batched calls write there)."""
    geoms = geometries(codec, max_chunk_frames, dtype, block_frames)
    return sum(g.scratch_blocks * g.block_bytes for g in geoms.values())


@dataclass(eq=False)
class KeptBlocks:
    """A stream's K/V blocks kept without a slot after it ended (one reference each), for retakes to share.

    ``frames`` is how far the stream had decoded; ``blocks[i]`` are its blocks of stage i in ring order. Give it
    back with :meth:`BlockTables.drop` (the decoder does that when it is collected, too).
    """

    blocks: list[list[int]]
    frames: int
    dropped: bool = False
    _release: object = field(default=None, repr=False)  # the decoder's finalizer (drops it if collected)


class BlockTables:
    """Free lists, reservations and the block table of every stage (see the module docstring).

    The table ``[rows + 1, sum of ring_blocks]`` int32 maps (slot, stage column + ring block) to a pool block; row
    ``rows`` is the scratch row, whose entries cycle over the stage's scratch blocks. Entries a stream has not
    reached yet point at scratch block 0: never read by the kernel (it reads only keys the stream wrote), read
    but masked by the SDPA path (finite values, so masked weights stay zero).
    """

    def __init__(
        self, geoms: Sequence[StageGeometry], rows: int, pool_streams: int, device: torch.device
    ) -> None:
        self.geoms = list(geoms)
        self.rows = rows
        self.cols: list[int] = []
        c = 0
        for g in self.geoms:
            self.cols.append(c)
            c += g.ring_blocks
        self.n_blocks = [g.scratch_blocks + pool_streams * g.ring_blocks for g in self.geoms]
        # Low ids first; closed streams' blocks are reused first (still warm in caches).
        self._free = [list(range(n - 1, g.scratch_blocks - 1, -1)) for n, g in zip(self.n_blocks, self.geoms,
                                                                                   strict=True)]
        self._reserved = [0] * len(self.geoms)  # promised to open streams, not yet taken
        # References per block: streams holding it in their table and KeptBlocks (0: free; scratch blocks: 1).
        self._refs = [np.zeros(n, dtype=np.int32) for n in self.n_blocks]
        for refs, g in zip(self._refs, self.geoms, strict=True):
            refs[: g.scratch_blocks] = 1
        self._held: dict[int, list[list[int]]] = {}
        self._promised: dict[int, list[int]] = {}
        self._host = torch.zeros(rows + 1, c, dtype=torch.int32)
        for g, col in zip(self.geoms, self.cols, strict=True):
            self._host[rows, col : col + g.ring_blocks] = torch.arange(g.ring_blocks) % g.scratch_blocks
        # The host table's entries are written through a numpy view of the same memory: a write through the tensor
        # is a torch call (a dispatch, several aten ops) per entry, and a retake attaching a kept state writes dozens.
        self._host_np = self._host.numpy()
        self.table = self._host if device.type == "cpu" else self._host.to(device)
        self._dirty = False
        self.lock = threading.RLock()

    # ------------------------------------------------------------------ figures
    @property
    def free_blocks(self) -> list[int]:
        """Blocks not held by any stream, per stage (reserved ones included)."""
        return [len(f) for f in self._free]

    @property
    def unreserved_blocks(self) -> list[int]:
        """Blocks neither held nor promised, per stage: what a new stream's reservation can draw on."""
        return [len(f) - r for f, r in zip(self._free, self._reserved, strict=True)]

    def held(self, slot: int) -> list[list[int]]:
        return self._held.get(slot, [[] for _ in self.geoms])

    def held_bytes(self, slot: int) -> int:
        return sum(len(b) * g.block_bytes for b, g in zip(self.held(slot), self.geoms, strict=True))

    def blocks_needed(self, max_frames: int | None) -> list[int]:
        return [g.ring_blocks if max_frames is None else g.blocks_for(max_frames) for g in self.geoms]

    def can_open(self, max_frames: int | None = None) -> bool:
        with self.lock:
            return all(n <= u for n, u in zip(self.blocks_needed(max_frames), self.unreserved_blocks, strict=True))

    def refcount(self, stage: int, block: int) -> int:
        return int(self._refs[stage][block])

    def can_resume(self, kept: KeptBlocks, frames: int) -> bool:
        """Whether a stream sharing ``kept`` may continue at ``frames`` exactly: at every stage the keys of
        positions ``frames * tpf - context .. frames * tpf - 1`` (those its next queries see) are still in the kept
        ring, i.e. the ring has not gone round over them since (it holds the last ``ring`` positions)."""
        if kept.dropped or not 0 < frames <= kept.frames:
            return False
        for g in self.geoms:
            oldest_kept = kept.frames * g.tokens_per_frame - g.ring  # positions before this were overwritten
            oldest_needed = max(0, frames * g.tokens_per_frame - g.context)
            if oldest_needed < oldest_kept:
                return False
        return True

    # ------------------------------------------------------------------ lifecycle
    def open(self, slot: int, max_frames: int | None = None) -> None:
        """Reserve the blocks a stream in ``slot`` may hold: its whole ring, or what ``max_frames`` frames need."""
        with self.lock:
            need = self.blocks_needed(max_frames)
            if not self.can_open(max_frames):
                raise NoFreeBlocks(
                    f"codec state pools cannot reserve {need} blocks per stage (unreserved: {self.unreserved_blocks})"
                )
            for i, n in enumerate(need):
                self._reserved[i] += n
            self._promised[slot] = need
            self._held[slot] = [[] for _ in self.geoms]
            self._point_at_scratch(slot)

    def _touched(self, g: StageGeometry, start: int, end: int) -> range | set[int]:
        """Ring indices of the blocks a chunk of frames [start, end) writes its keys into."""
        if end <= start:
            return range(0)
        first = start * g.tokens_per_frame // g.block
        last = (end * g.tokens_per_frame - 1) // g.block
        if last - first + 1 >= g.ring_blocks:
            return range(g.ring_blocks)
        return {b % g.ring_blocks for b in range(first, last + 1)}

    def grow(self, wants: Sequence[tuple[int, int] | tuple[int, int, int]]) -> list[list[tuple[int, int]]]:
        """Make each stream writable for its next chunk: ``(slot, frames)`` (the blocks ``frames`` decoded frames
        need) or ``(slot, start, end)`` (also: the shared blocks frames ``[start, end)`` write into are replaced by
        copies). All or nothing: raises NoFreeBlocks (nothing taken) if a stream outgrows its reservation and the
        pool has no spare block. Returns, per stage, the (source, destination) block copies the caller must make on
        the device before the chunk's keys are written."""
        with self.lock:
            extra = [0] * len(self.geoms)  # blocks beyond reservations, per stage
            plan: list[tuple[int, int, int, list[int]]] = []  # (slot, stage, new blocks, ring indices to copy)
            for want in wants:
                slot, end = want[0], want[-1]
                start = want[1] if len(want) == 3 else end
                held, promised = self._held[slot], self._promised[slot]
                for i, g in enumerate(self.geoms):
                    n = max(0, g.blocks_for(end) - len(held[i]))
                    cow = [j for j in self._touched(g, start, end) if j < len(held[i])
                           and self._refs[i][held[i][j]] > 1]
                    if n or cow:
                        plan.append((slot, i, n, sorted(cow)))
                        extra[i] += max(0, n + len(cow) - promised[i])
            short = [e > u for e, u in zip(extra, self.unreserved_blocks, strict=True)]
            if any(short):
                raise NoFreeBlocks(f"codec state pools out of blocks (stages {[i for i, s in enumerate(short) if s]}): "
                                   "a stream outgrew its reservation")
            copies: list[list[tuple[int, int]]] = [[] for _ in self.geoms]
            for slot, i, n, cow in plan:
                blocks = self._held[slot][i]
                col = self.cols[i]
                for j in cow:  # copy on write: this stream's own copy of a block it shares
                    fresh = self._take(slot, i)
                    copies[i].append((blocks[j], fresh))
                    self._unref(i, blocks[j])
                    blocks[j] = fresh
                    self._host_np[slot, col + j] = fresh
                for _ in range(n):
                    self._host_np[slot, col + len(blocks)] = blk = self._take(slot, i)
                    blocks.append(blk)
                self._dirty = True
            return copies

    def _take(self, slot: int, stage: int) -> int:
        """A free block for ``slot`` (from its promise while it lasts; grow checked that a spare one exists)."""
        promised = self._promised[slot]
        if promised[stage] > 0:
            promised[stage] -= 1
            self._reserved[stage] -= 1
        block = self._free[stage].pop()
        self._refs[stage][block] = 1
        return block

    def _unref(self, stage: int, block: int) -> None:
        refs = self._refs[stage]
        refs[block] -= 1
        if refs[block] == 0:
            self._free[stage].append(block)
        elif refs[block] < 0:  # pragma: no cover - a bookkeeping bug
            raise RuntimeError(f"codec block {block} of stage {stage} given back twice")

    def close(self, slot: int) -> None:
        """Give back the stream's block references and what is left of its reservation."""
        with self.lock:
            held = self._held.pop(slot, None)
            promised = self._promised.pop(slot, None)
            if held is None or promised is None:
                return
            for i, blocks in enumerate(held):
                for block in reversed(blocks):
                    self._unref(i, block)
                self._reserved[i] -= promised[i]
            self._point_at_scratch(slot)

    # ------------------------------------------------------------------ sharing
    def detach(self, slot: int, frames: int) -> KeptBlocks:
        """The stream in ``slot`` ends but its blocks stay (their references move to the returned KeptBlocks); the
        slot and what is left of its reservation are given back."""
        with self.lock:
            held = self._held.pop(slot)
            promised = self._promised.pop(slot)
            for i in range(len(self.geoms)):
                self._reserved[i] -= promised[i]
            self._point_at_scratch(slot)
            return KeptBlocks(held, int(frames))

    def attach(self, slot: int, kept: KeptBlocks) -> None:
        """The freshly opened stream in ``slot`` shares every block of ``kept`` (one more reference each), in the
        same ring places; its writes copy them first (grow)."""
        with self.lock:
            if kept.dropped:
                raise ValueError("cannot share blocks that were given back")
            if any(self._held[slot]):
                raise ValueError(f"codec slot {slot} already holds blocks")
            self._held[slot] = [list(blocks) for blocks in kept.blocks]
            for i, blocks in enumerate(kept.blocks):
                np.add.at(self._refs[i], blocks, 1)
                self._host_np[slot, self.cols[i] : self.cols[i] + len(blocks)] = blocks
            self._dirty = True

    def drop(self, kept: KeptBlocks) -> None:
        """Give back the references ``kept`` holds (once)."""
        with self.lock:
            if kept.dropped:
                return
            kept.dropped = True
            for i, blocks in enumerate(kept.blocks):
                for block in blocks:
                    self._unref(i, block)

    def sync(self) -> torch.Tensor:
        """The device table, updated with any change since the last call (one small copy)."""
        with self.lock:
            if self._dirty and self.table is not self._host:
                self.table.copy_(self._host)
            self._dirty = False
            return self.table

    def _point_at_scratch(self, slot: int) -> None:
        self._host_np[slot] = 0
        self._dirty = True
