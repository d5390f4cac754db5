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

Host bookkeeping only (no torch work but the table copy); the worker thread that owns the decoder owns this.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .config import TransformerSpec
from .model import CodecModel
from .modules import ProjectedTransformer

__all__ = [
    "BlockTables",
    "NoFreeBlocks",
    "StageGeometry",
    "geometries",
    "scratch_state_bytes",
    "stream_state_bytes",
]

BLOCK_FRAME_CHOICES = range(4, 9)


class NoFreeBlocks(RuntimeError):
    """The codec state pools cannot promise a new stream the blocks it may need; close one first."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


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
    spec: TransformerSpec, frame_rate: float, max_chunk_frames: int, itemsize: int, block_frames: int | None = None
) -> StageGeometry:
    tpf = int(round(spec.rate_hz / frame_rate))
    need = spec.context + max_chunk_frames * tpf - 1  # keys a chunk's queries see, its own included
    if block_frames is None:
        # The block size (in whole frames) whose ring wastes least; the larger on a tie (fewer table entries).
        block_frames = min(BLOCK_FRAME_CHOICES, key=lambda f: (_cdiv(need, f * tpf) * f, -f))
    block = block_frames * tpf
    return StageGeometry(
        tokens_per_frame=tpf,
        context=spec.context,
        block=block,
        ring_blocks=_cdiv(need, block),
        scratch_blocks=_cdiv(max_chunk_frames * tpf, block),
        token_bytes=2 * spec.num_layers * spec.num_heads * spec.head_dim * itemsize,
    )


def geometries(
    codec: CodecModel, max_chunk_frames: int, dtype: torch.dtype, block_frames: int | None = None
) -> dict[int, StageGeometry]:
    """Geometry of every decoder transformer stage, keyed by its index in ``codec.decoder``."""
    itemsize = torch.tensor([], dtype=dtype).element_size()
    return {
        idx: stage_geometry(m.spec, codec.config.frame_rate, max_chunk_frames, itemsize, block_frames)
        for idx, m in enumerate(codec.decoder)
        if isinstance(m, ProjectedTransformer)
    }


def stream_state_bytes(
    codec: CodecModel, max_chunk_frames: int, dtype: torch.dtype, frames: int | None = None,
    block_frames: int | None = None,
) -> int:
    """Bytes of K/V blocks one stream holds after ``frames`` frames (None: the most it can hold, its whole ring,
    which is what the pools reserve per stream). Allocates nothing."""
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
        self._held: dict[int, list[list[int]]] = {}
        self._promised: dict[int, list[int]] = {}
        self._host = torch.zeros(rows + 1, c, dtype=torch.int32)
        for g, col in zip(self.geoms, self.cols, strict=True):
            self._host[rows, col : col + g.ring_blocks] = torch.arange(g.ring_blocks) % g.scratch_blocks
        self.table = self._host if device.type == "cpu" else self._host.to(device)
        self._dirty = False

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
        return all(n <= u for n, u in zip(self.blocks_needed(max_frames), self.unreserved_blocks, strict=True))

    # ------------------------------------------------------------------ lifecycle
    def open(self, slot: int, max_frames: int | None = None) -> None:
        """Reserve the blocks a stream in ``slot`` may hold: its whole ring, or what ``max_frames`` frames need."""
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

    def grow(self, wants: Sequence[tuple[int, int]]) -> None:
        """Give each ``(slot, frames)`` stream the blocks ``frames`` decoded frames need. All or nothing: raises
        NoFreeBlocks (nothing taken) if a stream outgrows its reservation and the pool has no spare block."""
        extra = [0] * len(self.geoms)  # blocks beyond reservations, per stage
        plan: list[tuple[int, int, int]] = []  # (slot, stage, count)
        for slot, frames in wants:
            held, promised = self._held[slot], self._promised[slot]
            for i, g in enumerate(self.geoms):
                n = g.blocks_for(frames) - len(held[i])
                if n > 0:
                    plan.append((slot, i, n))
                    extra[i] += max(0, n - promised[i])
        short = [e > u for e, u in zip(extra, self.unreserved_blocks, strict=True)]
        if any(short):
            raise NoFreeBlocks(f"codec state pools out of blocks (stages {[i for i, s in enumerate(short) if s]}): "
                               "a stream outgrew its reservation")
        for slot, i, n in plan:
            promised = self._promised[slot]
            from_promise = min(n, promised[i])
            promised[i] -= from_promise
            self._reserved[i] -= from_promise
            held = self._held[slot][i]
            col = self.cols[i]
            for _ in range(n):
                self._host[slot, col + len(held)] = blk = self._free[i].pop()
                held.append(blk)
            self._dirty = True

    def close(self, slot: int) -> None:
        """Return the stream's blocks and what is left of its reservation."""
        held = self._held.pop(slot, None)
        promised = self._promised.pop(slot, None)
        if held is None or promised is None:
            return
        for i, blocks in enumerate(held):
            self._free[i].extend(reversed(blocks))
            self._reserved[i] -= promised[i]
        self._point_at_scratch(slot)

    def sync(self) -> torch.Tensor:
        """The device table, updated with any change since the last call (one small copy)."""
        if self._dirty and self.table is not self._host:
            self.table.copy_(self._host)
        self._dirty = False
        return self.table

    def _point_at_scratch(self, slot: int) -> None:
        self._host[slot] = 0
        self._dirty = True
