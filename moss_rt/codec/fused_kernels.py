"""The Triton kernels of fused.py (imported on first use, so TRITON_INTERPRET is read then).

A module of its own, importing Triton and nothing of torch: a compile worker (engine/compile_workers.py) imports it
to compile these kernels in a fraction of a second, where importing torch took seconds of a fresh start.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _residual_norm(
    X, U, LS, W, Bias, XOUT, H, D, eps,
    HAS_RES: tl.constexpr, HAS_NORM: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    o = tl.arange(0, BLOCK)
    m = o < D
    x = tl.load(X + row * D + o, mask=m, other=0.0).to(tl.float32)
    if HAS_RES:
        u = tl.load(U + row * D + o, mask=m, other=0.0).to(tl.float32)
        ls = tl.load(LS + o, mask=m, other=0.0).to(tl.float32)
        x = x + ls * u
        tl.store(XOUT + row * D + o, x, mask=m)
    if HAS_NORM:
        mean = tl.sum(x, axis=0) / D
        xc = tl.where(m, x - mean, 0.0)
        var = tl.sum(xc * xc, axis=0) / D
        rstd = 1.0 / tl.sqrt(var + eps)
        w = tl.load(W + o, mask=m, other=0.0).to(tl.float32)
        b = tl.load(Bias + o, mask=m, other=0.0).to(tl.float32)
        x = xc * rstd * w + b
    tl.store(H + row * D + o, x.to(H.dtype.element_ty), mask=m)


@triton.jit
def _rope_store(
    QKV, COS, SIN, Q, KB, VB, ROWS, RIDX, s_row, s_head, s_ring,
    D: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr,
):
    # One program per token n = b * T + t; lanes over the D/2 (head, pair) pairs of the token.
    n = tl.program_id(0).to(tl.int64)
    p = tl.arange(0, BLOCK)
    m = p < D // 2
    head = p // HALF
    i = p % HALF
    col = head * (2 * HALF) + 2 * i  # even element of the pair inside q (k, v at +D, +2D)
    src = QKV + n * (3 * D) + col
    c = tl.load(COS + n * HALF + i, mask=m, other=0.0)
    s = tl.load(SIN + n * HALF + i, mask=m, other=0.0)
    # (a + ib)(c + is): the complex product of the plain path.
    qa = tl.load(src, mask=m, other=0.0).to(tl.float32)
    qb = tl.load(src + 1, mask=m, other=0.0).to(tl.float32)
    qdst = Q + n * D + col
    tl.store(qdst, (qa * c - qb * s).to(Q.dtype.element_ty), mask=m)
    tl.store(qdst + 1, (qa * s + qb * c).to(Q.dtype.element_ty), mask=m)
    ka = tl.load(src + D, mask=m, other=0.0).to(tl.float32)
    kb = tl.load(src + D + 1, mask=m, other=0.0).to(tl.float32)
    va = tl.load(src + 2 * D, mask=m, other=0.0)
    vb = tl.load(src + 2 * D + 1, mask=m, other=0.0)
    slot = tl.load(ROWS + n)
    r = tl.load(RIDX + n)
    off = slot * s_row + head * s_head + r * s_ring + 2 * i
    tl.store(KB + off, (ka * c - kb * s).to(KB.dtype.element_ty), mask=m)
    tl.store(KB + off + 1, (ka * s + kb * c).to(KB.dtype.element_ty), mask=m)
    tl.store(VB + off, va.to(VB.dtype.element_ty), mask=m)
    tl.store(VB + off + 1, vb.to(VB.dtype.element_ty), mask=m)


@triton.jit
def _rope_store_fp8(
    QKV, COS, SIN, Q, KB, VB, KS, VS, ROWS, RIDX, s_row, s_head, s_ring, ss_row, ss_head, ss_ring, H,
    D: tl.constexpr, HALF: tl.constexpr, HB: tl.constexpr,
):
    # _rope_store with fp8 K/V (kv_quant.py): one program per token, a [heads, pairs] tile, so each head's
    # amax (its scale) is one row reduction. Same arithmetic as kv_quant.quantize: s = max(amax, MIN) / 448,
    # values x / s clamped to +-448, rounded to nearest e4m3.
    n = tl.program_id(0).to(tl.int64)
    hv = tl.arange(0, HB)
    hh = hv[:, None]
    i = tl.arange(0, HALF)[None, :]
    m = (hh < H) & (i < HALF)  # [HB, HALF]
    col = hh * (2 * HALF) + 2 * i
    src = QKV + n * (3 * D) + col
    c = tl.load(COS + n * HALF + i)
    s = tl.load(SIN + n * HALF + i)
    qa = tl.load(src, mask=m, other=0.0).to(tl.float32)
    qb = tl.load(src + 1, mask=m, other=0.0).to(tl.float32)
    qdst = Q + n * D + col
    tl.store(qdst, (qa * c - qb * s).to(Q.dtype.element_ty), mask=m)
    tl.store(qdst + 1, (qa * s + qb * c).to(Q.dtype.element_ty), mask=m)
    ka = tl.load(src + D, mask=m, other=0.0).to(tl.float32)
    kb = tl.load(src + D + 1, mask=m, other=0.0).to(tl.float32)
    ra = ka * c - kb * s
    rb = ka * s + kb * c
    va = tl.load(src + 2 * D, mask=m, other=0.0).to(tl.float32)
    vb = tl.load(src + 2 * D + 1, mask=m, other=0.0).to(tl.float32)
    k_scale = tl.maximum(tl.max(tl.maximum(tl.abs(ra), tl.abs(rb)), axis=1), 1e-30) / 448.0  # [HB]
    v_scale = tl.maximum(tl.max(tl.maximum(tl.abs(va), tl.abs(vb)), axis=1), 1e-30) / 448.0
    slot = tl.load(ROWS + n)
    r = tl.load(RIDX + n)
    off = slot * s_row + hh * s_head + r * s_ring + 2 * i
    ksc = k_scale[:, None]
    vsc = v_scale[:, None]
    tl.store(KB + off, tl.minimum(tl.maximum(ra / ksc, -448.0), 448.0).to(KB.dtype.element_ty), mask=m)
    tl.store(KB + off + 1, tl.minimum(tl.maximum(rb / ksc, -448.0), 448.0).to(KB.dtype.element_ty), mask=m)
    tl.store(VB + off, tl.minimum(tl.maximum(va / vsc, -448.0), 448.0).to(VB.dtype.element_ty), mask=m)
    tl.store(VB + off + 1, tl.minimum(tl.maximum(vb / vsc, -448.0), 448.0).to(VB.dtype.element_ty), mask=m)
    soff = slot * ss_row + hv * ss_head + r * ss_ring
    tl.store(KS + soff, k_scale, mask=hv < H)
    tl.store(VS + soff, v_scale, mask=hv < H)
