"""The Triton kernels of window_attention.py (imported on first use, so TRITON_INTERPRET is read then)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tile(
    acc, m_i, l_i, q, K, V, KS, VS, trow, k0, hi, p, h, context, block, ring_blocks, scale, s_kn, s_kh, s_kt,
    s_sn, s_sh, D: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
    MASK: tl.constexpr, ALIGNED: tl.constexpr, FP8: tl.constexpr,
):
    """One key tile [k0, k0 + BLOCK_N) into the running softmax, in base 2: ``scale`` holds log2(e), so one exp2
    makes each weight (the weights and their sum are the base-e ones; the running max is scaled by log2(e)).
    MASK: some key of the tile is out of some query's window (or past ``hi``); tiles every query sees whole skip the
    mask. ALIGNED: the tile lies in one block (one table read, contiguous rows). FP8: K/V are fp8 with one scale per
    (key, head) (kv_quant.py): the values enter the dots as they are (exact in bf16/fp32), the K scales multiply the
    scores' columns and the V scales the probabilities' columns, in registers."""
    kp = k0 + tl.arange(0, BLOCK_N)  # key positions of this tile
    d = tl.arange(0, D)
    if ALIGNED:
        blk = tl.load(trow + (k0 // block) % ring_blocks).to(tl.int64)
        row = blk * s_kn + h * s_kh + ((k0 % block) + tl.arange(0, BLOCK_N)) * s_kt
        srow = blk * s_sn + h * s_sh + (k0 % block) + tl.arange(0, BLOCK_N)
    else:
        blk_n = tl.load(trow + (kp // block) % ring_blocks, mask=kp < hi, other=0).to(tl.int64)
        row = blk_n * s_kn + h * s_kh + (kp % block) * s_kt
        srow = blk_n * s_sn + h * s_sh + (kp % block)
    if MASK:
        k_ok = kp < hi
        k = tl.load(K + row[:, None] + d[None, :], mask=k_ok[:, None], other=0.0)
    else:
        k = tl.load(K + row[:, None] + d[None, :])
    if UPCAST:
        k = k.to(tl.float32)
    elif FP8:
        k = k.to(q.dtype)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    if FP8:
        if MASK:
            ks = tl.load(KS + srow, mask=k_ok, other=0.0)
        else:
            ks = tl.load(KS + srow)
        s = s * (ks[None, :] * scale)
    else:
        s = s * scale
    if MASK:
        delta = p[:, None] - kp[None, :]
        seen = k_ok[None, :] & (delta >= 0) & (delta < context)
        s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # A row that has seen no key yet keeps m = -inf: shift by 0 there (no inf - inf).
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    pr = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(pr, axis=1)
    if MASK:
        v = tl.load(V + row[:, None] + d[None, :], mask=k_ok[:, None], other=0.0)
    else:
        v = tl.load(V + row[:, None] + d[None, :])
    if UPCAST:
        v = v.to(tl.float32)
    elif FP8:
        v = v.to(q.dtype)
    pv = pr
    if FP8:
        if MASK:
            vs = tl.load(VS + srow, mask=k_ok, other=0.0)
        else:
            vs = tl.load(VS + srow)
        pv = pr * vs[None, :]
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(pv.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(pv.to(v.dtype), v)
    return acc, m_new, l_i

# Shape-derived integers are not specialised on (Triton would compile a variant per "== 1" / "% 16" pattern
# of each, dozens over the stages and chunk lengths, each a few seconds on the first capture).
@triton.jit(do_not_specialize=["H", "Tq", "tpf", "context", "block", "ring_blocks", "chunk", "splits"])
def _attend(
    Q, K, V, KS, VS, TABLE, SLOTS, OFFS, OUT, PACC, PML,
    H, Tq, tpf, context, block, ring_blocks, chunk, splits, scale,
    s_qb, s_qh, s_qt, s_kn, s_kh, s_kt, s_sn, s_sh, s_tr, s_ob, s_oh, s_ot,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr, UPCAST: tl.constexpr, SPLIT: tl.constexpr, ALIGNED: tl.constexpr, FP8: tl.constexpr,
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
    # Keys any query of this block sees: from the first query's window start to the last query. ALIGNED
    # starts at a tile boundary (block % BLOCK_N == 0: tiles never straddle blocks); the keys before the window
    # it adds are masked.
    p_first = start + qblk * BLOCK_M
    p_last = start + tl.minimum(Tq, qblk * BLOCK_M + BLOCK_M) - 1
    lo = tl.maximum(p_first - context + 1, 0)
    if ALIGNED:
        lo = (lo // BLOCK_N) * BLOCK_N
    lo = lo + split * chunk
    hi = tl.maximum(tl.minimum(p_last + 1, lo + chunk), lo)  # a split past the last query is empty: hi = lo
    # Tiles [a, b) are inside every valid query's window (no mask); [lo, a) and [b, hi) are masked.
    a = lo + ((tl.maximum(p_last - context + 1 - lo, 0) + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
    a = tl.minimum(a, hi)
    b_end = lo + (tl.maximum(tl.minimum(p_first + 1, hi) - lo, 0) // BLOCK_N) * BLOCK_N
    b_end = tl.maximum(b_end, a)
    trow = TABLE + slot * s_tr
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    for k0 in range(lo, a, BLOCK_N):
        acc, m_i, l_i = _tile(acc, m_i, l_i, q, K, V, KS, VS, trow, k0, hi, p, h, context, block, ring_blocks,
                              scale, s_kn, s_kh, s_kt, s_sn, s_sh, D, BLOCK_N, IEEE, UPCAST, True, ALIGNED, FP8)
    for k0 in range(a, b_end, BLOCK_N):
        acc, m_i, l_i = _tile(acc, m_i, l_i, q, K, V, KS, VS, trow, k0, hi, p, h, context, block, ring_blocks,
                              scale, s_kn, s_kh, s_kt, s_sn, s_sh, D, BLOCK_N, IEEE, UPCAST, False, ALIGNED, FP8)
    for k0 in range(b_end, hi, BLOCK_N):
        acc, m_i, l_i = _tile(acc, m_i, l_i, q, K, V, KS, VS, trow, k0, hi, p, h, context, block, ring_blocks,
                              scale, s_kn, s_kh, s_kt, s_sn, s_sh, D, BLOCK_N, IEEE, UPCAST, True, ALIGNED, FP8)
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
        w_old = tl.exp2(top - safe)  # the splits' maxima are base-2 (_tile)
        w_new = tl.exp2(mj - safe)
        total = total * w_old + lj * w_new
        acc = acc * w_old[:, None] + aj * w_new[:, None]
        top = new
    out = acc / tl.where(total > 0.0, total, 1.0)[:, None]
    o = OUT + b * s_ob + h * s_oh + m[:, None] * s_ot + d[None, :]
    tl.store(o, out.to(OUT.dtype.element_ty), mask=row_ok[:, None])
