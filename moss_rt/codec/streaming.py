"""Exact, batched, stateful streaming decode.

Every decoder stage is causal with a finite window, and patch stages are reshapes, so the
waveform of frame t depends only on codes <= t. A stream's state is, per attention layer, the
keys/values of its recent tokens plus the number of frames decoded so far.

Storage is paged (:mod:`.paged_state`): per stage and layer one pool of fixed-size K/V blocks shared by
all streams, ``[blocks, heads, block, head_dim]``, and one block table per stage shared by its layers. A
stream holds the blocks its age has reached, at most a ring of ``context + max_chunk_frames *
tokens_per_frame - 1`` tokens or more ("headroom"): a chunk's keys are written first and attention then
reads them with the ``context`` keys before it, so every query sees exactly the keys the whole-clip decode
gives it (upstream's ring of exactly ``context`` entries drops some for multi-frame chunks). Opening a
stream reserves the blocks it may hold, so a stream once opened never runs out. Chunks longer than
``max_chunk_frames`` are split internally.

Retakes share state (:meth:`StreamingDecoder.detach`, :meth:`StreamingDecoder.resume`): a stream that ends leaves
its blocks behind (reference-counted, no slot), and a retake from frame N continues from them at N without decoding
a frame, copying a shared block only when it first writes into it (paged_state). Where the kept ring no longer
holds what frame N needs (:meth:`StreamingDecoder.can_resume`), the state is rebuilt from the codes instead.

Attention: on CUDA the Triton kernel of :mod:`.window_attention` reads, for each stream, only the keys
its queries can see, in place through the block table (``attention="kernel"``, the default). Elsewhere
(CPU, ``MOSS_RT_CODEC_KERNEL=0``, ``attention="sdpa"``) each layer's ring of every stream is gathered
through the table and SDPA runs over it with a position mask.

Batched calls: streams with the same chunk length T run in one forward; groups of different T run
one after another (no padding, so padding can never advance a state).

On CUDA, ``cuda_graphs=True`` captures one graph per (batch, T) on first use (or in :meth:`warmup`):
the step is pure device work with slots/offsets as input tensors and the block table a persistent device
tensor, captured against the scratch row (its own scratch blocks) so capture never touches a live stream.

Not thread-safe: one worker thread owns a StreamingDecoder (as it owns the GPU).
"""

from __future__ import annotations

import logging
import weakref
from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from . import fused, kv_quant
from . import window_attention as wa
from .model import DEFAULT_DECODE_LEVELS, CodecModel, Patch
from .modules import KVTarget, ProjectedTransformer, acc_dtype, rope_rotation, rope_tables, run_layers_fused
from .paged_state import (
    BlockTables,
    KeptBlocks,
    NoFreeBlocks,
    StageGeometry,
    geometries,
    scratch_state_bytes,
    stream_state_bytes,
)

__all__ = [
    "DecoderState",
    "KeptBlocks",
    "NoFreeBlocks",
    "NoFreeSlot",
    "StreamingDecoder",
    "scratch_state_bytes",
    "stream_state_bytes",
]

log = logging.getLogger(__name__)

# The integer dtypes a chunk of codes may come in (torch, and the numpy dtypes torch.as_tensor maps to them).
_CODE_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)
_CODE_DTYPES_NP = tuple(np.dtype(d) for d in (np.int64, np.int32, np.int16, np.uint8))


class NoFreeSlot(RuntimeError):
    """All ``max_streams`` decoder slots are held by live states; close one first."""


@dataclass(eq=False)
class DecoderState:
    """Per-stream decoder state: a slot (a row of the block tables) and the frames decoded so far.

    Close it (or drop every reference to it) to give the slot and its K/V blocks back.
    """

    slot: int
    frames: int = 0
    closed: bool = False
    _release: weakref.finalize[..., DecoderState] | None = field(default=None, repr=False)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self._release is not None:
                self._release()


@dataclass
class _Graph:
    """One captured step: static inputs, the graph, and its output buffer."""

    codes: torch.Tensor  # [B, T, nq] int64
    slots: torch.Tensor  # [B] int64
    offs: torch.Tensor  # [B] int64
    graph: torch.cuda.CUDAGraph
    out: torch.Tensor  # [B, ch, T * spf] float32


@dataclass
class _Stage:
    """Streaming bookkeeping of one decoder transformer stage."""

    module: ProjectedTransformer
    geom: StageGeometry
    col: int  # first column of this stage in the block table
    k_all: torch.Tensor  # [layers, blocks, H, block, Dh]: every layer's keys, so one copy moves a block of all layers
    v_all: torch.Tensor
    k_pool: list[torch.Tensor]  # per layer [blocks, H, block, Dh] (views of k_all)
    v_pool: list[torch.Tensor]
    # fp8 storage only (kv_quant): one fp32 scale per (block, head, row), [layers, blocks, H, block], and per-layer
    # views; None in the compute dtype.
    ks_all: torch.Tensor | None = None
    vs_all: torch.Tensor | None = None
    ks_pool: list[torch.Tensor] | None = None
    vs_pool: list[torch.Tensor] | None = None

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy on write: blocks ``src`` into ``dst`` for every layer (two device copies per stage; four with fp8
        scales: a copied row keeps its scale)."""
        src = torch.tensor([a for a, _ in pairs], device=self.k_all.device)
        dst = torch.tensor([b for _, b in pairs], device=self.k_all.device)
        for t in (self.k_all, self.v_all, self.ks_all, self.vs_all):
            if t is not None:
                t[:, dst] = t[:, src]

    def scales(self, li: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Layer ``li``'s K and V scale pools (None, None in the compute dtype)."""
        if self.ks_pool is None or self.vs_pool is None:
            return None, None
        return self.ks_pool[li], self.vs_pool[li]


class StreamingDecoder:
    """Exact streaming decoder over a :class:`CodecModel` (see module docstring).

    Args:
        codec: the loaded codec (decode-only is enough). It is moved to ``device`` and its transformer
            linears set to ``dtype`` if they differ.
        device: compute device.
        dtype: compute dtype of the transformer linears (and of the K/V pools unless ``state_dtype`` says
            otherwise): fp32 or bf16.
        state_dtype: storage dtype of the K/V pools: None (or ``dtype``) stores them as computed (exact streaming);
            ``torch.float8_e4m3fn`` stores 8-bit values with one fp32 scale per (token, head) (:mod:`.kv_quant`:
            about half the memory per stream, a few times bf16's error; the memory plan decides).
        max_streams: number of slots (live states at once).
        max_chunk_frames: largest chunk decoded in one forward; sets the ring headroom.
        num_quantizers: codebooks used per frame (12 for MOSS-TTS).
        cuda_graphs: capture and replay one CUDA graph per (batch, T) (CUDA only).
        attention: "kernel" (the Triton varlen window kernel of :mod:`.window_attention`, reading each stream's
            keys in place; SDPA where it cannot run: CPU, ``MOSS_RT_CODEC_KERNEL=0``), "sdpa" (masked SDPA over
            the gathered ring), "matmul" (two batched GEMMs + softmax; for short chunks over long windows) or
            "auto" (matmul while the score tensor stays under ``matmul_max_scores`` elements).
        pool_streams: whole rings the block pools hold (None: ``max_streams``, so every slot can always grow
            to its full window). Fewer admits streams only while their reservations fit (``new_state``).
        block_frames: frames per block at every stage (None: 4..8, whichever wastes least per stage).
    """

    def __init__(
        self,
        codec: CodecModel,
        *,
        device: str | torch.device,
        dtype: torch.dtype = torch.float32,
        max_streams: int = 16,
        max_chunk_frames: int = 25,
        num_quantizers: int = DEFAULT_DECODE_LEVELS,
        cuda_graphs: bool = False,
        attention: str = "kernel",
        matmul_max_scores: int = 1 << 26,
        pool_streams: int | None = None,
        block_frames: int | None = None,
        state_dtype: torch.dtype | None = None,
    ) -> None:
        self.device = torch.device(device)
        if state_dtype is not None and state_dtype not in (dtype, kv_quant.FP8):
            raise ValueError(f"state_dtype must be the compute dtype or torch.float8_e4m3fn, got {state_dtype}")
        self.state_dtype = dtype if state_dtype is None else state_dtype
        self.fp8 = kv_quant.is_fp8(self.state_dtype)
        if attention not in ("kernel", "sdpa", "matmul", "auto"):
            raise ValueError(f"attention must be kernel, sdpa, matmul or auto, got {attention!r}")
        self.attention = attention
        self.matmul_max_scores = int(matmul_max_scores)
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError("cuda_graphs needs a CUDA device")
        self.cuda_graphs = cuda_graphs
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._graph_pool = torch.cuda.graph_pool_handle() if cuda_graphs else None
        self.dtype = dtype
        if codec.device != self.device:
            codec.to(self.device)
        if codec.compute_dtype != dtype:
            log.info("streaming decoder: setting codec compute dtype to %s", dtype)
            codec.set_compute_dtype(dtype)
        codec.quantizer.build_lut()
        self.codec = codec
        self.max_streams = int(max_streams)
        self.max_chunk_frames = int(max_chunk_frames)
        self.num_quantizers = int(num_quantizers)
        self.samples_per_frame = codec.config.samples_per_frame
        self._free: list[int] = list(range(self.max_streams - 1, -1, -1))
        # Slots of closed or collected states, given back (with their blocks) by the owning thread: a finalizer
        # may run in any thread that triggers garbage collection, and only deque.append is safe there.
        self._released: deque[int] = deque()
        self._kept_released: deque[KeptBlocks] = deque()  # kept blocks collected without drop()
        self.copies = 0  # blocks copied on write so far (retakes writing into blocks they share)
        geoms = geometries(codec, self.max_chunk_frames, self.state_dtype, block_frames)
        self._tables = BlockTables(
            list(geoms.values()), self.max_streams,
            self.max_streams if pool_streams is None else int(pool_streams), self.device,
        )
        self._stages: dict[int, _Stage] = {}
        for (idx, g), col, n_blocks in zip(geoms.items(), self._tables.cols, self._tables.n_blocks, strict=True):
            m = codec.decoder[idx]
            assert isinstance(m, ProjectedTransformer)
            spec = m.spec
            shape = (spec.num_layers, n_blocks, spec.num_heads, g.block, spec.head_dim)
            # Zeros (fp8 and scales too): entries a stream has not reached are read, masked, by the SDPA path and
            # must be finite.
            k_all = torch.zeros(shape, device=self.device, dtype=self.state_dtype)
            v_all = torch.zeros(shape, device=self.device, dtype=self.state_dtype)
            stage = _Stage(
                module=m, geom=g, col=col, k_all=k_all, v_all=v_all, k_pool=list(k_all), v_pool=list(v_all),
            )
            if self.fp8:
                stage.ks_all = torch.zeros(shape[:-1], device=self.device, dtype=kv_quant.SCALE_DTYPE)
                stage.vs_all = torch.zeros(shape[:-1], device=self.device, dtype=kv_quant.SCALE_DTYPE)
                stage.ks_pool, stage.vs_pool = list(stage.ks_all), list(stage.vs_all)
            self._stages[idx] = stage
        log.info(
            "streaming decoder: %d slots, chunks <= %d frames, K/V block pools %.1f MB on %s (%s, K/V stored as %s): "
            "%.1f MB per stream at most, blocks of %s frames",
            self.max_streams, self.max_chunk_frames, self.pool_bytes / 1e6, self.device, dtype, self.state_dtype,
            self.stream_bytes / 1e6, "/".join(str(g.block // g.tokens_per_frame) for g in geoms.values()),
        )

    # ---------------------------------------------------------------- states
    def _drain(self) -> None:
        """Give back the slots and blocks of states closed or collected since the last call (either thread may
        call it: the tables' lock covers the slot list too)."""
        with self._tables.lock:
            while self._released:
                slot = self._released.popleft()
                self._tables.close(slot)
                self._free.append(slot)
            while self._kept_released:
                self._tables.drop(self._kept_released.popleft())

    @property
    def free_slots(self) -> int:
        self._drain()
        return len(self._free)

    @property
    def free_blocks(self) -> list[int]:
        """Pool blocks held by no stream, per stage (in decoder order)."""
        self._drain()
        return self._tables.free_blocks

    @property
    def unreserved_blocks(self) -> list[int]:
        """Pool blocks neither held nor promised to an open stream, per stage."""
        self._drain()
        return self._tables.unreserved_blocks

    def can_open(self, max_frames: int | None = None) -> bool:
        """Whether :meth:`new_state` would succeed now for a stream of at most ``max_frames`` frames."""
        self._drain()
        return bool(self._free) and self._tables.can_open(max_frames)

    def new_state(self, max_frames: int | None = None) -> DecoderState:
        """A fresh stream state (position 0) with the K/V blocks it may hold reserved: its whole window, or what
        ``max_frames`` frames need when the stream will decode no more (fewer for a short take).

        Raises NoFreeSlot when all slots are taken, NoFreeBlocks when the pools cannot promise the blocks.
        """
        with self._tables.lock:
            self._drain()
            if not self._free:
                raise NoFreeSlot(f"all {self.max_streams} codec decoder slots are in use")
            slot = self._free[-1]
            self._tables.open(slot, max_frames)  # raises before the slot is taken
            self._free.pop()
        state = DecoderState(slot=slot)
        # The finalizer runs on close() or when the state is garbage-collected; it holds no
        # reference to the state itself, only to the release queue.
        state._release = weakref.finalize(state, self._released.append, slot)
        return state

    # ---------------------------------------------------------------- sharing (retakes)
    def detach(self, state: DecoderState) -> KeptBlocks:
        """End ``state`` but keep its blocks (no slot) for retakes to share; its slot is free again. Give the
        result back with :meth:`drop` (or let it be collected). No call on ``state`` may be running."""
        if state.closed:
            raise ValueError("detach of a closed DecoderState")
        with self._tables.lock:
            self._drain()
            state.closed = True
            if state._release is not None:
                state._release.detach()  # its slot goes back here, its blocks into the kept reference
            kept = self._tables.detach(state.slot, state.frames)
            self._free.append(state.slot)
        # Collected without drop(): its references go back on the next call (a finalizer may run on any thread). The
        # finalizer holds a twin of the reference, not the reference itself, or it would never be collected.
        kept._release = weakref.finalize(kept, self._kept_released.append, KeptBlocks(kept.blocks, kept.frames))
        return kept

    def can_resume(self, kept: KeptBlocks, frames: int) -> bool:
        """Whether :meth:`resume` may continue from ``kept`` at ``frames`` exactly (see BlockTables.can_resume)."""
        return self._tables.can_resume(kept, frames)

    def resume(self, kept: KeptBlocks, frames: int, max_frames: int | None = None) -> DecoderState:
        """A new stream at ``frames`` sharing ``kept``'s blocks: the state after frames ``[0, frames)`` of the stream
        ``kept`` came from, with nothing decoded (exact; its writes copy shared blocks first). ``max_frames`` as in
        :meth:`new_state` (counting the kept frames). Raises ValueError where :meth:`can_resume` says no."""
        if not self.can_resume(kept, frames):
            raise ValueError(f"kept codec state of {kept.frames} frames cannot resume at frame {frames}")
        state = self.new_state(max_frames)
        try:
            self._tables.attach(state.slot, kept)
        except BaseException:
            state.close()
            raise
        state.frames = int(frames)
        return state

    def drop(self, kept: KeptBlocks) -> None:
        """Give back a kept state's blocks (those no retake shares are free again)."""
        fin = kept._release
        if isinstance(fin, weakref.finalize):
            fin.detach()
        self._tables.drop(kept)

    def scratch_state(self) -> DecoderState:
        """A state on the scratch row (never a stream's; its own few blocks): for padding rows of a batched call,
        whose output is thrown away. Any number of them may share the row; it is never given back."""
        return DecoderState(slot=self.max_streams)

    @property
    def stream_bytes(self) -> int:
        """Bytes of K/V one stream holds at most (its whole ring at every stage): what the pools reserve for it."""
        return sum(st.geom.ring_blocks * st.geom.block_bytes for st in self._stages.values())

    @property
    def pool_bytes(self) -> int:
        """Bytes of every K/V block pool (streams' blocks and the scratch blocks; fp8: their scales too)."""
        return sum(
            t.numel() * t.element_size()
            for s in self._stages.values() for t in (s.k_all, s.v_all, s.ks_all, s.vs_all) if t is not None
        )

    def state_bytes(self, state: DecoderState) -> int:
        """Bytes of K/V blocks ``state`` holds now (grows with its age up to :attr:`stream_bytes`; 0 once closed)."""
        return 0 if state.closed else self._tables.held_bytes(state.slot)

    def rebuild(self, codes_prefix: np.ndarray | torch.Tensor, max_frames: int | None = None) -> DecoderState:
        """State after decoding frames ``[0, N)`` of ``codes_prefix`` ``[N, >=12]`` (exact; used for seek).

        Decodes the prefix from scratch (the stacked windows make the state depend on far more than the
        last window) in chunks of ``max_chunk_frames``, discarding the audio. ``max_frames``: as in
        :meth:`new_state` (counting the prefix).
        """
        state = self.new_state(max_frames)
        try:
            codes = self._as_codes(codes_prefix, allow_empty=True)
            for s in range(0, codes.shape[0], self.max_chunk_frames):
                chunk = codes[s : s + self.max_chunk_frames]
                self._run([state], chunk[None])
                state.frames += chunk.shape[0]
        except BaseException:
            state.close()
            raise
        return state

    # ---------------------------------------------------------------- decode
    def decode(
        self, states: Sequence[DecoderState], codes: Sequence[np.ndarray | torch.Tensor]
    ) -> list[np.ndarray]:
        """Decode one chunk per stream and advance each state.

        Args:
            states: one state per stream (distinct).
            codes: ``codes[i]`` ``[T_i, >=12]`` int (T_i >= 1, may differ per stream).
        Returns:
            ``audio[i]`` float32 ``[channels, samples_per_frame * T_i]`` at the codec sample rate.
        """
        return [a.cpu().numpy() for a in self.decode_tensors(states, codes)]

    @torch.no_grad()
    def decode_tensors(
        self, states: Sequence[DecoderState], codes: Sequence[np.ndarray | torch.Tensor]
    ) -> list[torch.Tensor]:
        """Like :meth:`decode` but returns float32 tensors on the decoder's device."""
        if len(states) != len(codes):
            raise ValueError(f"{len(states)} states but {len(codes)} code chunks")
        if len({id(s) for s in states}) != len(states):
            raise ValueError("the same state appears twice in one decode call")
        for s in states:
            if s.closed:
                raise ValueError("decode on a closed DecoderState")
        chunks = [self._checked_codes(c) for c in codes]
        groups: dict[int, list[int]] = defaultdict(list)
        for i, c in enumerate(chunks):
            groups[c.shape[0]].append(i)
        # Each call's codes reach the device in one copy, their range checked once, before any state advances: a
        # 128-stream call made 129 copies (each a stream synchronisation, with two reductions for its range) and
        # took 3-4 ms longer on an H200 (bench/RESULTS.md, session 33).
        batches = {T: self._code_batch([chunks[i] for i in idxs]) for T, idxs in groups.items()}
        self._drain()  # blocks of streams closed since the last call are free again
        # Every stream's blocks for the whole call first: a stream that outgrew its reservation fails the call
        # here, before any state advances.
        self._grow(states, [s.frames + c.shape[0] for s, c in zip(states, chunks, strict=True)])
        out: list[torch.Tensor | None] = [None] * len(states)
        for T, idxs in groups.items():
            batch = batches[T]  # [B, T, nq]
            pieces = []
            for start in range(0, T, self.max_chunk_frames):
                sub = batch[:, start : start + self.max_chunk_frames]
                pieces.append(self._run([states[i] for i in idxs], sub, grown=True))
                for i in idxs:
                    states[i].frames += sub.shape[1]
            audio = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1)
            for j, i in enumerate(idxs):
                out[i] = audio[j]
        return [a for a in out if a is not None]

    def _grow(self, states: Sequence[DecoderState], frames: Sequence[int]) -> None:
        """Blocks for each live state's tokens from its position up to ``frames``, shared blocks those frames write
        into copied first (the scratch row has its own blocks)."""
        wants = [(s.slot, s.frames, f) for s, f in zip(states, frames, strict=True) if s.slot != self.max_streams]
        if not wants:
            return
        copies = self._tables.grow(wants)
        for stage, pairs in zip(self._stages.values(), copies, strict=True):
            if pairs:
                stage.copy_blocks(pairs)
                self.copies += len(pairs)

    def _checked_codes(
        self, codes: np.ndarray | torch.Tensor, allow_empty: bool = False
    ) -> np.ndarray | torch.Tensor:
        """``codes`` ``[T, >= nq]`` checked (shape, integer dtype) and cut to the decoder's ``nq`` codebooks (the
        columns past them are never read, nor checked), where it is: numpy stays on the host (its range is checked
        where it is copied: :meth:`_code_batch`), a tensor is range-checked now."""
        t: np.ndarray | torch.Tensor = codes if isinstance(codes, torch.Tensor) else np.asarray(codes)
        if t.ndim != 2 or t.shape[1] < self.num_quantizers:
            raise ValueError(f"codes must be [T, >= {self.num_quantizers}], got {tuple(t.shape)}")
        if t.shape[0] == 0 and not allow_empty:
            raise ValueError("codes chunk has no frames (T must be >= 1)")
        if isinstance(t, np.ndarray):
            if t.dtype not in _CODE_DTYPES_NP:
                raise ValueError(f"codes must be integers, got {t.dtype}")
            return t[:, : self.num_quantizers]
        if t.dtype not in _CODE_DTYPES:
            raise ValueError(f"codes must be integers, got {t.dtype}")
        t = t[:, : self.num_quantizers]
        self._check_range(t)
        return t

    def _check_range(self, codes: np.ndarray | torch.Tensor) -> None:
        size = self.codec.config.quantizer.codebook_size
        if codes.size if isinstance(codes, np.ndarray) else codes.numel():
            if int(codes.min()) < 0 or int(codes.max()) >= size:
                raise ValueError(f"codes out of range [0, {size})")

    def _code_batch(self, chunks: Sequence[np.ndarray | torch.Tensor]) -> torch.Tensor:
        """``[B, T, nq]`` int64 on the device from B checked chunks of equal T: host chunks stacked, range-checked
        and copied in one transfer."""
        if all(isinstance(c, np.ndarray) for c in chunks):
            stacked = np.stack(chunks)
            self._check_range(stacked)
            return torch.from_numpy(stacked.astype(np.int64, copy=False)).to(self.device)
        return torch.stack([torch.as_tensor(c).to(device=self.device, dtype=torch.int64) for c in chunks])

    def _as_codes(self, codes: np.ndarray | torch.Tensor, allow_empty: bool = False) -> torch.Tensor:
        """One chunk ``[T, nq]`` int64 on the device, checked (see :meth:`_checked_codes`)."""
        return self._code_batch([self._checked_codes(codes, allow_empty)])[0]

    # ---------------------------------------------------------------- forward
    def _kernel_for(self, st: _Stage) -> bool:
        """Whether stage ``st`` runs its attention through the window kernel (decided per call, so the
        environment switch applies to eager calls and to graphs captured after it is set)."""
        return self.attention == "kernel" and wa.available(self.device, self.dtype, st.module.spec.head_dim)

    def _run(self, states: Sequence[DecoderState], codes: torch.Tensor, grown: bool = False) -> torch.Tensor:
        """One forward of B streams, equal T <= max_chunk_frames. codes ``[B, T, nq]`` → audio ``[B, ch, T*spf]``.
        ``grown``: the caller made every stream writable for this chunk already (decode_tensors grows for the whole
        call; growing again finds nothing to do, at ~10 us a stream)."""
        B, T = codes.shape[0], codes.shape[1]
        if not grown:
            self._grow(states, [s.frames + T for s in states])
        self._tables.sync()
        slots_list = [s.slot for s in states]
        offs_list = [s.frames for s in states]
        if self.cuda_graphs:
            g = self._graphs.get((B, T)) or self._capture(B, T)
            g.codes.copy_(codes)
            g.slots.copy_(torch.tensor(slots_list, dtype=torch.int64))
            g.offs.copy_(torch.tensor(offs_list, dtype=torch.int64))
            g.graph.replay()
            # Graphs share one memory pool: copy the output out before any other graph runs.
            return g.out.clone()
        slots = torch.tensor(slots_list, device=self.device, dtype=torch.int64)
        offs = torch.tensor(offs_list, device=self.device, dtype=torch.int64)
        return self._forward(codes, slots, offs)

    @torch.no_grad()
    def warmup(
        self, batch_sizes: Sequence[int], chunk_frames: Sequence[int], contiguous_from: int | None = None
    ) -> None:
        """Capture CUDA graphs now instead of on first use (no-op without graphs), one per (batch, T).
        ``contiguous_from`` is accepted for callers of the former per-slot-range graphs and ignored: every slot
        set shares one graph now."""
        if not self.cuda_graphs:
            return
        for b in batch_sizes:
            for t in chunk_frames:
                if (b, t) not in self._graphs:
                    self._capture(b, t)

    @torch.no_grad()
    def compile_shape(self, B: int, T: int) -> None:
        """One eager forward of a (B, T) call on the scratch row, as a capture's warm-up runs it (no stream state is
        touched): the shape's Triton kernels compile ahead of its capture (engine/warm_compile.py runs several such
        calls on threads at once, before any capture and while nothing else decodes)."""
        if B > self.max_streams or T > self.max_chunk_frames:
            raise ValueError(f"shape ({B}, {T}) exceeds max_streams/max_chunk_frames")
        dev = self.device
        codes = torch.zeros(B, T, self.num_quantizers, dtype=torch.int64, device=dev)
        scratch = torch.full((B,), self.max_streams, dtype=torch.int64, device=dev)
        self._forward(codes, scratch, torch.zeros(B, dtype=torch.int64, device=dev))

    def _capture(self, B: int, T: int) -> _Graph:
        if B > self.max_streams or T > self.max_chunk_frames:
            raise ValueError(f"graph ({B}, {T}) exceeds max_streams/max_chunk_frames")
        dev = self.device
        codes = torch.zeros(B, T, self.num_quantizers, dtype=torch.int64, device=dev)
        scratch = torch.full((B,), self.max_streams, dtype=torch.int64, device=dev)
        offs = torch.zeros(B, dtype=torch.int64, device=dev)
        self._tables.sync()
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            # One warm-up run outside the capture: it compiles or loads the shape's Triton kernels and sets cuBLAS up,
            # writing only the scratch row's blocks (no stream state is touched). A second run changed nothing the
            # graphs replay and cost a 128-slot server's start ~0.5 s over its 16 codec graphs (bench/RESULTS.md).
            self._forward(codes, scratch, offs)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            out = self._forward(codes, scratch, offs)
        g = _Graph(codes=codes, slots=scratch, offs=offs, graph=graph, out=out)
        self._graphs[(B, T)] = g
        log.info("captured codec decode graph: batch %d, %d frames", B, T)
        return g

    def _forward(self, codes: torch.Tensor, slots: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """Device-only maths of one step (no host sync), so it can be captured in a CUDA graph.

        Args:
            codes: ``[B, T, nq]`` int64. slots: ``[B]`` block-table rows. offs: ``[B]`` frames already decoded.
        """
        x = self.codec.quantizer.decode(codes)
        for idx, m in enumerate(self.codec.decoder):
            if isinstance(m, Patch):
                x = m(x)
            else:
                x = self._stage(self._stages[idx], x, slots, offs)
        return self.codec.deinterleave(x)

    def _stage(self, st: _Stage, x: torch.Tensor, slots: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        B, Tq, _ = x.shape
        dev = x.device
        g = st.geom
        R = g.ring
        table = self._tables.table[:, st.col : st.col + g.ring_blocks]  # [rows, ring_blocks] of this stage
        start = offs * g.tokens_per_frame  # [B] first token position of this chunk
        pos = start[:, None] + torch.arange(Tq, device=dev)  # [B, Tq]
        # Where the chunk's keys go: the stream's block for each position, and the row inside it.
        blk = table[slots[:, None], (pos // g.block) % g.ring_blocks].long()  # [B, Tq]
        row = pos % g.block
        H = st.module.spec.num_heads
        scale = st.module.spec.head_dim**-0.5
        kernel = self._kernel_for(st)
        if not kernel:
            # Ring entry j (position p with p % R == j) lives in block table[j // block], row j % block; the
            # three index tensors broadcast to [B, H, R], so the gather lands contiguous in [B, H, R, Dh].
            j = torch.arange(R, device=dev)
            ring_blk = table[slots[:, None], (j // g.block)[None, :]].long()[:, None, :]  # [B, 1, R]
            ring_row = (j % g.block)[None, None, :]
            heads = torch.arange(H, device=dev)[None, :, None]
            # Position held by each ring entry once this chunk is written: the latest p <= last with p % R == j.
            last = (start + Tq - 1)[:, None]
            pos_j = last - (last - j[None, :]) % R  # [B, R]; negative = never written
            delta = pos[:, :, None] - pos_j[:, None, :]  # [B, Tq, R]
            visible = ((pos_j >= 0)[:, None, :] & (delta >= 0) & (delta < g.context))[:, None]  # [B, 1, Tq, R]
            # Additive mask made once per stage: a bool mask would be converted again in every layer.
            mask = torch.zeros(visible.shape, device=dev, dtype=self.dtype).masked_fill_(~visible, float("-inf"))
        use_matmul = self.attention == "matmul" or (
            self.attention == "auto" and B * H * Tq * R <= self.matmul_max_scores
        )

        def attend(li: int, q: torch.Tensor) -> torch.Tensor:
            """Attention of the chunk's queries over layer ``li``'s keys (the chunk's keys already written)."""
            kp, vp = st.k_pool[li], st.v_pool[li]
            ks, vs = st.scales(li)
            if kernel:
                return wa.window_attention(
                    q, kp, vp, table, slots, offs, tokens_per_frame=g.tokens_per_frame, context=g.context,
                    block=g.block, ring_blocks=g.ring_blocks, scale=scale, k_scale=ks, v_scale=vs,
                )
            # Gather each stream's ring ([B, H, R, Dh]) out of the blocks (fp8: with its scales, dequantized).
            kb, vb = kp[ring_blk, heads, ring_row], vp[ring_blk, heads, ring_row]
            if ks is not None and vs is not None:
                kb = kv_quant.dequantize(kb, ks[ring_blk, heads, ring_row], self.dtype)
                vb = kv_quant.dequantize(vb, vs[ring_blk, heads, ring_row], self.dtype)
            if use_matmul:
                scores = torch.matmul(q * scale, kb.transpose(-1, -2)) + mask  # [B, H, Tq, R]
                return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(vb.dtype), vb)
            return F.scaled_dot_product_attention(q, kb, vb, attn_mask=mask)

        h = st.module.project_in(x)
        layers = st.module.transformer.blocks
        if fused.usable(h):
            # Fused kernels (CUDA): RoPE + K/V block write in one kernel, residual + LayerNorm + cast in another.
            cos, sin = rope_tables(pos, st.module.spec.head_dim, st.module.spec.max_period)

            def kv_dst(li: int) -> KVTarget:
                ks, vs = st.scales(li)
                return st.k_pool[li], st.v_pool[li], blk, row, ks, vs

            return st.module.project_out(run_layers_fused(layers, h, cos, sin, kv_dst, attend))
        rot = rope_rotation(pos, st.module.spec.head_dim, st.module.spec.max_period, acc_dtype(self.dtype))
        for li, layer in enumerate(layers):
            q, k, v = layer.qkv(h, rot)
            # Advanced indices (blk, row) around a slice: target shape [B, Tq, H, Dh].
            ks, vs = st.scales(li)
            if ks is not None and vs is not None:
                kq, kscale = kv_quant.quantize(k.transpose(1, 2))
                vq, vscale = kv_quant.quantize(v.transpose(1, 2))
                st.k_pool[li][blk, :, row], ks[blk, :, row] = kq, kscale
                st.v_pool[li][blk, :, row], vs[blk, :, row] = vq, vscale
            else:
                st.k_pool[li][blk, :, row] = k.transpose(1, 2)
                st.v_pool[li][blk, :, row] = v.transpose(1, 2)
            h = layer.finish(h, attend(li, q))
        return st.module.project_out(h)
