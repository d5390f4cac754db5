"""Small building blocks shared by the backbone and the local transformer.

Written for inference over explicit, preallocated key/value buffers (no HF cache
objects), so every function here is CUDA-graph capturable: no host syncs, no
data-dependent shapes.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm: normalise in fp32, cast back, then scale (the upstream order)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = float(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


def inverse_frequencies(head_dim: int, base: float) -> torch.Tensor:
    """theta^(-2i/d) computed in fp32 exactly as the upstream rotary modules do."""
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def rope_tables_half_split(
    positions: int, head_dim: int, base: float, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [positions, head_dim] for the NeoX (half-split) convention used by the backbone."""
    freqs = torch.arange(positions, dtype=torch.float32)[:, None] * inverse_frequencies(head_dim, base)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device=device, dtype=dtype), emb.sin().to(device=device, dtype=dtype)


def rope_tables_interleaved(
    positions: int, head_dim: int, base: float, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [positions, head_dim] for the GPT-J (interleaved pairs) convention of the local transformer."""
    freqs = torch.arange(positions, dtype=torch.float32)[:, None] * inverse_frequencies(head_dim, base)[None, :]
    cos = freqs.cos().repeat_interleave(2, dim=-1)
    sin = freqs.sin().repeat_interleave(2, dim=-1)
    return cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)


def rotate_half_split(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_interleaved(x: torch.Tensor) -> torch.Tensor:
    even = x[..., ::2]
    odd = x[..., 1::2]
    return torch.stack((-odd, even), dim=-1).reshape_as(x)


def grouped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """Attention of queries q [B,T,Hq,D] over keys/values [B,Hkv,S,D] (Hq = g*Hkv).

    GQA without materialising repeated K/V: the g query heads that share one KV
    head are folded into the query length, so one SDPA call reads each cached key
    once. ``key_mask`` [B,T,S] (True = may attend) or None (attend to all S).
    Returns [B,T,Hq*D]; query head h uses KV head h // g, as in repeat_kv.
    """
    batch, tq, hq, dim = q.shape
    hkv = k.shape[1]
    groups = hq // hkv
    qg = q.view(batch, tq, hkv, groups, dim).permute(0, 2, 3, 1, 4).reshape(batch, hkv, groups * tq, dim)
    # Plain matmul/softmax: faster than SDPA for these small decode shapes on CPU and
    # trivially graph-capturable on CUDA. Softmax runs in fp32 for bf16 inputs.
    scores = torch.matmul(qg, k.transpose(-1, -2)) * scale
    if key_mask is not None:
        s = key_mask.shape[-1]
        mask = key_mask[:, None, None, :, :].expand(batch, 1, groups, tq, s).reshape(batch, 1, groups * tq, s)
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    out = torch.matmul(probs, v)
    out = out.view(batch, hkv, groups, tq, dim).permute(0, 3, 1, 2, 4)
    return out.reshape(batch, tq, hq * dim)


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The transformers ACT2FN entries a MOSS local transformer may name."""
    if name in ("silu", "swish"):
        return F.silu
    if name == "gelu":
        return F.gelu
    if name in ("gelu_new", "gelu_pytorch_tanh"):
        return lambda x: F.gelu(x, approximate="tanh")
    raise ValueError(f"unsupported activation {name!r}")


def attention_scale(head_dim: int, scale_weights: bool, inverse_layer: bool, layer_idx: int) -> float:
    scale = 1.0 / math.sqrt(head_dim) if scale_weights else 1.0
    if inverse_layer:
        scale /= float(layer_idx + 1)
    return scale
