"""Fused local-transformer pieces (Triton): fewer kernels per local position of the frame step (issue 12).

Why: the torch local block costs ~35 small kernels a position (LayerNorms, residual adds, RoPE as
slice/neg/stack/mul/add for q and k, two buffer writes, the attention as matmul/scale/softmax/casts/matmul and its
reshapes), twelve positions a frame, all launch-bound at decode batch sizes. The fused position
(``network.LocalTransformer.step``) runs per layer:

    add_layernorm -> c_attn GEMM -> rope_write_attention -> c_proj GEMM -> add_layernorm -> fc_in GEMM -> act
    -> fc_out GEMM

and one ``add_layernorm`` for the last residual add + ``ln_f``: 8 kernels a layer + 1. The kernels here:

- ``add_layernorm``: residual add + LayerNorm (weight and bias) in one pass, returning the new residual stream and
  the normed rows (the first layer has nothing to add);
- ``rope_write_attention``: interleaved RoPE of q and k from the c_attn row, the write of k and v into the
  per-frame buffers [B, heads, n_vq, D] at ``pos``, and the attention of the one query over keys 0..pos (at most
  n_vq of them: one small program per (row, head)).

The GEMMs (with their biases) and the activation stay torch's, so those numerics are the torch path's exactly; the
kernels repeat the torch code's cast points (fused_local_kernels.py), so results agree to float rounding.

On CUDA when Triton imports and ``MOSS_RT_FUSED_LOCAL`` is not ``0``; the CPU and that switch keep the torch path.
``MOSS_RT_FUSED_LOCAL=interpret`` with ``TRITON_INTERPRET=1`` runs it on CPU tensors through Triton's interpreter
(tests only; slow). No host syncs and no value-dependent allocations (``pos`` is a host int, as in the torch
path): the same code runs eagerly and under CUDA-graph capture.
"""

from __future__ import annotations

import torch

from moss_rt.kernel_switch import import_kernels, kernel_wanted, loaded_kernels
from moss_rt.model.fused_layers import row_block, row_warps

__all__ = ["add_layernorm", "available", "rope_write_attention"]


KERNELS = "moss_rt.model.fused_local_kernels"


def available(t: torch.Tensor) -> bool:
    """Whether the fused local step runs for tensors like ``t`` (``MOSS_RT_FUSED_LOCAL``, see kernel_switch.py)."""
    return kernel_wanted("MOSS_RT_FUSED_LOCAL", t.is_cuda) and import_kernels(KERNELS) is not None


def add_layernorm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows x [M,E] (+ delta [M,E]) -> (residual, LayerNorm(residual)); residual is ``x`` itself without delta."""
    rows, n = x.shape
    assert x.stride(1) == 1 and (delta is None or delta.stride(1) == 1)
    res = torch.empty_like(x) if delta is not None else x
    out = torch.empty_like(x)
    d = delta if delta is not None else x
    block = row_block(n)
    loaded_kernels(KERNELS).add_layernorm[(rows,)](
        x, d, res, out, weight, bias, x.stride(0), d.stride(0), res.stride(0), out.stride(0), n, float(eps),
        HAS_ADD=delta is not None, BLOCK=block, ACCURATE=x.is_cuda, num_warps=row_warps(block),
    )
    return res, out


def rope_write_attention(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    pos: int,
    heads: int,
    scale: float,
) -> torch.Tensor:
    """qkv [B,3E] (the c_attn output), cos/sin [D] for ``pos``, buffers [B,heads,L,D] with pos < L
    -> attention output [B,E] (heads concatenated, what c_proj reads); k and v of ``pos`` land in the buffers."""
    batch, width = qkv.shape
    embed = width // 3
    dim = embed // heads
    length = k_buf.shape[2]
    assert 0 <= pos < length and k_buf.shape == (batch, heads, length, dim)
    assert qkv.stride(1) == 1 and cos.stride(0) == 1 and sin.stride(0) == 1
    assert k_buf.stride() == v_buf.stride() and k_buf.stride(3) == 1
    out = torch.empty((batch, embed), dtype=qkv.dtype, device=qkv.device)
    block = row_block(dim)
    loaded_kernels(KERNELS).rope_write_attention[(batch, heads)](
        qkv, cos, sin, k_buf, v_buf, out, qkv.stride(0), out.stride(0), k_buf.stride(0), k_buf.stride(1),
        k_buf.stride(2), int(pos), float(scale),
        E=embed, D=dim, BLOCK_D=block, BLOCK_S=row_block(length), ACCURATE=qkv.is_cuda,
        num_warps=1 if block <= 128 else 2,
    )
    return out
