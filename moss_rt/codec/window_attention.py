"""Varlen windowed attention of a streaming codec chunk (Triton): keys read in place through each stream's block table.

Why: the plain streaming path runs SDPA over every stream's *whole* ring (4,288 entries at the last full-size
stage) under an additive position mask, most of it masked for young streams, and first copies each layer's ring
of every stream out of the pool (``index_select``) when the slots are not adjacent. At 64 streams that copy and
the dense mask cost more than the attention. This kernel reads only the keys each query can see, straight from
the pool.

Semantics (what the masked SDPA computes): query ``t`` of stream ``b`` sits at position ``p = offs[b] * tpf + t``
and sees the keys at positions ``max(0, p - context + 1) .. p`` (the chunk's own keys are written before the
call). Key position ``k`` of stream ``b`` lives in block ``table[slots[b], (k // block) % ring_blocks]`` at row
``k % block``: a ring of ``ring_blocks * block`` entries over the stream's own block list. The ring must hold
``context + Tq - 1`` entries, so every key a query sees is still there; keys before position 0 are never read
(the pool may hold another stream's old keys).

Layout:

- ``q`` ``[B, H, Tq, D]``, any strides with unit stride on D;
- ``k_pool`` / ``v_pool`` ``[N, H, block, D]`` views with equal strides and unit stride on D (the streaming pools:
  ``[slots, H, ring, D]`` rings, or ``[blocks, H, block, D]`` paged views);
- ``table`` ``[rows, ring_blocks]`` int32 (a column slice of a wider table is fine), indexed by ``slots``;
- ``slots`` / ``offs`` ``[B]`` int64 device tensors (graph inputs), ``offs`` in frames decoded before the chunk.

One program per (query block of up to ``BLOCK_M`` queries, stream, head, key split) walks its keys in tiles of
``BLOCK_N`` with an fp32 online softmax. Where a power-of-two tile divides the block (the paged layout picks such
blocks: paged_state.py), tiles start on tile boundaries, so each lies in one block: one table read and contiguous
rows per tile. Only the edge tiles, which hold a key outside some query's window, are masked. Small calls split
the keys so about ``TARGET_PROGRAMS`` programs run, and a second kernel merges the partial sums. Everything the
host computes depends only on shapes, so one CUDA graph per (batch, T) serves every age and slot set.

Rounding: scores, the running max/sum and the output accumulate in fp32; probabilities enter the P·V dot in the
pool dtype (bf16 in production), like flash attention. In fp32 it equals the masked SDPA to ~1e-7.

Used on CUDA (and through Triton's interpreter when ``MOSS_RT_CODEC_KERNEL=interpret`` and
``TRITON_INTERPRET=1``: tests only, where dots run in fp32 since the interpreter of Triton 3.9 computes bf16
``tl.dot`` wrongly); ``MOSS_RT_CODEC_KERNEL=0`` keeps the SDPA path.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

from moss_rt.codec.paged_state import tile_divisor
from moss_rt.kernel_switch import kernel_wanted

__all__ = ["available", "window_attention"]

log = logging.getLogger(__name__)

BLOCK_N = 64  # keys per tile where no power-of-two tile of MIN_ALIGNED_TILE keys or more divides the block
MIN_ALIGNED_TILE = 32
MAX_ALIGNED_TILE = 128
FULL_BLOCK_TILE = 64  # keys per tile (at most) for full query blocks: tiles_for
# Registers a thread may use on CUDA (16-bit pools): left to itself the compiler takes 140-164 for the full-block
# tiles, which fits 3 programs of 4 warps on an SM; at 128 four fit (no spills with 2 stages) and the kernel, bound
# by latency rather than by any one pipe (ncu, 400 Hz 8-frame call: tensor 29 %, MUFU 39 %, FMA 26 %, 18 % of the warp
# slots in use), hides more of it: 1.10-1.22x on every shape that matters (tiles_for).
MAX_REGISTERS = 128
MAX_BLOCK_M = 64  # queries per program (a power of two, >= 16 for tl.dot)
TARGET_PROGRAMS = 256  # split the keys of small calls until about this many programs run (~2 per H200 SM)
MAX_SPLITS = 32
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LOG2E = math.log2(math.e)  # the kernel's softmax is base 2: scores scaled by it, then exp2 (one instruction)


@functools.cache
def _kernels() -> Any:
    """The jitted kernels (window_attention_kernels.py), imported on first use (so TRITON_INTERPRET is read then);
    None without Triton."""
    try:
        from moss_rt.codec import window_attention_kernels as k
    except Exception:  # noqa: BLE001 - no Triton (CPU wheels): the SDPA path
        return None
    return k._attend, k._merge


def available(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the kernel runs here: CUDA (or the interpreter in tests), Triton, a supported dtype and head size,
    and ``MOSS_RT_CODEC_KERNEL`` not ``0``."""
    if not kernel_wanted("MOSS_RT_CODEC_KERNEL", device.type == "cuda"):
        return False
    if dtype not in _DTYPES or head_dim < 16 or head_dim & (head_dim - 1):
        return False  # the head dimension is one tile: a power of two >= 16 (tl.arange, tl.dot)
    return _kernels() is not None and _works_on(device)


@functools.cache
def _works_on(device: torch.device) -> bool:
    """One tiny launch per device, the first time (before any capture: captures follow warm-up runs): Triton can
    import yet fail to compile (no C compiler, an unsupported GPU); then the SDPA path."""
    try:
        q = torch.zeros(1, 1, 1, 16, device=device)
        pool = torch.zeros(1, 1, 4, 16, device=device)
        table = torch.zeros(1, 1, dtype=torch.int32, device=device)
        idx = torch.zeros(1, dtype=torch.int64, device=device)
        window_attention(q, pool, pool, table, idx, idx, tokens_per_frame=1, context=1, block=4, ring_blocks=1,
                         scale=1.0)
        return True
    except Exception:  # noqa: BLE001
        log.warning("codec: Triton window-attention kernel unusable on %s; using SDPA", device, exc_info=True)
        return False


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Tiles:
    """Tile sizes and launch shape of one call (the defaults come from ``tiles_for``; benches try others)."""

    block_m: int
    block_n: int = BLOCK_N
    num_warps: int = 4
    num_stages: int = 2
    max_registers: int | None = MAX_REGISTERS  # per thread, on CUDA with 16-bit pools (None: the compiler's choice)


def tiles_for(tq: int, block: int) -> Tiles:
    """The tiles a chunk of ``tq`` query tokens over blocks of ``block`` keys runs with: key tiles that divide the
    block where one of at least MIN_ALIGNED_TILE keys does (64 streams, the last full-size stage: 1.45 ms a layer
    with 64-key tiles gathered key by key, 0.55 ms with 128-key tiles inside blocks of 256).

    Full query blocks (chunks of 8 frames at 100 Hz and above) run 64-key tiles, smaller ones (1-frame chunks)
    128-key tiles, all with 2 pipeline stages and at most MAX_REGISTERS registers a thread. Measured on the H200
    (128 streams, graphed, ms a layer, the compiler's registers -> 128): 8 frames at 400 Hz 11 s old 1.57 (3 stages)
    -> 1.40, 1 s old 0.294 -> 0.241; at 200 Hz 6 s 0.309 -> 0.272; at 50 Hz 0.093 -> 0.078; one frame at 400 Hz 6 s
    0.319 -> 0.267; at 12.5 Hz and young 1-frame windows within 3 % either way. (Before the cap, 3 stages beat 2 for
    full blocks: 64 streams, 400 Hz, 0.485 -> 0.441.)"""
    rows = block_rows(tq)
    full = rows == MAX_BLOCK_M
    tile = tile_divisor(block, FULL_BLOCK_TILE if full else MAX_ALIGNED_TILE)
    if tile < MIN_ALIGNED_TILE:
        return Tiles(rows, BLOCK_N)
    return Tiles(rows, tile)


def _register_cap(tiles: Tiles, q: torch.Tensor, fp8: bool) -> dict[str, int]:
    """The launch option capping registers (``maxnreg``), for the tuned case only: CUDA, 16-bit queries and pools.
    fp32 (tests) and fp8 pools (their dequantisation holds more registers) keep the compiler's choice."""
    if tiles.max_registers is None or not q.is_cuda or fp8 or q.dtype == torch.float32:
        return {}
    return {"maxnreg": tiles.max_registers}


def block_rows(tq: int) -> int:
    """Queries per program for a chunk of ``tq`` tokens: a power of two in [16, MAX_BLOCK_M]."""
    return max(16, min(MAX_BLOCK_M, 1 << max(0, tq - 1).bit_length()))


def split_count(
    programs: int, context: int, block_m: int, target: int = TARGET_PROGRAMS, block_n: int = BLOCK_N
) -> int:
    """Key splits for a call of ``programs`` (query block, stream, head) programs: enough that about ``target``
    programs run, at most one per key tile of the widest window a query block sees."""
    tiles = _cdiv(context + block_m - 1, block_n)
    return max(1, min(tiles, MAX_SPLITS, target // max(1, programs)))


def window_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    table: torch.Tensor,
    slots: torch.Tensor,
    offs: torch.Tensor,
    *,
    tokens_per_frame: int,
    context: int,
    block: int,
    ring_blocks: int,
    scale: float,
    splits: int | None = None,
    tiles: Tiles | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Windowed attention of the chunk's queries over each stream's stored keys (see the module docstring).

    Args:
        q: ``[B, H, Tq, D]``. k_pool, v_pool: ``[N, H, block, D]`` (in ``q``'s dtype, or float8_e4m3fn with
            ``k_scale`` / ``v_scale``). table: ``[rows, >= ring_blocks]`` int32.
        k_scale, v_scale: fp8 pools only: ``[N, H, block]`` fp32 (unit stride on the row, equal strides), one
            scale per stored (key, head) row (kv_quant.py).
        slots, offs: ``[B]`` int64 on the device. splits: key splits (None: chosen from the shapes).
        tiles: tile sizes and launch shape (None: ``tiles_for(Tq, block)``).
    Returns:
        ``[B, H, Tq, D]`` in ``q``'s dtype (a transposed view of a contiguous ``[B, Tq, H, D]``).
    """
    kernels = _kernels()
    assert kernels is not None, "check available() first"
    attend, merge = kernels
    B, H, Tq, D = q.shape
    assert q.stride(-1) == 1 and k_pool.stride() == v_pool.stride() and k_pool.stride(-1) == 1
    assert table.dtype == torch.int32 and table.stride(-1) == 1
    fp8 = k_scale is not None or v_scale is not None
    if fp8:
        assert k_scale is not None and v_scale is not None and k_pool.dtype == torch.float8_e4m3fn
        assert k_scale.stride() == v_scale.stride() and k_scale.stride(-1) == 1 and k_scale.dtype == torch.float32
        assert k_scale.shape == k_pool.shape[:-1]
    else:
        assert k_pool.dtype == q.dtype
    ks = k_scale if k_scale is not None else k_pool  # placeholders when not fp8 (never read)
    vs = v_scale if v_scale is not None else v_pool
    s_sn, s_sh = (k_scale.stride(0), k_scale.stride(1)) if k_scale is not None else (0, 0)
    assert ring_blocks * block >= context, "the ring must hold at least the window"
    out = torch.empty(B, Tq, H, D, device=q.device, dtype=q.dtype)
    tiles = tiles or tiles_for(Tq, block)
    bm, bn = tiles.block_m, tiles.block_n
    qblocks = _cdiv(Tq, bm)
    if splits is None:
        splits = split_count(qblocks * B * H, context, bm, block_n=bn) if q.is_cuda else 1
    aligned = block % bn == 0
    span = context + bm - 1 + (bn - 1 if aligned else 0)  # the most keys one query block reads
    chunk = _cdiv(_cdiv(span, splits), bn) * bn  # keys per split, whole tiles
    splits = _cdiv(span, chunk)
    if splits > 1:
        part_acc = torch.empty(B * H * Tq * splits, D, device=q.device, dtype=torch.float32)
        part_ml = torch.empty(B * H * Tq * splits, 2, device=q.device, dtype=torch.float32)
    else:
        part_acc = part_ml = out  # unused
    if B * Tq:
        attend[(qblocks, B * H, splits)](
            q, k_pool, v_pool, ks, vs, table, slots, offs, out, part_acc, part_ml,
            H, Tq, int(tokens_per_frame), int(context), int(block), int(ring_blocks), chunk, splits,
            float(scale) * LOG2E,
            q.stride(0), q.stride(1), q.stride(2), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), s_sn, s_sh,
            table.stride(0), out.stride(0), out.stride(2), out.stride(1),
            D=D, BLOCK_M=bm, BLOCK_N=bn, IEEE=q.dtype == torch.float32 or not q.is_cuda,
            UPCAST=not q.is_cuda, SPLIT=splits > 1, ALIGNED=aligned, FP8=fp8, num_warps=tiles.num_warps,
            num_stages=tiles.num_stages, **_register_cap(tiles, q, fp8),
        )
        if splits > 1:
            merge[(qblocks, B * H)](part_acc, part_ml, out, H, Tq, splits, out.stride(0), out.stride(2),
                                    out.stride(1), D=D, BLOCK_M=bm, num_warps=4)
    return out.transpose(1, 2)
