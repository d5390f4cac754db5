"""Fused elementwise kernels (Triton) for the codec transformers on CUDA.

Why: a streaming decode step of 16 streams × 1 frame is bound by the *number* of kernels a CUDA graph replays
(≈2,040 per step, ≈17.6 per layer over 92 decoder layers), not by their work. Per layer the plain-PyTorch path
launches LayerNorm, a cast to the compute dtype, three RoPE kernels, two ring writes and two residual updates
around the GEMMs and the attention. Two Triton kernels replace them:

- :func:`residual_norm`: ``x += scale * update`` (LayerScale residual, fp32) followed by LayerNorm and the cast to
  the compute dtype, one pass over the row. Used after attention (→ LN2) and after the FFN (→ the next layer's LN1,
  or just the cast for ``output_proj`` after the last layer).
- :func:`rope_store`: interleaved RoPE of q and k in fp32 from the in_proj output, q written out in the compute
  dtype, rotated k and plain v written straight into their K/V buffers (ring slots of the streaming pools, or
  fresh whole-clip buffers) at ``[rows[b, t], :, ring_idx[b, t], :]``.

The maths and dtypes are the plain path's (fp32 residual, LayerNorm, LayerScale and RoPE; K/V and GEMM inputs in
the compute dtype); only rounding order differs (fused multiply-adds, the LayerNorm reduction order), ~1e-7
relative in fp32. Whole-clip decode uses the same kernels, so chunked == whole holds as before (tested on CUDA).

Used when the tensors are on CUDA, the residual stream is fp32 and Triton imports. Its switch follows the rule of
every kernel's (moss_rt/kernel_switch.py): ``MOSS_RT_CODEC_FUSED=0`` turns it off (and :func:`disabled` in code),
``MOSS_RT_CODEC_FUSED=interpret`` with ``TRITON_INTERPRET=1`` runs the kernels on CPU tensors through Triton's
interpreter (tests only; slow).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from typing import Any

import torch

from moss_rt.kernel_switch import kernel_wanted

__all__ = ["SWITCH", "disabled", "residual_norm", "rope_store", "usable"]

SWITCH = "MOSS_RT_CODEC_FUSED"  # the kernels' switch (moss_rt/kernel_switch.py)

log = logging.getLogger(__name__)

_off = 0  # nesting depth of ``disabled()``


@functools.cache
def _triton() -> Any:
    """The jitted kernels (fused_kernels.py), imported on first use (so TRITON_INTERPRET is read then); None without
    Triton."""
    try:
        import triton

        from moss_rt.codec import fused_kernels as k
    except Exception:  # noqa: BLE001 - no Triton (CPU wheels): plain path
        return None
    return triton, k._residual_norm, k._rope_store, k._rope_store_fp8


def usable(x: torch.Tensor) -> bool:
    """Whether the fused kernels run for residual stream ``x`` (see the module docstring)."""
    if _off or x.dtype != torch.float32 or not kernel_wanted(SWITCH, x.is_cuda):
        return False
    return _triton() is not None and _works_on(x.device)


@functools.cache
def _works_on(device: torch.device) -> bool:
    """One tiny launch per device, the first time (always before any graph capture: captures are preceded by
    warm-up runs): Triton can import yet fail to compile (no C compiler, unsupported GPU); then plain PyTorch."""
    try:
        x = torch.ones(2, 8, device=device)
        norm = torch.nn.LayerNorm(8).to(device)
        residual_norm(x, x, x[0], norm, torch.float32)
        return True
    except Exception:  # noqa: BLE001
        log.warning("codec: Triton fused kernels unusable on %s; using plain PyTorch ops", device, exc_info=True)
        return False


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Use the plain PyTorch path inside this block (comparisons, benchmarks)."""
    global _off
    _off += 1
    try:
        yield
    finally:
        _off -= 1


def _block(n: int) -> int:
    return 1 << max(5, (n - 1).bit_length())


def _warps(block: int) -> int:
    return 8 if block >= 2048 else 4


def residual_norm(
    x: torch.Tensor,
    update: torch.Tensor | None,
    scale: torch.Tensor | None,
    norm: torch.nn.LayerNorm | None,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x + scale * update`` (fp32; ``x`` itself when ``update`` is None) and its LayerNorm (or the plain value
    when ``norm`` is None) in ``out_dtype``.

    Args:
        x: ``[..., D]`` fp32 contiguous. update: same shape, any float dtype. scale: ``[D]``.
    Returns:
        (new residual fp32, normalised row in ``out_dtype``).
    """
    _, kern, _, _ = _triton()
    D = x.shape[-1]
    rows = x.numel() // D
    has_res = update is not None
    res = update.contiguous() if update is not None else x
    xo = torch.empty_like(x) if has_res else x
    h = torch.empty(x.shape, device=x.device, dtype=out_dtype)
    if rows:
        blk = _block(D)
        kern[(rows,)](
            x, res, scale if has_res else x,
            norm.weight if norm is not None else x, norm.bias if norm is not None else x,
            xo, h, D, float(norm.eps) if norm is not None else 0.0,
            HAS_RES=has_res, HAS_NORM=norm is not None, BLOCK=blk, num_warps=_warps(blk),
        )
    return xo, h


def rope_store(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    rows: torch.Tensor,
    ring_idx: torch.Tensor,
    num_heads: int,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    q_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """RoPE q/k from the in_proj output and store k/v; returns q.

    Args:
        qkv: ``[B, T, 3 * D]`` contiguous (q | k | v, heads inside each), any float dtype.
        cos, sin: ``[B, T, Dh / 2]`` fp32 contiguous (:func:`moss_rt.codec.modules.rope_angles`).
        k_buf, v_buf: ``[N, H, R, Dh]`` with equal strides and unit stride on Dh: rotated k and v land at
            ``[rows[b, t], :, ring_idx[b, t], :]`` (a K/V block and the row inside it, for the streaming pools).
        rows: ``[B]`` (one buffer row per sequence) or ``[B, T]`` int64; ring_idx: ``[B, T]`` int64.
        k_scale, v_scale: fp8 buffers only (``k_buf`` float8_e4m3fn): ``[N, H, R]`` fp32, equal strides; each
            (token, head) row of k and v is quantized with its own scale (kv_quant.quantize), stored at
            ``[rows[b, t], :, ring_idx[b, t]]``.
        q_dtype: dtype of the returned q (None: ``k_buf``'s; required with fp8 buffers).
    Returns:
        rotated q ``[B, H, T, Dh]`` (a transposed view of ``[B, T, H, Dh]``) in ``q_dtype``.
    """
    _, _, kern, kern_fp8 = _triton()
    B, T, D3 = qkv.shape
    D = D3 // 3
    H = num_heads
    Dh = D // H
    assert k_buf.stride() == v_buf.stride() and k_buf.stride(-1) == 1 and k_buf.dtype == v_buf.dtype
    assert cos.is_contiguous() and sin.is_contiguous() and cos.shape == (B, T, Dh // 2)
    qkv = qkv.contiguous()
    ring_idx = ring_idx.expand(B, T).contiguous()
    rows = (rows[:, None] if rows.dim() == 1 else rows).expand(B, T).contiguous()
    fp8 = k_scale is not None or v_scale is not None
    if fp8:
        assert k_scale is not None and v_scale is not None and q_dtype is not None
        assert k_buf.dtype == torch.float8_e4m3fn and k_scale.stride() == v_scale.stride()
        assert k_scale.shape == k_buf.shape[:-1] and k_scale.dtype == v_scale.dtype == torch.float32
        assert Dh >= 2 and Dh & (Dh - 1) == 0, "fp8 K/V need a power-of-two head size"
    q = torch.empty(B, T, H, Dh, device=qkv.device, dtype=q_dtype or k_buf.dtype)
    if B * T and fp8:
        assert k_scale is not None and v_scale is not None
        hb = 1 << max(0, H - 1).bit_length()
        kern_fp8[(B * T,)](
            qkv, cos, sin, q, k_buf, v_buf, k_scale, v_scale, rows, ring_idx,
            k_buf.stride(0), k_buf.stride(1), k_buf.stride(2), k_scale.stride(0), k_scale.stride(1),
            k_scale.stride(2), H, D=D, HALF=Dh // 2, HB=hb, num_warps=_warps(_block(D // 2)),
        )
    elif B * T:
        blk = _block(D // 2)
        kern[(B * T,)](
            qkv, cos, sin, q, k_buf, v_buf, rows, ring_idx,
            k_buf.stride(0), k_buf.stride(1), k_buf.stride(2),
            D=D, HALF=Dh // 2, BLOCK=blk, num_warps=_warps(blk),
        )
    return q.transpose(1, 2)
