"""Exact, batched, stateful streaming decode.

Every decoder stage is causal with a finite window, and patch stages are reshapes, so the
waveform of frame t depends only on codes <= t. A stream's state is, per attention layer, the
keys/values of its recent tokens plus the number of frames decoded so far.

Storage: one pool per attention layer, ``[max_streams, heads, ring, head_dim]``; a stream owns one
slot (row). ``ring = context + max_chunk_frames * tokens_per_frame`` ("headroom"): a chunk's keys are
written first and attention then runs over the whole ring with a position mask. Because the ring
also holds the ``context`` keys before the chunk, every query sees exactly the keys the whole-clip
decode gives it (upstream's ring of exactly ``context`` entries drops some for multi-frame chunks).
Chunks longer than ``max_chunk_frames`` are split internally.

Attention: on CUDA the Triton kernel of :mod:`.window_attention` reads, for each stream, only the keys
its queries can see, in place from the pools (``attention="kernel"``, the default). Elsewhere (CPU,
``MOSS_RT_CODEC_KERNEL=0``, ``attention="sdpa"``) SDPA runs over the whole ring with a position mask.

Batched calls: streams with the same chunk length T run in one forward; groups of different T run
one after another (no padding, so padding can never advance a state). On the SDPA path, slots that form
a contiguous range are used as a view of the pool; otherwise they are gathered.

On CUDA, ``cuda_graphs=True`` captures one graph per (batch, T) on first use (or in :meth:`warmup`):
the step is pure device work with slots/offsets as input tensors, captured against a scratch pool row so
capture never touches a live stream. With the kernel one graph serves every slot set; the SDPA path
gathers slots in its graphs (plus, with ``contiguous_graphs``, one view graph per start slot).

Not thread-safe: one worker thread owns a StreamingDecoder (as it owns the GPU).
"""

from __future__ import annotations

import logging
import weakref
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from . import fused
from . import window_attention as wa
from .model import DEFAULT_DECODE_LEVELS, CodecModel, Patch
from .modules import ProjectedTransformer, acc_dtype, rope_rotation, rope_tables, run_layers_fused

__all__ = ["DecoderState", "NoFreeSlot", "StreamingDecoder", "stream_state_bytes"]

log = logging.getLogger(__name__)


class NoFreeSlot(RuntimeError):
    """All ``max_streams`` decoder slots are held by live states; close one first."""


@dataclass(eq=False)
class DecoderState:
    """Per-stream decoder state: a slot in the decoder's K/V pools and the frames decoded so far.

    Close it (or drop every reference to it) to give the slot back.
    """

    slot: int
    frames: int = 0
    closed: bool = False
    _release: weakref.finalize | None = field(default=None, repr=False)

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
    tokens_per_frame: int
    context: int
    ring: int
    k_pool: list[torch.Tensor]  # per layer [S, H, ring, Dh]
    v_pool: list[torch.Tensor]


def _ring_size(spec: object, frame_rate: float, max_chunk_frames: int) -> tuple[int, int]:
    """(tokens per frame, ring entries) of one decoder stage: its window plus one chunk of headroom,
    rounded up to 64 so the additive mask rows stay aligned for SDPA."""
    tpf = int(round(spec.rate_hz / frame_rate))  # type: ignore[attr-defined]
    return tpf, -(-(spec.context + max_chunk_frames * tpf) // 64) * 64  # type: ignore[attr-defined]


def stream_state_bytes(codec: CodecModel, max_chunk_frames: int, dtype: torch.dtype) -> int:
    """Bytes of one stream's K/V rings (what each pool row costs), without allocating anything."""
    total = 0
    itemsize = torch.tensor([], dtype=dtype).element_size()
    for m in codec.decoder:
        if isinstance(m, ProjectedTransformer):
            spec = m.spec
            _, ring = _ring_size(spec, codec.config.frame_rate, max_chunk_frames)
            total += 2 * spec.num_layers * spec.num_heads * ring * spec.head_dim * itemsize
    return total


class StreamingDecoder:
    """Exact streaming decoder over a :class:`CodecModel` (see module docstring).

    Args:
        codec: the loaded codec (decode-only is enough). It is moved to ``device`` and its transformer
            linears set to ``dtype`` if they differ.
        device: compute device.
        dtype: compute dtype of the transformer linears and of the K/V pools (fp32 or bf16).
        max_streams: number of pool slots (live states at once).
        max_chunk_frames: largest chunk decoded in one forward; sets the ring headroom.
        num_quantizers: codebooks used per frame (12 for MOSS-TTS).
        cuda_graphs: capture and replay one CUDA graph per (batch, T) (CUDA only).
        attention: "kernel" (the Triton varlen window kernel of :mod:`.window_attention`, reading each stream's
            keys in place; SDPA where it cannot run: CPU, ``MOSS_RT_CODEC_KERNEL=0``), "sdpa" (masked SDPA over
            the whole ring), "matmul" (two batched GEMMs + softmax; for short chunks over long windows) or "auto"
            (matmul while the score tensor stays under ``matmul_max_scores`` elements).
        contiguous_graphs: in graph mode without the kernel, give a batch of >= 2 streams in adjacent ascending
            slots its own graph that reads the pools as views (≈2x faster at 16 streams × 1 frame) at the cost of
            one capture per start slot; False always uses the gather graphs. A single stream always uses the
            gather graph. The kernel reads every slot in place: one graph per (batch, T).
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
        contiguous_graphs: bool = True,
    ) -> None:
        self.device = torch.device(device)
        if attention not in ("kernel", "sdpa", "matmul", "auto"):
            raise ValueError(f"attention must be kernel, sdpa, matmul or auto, got {attention!r}")
        self.attention = attention
        self.matmul_max_scores = int(matmul_max_scores)
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError("cuda_graphs needs a CUDA device")
        self.cuda_graphs = cuda_graphs
        self.contiguous_graphs = contiguous_graphs
        self._graphs: dict[tuple[int, int, int | None], _Graph] = {}
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
        self._stages: dict[int, _Stage] = {}
        frame_rate = codec.config.frame_rate
        for idx, m in enumerate(codec.decoder):
            if isinstance(m, ProjectedTransformer):
                spec = m.spec
                tpf, ring = _ring_size(spec, frame_rate, self.max_chunk_frames)
                # One extra row (index max_streams) is scratch: graph capture writes there, never to a stream.
                shape = (self.max_streams + 1, spec.num_heads, ring, spec.head_dim)
                self._stages[idx] = _Stage(
                    module=m,
                    tokens_per_frame=tpf,
                    context=spec.context,
                    ring=ring,
                    k_pool=[torch.zeros(shape, device=self.device, dtype=dtype) for _ in range(spec.num_layers)],
                    v_pool=[torch.zeros(shape, device=self.device, dtype=dtype) for _ in range(spec.num_layers)],
                )
        # The kernel addresses keys through a block table; a ring per slot is one block per row.
        self._ring_table = torch.arange(self.max_streams + 1, device=self.device, dtype=torch.int32)[:, None]
        nbytes = sum(t.numel() * t.element_size() for s in self._stages.values() for t in s.k_pool + s.v_pool)
        log.info(
            "streaming decoder: %d slots, chunks <= %d frames, K/V pools %.1f MB on %s (%s)",
            self.max_streams, self.max_chunk_frames, nbytes / 1e6, self.device, dtype,
        )

    # ---------------------------------------------------------------- states
    @property
    def free_slots(self) -> int:
        return len(self._free)

    def new_state(self) -> DecoderState:
        """A fresh stream state (position 0). Raises NoFreeSlot when all slots are taken."""
        if not self._free:
            raise NoFreeSlot(f"all {self.max_streams} codec decoder slots are in use")
        slot = self._free.pop()
        state = DecoderState(slot=slot)
        # The finalizer runs on close() or when the state is garbage-collected; it holds no
        # reference to the state itself, only to the free list.
        state._release = weakref.finalize(state, self._free.append, slot)
        return state

    def scratch_state(self) -> DecoderState:
        """A state on the scratch pool row (never a stream's): for padding rows of a batched call, whose
        output is thrown away. Any number of them may share the row; it is never given back."""
        return DecoderState(slot=self.max_streams)

    @property
    def stream_bytes(self) -> int:
        """Bytes of one stream's K/V rings."""
        return sum(t[0].numel() * t.element_size() for s in self._stages.values() for t in s.k_pool + s.v_pool)

    def rebuild(self, codes_prefix: np.ndarray | torch.Tensor) -> DecoderState:
        """State after decoding frames ``[0, N)`` of ``codes_prefix`` ``[N, >=12]`` (exact; used for seek).

        Decodes the prefix from scratch (the stacked windows make the state depend on far more than the
        last window) in chunks of ``max_chunk_frames``, discarding the audio.
        """
        state = self.new_state()
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
        chunks = [self._as_codes(c) for c in codes]
        groups: dict[int, list[int]] = defaultdict(list)
        for i, c in enumerate(chunks):
            groups[c.shape[0]].append(i)
        out: list[torch.Tensor | None] = [None] * len(states)
        for T, idxs in groups.items():
            batch = torch.stack([chunks[i] for i in idxs])  # [B, T, nq]
            pieces = []
            for s in range(0, T, self.max_chunk_frames):
                sub = batch[:, s : s + self.max_chunk_frames]
                pieces.append(self._run([states[i] for i in idxs], sub))
                for i in idxs:
                    states[i].frames += sub.shape[1]
            audio = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1)
            for j, i in enumerate(idxs):
                out[i] = audio[j]
        return [a for a in out if a is not None]

    def _as_codes(self, codes: np.ndarray | torch.Tensor, allow_empty: bool = False) -> torch.Tensor:
        t = torch.as_tensor(np.asarray(codes) if not isinstance(codes, torch.Tensor) else codes)
        if t.dim() != 2 or t.shape[1] < self.num_quantizers:
            raise ValueError(f"codes must be [T, >= {self.num_quantizers}], got {tuple(t.shape)}")
        if t.shape[0] == 0 and not allow_empty:
            raise ValueError("codes chunk has no frames (T must be >= 1)")
        if t.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
            raise ValueError(f"codes must be integers, got {t.dtype}")
        size = self.codec.config.quantizer.codebook_size
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= size):
            raise ValueError(f"codes out of range [0, {size})")
        return t[:, : self.num_quantizers].to(device=self.device, dtype=torch.int64)

    # ---------------------------------------------------------------- forward
    def _kernel_for(self, st: _Stage) -> bool:
        """Whether stage ``st`` runs its attention through the window kernel (decided per call, so the
        environment switch applies to eager calls and to graphs captured after it is set)."""
        return self.attention == "kernel" and wa.available(self.device, self.dtype, st.module.spec.head_dim)

    def _run(self, states: Sequence[DecoderState], codes: torch.Tensor) -> torch.Tensor:
        """One forward of B streams, equal T <= max_chunk_frames. codes ``[B, T, nq]`` → audio ``[B, ch, T*spf]``."""
        slots_list = [s.slot for s in states]
        offs_list = [s.frames for s in states]
        B, T = codes.shape[0], codes.shape[1]
        contig = slots_list == list(range(slots_list[0], slots_list[0] + B))
        # The kernel reads every slot in place: views of adjacent slots gain nothing there.
        start = slots_list[0] if contig and not self._all_kernel() else None
        if self.cuda_graphs:
            # Contiguous slot ranges may get their own graph that reads the pools as views (no gather copy);
            # not for one stream, where the gather is cheap and a graph per slot would be wasteful.
            gstart = start if (self.contiguous_graphs and B >= 2 and not self._all_kernel()) else None
            g = self._graphs.get((B, T, gstart)) or self._capture(B, T, gstart)
            g.codes.copy_(codes)
            g.slots.copy_(torch.tensor(slots_list, dtype=torch.int64))
            g.offs.copy_(torch.tensor(offs_list, dtype=torch.int64))
            g.graph.replay()
            # Graphs share one memory pool: copy the output out before any other graph runs.
            return g.out.clone()
        slots = torch.tensor(slots_list, device=self.device, dtype=torch.int64)
        offs = torch.tensor(offs_list, device=self.device, dtype=torch.int64)
        return self._forward(codes, slots, offs, start)

    @torch.no_grad()
    def warmup(self, batch_sizes: Sequence[int], chunk_frames: Sequence[int], contiguous_from: int | None = 0) -> None:
        """Capture CUDA graphs now instead of on first use (no-op without graphs): for each (batch, T), the
        gather graph and, unless ``contiguous_from`` is None, the graph for slots ``contiguous_from..+batch-1``."""
        if not self.cuda_graphs:
            return
        for b in batch_sizes:
            for t in chunk_frames:
                starts: list[int | None] = [None]
                if (
                    self.contiguous_graphs
                    and not self._all_kernel()
                    and b >= 2
                    and contiguous_from is not None
                    and contiguous_from + b <= self.max_streams
                ):
                    starts.append(contiguous_from)
                for start in starts:
                    if (b, t, start) not in self._graphs:
                        self._capture(b, t, start)

    def _all_kernel(self) -> bool:
        return all(self._kernel_for(st) for st in self._stages.values())

    def _capture(self, B: int, T: int, start: int | None) -> _Graph:
        if B > self.max_streams or T > self.max_chunk_frames:
            raise ValueError(f"graph ({B}, {T}) exceeds max_streams/max_chunk_frames")
        dev = self.device
        codes = torch.zeros(B, T, self.num_quantizers, dtype=torch.int64, device=dev)
        scratch = torch.full((B,), self.max_streams, dtype=torch.int64, device=dev)
        offs = torch.zeros(B, dtype=torch.int64, device=dev)
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            # Warm-up runs (allocator, cuBLAS/SDPA plans) outside the capture. Writes go to the scratch
            # row; a contiguous graph only *reads* live rows here, so no stream state is touched.
            for _ in range(2):
                self._forward(codes, scratch, offs, start)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            out = self._forward(codes, scratch, offs, start)
        g = _Graph(codes=codes, slots=scratch, offs=offs, graph=graph, out=out)
        self._graphs[(B, T, start)] = g
        log.info("captured codec decode graph: batch %d, %d frames, slots %s", B, T,
                 "gathered" if start is None else f"{start}..{start + B - 1}")
        return g

    def _forward(
        self, codes: torch.Tensor, slots: torch.Tensor, offs: torch.Tensor, contig_start: int | None
    ) -> torch.Tensor:
        """Device-only maths of one step (no host sync), so it can be captured in a CUDA graph.

        Args:
            codes: ``[B, T, nq]`` int64. slots: ``[B]`` pool rows. offs: ``[B]`` frames already decoded.
            contig_start: when the slots are ``contig_start .. contig_start+B-1``, pools are sliced, not gathered.
        """
        B, T, _ = codes.shape
        x = self.codec.quantizer.decode(codes)
        for idx, m in enumerate(self.codec.decoder):
            if isinstance(m, Patch):
                x = m(x)
            else:
                x = self._stage(self._stages[idx], x, slots, offs, contig_start)
        return self.codec.deinterleave(x)

    def _stage(
        self, st: _Stage, x: torch.Tensor, slots: torch.Tensor, offs: torch.Tensor, contig_start: int | None
    ) -> torch.Tensor:
        B, Tq, _ = x.shape
        dev = x.device
        R = st.ring
        start = offs * st.tokens_per_frame  # [B] first token position of this chunk
        pos = start[:, None] + torch.arange(Tq, device=dev)  # [B, Tq]
        ring_idx = pos % R
        rows = slots[:, None]
        H = st.module.spec.num_heads
        scale = st.module.spec.head_dim**-0.5
        kernel = self._kernel_for(st)
        if not kernel:
            # Position held by each ring entry once this chunk is written: the latest p <= last with p % R == j.
            last = (start + Tq - 1)[:, None]
            j = torch.arange(R, device=dev)[None, :]
            pos_j = last - (last - j) % R  # [B, R]; negative = never written
            delta = pos[:, :, None] - pos_j[:, None, :]  # [B, Tq, R]
            visible = ((pos_j >= 0)[:, None, :] & (delta >= 0) & (delta < st.context))[:, None]  # [B, 1, Tq, R]
            # Additive mask made once per stage: a bool mask would be converted again in every layer.
            mask = torch.zeros(visible.shape, device=dev, dtype=self.dtype).masked_fill_(~visible, float("-inf"))
        use_matmul = self.attention == "matmul" or (
            self.attention == "auto" and B * H * Tq * R <= self.matmul_max_scores
        )

        def attend(li: int, q: torch.Tensor) -> torch.Tensor:
            """Attention of the chunk's queries over layer ``li``'s ring (the chunk's keys already written)."""
            kp, vp = st.k_pool[li], st.v_pool[li]
            if kernel:
                return wa.window_attention(
                    q, kp, vp, self._ring_table, slots, offs, tokens_per_frame=st.tokens_per_frame,
                    context=st.context, block=R, ring_blocks=1, scale=scale,
                )
            if contig_start is not None:
                kb, vb = kp[contig_start : contig_start + B], vp[contig_start : contig_start + B]
            else:
                kb, vb = kp.index_select(0, slots), vp.index_select(0, slots)
            if use_matmul:
                scores = torch.matmul(q * scale, kb.transpose(-1, -2)) + mask  # [B, H, Tq, R]
                return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(vb.dtype), vb)
            return F.scaled_dot_product_attention(q, kb, vb, attn_mask=mask)

        h = st.module.project_in(x)
        layers = st.module.transformer.layers
        if fused.usable(h):
            # Fused kernels (CUDA): RoPE + ring write in one kernel, residual + LayerNorm + cast in another.
            cos, sin = rope_tables(pos, st.module.spec.head_dim, st.module.spec.max_period)

            def kv_dst(li: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
                return st.k_pool[li], st.v_pool[li], slots, ring_idx

            return st.module.project_out(run_layers_fused(layers, h, cos, sin, kv_dst, attend))
        rot = rope_rotation(pos, st.module.spec.head_dim, st.module.spec.max_period, acc_dtype(self.dtype))
        for li, layer in enumerate(layers):
            q, k, v = layer.qkv(h, rot)
            # Advanced indices (rows, ring_idx) around a slice: target shape [B, Tq, H, Dh].
            st.k_pool[li][rows, :, ring_idx] = k.transpose(1, 2)
            st.v_pool[li][rows, :, ring_idx] = v.transpose(1, 2)
            h = layer.finish(h, attend(li, q))
        return st.module.project_out(h)
