"""The Triton kernels of fused_sampling.py (imported on first use, so TRITON_INTERPRET is read then).

Module-level functions because Triton's interpreter resolves a kernel's helpers through the module's globals.
A program handles ``ROWS`` rows as a [ROWS, BLOCK] tile: CUDA launches ROWS=1 (one program per row, every SM
busy); the interpreter runs ROWS>1, where numpy then works on whole tiles (the same code, much faster).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from moss_rt.model.fused_layers_kernels import _exp  # libdevice exp on CUDA, as torch runs it


@triton.jit
def _fmix32(x):
    # MurmurHash3's finaliser on uint32: multiplications wrap mod 2^32, shifts are logical (sampling.fmix32).
    x ^= x >> 16
    x *= 0x85EBCA6B
    x ^= x >> 13
    x *= 0xC2B2AE35
    x ^= x >> 16
    return x


@triton.jit
def _row_hash(seed_lo, seed_hi, counter):
    # sampling.uniforms' per-row part, from int64 seeds halves and counter (low 32 bits of each).
    h = _fmix32(seed_lo.to(tl.uint32) ^ _fmix32(seed_hi.to(tl.uint32) ^ 0x5BD1E995))
    return _fmix32(h ^ _fmix32(counter.to(tl.uint32) ^ 0x27D4EB2F))


@triton.jit
def _uniform(h, token):
    # sampling.token_keys then the top 24 bits of the token's hash: exact in float32, as the torch path.
    key = _fmix32(token.to(tl.uint32) * 0x9E3779B1 + 0x7F4A7C15)
    bits = _fmix32(h ^ key) >> 8
    return (bits.to(tl.float32) + 0.5) * (1.0 / 16777216.0)


@triton.jit
def _log(x, ACCURATE: tl.constexpr):
    if ACCURATE:
        return libdevice.log(x)  # logf, what torch.log runs on CUDA (tl.log may lower to an approximation)
    else:
        return tl.log(x)


@triton.jit
def _sort_descending(x, ROWS: tl.constexpr, N: tl.constexpr):
    """Bitonic sort of each row of ``x`` [ROWS, 2^N] (distinct integers), largest first.

    Stage s merges bitonic runs into sorted runs of 2^s, descending where bit s of the index is 0 and ascending
    elsewhere (so that neighbouring runs form the next stage's bitonic input; the last stage is all descending).
    A compare-exchange at distance 2^b reads the partner as (pair sum) - self: a sum over one size-2 axis, which
    compiles to register moves or lane shuffles like tl.sort's xor-reduction does, but which Triton's interpreter
    runs as one numpy call (it runs tl.sort's custom reduction element by element). Keys stay below 2^48 in
    magnitude, so the pair sum cannot overflow.
    """
    h = tl.reshape(x, [ROWS] + [2] * N)
    pair = tl.arange(0, 2)
    for s in tl.static_range(1, N + 1):
        if s < N:  # bit s of the index is dimension N-s (after the row dimension)
            descending = tl.reshape(pair, [1] * (N - s) + [2] + [1] * s) == 0
        else:
            descending = tl.full([1] * (N + 1), 1, tl.int1)
        for b in tl.static_range(s - 1, -1, -1):  # distances 2^(s-1) .. 1
            right = tl.reshape(pair, [1] * (N - b) + [2] + [1] * b) != 0  # bit b set: the pair's right element
            partner = tl.sum(h, axis=N - b, keep_dims=True) - h
            take_max = right != descending  # the left element of a descending pair keeps the larger key
            h = tl.where(take_max, tl.maximum(h, partner), tl.minimum(h, partner))
    return tl.reshape(h, x.shape)


# Row counts, strides, the counter offset and the alignment of the per-row pointers (the step writes codebook k's
# codes at an 8k-byte offset) vary between calls: one compiled variant serves them all.
@triton.jit(do_not_specialize=[
    "s_l", "TEMP", "TOPK", "TOPP", "PEN", "s_p", "SEED_LO", "SEED_HI", "FRAME", "ctr_mul", "ctr_add", "ACTIVE", "STOP",
    "OUT", "s_o", "n_rows",
])
def draw(
    LOGITS, s_l, TEMP, TOPK, TOPP, PEN, PRES, s_p, SEED_LO, SEED_HI, FRAME, ctr_mul, ctr_add,
    ACTIVE, STOP, OUT, s_o, n_rows,
    V: tl.constexpr, BLOCK: tl.constexpr, LOG2_BLOCK: tl.constexpr, ROWS: tl.constexpr,
    PENALTY: tl.constexpr, MARK: tl.constexpr, ACCURATE: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    row_ok = r < n_rows
    rc = r[:, None]
    i = tl.arange(0, BLOCK)[None, :]  # token index [1, BLOCK]
    real = i < V
    x = tl.load(LOGITS + rc * s_l + i, mask=row_ok[:, None] & real, other=0.0)
    if PENALTY:
        pen = tl.load(PEN + r, mask=row_ok, other=1.0)[:, None]
        seen = tl.load(PRES + rc * s_p + i, mask=row_ok[:, None] & real, other=0) != 0
        x = tl.where(seen, tl.where(x < 0, x * pen, tl.math.div_rn(x, pen)), x)
    temp = tl.load(TEMP + r, mask=row_ok, other=0.0)
    hot = temp > 0
    s = tl.math.div_rn(x, tl.where(hot, temp, 1.0)[:, None])  # t <= 0: / 1, the penalised logits unchanged
    s = tl.where(s == 0.0, 0.0, s)  # -0.0 == +0.0 for torch: one key, so they tie (and break by index)
    bits = s.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # signed order of this integer image == float order
    key = tl.where(real, key, -2147483648)  # padding sorts after every real score (even -inf)
    packed = key.to(tl.int64) * 65536 + (BLOCK - 1 - i)  # distinct; among equal scores the lower index first
    packed = _sort_descending(packed, ROWS, LOG2_BLOCK)

    pos = tl.arange(0, BLOCK)[None, :]  # sorted position
    valid = pos < V
    skey = (packed >> 16).to(tl.int32)
    token = (BLOCK - 1) - (packed & 0xFFFF).to(tl.int32)
    v = tl.where(skey < 0, skey ^ 0x7FFFFFFF, skey).to(tl.float32, bitcast=True)  # the scores, descending

    # top-k: keep scores >= the k-th largest (ties survive); off unless 0 < k < V.
    k = tl.load(TOPK + r, mask=row_ok, other=0)
    k_eff = tl.where((k > 0) & (k < V), k, V)
    kth = tl.max(tl.where(pos == (k_eff - 1)[:, None], v, float("-inf")), axis=1)
    keep = valid & (v >= kth[:, None])
    # top-p over the top-k survivors: keep the positions up to the first whose cumulative mass exceeds p.
    top = tl.max(tl.where(valid, v, float("-inf")), axis=1)
    e = tl.where(keep, _exp(v - top[:, None], ACCURATE), 0.0)
    prob = tl.math.div_rn(e, tl.sum(e, axis=1)[:, None])
    mass = tl.cumsum(prob, axis=1)
    p = tl.load(TOPP + r, mask=row_ok, other=1.0)
    cross = tl.min(tl.where(mass > p[:, None], pos, BLOCK), axis=1)
    cross = tl.where((p > 0) & (p < 1), cross, BLOCK)
    keep = keep & (pos <= cross[:, None])
    # Gumbel-max over the kept scores, first index among equal maxima; greedy: the top sorted token.
    seed_lo = tl.load(SEED_LO + r, mask=row_ok, other=0)
    seed_hi = tl.load(SEED_HI + r, mask=row_ok, other=0)
    counter = tl.load(FRAME + r, mask=row_ok, other=0) * ctr_mul + ctr_add
    u = _uniform(_row_hash(seed_lo, seed_hi, counter)[:, None], token)
    noisy = tl.where(keep, v + -_log(-_log(u, ACCURATE), ACCURATE), float("-inf"))
    best = tl.max(noisy, axis=1)
    drawn = tl.min(tl.where(valid & (noisy == best[:, None]), token, BLOCK), axis=1)
    greedy = tl.min(tl.where(pos == 0, token, BLOCK), axis=1)
    code = tl.where(hot, drawn, greedy)
    tl.store(OUT + r * s_o, code.to(tl.int64), mask=row_ok)
    if MARK:  # a row that produced this frame (active, the stop head said continue) remembers its code
        act = tl.load(ACTIVE + r, mask=row_ok, other=0) != 0
        stopped = tl.load(STOP + r, mask=row_ok, other=1) == 1
        tl.store(PRES + r * s_p + code, tl.full([ROWS], 1, tl.uint8), mask=row_ok & act & ~stopped)


@triton.jit(do_not_specialize=["ctr_mul", "ctr_add"])
def uniforms(
    SEED_LO, SEED_HI, FRAME, ctr_mul, ctr_add, OUT,
    V: tl.constexpr, BLOCK: tl.constexpr, GUMBEL: tl.constexpr, ACCURATE: tl.constexpr,
):
    # The draw kernel's uniforms (or its Gumbel noise) of one row, written out for the tests.
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    counter = tl.load(FRAME + row) * ctr_mul + ctr_add
    u = _uniform(_row_hash(tl.load(SEED_LO + row), tl.load(SEED_HI + row), counter), i)
    if GUMBEL:
        u = -_log(-_log(u, ACCURATE), ACCURATE)
    tl.store(OUT + row * V + i, u, mask=i < V)
