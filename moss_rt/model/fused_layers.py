"""Fused backbone layer pieces (Triton): fewer, larger kernels for the launch-bound decode step (issue 12).

Why: a torch backbone layer costs ~62 small kernels (RMSNorms as several elementwise passes, three q/k/v GEMMs,
q/k norms, RoPE as cat/neg/mul/add, two index_put writes, SiLU and mul...); at batch 1 the H200 spends more time
launching them than streaming the weights. The fused layer (``network.Qwen3Backbone``) runs:

    add_rmsnorm -> qkv GEMM -> qk_norm_rope_write -> attention -> o_proj -> add_rmsnorm -> gate/up GEMM
    -> silu_mul -> down GEMM

(one GEMM per fused weight, fused_weights.py). The kernels here:

- ``add_rmsnorm``: residual add + RMSNorm in one pass, returning the new residual stream and the normed rows
  (the first layer has nothing to add);
- ``qk_norm_rope_write``: q_norm / k_norm, half-split RoPE of q and k, and the write of k and v into the paged
  pool at ``PagedIndex.write``; returns q as ``[rows, Hq, D]`` (the layout both attention paths read);
- ``silu_mul``: SiLU(gate) * up.

Numerics follow the torch reference's cast points (fused_layers_kernels.py); only the order of the fp32 sum of
squares differs, so results agree with the torch path to float rounding (fp32: ~1e-7 relative).

Used for every backbone pass (decode and prefill) on CUDA when Triton imports and ``MOSS_RT_FUSED_BACKBONE`` is
not ``0``; the CPU and that switch keep the torch path. ``MOSS_RT_FUSED_BACKBONE=interpret`` with
``TRITON_INTERPRET=1`` runs it on CPU tensors through Triton's interpreter (tests only; slow). No host syncs and
no value-dependent allocations: the same code runs eagerly and under CUDA-graph capture.
"""

from __future__ import annotations

import torch

from moss_rt.kernel_switch import import_kernels, kernel_wanted, loaded_kernels

__all__ = ["add_rmsnorm", "available", "qk_norm_rope_write", "silu_mul"]

SILU_BLOCK = 1024


KERNELS = "moss_rt.model.fused_layers_kernels"


def available(t: torch.Tensor) -> bool:
    """Whether the fused layer runs for tensors like ``t`` (``MOSS_RT_FUSED_BACKBONE``, see kernel_switch.py)."""
    return kernel_wanted("MOSS_RT_FUSED_BACKBONE", t.is_cuda) and import_kernels(KERNELS) is not None


def row_block(n: int) -> int:
    """Tile of a kernel that holds one row of ``n`` values: the next power of two, at least 16."""
    return max(16, 1 << (n - 1).bit_length())


def row_warps(block: int) -> int:
    return max(1, min(16, block // 256))


def add_rmsnorm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows x [M,H] (+ delta [M,H]) -> (residual, RMSNorm(residual)); residual is ``x`` itself without delta."""
    rows, n = x.shape
    assert x.stride(1) == 1 and (delta is None or delta.stride(1) == 1)
    res = torch.empty_like(x) if delta is not None else x
    out = torch.empty_like(x)
    d = delta if delta is not None else x
    block = row_block(n)
    loaded_kernels(KERNELS).add_rmsnorm[(rows,)](
        x, d, res, out, weight, x.stride(0), d.stride(0), res.stride(0), out.stride(0), n, float(eps),
        HAS_ADD=delta is not None, BLOCK=block, ACCURATE=x.is_cuda, num_warps=row_warps(block),
    )
    return res, out


def qk_norm_rope_write(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    write: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    heads: int,
    kv_heads: int,
) -> torch.Tensor:
    """qkv [M,(Hq+2Hkv)*D] (rows of the fused projection), cos/sin [M,D], write [M] pool positions,
    caches [P,Hkv,D] (one layer) -> q [M,Hq,D] normed and rotated; k (normed, rotated) and v land in the caches."""
    rows = qkv.shape[0]
    dim = k_cache.shape[-1]
    assert qkv.stride(1) == 1 and cos.stride(1) == 1 and sin.stride() == cos.stride()
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(2) == 1
    q = torch.empty((rows, heads, dim), dtype=qkv.dtype, device=qkv.device)
    block = row_block(dim)
    loaded_kernels(KERNELS).qk_norm_rope_write[(rows, heads + kv_heads)](
        qkv, cos, sin, q_weight, k_weight, write, q, k_cache, v_cache,
        qkv.stride(0), cos.stride(0), q.stride(0), k_cache.stride(0), k_cache.stride(1), float(eps),
        HQ=heads, HKV=kv_heads, D=dim, BLOCK_D=block, ACCURATE=qkv.is_cuda, num_warps=1 if block <= 128 else 2,
    )
    return q


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [M,2I] (the fused gate/up projection) -> SiLU(gate) * up [M,I]."""
    rows, width = gate_up.shape
    n = width // 2
    assert gate_up.stride(1) == 1
    out = torch.empty((rows, n), dtype=gate_up.dtype, device=gate_up.device)
    block = min(SILU_BLOCK, row_block(n))
    loaded_kernels(KERNELS).silu_mul[(rows, -(-n // block))](
        gate_up, out, gate_up.stride(0), out.stride(0), n, BLOCK=block, ACCURATE=gate_up.is_cuda,
        num_warps=row_warps(block),
    )
    return out
