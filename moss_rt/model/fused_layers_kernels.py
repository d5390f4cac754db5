"""The Triton kernels of fused_layers.py (imported on first use, so TRITON_INTERPRET is read then).

Every kernel repeats the torch reference's cast points: values are rounded to the activation dtype wherever the
torch code produces a tensor of that dtype (``RMSNorm``: normalise in fp32, cast, then scale in the dtype; RoPE:
``q * cos`` and ``rotate(q) * sin`` each rounded, then their sum; ``silu(g)`` rounded, then ``* u``). With
``ACCURATE`` (CUDA) exp / rsqrt / division are libdevice's IEEE-style functions, what torch's CUDA kernels call;
the interpreter uses numpy's.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def _rsqrt(x, ACCURATE: tl.constexpr):
    if ACCURATE:
        return libdevice.rsqrt(x)
    else:
        return 1.0 / tl.sqrt(x)


@triton.jit
def _exp(x, ACCURATE: tl.constexpr):
    if ACCURATE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _div(a, b, ACCURATE: tl.constexpr):
    if ACCURATE:
        return tl.math.div_rn(a, b)
    else:
        return a / b


@triton.jit
def _scale(w, x, DT: tl.constexpr):
    """``weight * x`` of two tensors of the activation dtype, rounded to it (torch's elementwise multiply)."""
    return (w.to(tl.float32) * x.to(tl.float32)).to(DT)


@triton.jit
def add_rmsnorm(
    X, DELTA, RES, OUT, W, s_x, s_d, s_r, s_o, n, eps,
    HAS_ADD: tl.constexpr, BLOCK: tl.constexpr, ACCURATE: tl.constexpr,
):
    """One row: res = x + delta (rounded; stored to RES) or x; out = w * (res_f32 * rsqrt(mean(res^2) + eps))."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    ok = c < n
    x = tl.load(X + row * s_x + c, mask=ok, other=0.0)
    DT: tl.constexpr = X.dtype.element_ty
    if HAS_ADD:
        d = tl.load(DELTA + row * s_d + c, mask=ok, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(DT)
        tl.store(RES + row * s_r + c, x, mask=ok)
    xf = x.to(tl.float32)
    r = _rsqrt(tl.sum(xf * xf, axis=0) / n + eps, ACCURATE)
    w = tl.load(W + c, mask=ok, other=0.0)
    tl.store(OUT + row * s_o + c, _scale(w, (xf * r).to(DT), DT), mask=ok)


@triton.jit
def qk_norm_rope_write(
    QKV, COS, SIN, QW, KW, WRITE, QOUT, KC, VC,
    s_qkv, s_cs, s_qo, s_kp, s_kh, eps,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, ACCURATE: tl.constexpr,
):
    """Program (row, head): head < HQ: RMSNorm(q head) then half-split RoPE -> QOUT[row, head];
    else KV head j = head - HQ: RMSNorm(k) then RoPE -> KC[WRITE[row], j], and v copied -> VC[WRITE[row], j]."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    ok = d < D
    HALF: tl.constexpr = D // 2
    partner = tl.where(d < HALF, d + HALF, d - HALF)
    DT: tl.constexpr = QKV.dtype.element_ty
    base = QKV + row * s_qkv + head * D  # q heads then k heads: head j of k starts at (HQ + j) * D
    x = tl.load(base + d, mask=ok, other=0.0)
    xp = tl.load(base + partner, mask=ok, other=0.0)
    if head < HQ:
        w = tl.load(QW + d, mask=ok, other=0.0)
        wp = tl.load(QW + partner, mask=ok, other=0.0)
    else:
        w = tl.load(KW + d, mask=ok, other=0.0)
        wp = tl.load(KW + partner, mask=ok, other=0.0)
    xf = x.to(tl.float32)
    r = _rsqrt(tl.sum(xf * xf, axis=0) / D + eps, ACCURATE)
    normed = _scale(w, (xf * r).to(DT), DT)
    normed_p = _scale(wp, (xp.to(tl.float32) * r).to(DT), DT)
    # rotate_half_split: cat(-x[half:], x[:half]); negated in fp32 (exact; the interpreter mis-negates bf16).
    rotated = tl.where(d < HALF, -normed_p.to(tl.float32), normed_p.to(tl.float32))
    cos = tl.load(COS + row * s_cs + d, mask=ok, other=0.0)
    sin = tl.load(SIN + row * s_cs + d, mask=ok, other=0.0)
    out = (_scale(normed, cos, DT).to(tl.float32) + _scale(rotated, sin, DT).to(tl.float32)).to(DT)
    if head < HQ:
        tl.store(QOUT + row * s_qo + head * D + d, out, mask=ok)
    else:
        j = head - HQ
        pos = tl.load(WRITE + row).to(tl.int64)
        tl.store(KC + pos * s_kp + j * s_kh + d, out.to(KC.dtype.element_ty), mask=ok)
        v = tl.load(QKV + row * s_qkv + (HQ + HKV + j) * D + d, mask=ok, other=0.0)
        tl.store(VC + pos * s_kp + j * s_kh + d, v.to(VC.dtype.element_ty), mask=ok)


@triton.jit
def silu_mul(GU, OUT, s_g, s_o, n, BLOCK: tl.constexpr, ACCURATE: tl.constexpr):
    """Row ``row``, columns of block ``pid(1)``: OUT = silu(GU[:, :n]) * GU[:, n:] (silu rounded first)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < n
    DT: tl.constexpr = GU.dtype.element_ty
    g = tl.load(GU + row * s_g + c, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(GU + row * s_g + n + c, mask=ok, other=0.0)
    act = _div(g, 1.0 + _exp(-g, ACCURATE), ACCURATE).to(DT)
    tl.store(OUT + row * s_o + c, _scale(act, u, DT), mask=ok)


__all__ = ["add_rmsnorm", "qk_norm_rope_write", "silu_mul", "triton"]
