"""Attention of a multi-row chunk (a prefill pass) through PyTorch's fused SDPA kernels on CUDA.

Why: a prefill pass of 16 prompts of 400 rows scores 16 x 32 heads x 400 x 400 keys per layer. The plain path
(``layers.grouped_attention``: matmul, masked fill, softmax in fp32, matmul) writes and reads those scores several
times in fp32, about a fifth of the pass on an H200. SDPA's flash / memory-efficient kernels never materialise them.

Two cases:

- ``causal``: every row's chunk starts at position 0 (fresh prompts, the common case), so the keys a row sees are
  exactly its chunk's rows up to its own: flash attention's causal mode, with grouped K/V heads read as they are
  (``enable_gqa``). Padded rows past a shorter chunk see padded keys; their outputs land in the scratch row.
- otherwise (a later chunk of a long prompt, or a retake's kept frames after a cached prompt): the boolean key mask,
  with the K/V heads repeated to the query heads (the memory-efficient kernel takes a mask but not grouped heads).

Same semantics as ``grouped_attention`` (query head h reads KV head h // g; scale on the raw dot product), equal to
it within bf16 rounding (the plain path rounds probabilities to bf16 before P·V as well).

Used on CUDA; ``MOSS_RT_CHUNK_SDPA=0`` keeps the plain path; ``MOSS_RT_CHUNK_SDPA=interpret`` with
``TRITON_INTERPRET=1`` runs SDPA on CPU tensors too (tests). The CPU default stays on the plain path, whose rounding
the CPU parity tests pin.

**Packed pieces** (:func:`packed_causal_attention`, on CUDA in bf16/fp16 unless ``MOSS_RT_PACKED_PREFILL=0``; measured
on an H200 in bench/RESULTS.md, sessions 20 and 21: in a graphed pass of 8 retakes' 253 rows after their openings the
masked kernel took 5.7 ms and repeating the K/V heads for it 3.1 ms of 34; packed, the pass takes 31.6 ms instead of
35.2, 4 pieces 16.1 instead of 18.3): each piece's queries and its own keys packed end to end
(``cu_q`` / ``cu_k``, the offsets where each piece begins, int32), every piece causal aligned to its last key (query
t of a piece of T queries and L keys sees keys 0..L-T+t: the piece's opening and its rows up to its own), grouped
K/V heads read as they are. On CUDA that is flash attention's variable-length forward, where a piece with more keys
than queries aligns its causal mask to the bottom right (why PyTorch's SDPA refuses ``is_causal`` for such shapes:
its own causal mask is top-left); ``MOSS_RT_PACKED_PREFILL=interpret`` runs the same attention piece by piece through
the plain path on any device (tests: the packing against the masked path).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from moss_rt.kernel_switch import kernel_wanted
from moss_rt.model.layers import grouped_attention

__all__ = ["available", "chunk_attention", "packed_available", "packed_causal_attention"]

# Not cuDNN's SDPA (PyTorch's first choice on Hopper): it builds a plan for every new shape, 60-130 ms on an H200 the
# first time a pass of that batch and length comes, which the first takes of a burst would wait for.
BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def available(t: torch.Tensor) -> bool:
    return kernel_wanted("MOSS_RT_CHUNK_SDPA", t.is_cuda)


def chunk_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor, scale: float, causal: bool
) -> torch.Tensor:
    """Queries q [B,T,Hq,D] over keys/values [B,Hkv,S,D]; ``key_mask`` [B,T,S] (True = may attend).

    ``causal``: the mask is known to be ``key <= row`` with S == T (chunks from position 0); it is then not read.
    Returns [B,T,Hq*D].
    """
    if not available(q):
        return grouped_attention(q, k, v, key_mask, scale)
    batch, tq, hq, dim = q.shape
    qh = q.transpose(1, 2)  # [B,Hq,T,D]
    with sdpa_kernel(BACKENDS):
        if causal:
            out = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            groups = hq // k.shape[1]
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
            out = F.scaled_dot_product_attention(qh, k, v, attn_mask=key_mask[:, None], scale=scale)
    return out.transpose(1, 2).reshape(batch, tq, hq * dim)


def packed_available(cache: torch.Tensor) -> bool:
    """Whether a pass after a prefix over keys like ``cache`` packs its pieces: on CUDA in bf16 or fp16 (flash
    attention's dtypes) unless ``MOSS_RT_PACKED_PREFILL=0`` (the masked path); ``interpret`` on any device and dtype,
    the plain path piece by piece."""
    mode = os.environ.get("MOSS_RT_PACKED_PREFILL", "1")
    return mode == "interpret" or (mode == "1" and cache.is_cuda and cache.dtype in (torch.float16, torch.bfloat16))


def packed_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int,
    max_k: int, scale: float,
) -> torch.Tensor:
    """Queries q [Nq,Hq,D] of pieces packed end to end (piece i: rows cu_q[i]..cu_q[i+1]) over their own keys and
    values [Nk,Hkv,D] (cu_k), each piece causal aligned to its last key; entries past the last piece's are never
    read. ``max_q`` / ``max_k``: at least any piece's rows / keys. Returns [Nq,Hq,D]."""
    if q.is_cuda and os.environ.get("MOSS_RT_PACKED_PREFILL") != "interpret":
        out = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale)
        return out[0]
    pieces = []
    starts_q, starts_k = cu_q.tolist(), cu_k.tolist()  # host reads: the reference path, never inside a graph
    for i in range(len(starts_q) - 1):
        qi = q[starts_q[i] : starts_q[i + 1]]
        ki = k[starts_k[i] : starts_k[i + 1]].transpose(0, 1)[None]  # [1,Hkv,L,D]
        vi = v[starts_k[i] : starts_k[i + 1]].transpose(0, 1)[None]
        rows, keys = qi.shape[0], ki.shape[2]
        last = keys - rows + torch.arange(rows, device=q.device)  # each query's last key: aligned to the bottom right
        mask = torch.arange(keys, device=q.device)[None, :] <= last[:, None]
        pieces.append(grouped_attention(qi[None], ki, vi, mask[None], scale)[0].view(rows, *q.shape[1:]))
    return torch.cat(pieces)
