"""8-bit (fp8 e4m3) storage of the streaming codec's keys and values, one fp32 scale per (token, head).

Why: a stream's codec state (the K/V of every decoder attention layer over 10 s windows, paged_state.py) is the
largest per-stream cost of the service; fp8 halves it (plus 4 bytes of scale per 64 values: 53% of bf16 at
head_dim 64), so about 1.5x as many streams fit a card.

Scale granularity: one scale per (token, head) row of ``head_dim`` values, ``amax(|row|) / 448`` (448 is e4m3's
largest finite value), so every row uses e4m3's whole range. Blocks fill chunk by chunk, so a per-block scale fixed
at the block's first write would clip the keys of later chunks (or waste range on them); a per-row scale is fixed
when the row is written and never changes, so writes stay independent and copy-on-write copies a row with its
scale. Measured (bench/codec_state_dtype_error.py, docs/codec.md): the per-row scales keep the PCM error of fp8
state a few times bf16's, not orders of magnitude.

The CUDA paths quantize in fused.rope_store and dequantize in the window-attention kernel (scales applied to the
scores and probabilities in registers); this module is the plain-PyTorch path (CPU, masked SDPA fallback) and the
reference the kernels are tested against.
"""

from __future__ import annotations

import torch

__all__ = ["FP8", "FP8_MAX", "SCALE_BYTES", "dequantize", "is_fp8", "quantize", "value_bytes"]

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
SCALE_DTYPE = torch.float32
SCALE_BYTES = 4
MIN_AMAX = 1e-30  # an all-zero row gets a tiny scale (its values are 0 whatever the scale)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8


def value_bytes(head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one (token, head) row of K (or V) takes in storage ``dtype``: its values, and its scale in fp8."""
    if is_fp8(dtype):
        return head_dim + SCALE_BYTES
    return head_dim * torch.tensor([], dtype=dtype).element_size()


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[..., D]`` (any float dtype) → (fp8 values ``[..., D]``, fp32 scales ``[...]``), ``x ≈ q * s``.

    The scale is ``amax / 448`` in fp32 and the values ``x / s`` rounded to nearest (the same arithmetic as
    fused.rope_store's fp8 variant)."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1).clamp_min(MIN_AMAX) / FP8_MAX
    q = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp8 values ``[..., D]`` and their scales ``[...]`` → ``dtype``."""
    return (q.float() * scale[..., None].float()).to(dtype)
