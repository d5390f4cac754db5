"""One frame for a contiguous range of slots, as pure tensor code.

This single function is what runs eagerly (CPU, or CUDA without graphs) and what the
runner captures into CUDA graphs, so both paths are numerically the same code. It
reads and writes only the ``SlotState`` tensors: inputs are ``state.active`` and the
per-slot sampler state; outputs are ``state.codes`` / ``state.stop``; side effects are
the cache/hidden writes and the length, frame counter and presence updates of the rows
that produced a frame.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from moss_rt.model import chunk_attention, fused_sampling
from moss_rt.model.layers import rope_tables_half_split, rope_tables_interleaved
from moss_rt.model.network import MossTTSLocalModel, PackedKeys, PagedIndex
from moss_rt.model.sampling import apply_repetition_penalty, sample, token_keys, uniforms
from moss_rt.model.state import SlotState


@dataclass
class Tables:
    """Constants the step needs, built once per runner."""

    cos: torch.Tensor  # backbone RoPE [positions, head_dim]
    sin: torch.Tensor
    local_cos: torch.Tensor  # local RoPE [n_vq, local_head_dim]
    local_sin: torch.Tensor
    audio_keys: torch.Tensor  # per-token hash keys [audio_vocab]
    stop_keys: torch.Tensor  # [2]

    @classmethod
    def build(cls, model: MossTTSLocalModel, positions: int, device: torch.device, dtype: torch.dtype) -> Tables:
        cfg = model.config
        cos, sin = rope_tables_half_split(positions, cfg.backbone.head_dim, cfg.backbone.rope_theta, device, dtype)
        lcos, lsin = rope_tables_interleaved(cfg.n_vq, cfg.local.head_dim, cfg.local.rope_base, device, dtype)
        return cls(cos, sin, lcos, lsin, token_keys(cfg.audio_vocab_size, device), token_keys(2, device))


@dataclass
class Timer:
    """Wall-clock split of an eager step (only meaningful where ops run synchronously, i.e. CPU)."""

    backbone_ms: float = 0.0
    local_ms: float = 0.0
    sampling_ms: float = 0.0
    bookkeeping_ms: float = 0.0  # lengths, counters, presence, outputs after the backbone
    _t: float = field(default=0.0, repr=False)

    def start(self) -> None:
        self._t = time.perf_counter()

    def lap(self, bucket: str) -> None:
        now = time.perf_counter()
        setattr(self, bucket, getattr(self, bucket) + (now - self._t) * 1000.0)
        self._t = now


def frame_step(
    model: MossTTSLocalModel,
    st: SlotState,
    tables: Tables,
    r0: int,
    r1: int,
    key_len: int,
    timer: Timer | None = None,
) -> None:
    """Advance the active rows of slots [r0, r1) by one frame.

    ``key_len`` bounds the attention window of the backbone decode (>= length+1 of every
    active row); rows that are not active compute garbage that is written only to the
    scratch position and never read.
    """
    cfg = model.config
    n_vq = cfg.n_vq
    rows = slice(r0, r1)
    batch = r1 - r0
    device = st.hidden.device
    active = st.active[rows]
    lengths = st.lengths[rows]
    frame = st.frame_index[rows]
    seed_lo, seed_hi = st.seed_lo[rows], st.seed_hi[rows]
    if timer:
        timer.start()

    # ---- local transformer + heads + sampling on the pending hidden state
    slot_ids = torch.arange(r0, r1, device=device)
    kv_heads = cfg.backbone.num_key_value_heads
    h = st.hidden[st.pool_index(slot_ids, (lengths - 1).clamp(min=0)[:, None])[:, 0]]
    local = model.local_transformer
    buffers = local.new_buffers(batch, n_vq, device, h.dtype)
    z = local.step(h, tables.local_cos[0], tables.local_sin[0], buffers, 0)
    stop_logits = model.stop_logits(z)
    if timer:
        timer.lap("local_ms")
    # The uniforms' counter of draw j (0: stop head, 1 + k: codebook k) of a frame is frame * (n_vq + 1) + j.
    fused = fused_sampling.available(stop_logits)
    counter_base = frame * (n_vq + 1) if not fused else frame  # the kernel forms the counter itself
    if fused:
        # One kernel per draw (fused_sampling.py); the audio draws also set the presence bits of the rows
        # that produce this frame, which the bookkeeping below then leaves alone.
        stop_code = torch.empty((batch,), dtype=torch.int64, device=device)
        fused_sampling.fused_draw(
            stop_code, stop_logits, st.text_temperature[rows], st.text_top_k[rows], st.text_top_p[rows],
            seed_lo, seed_hi, frame, n_vq + 1, 0,
        )
        stop = stop_code == 1
    else:
        stop = (
            sample(
                stop_logits,
                st.text_temperature[rows],
                st.text_top_k[rows],
                st.text_top_p[rows],
                uniforms(seed_lo, seed_hi, counter_base, tables.stop_keys),
            )
            == 1
        )
    if timer:
        timer.lap("sampling_ms")
    presence = st.presence[rows]
    frame_codes = torch.empty((batch, n_vq), dtype=torch.int64, device=device)
    for k in range(n_vq):
        logits = model.audio_logits(z, k)
        if timer:
            timer.lap("local_ms")
        if fused:
            code = fused_sampling.fused_draw(
                frame_codes[:, k], logits, st.audio_temperature[rows], st.audio_top_k[rows], st.audio_top_p[rows],
                seed_lo, seed_hi, frame, n_vq + 1, k + 1,
                penalty=st.audio_penalty[rows], presence=presence[:, k], active=active, stop=stop_code,
            )
        else:
            logits = apply_repetition_penalty(logits, presence[:, k], st.audio_penalty[rows])
            code = sample(
                logits,
                st.audio_temperature[rows],
                st.audio_top_k[rows],
                st.audio_top_p[rows],
                uniforms(seed_lo, seed_hi, counter_base + (k + 1), tables.audio_keys),
            )
            frame_codes[:, k] = code
        if timer:
            timer.lap("sampling_ms")
        if k + 1 < n_vq:
            emb = model.audio_embeddings[k](code).to(h.dtype)
            z = local.step(emb, tables.local_cos[k + 1], tables.local_sin[k + 1], buffers, k + 1)
            if timer:
                timer.lap("local_ms")
    produced = active & ~stop

    # ---- feed the new row through the backbone so the next hidden state is ready
    row = torch.cat([torch.full_like(frame_codes[:, :1], cfg.audio_assistant_slot_token_id), frame_codes], dim=-1)
    x = model.embed_rows(row[:, None, :])
    # Inactive rows compute at position 0 and write into the scratch block; their keys are all visible
    # (no fully masked row, so no NaN) and nothing they write is ever read.
    write_pos = torch.where(active, lengths, torch.zeros_like(lengths))[:, None]
    write_at = torch.where(active[:, None], st.pool_index(slot_ids, write_pos), torch.full_like(write_pos, st.scratch))
    keys = torch.arange(key_len, device=device)
    key_mask = (keys[None, :] <= write_pos) | ~active[:, None]
    # The decode kernel reads no key past a row's own (an inactive row reads none: its output is never used).
    extent = torch.where(active, write_pos[:, 0] + 1, 0).to(torch.int32)
    index = PagedIndex.build(
        write_at, st.pool_index(slot_ids, keys[None, :].expand(batch, key_len)), kv_heads, extent=extent
    )
    out = model.transformer(
        x,
        tables.cos[write_pos],
        tables.sin[write_pos],
        st.k_cache,
        st.v_cache,
        index,
        key_mask[:, None, :],
    )
    st.hidden[write_at[:, 0]] = out[:, 0]
    if timer:
        timer.lap("backbone_ms")

    # ---- bookkeeping of the rows that produced a frame
    step = produced.to(torch.int64)
    st.lengths[rows] += step
    st.frame_index[rows] += step
    if not fused:
        seen = presence.gather(2, frame_codes[:, :, None]) | produced[:, None, None]
        presence.scatter_(2, frame_codes[:, :, None], seen)
    st.codes[rows] = torch.where(produced[:, None], frame_codes, torch.full_like(frame_codes, cfg.audio_pad_token_id))
    st.stop[rows] = stop
    if timer:
        timer.lap("bookkeeping_ms")


def packed_keys(
    st: SlotState, slots: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor, width: int, key_len: int,
    kv_heads: int,
) -> PackedKeys:
    """The keys of a pass after a prefix, piece by piece end to end (chunk_attention.packed_causal_attention): piece
    b's T = ``width`` query rows (its chunk padded) over its keys 0..starts[b]+T-1, so query t sees keys up to
    starts[b]+t, its own position. Keys past the piece's valid rows (only its padded queries reach them) and the
    entries past the last piece read the scratch position. Device-only and of fixed shapes (a prefill graph captures
    it; the starts and counts are its inputs): the buffer holds B x (key_len + T) entries, the most the pieces fill."""
    batch = int(slots.shape[0])
    device = starts.device
    lengths = starts + width
    cu_k = torch.zeros(batch + 1, dtype=torch.int64, device=device)
    cu_k[1:] = torch.cumsum(lengths, 0)
    entry = torch.arange(batch * (key_len + width), device=device)
    piece = torch.searchsorted(cu_k[1:], entry, right=True)  # the piece each entry belongs to (batch: past the last)
    inside = piece < batch
    piece = piece.clamp(max=batch - 1)
    key = entry - cu_k[piece]
    valid = inside & (key < starts[piece] + counts[piece])
    at = st.pool_index(slots[piece], key.clamp(0, st.positions - 1)[:, None])[:, 0]
    at = torch.where(valid, at, torch.full_like(at, st.scratch))
    heads = torch.arange(kv_heads, device=device)
    cu_q = torch.arange(batch + 1, device=device, dtype=torch.int32) * width
    return PackedKeys(at[:, None] * kv_heads + heads[None, :], cu_q, cu_k.to(torch.int32), width, key_len + width)


def prefill_batch_rows(
    model: MossTTSLocalModel,
    st: SlotState,
    tables: Tables,
    slots: torch.Tensor,
    rows: torch.Tensor,
    starts: torch.Tensor,
    counts: torch.Tensor,
    key_len: int,
    from_zero: bool = False,
) -> None:
    """Write prompt rows of several slots in ONE backbone pass (eager only).

    ``rows`` [B,T,1+n_vq] holds each slot's chunk padded to the longest (T); slot ``slots[b]``'s
    rows t < ``counts[b]`` go to positions ``starts[b]+t``; ``key_len`` = max(starts + counts).
    Every query attends causally to its own slot's keys only, so a valid row computes what it
    would alone, to float rounding (the GEMMs see more rows and the reduction over keys spans the
    longest window; with B=1 the shapes are exactly those of prefilling alone). Padded rows write
    their keys, values and hidden state to the slot's scratch position (never read by a valid
    row): positions past a shorter chunk keep whatever they held, and the slot's length, not the
    cache, decides what later steps see. A padded query still sees the slot's own earlier keys,
    so no attention row is fully masked (no NaN). ``from_zero``: every start is 0 (the caller knows it on the
    host), so the attention is plainly causal over the pass's own rows (see chunk_attention).
    """
    batch, width = int(rows.shape[0]), int(rows.shape[1])
    device = st.hidden.device
    kv_heads = model.config.backbone.num_key_value_heads
    offsets = torch.arange(width, device=device)[None, :]
    positions = starts[:, None] + offsets  # [B,T]
    valid = offsets < counts[:, None]
    rope_pos = positions.clamp(max=st.positions - 1)  # padded rows may run past the table; their values are unused
    write_at = torch.where(valid, st.pool_index(slots, rope_pos), torch.full_like(positions, st.scratch))
    keys = torch.arange(key_len, device=device)
    key_mask = keys[None, None, :] <= positions[:, :, None]
    read_at = st.pool_index(slots, keys[None, :].expand(batch, key_len))
    causal = from_zero and key_len == width
    packed = None
    if not causal and chunk_attention.packed_available(st.k_cache):
        packed = packed_keys(st, slots, starts, counts, width, key_len, kv_heads)
    index = PagedIndex.build(write_at, read_at, kv_heads, causal=causal, packed=packed)
    out = model.transformer(
        model.embed_rows(rows),
        tables.cos[rope_pos],
        tables.sin[rope_pos],
        st.k_cache,
        st.v_cache,
        index,
        key_mask,
    )
    st.hidden[write_at] = out
