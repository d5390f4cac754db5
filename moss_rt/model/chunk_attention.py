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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from moss_rt.kernel_switch import kernel_wanted
from moss_rt.model.layers import grouped_attention

__all__ = ["available", "chunk_attention"]

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
