"""The Triton kernels of paged_attention.py (imported on first use, so TRITON_INTERPRET is read then).

A module of its own, importing Triton and nothing of torch: a compile worker (engine/compile_workers.py) imports it
to compile these kernels in a fraction of a second, where importing torch took seconds of a fresh start.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _paged_decode(
    Q, K, V, POS, MASK, EXTENT, OUT, PACC, PML, S, chunk, splits, scale,
    s_qb, s_qh, s_kp, s_kh, s_pb, s_mb, s_ob, s_oh,
    G: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, IEEE: tl.constexpr,
    UPCAST: tl.constexpr, SPLIT: tl.constexpr, HAS_EXTENT: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    lo = split * chunk
    hi = tl.minimum(S, lo + chunk)
    if HAS_EXTENT:  # the row's keys end here: the tiles past it would all be masked
        hi = tl.minimum(hi, tl.load(EXTENT + b))
    r = tl.arange(0, ROWS)
    d = tl.arange(0, D)
    row_ok = r < G
    heads = kvh * G + r
    q = tl.load(Q + b * s_qb + heads[:, None] * s_qh + d[None, :], mask=row_ok[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full((ROWS,), float("-inf"), tl.float32)
    l_i = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, D), tl.float32)
    for start in range(lo, hi, BLOCK):
        s = start + tl.arange(0, BLOCK)
        in_range = s < hi
        pos = tl.load(POS + b * s_pb + s, mask=in_range, other=0)
        ok = tl.load(MASK + b * s_mb + s, mask=in_range, other=0) != 0
        ok = ok & in_range
        kv_off = pos[:, None] * s_kp + kvh * s_kh + d[None, :]
        k = tl.load(K + kv_off, mask=ok[:, None], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        if IEEE:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        scores = tl.where(ok[None, :], scores * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        # A row whose keys so far are all masked keeps m = -inf: shift by 0 there (no inf - inf).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(V + kv_off, mask=ok[:, None], other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    if not SPLIT:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        o_off = b * s_ob + heads[:, None] * s_oh + d[None, :]
        tl.store(OUT + o_off, out.to(OUT.dtype.element_ty), mask=row_ok[:, None])
    else:  # this split's unnormalised partial result, merged by _combine
        part = (b * (G * tl.num_programs(1)) + heads) * splits + split  # (row, query head, split)
        tl.store(PACC + part[:, None] * D + d[None, :], acc, mask=row_ok[:, None])
        tl.store(PML + part * 2, m_i, mask=row_ok)
        tl.store(PML + part * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _combine(PACC, PML, OUT, s_ob, s_oh, splits, HQ: tl.constexpr, D: tl.constexpr, SP: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    j = tl.arange(0, SP)
    d = tl.arange(0, D)
    ok = j < splits
    part = (b * HQ + h) * splits + j
    m = tl.load(PML + part * 2, mask=ok, other=float("-inf"))
    lsum = tl.load(PML + part * 2 + 1, mask=ok, other=0.0)
    top = tl.max(m, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp(m - top)
    total = tl.sum(w * lsum, axis=0)
    acc = tl.load(PACC + part[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(OUT + b * s_ob + h * s_oh + d, out.to(OUT.dtype.element_ty))
