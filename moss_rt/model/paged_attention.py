"""Paged decode attention (Triton): one query row per slot reads its keys straight from the KV pool.

Why: the plain path gathers every key and value a step attends to out of the pool into a contiguous
``[B, Hkv, S, D]`` copy (``k_cache.view(-1, D)[index.read]``) before the attention GEMMs; at batch 64 with
1000-position contexts that copy doubles the decode step. This kernel reads the pool in place.

Layout (see state.py):

- ``k_cache`` / ``v_cache`` of one layer: ``[P, Hkv, D]``, the pool, position-major (P = blocks x block_size);
- ``positions`` ``[B, S]`` int64: the pool position of key s of batch row b (the block table already
  resolved: ``block_table[slot, s // block_size] * block_size + s % block_size``, ``SlotState.pool_index``);
- ``key_mask`` ``[B, S]`` bool: True = may attend (the decode step's mask, T == 1);
- ``extent`` ``[B]`` int32, optional: keys ``extent[b]`` and after are not read at all (a decode row sees a prefix of
  its keys: length + 1; a row that is not advanced: 0, and yields zeros). Why: the step's keys are bucketed (256, 512,
  1,024), so rows of 400-550 positions walked a 1,024-key bucket, and rows in the graph's batch that are not
  advanced walked all of it; a masked tile reads no keys but still costs its position and mask loads and its dots;
- ``q`` ``[B, Hq, D]`` with Hq = g x Hkv; query head h uses KV head h // g (as ``grouped_attention``).

One program per (batch row, KV head, key split): its g query heads (padded to 16 rows for the tensor-core
dot) walk their keys in tiles of ``BLOCK_S`` with an online softmax; scores, the running max / sum and the
output accumulate in fp32. A large batch runs one split (the output is written directly); a small one splits
the keys so that about ``TARGET_PROGRAMS`` programs keep the GPU busy, each writes its unnormalised partial
(fp32) and a second kernel merges them (flash-decoding's split-K, written here from the maths).

Semantics are ``layers.grouped_attention``'s (scale on the raw dot product, masked keys at -inf, softmax in
fp32); only rounding differs: the plain path rounds scores and probabilities to the
compute dtype between its GEMMs, this kernel keeps them in fp32 (probabilities enter the P·V dot in the
cache dtype). A row with every key masked yields zeros (the plain path would yield NaN; the step never
builds one: key 0 is always visible).

Used for the decode step (T == 1) on CUDA when Triton imports and ``MOSS_RT_DECODE_KERNEL`` is not ``0``;
prefill (T > 1), the CPU and the fallback keep the gather path. ``MOSS_RT_DECODE_KERNEL=interpret`` with
``TRITON_INTERPRET=1`` runs it on CPU tensors through Triton's interpreter (tests only; slow; its dots run
in fp32 there, since the interpreter of Triton 3.9 computes bf16 ``tl.dot`` wrongly).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from moss_rt.kernel_switch import kernel_wanted

__all__ = ["available", "paged_decode_attention"]

BLOCK_S = 64  # keys per tile
MIN_ROWS = 16  # tl.dot needs at least 16 rows: the g query heads of a KV head are padded to this
TARGET_PROGRAMS = 256  # split the keys of small batches until about this many programs run (~2 per H200 SM)
MAX_SPLITS = 32


@functools.cache
def _kernel() -> Any:
    """The jitted kernels (paged_attention_kernels.py), imported on first use (so TRITON_INTERPRET is read then); None
    without Triton."""
    try:
        from moss_rt.model import paged_attention_kernels as k
    except Exception:  # noqa: BLE001 - no Triton (CPU wheels): the gather path
        return None
    return k._paged_decode, k._combine


def available(q: torch.Tensor) -> bool:
    """Whether the kernel runs for tensors like ``q``: CUDA (or the interpreter in tests), Triton, not turned off."""
    if not kernel_wanted("MOSS_RT_DECODE_KERNEL", q.is_cuda):
        return False
    if q.shape[-1] & (q.shape[-1] - 1) or q.shape[-1] < 16:
        return False  # the head dimension is one tile: a power of two (tl.arange)
    return _kernel() is not None


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    key_mask: torch.Tensor,
    scale: float,
    extent: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``q`` [B,Hq,D] over the pool keys at ``positions`` [B,S] under ``key_mask`` [B,S] → [B,Hq*D];
    ``extent`` [B] int32: keys read per row at most (the rest must be masked; see the module's docstring)."""
    kernels = _kernel()
    assert kernels is not None, "check available() first"
    kernel, combine = kernels
    batch, hq, dim = q.shape
    hkv = k_cache.shape[1]
    groups = hq // hkv
    q = q.contiguous()
    k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()  # views of the pool: already contiguous
    positions = positions.contiguous()
    mask = key_mask.contiguous().view(torch.uint8)
    if extent is not None:
        assert extent.shape == (batch,) and extent.dtype == torch.int32, "extent: [B] int32"
        extent = extent.contiguous()
    out = torch.empty((batch, hq, dim), dtype=q.dtype, device=q.device)
    rows = max(MIN_ROWS, 1 << (groups - 1).bit_length())
    keys = positions.shape[1]
    # Few rows (a small batch) leave most of the GPU idle: split the keys so about TARGET_PROGRAMS programs
    # run, each over a whole number of tiles, and merge their partial softmax sums afterwards.
    tiles = -(-keys // BLOCK_S)
    splits = max(1, min(tiles, TARGET_PROGRAMS // (batch * hkv), MAX_SPLITS))
    chunk = -(-tiles // splits) * BLOCK_S
    splits = -(-keys // chunk)
    if splits > 1:
        part_acc = torch.empty((batch * hq * splits, dim), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((batch * hq * splits, 2), dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    kernel[(batch, hkv, splits)](
        q, k_cache, v_cache, positions, mask, mask if extent is None else extent, out, part_acc, part_ml, keys, chunk,
        splits, float(scale),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), positions.stride(0), mask.stride(0),
        out.stride(0), out.stride(1),
        G=groups, D=dim, ROWS=rows, BLOCK=BLOCK_S, IEEE=q.dtype == torch.float32 or not q.is_cuda,
        UPCAST=not q.is_cuda,  # Triton 3.9's interpreter gets bf16 dots wrong: fp32 dots there
        SPLIT=splits > 1,  # a runtime count: one compiled variant serves every split count
        HAS_EXTENT=extent is not None,
    )
    if splits > 1:
        combine[(batch, hq)](part_acc, part_ml, out, out.stride(0), out.stride(1), splits, HQ=hq, D=dim,
                             SP=max(2, 1 << (splits - 1).bit_length()))
    return out.view(batch, hq * dim)
