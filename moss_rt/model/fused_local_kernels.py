"""The Triton kernels of fused_local.py (imported on first use, so TRITON_INTERPRET is read then).

Cast points follow the torch local transformer (network.LocalAttention / LocalBlock): the residual add is rounded
to the activation dtype; ``nn.LayerNorm`` normalises, scales and shifts in fp32 and rounds once; RoPE rounds
``x * cos`` and ``rotate(x) * sin`` each, then their sum; the attention rounds the q.k scores (a GEMM's output),
then ``* scale``, takes the softmax in fp32, rounds the probabilities, and rounds ``probs @ v`` once. The helpers
(libdevice functions on CUDA, numpy's in the interpreter) are the backbone kernels'.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moss_rt.model.fused_layers_kernels import _div, _exp, _rsqrt, _scale


@triton.jit
def add_layernorm(
    X, DELTA, RES, OUT, W, B, s_x, s_d, s_r, s_o, n, eps,
    HAS_ADD: tl.constexpr, BLOCK: tl.constexpr, ACCURATE: tl.constexpr,
):
    """One row: res = x + delta (rounded; stored to RES) or x; out = (res - mean) * rstd * w + b (rounded once)."""
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
    mean = tl.sum(xf, axis=0) / n
    diff = tl.where(ok, xf - mean, 0.0)
    r = _rsqrt(tl.sum(diff * diff, axis=0) / n + eps, ACCURATE)
    w = tl.load(W + c, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(B + c, mask=ok, other=0.0).to(tl.float32)
    tl.store(OUT + row * s_o + c, (diff * r * w + b).to(DT), mask=ok)


@triton.jit
def _rope_interleaved(x, xp, cos, sin, even, DT: tl.constexpr):
    """x * cos + rotate_interleaved(x) * sin with torch's roundings; ``xp`` is x at the pair partner (d ^ 1)."""
    # rotate_interleaved: out[2i] = -x[2i+1], out[2i+1] = x[2i]; negated in fp32 (exact; the interpreter
    # mis-negates bf16).
    rotated = tl.where(even, -xp.to(tl.float32), xp.to(tl.float32))
    return (_scale(x, cos, DT).to(tl.float32) + _scale(rotated, sin, DT).to(tl.float32)).to(DT)


@triton.jit
def rope_write_attention(
    QKV, COS, SIN, KB, VB, OUT, s_qkv, s_o, s_kb, s_kh, s_ks, pos, scale,
    E: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, ACCURATE: tl.constexpr,
):
    """Program (row b, head h) of one local position ``pos``: RoPE of q and k (interleaved pairs), k and v written
    to KB/VB[b, h, pos], then softmax(q . k[0..pos] * scale) @ v[0..pos] -> OUT[b, h*D : (h+1)*D].

    Keys/values 0..pos-1 come from the buffers; those of ``pos`` from registers (a store followed by a load of the
    same address from other threads of the program would need a barrier).
    """
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    ok = d < D
    partner = d ^ 1
    even = (d % 2) == 0
    DT: tl.constexpr = QKV.dtype.element_ty
    base = QKV + b * s_qkv + h * D  # the c_attn row: q heads, then k heads at +E, then v heads at +2E
    cos = tl.load(COS + d, mask=ok, other=0.0)
    sin = tl.load(SIN + d, mask=ok, other=0.0)
    q = _rope_interleaved(
        tl.load(base + d, mask=ok, other=0.0), tl.load(base + partner, mask=ok, other=0.0), cos, sin, even, DT
    )
    k = _rope_interleaved(
        tl.load(base + E + d, mask=ok, other=0.0), tl.load(base + E + partner, mask=ok, other=0.0), cos, sin, even,
        DT,
    )
    v = tl.load(base + 2 * E + d, mask=ok, other=0.0)
    slot = b * s_kb + h * s_kh
    tl.store(KB + slot + pos * s_ks + d, k.to(KB.dtype.element_ty), mask=ok)
    tl.store(VB + slot + pos * s_ks + d, v.to(VB.dtype.element_ty), mask=ok)

    s = tl.arange(0, BLOCK_S)
    earlier = (s < pos)[:, None] & ok[None, :]
    offs = slot + s[:, None] * s_ks + d[None, :]
    now = (s == pos)[:, None]
    keys = tl.where(now, k[None, :].to(tl.float32), tl.load(KB + offs, mask=earlier, other=0.0).to(tl.float32))
    values = tl.where(now, v[None, :].to(tl.float32), tl.load(VB + offs, mask=earlier, other=0.0).to(tl.float32))
    scores = tl.sum(q.to(tl.float32)[None, :] * keys, axis=1).to(DT)
    scores = (scores.to(tl.float32) * scale).to(DT).to(tl.float32)
    valid = s <= pos
    scores = tl.where(valid, scores, float("-inf"))
    e = tl.where(valid, _exp(scores - tl.max(scores, axis=0), ACCURATE), 0.0)
    probs = _div(e, tl.sum(e, axis=0), ACCURATE).to(DT).to(tl.float32)
    out = tl.sum(probs[:, None] * values, axis=0).to(DT)
    tl.store(OUT + b * s_o + h * D + d, out, mask=ok)


__all__ = ["add_layernorm", "rope_write_attention", "triton"]
