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
``BLOCK_N`` with an fp32 online softmax. Small calls split the keys so about ``TARGET_PROGRAMS`` programs run, and
a second kernel merges the partial sums. Everything the host computes depends only on shapes, so one CUDA graph
per (batch, T) serves every age and slot set.

Rounding: scores, the running max/sum and the output accumulate in fp32; probabilities enter the P·V dot in the
pool dtype (bf16 in production), like flash attention. In fp32 it equals the masked SDPA to ~1e-7.

Used on CUDA (and through Triton's interpreter when ``MOSS_RT_CODEC_KERNEL=interpret`` and
``TRITON_INTERPRET=1``: tests only, where dots run in fp32 since the interpreter of Triton 3.9 computes bf16
``tl.dot`` wrongly); ``MOSS_RT_CODEC_KERNEL=0`` keeps the SDPA path.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from moss_rt.kernel_switch import kernel_wanted

__all__ = ["available", "window_attention"]

log = logging.getLogger(__name__)

BLOCK_N = 64  # keys per tile
MAX_BLOCK_M = 64  # queries per program (a power of two, >= 16 for tl.dot)
TARGET_PROGRAMS = 256  # split the keys of small calls until about this many programs run (~2 per H200 SM)
MAX_SPLITS = 32
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def _kernels() -> Any:
    """The jitted kernels, built on first use (so TRITON_INTERPRET is read then); None without Triton."""
    try:
        import triton
        import triton.language as tl
    except Exception:  # noqa: BLE001 - no Triton (CPU wheels): the SDPA path
        return None

    # Shape-derived integers are not specialised on (Triton would compile a variant per "== 1" / "% 16" pattern
    # of each, dozens over the stages and chunk lengths, each a few seconds on the first capture).
    @triton.jit(do_not_specialize=["H", "Tq", "tpf", "context", "block", "ring_blocks", "chunk", "splits"])
    def _attend(
        Q, K, V, TABLE, SLOTS, OFFS, OUT, PACC, PML,
        H, Tq, tpf, context, block, ring_blocks, chunk, splits, scale,
        s_qb, s_qh, s_qt, s_kn, s_kh, s_kt, s_tr, s_ob, s_oh, s_ot,
        D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        IEEE: tl.constexpr, UPCAST: tl.constexpr, SPLIT: tl.constexpr,
    ):
        qblk = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        split = tl.program_id(2)
        b = bh // H
        h = bh % H
        slot = tl.load(SLOTS + b)
        start = tl.load(OFFS + b) * tpf  # position of the chunk's first query
        m = qblk * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = m < Tq
        p = start + m  # [BLOCK_M] query positions
        d = tl.arange(0, D)
        q = tl.load(Q + b * s_qb + h * s_qh + m[:, None] * s_qt + d[None, :], mask=row_ok[:, None], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        # Keys any query of this block sees: from the first query's window start to the last query.
        p_first = start + qblk * BLOCK_M
        p_last = start + tl.minimum(Tq, qblk * BLOCK_M + BLOCK_M) - 1
        lo = tl.maximum(p_first - context + 1, 0) + split * chunk
        hi = tl.minimum(p_last + 1, lo + chunk)
        trow = TABLE + slot * s_tr
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, D), tl.float32)
        for k0 in range(lo, hi, BLOCK_N):
            kp = k0 + tl.arange(0, BLOCK_N)  # key positions of this tile
            k_ok = kp < hi
            blk = tl.load(trow + (kp // block) % ring_blocks, mask=k_ok, other=0).to(tl.int64)
            row = blk * s_kn + h * s_kh + (kp % block) * s_kt
            k = tl.load(K + row[:, None] + d[None, :], mask=k_ok[:, None], other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            delta = p[:, None] - kp[None, :]
            seen = k_ok[None, :] & (delta >= 0) & (delta < context)
            s = tl.where(seen, s * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            # A row that has seen no key yet keeps m = -inf: shift by 0 there (no inf - inf).
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            pr = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(pr, axis=1)
            v = tl.load(V + row[:, None] + d[None, :], mask=k_ok[:, None], other=0.0)
            if UPCAST:
                v = v.to(tl.float32)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v)
            m_i = m_new
        if not SPLIT:
            out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
            o = OUT + b * s_ob + h * s_oh + m[:, None] * s_ot + d[None, :]
            tl.store(o, out.to(OUT.dtype.element_ty), mask=row_ok[:, None])
        else:  # this split's unnormalised partial sums, merged by _merge
            part = ((bh * Tq + m) * splits + split).to(tl.int64)
            tl.store(PACC + part[:, None] * D + d[None, :], acc, mask=row_ok[:, None])
            tl.store(PML + part * 2, m_i, mask=row_ok)
            tl.store(PML + part * 2 + 1, l_i, mask=row_ok)

    @triton.jit(do_not_specialize=["H", "Tq", "splits"])
    def _merge(
        PACC, PML, OUT, H, Tq, splits, s_ob, s_oh, s_ot,
        D: tl.constexpr, BLOCK_M: tl.constexpr,
    ):
        qblk = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        b = bh // H
        h = bh % H
        m = qblk * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = m < Tq
        d = tl.arange(0, D)
        top = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        total = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, D), tl.float32)
        for j in range(0, splits):
            part = ((bh * Tq + m) * splits + j).to(tl.int64)
            mj = tl.load(PML + part * 2, mask=row_ok, other=float("-inf"))
            lj = tl.load(PML + part * 2 + 1, mask=row_ok, other=0.0)
            aj = tl.load(PACC + part[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
            new = tl.maximum(top, mj)
            safe = tl.where(new == float("-inf"), 0.0, new)
            w_old = tl.exp(top - safe)
            w_new = tl.exp(mj - safe)
            total = total * w_old + lj * w_new
            acc = acc * w_old[:, None] + aj * w_new[:, None]
            top = new
        out = acc / tl.where(total > 0.0, total, 1.0)[:, None]
        o = OUT + b * s_ob + h * s_oh + m[:, None] * s_ot + d[None, :]
        tl.store(o, out.to(OUT.dtype.element_ty), mask=row_ok[:, None])

    return _attend, _merge


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


def block_rows(tq: int) -> int:
    """Queries per program for a chunk of ``tq`` tokens: a power of two in [16, MAX_BLOCK_M]."""
    return max(16, min(MAX_BLOCK_M, 1 << max(0, tq - 1).bit_length()))


def split_count(programs: int, context: int, block_m: int, target: int = TARGET_PROGRAMS) -> int:
    """Key splits for a call of ``programs`` (query block, stream, head) programs: enough that about ``target``
    programs run, at most one per key tile of the widest window a query block sees."""
    tiles = _cdiv(context + block_m - 1, BLOCK_N)
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
) -> torch.Tensor:
    """Windowed attention of the chunk's queries over each stream's stored keys (see the module docstring).

    Args:
        q: ``[B, H, Tq, D]``. k_pool, v_pool: ``[N, H, block, D]``. table: ``[rows, >= ring_blocks]`` int32.
        slots, offs: ``[B]`` int64 on the device. splits: key splits (None: chosen from the shapes).
    Returns:
        ``[B, H, Tq, D]`` in ``q``'s dtype (a transposed view of a contiguous ``[B, Tq, H, D]``).
    """
    kernels = _kernels()
    assert kernels is not None, "check available() first"
    attend, merge = kernels
    B, H, Tq, D = q.shape
    assert q.stride(-1) == 1 and k_pool.stride() == v_pool.stride() and k_pool.stride(-1) == 1
    assert table.dtype == torch.int32 and table.stride(-1) == 1
    assert ring_blocks * block >= context, "the ring must hold at least the window"
    out = torch.empty(B, Tq, H, D, device=q.device, dtype=q.dtype)
    bm = block_rows(Tq)
    qblocks = _cdiv(Tq, bm)
    if splits is None:
        splits = split_count(qblocks * B * H, context, bm) if q.is_cuda else 1
    span = context + bm - 1  # the most keys one query block sees
    chunk = _cdiv(_cdiv(span, splits), BLOCK_N) * BLOCK_N  # keys per split, whole tiles
    splits = _cdiv(span, chunk)
    if splits > 1:
        part_acc = torch.empty(B * H * Tq * splits, D, device=q.device, dtype=torch.float32)
        part_ml = torch.empty(B * H * Tq * splits, 2, device=q.device, dtype=torch.float32)
    else:
        part_acc = part_ml = out  # unused
    if B * Tq:
        attend[(qblocks, B * H, splits)](
            q, k_pool, v_pool, table, slots, offs, out, part_acc, part_ml,
            H, Tq, int(tokens_per_frame), int(context), int(block), int(ring_blocks), chunk, splits, float(scale),
            q.stride(0), q.stride(1), q.stride(2), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
            table.stride(0), out.stride(0), out.stride(2), out.stride(1),
            D=D, BLOCK_M=bm, BLOCK_N=BLOCK_N, IEEE=q.dtype == torch.float32 or not q.is_cuda,
            UPCAST=not q.is_cuda, SPLIT=splits > 1, num_warps=4,
        )
        if splits > 1:
            merge[(qblocks, B * H)](part_acc, part_ml, out, H, Tq, splits, out.stride(0), out.stride(2),
                                    out.stride(1), D=D, BLOCK_M=bm, num_warps=4)
    return out.transpose(1, 2)
