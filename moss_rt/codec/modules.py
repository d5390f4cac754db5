"""Building blocks of the codec transformers: RoPE, local-window attention, layers, stages.

Layout convention: activations are channels-last ``[B, T, C]`` everywhere inside this package
(upstream keeps ``[B, C, T]`` between modules; the maths is identical).

Precision policy (``compute_dtype``): linear weights may be stored in bf16 for compute while the
residual stream, LayerNorm, LayerScale and RoPE angles stay fp32 — the same split upstream gets
from autocast, without re-casting fp32 weights on every call.

Module and parameter names mirror the real checkpoint keys, e.g.
``decoder.0.transformer.layers.3.self_attn.in_proj.weight`` or ``...ffn.2.weight``,
so loading is a plain name match.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from moss_rt.kernel_switch import kernel_wanted

from . import fused
from .config import TransformerSpec

__all__ = [
    "Attend",
    "KVTarget",
    "ProjectedTransformer",
    "acc_dtype",
    "gelu_ffn",
    "TransformerLayer",
    "rotate_pairs",
    "patch_fold",
    "patch_unfold",
    "rope_angles",
    "rope_rotation",
    "rope_tables",
    "run_layers_fused",
    "windowed_attention",
]

# attend(q, k, v) -> out, all [B, H, T, Dh]; k/v are the chunk's own (post-RoPE) keys/values.
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def acc_dtype(weight_dtype: torch.dtype) -> torch.dtype:
    """Dtype of the residual stream, norms and RoPE for a given linear-weight dtype: fp32 for fp32/bf16
    weights; fp64 only for a codec cast to double (used by tests to separate logic from rounding)."""
    return torch.float64 if weight_dtype == torch.float64 else torch.float32


def rope_angles(
    positions: torch.Tensor, head_dim: int, max_period: float, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for interleaved (GPT-J) RoPE.

    Args:
        positions: ``[B, T]`` int64 absolute token positions.
    Returns:
        ``(cos, sin)`` each ``[B, 1, T, head_dim // 2]`` in ``dtype`` (float32 normally).
    """
    # Same fp32 formula as upstream (frequencies exp(-ln(max_period) * 2i / D)) so angles match bitwise.
    ds = torch.arange(head_dim // 2, device=positions.device, dtype=dtype)
    freqs = torch.exp(ds * (-math.log(max_period) * 2 / head_dim))
    ang = positions.to(dtype)[:, None, :, None] * freqs
    return torch.cos(ang), torch.sin(ang)


def rope_rotation(
    positions: torch.Tensor, head_dim: int, max_period: float, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Unit rotations e^{i·angle} for interleaved RoPE, complex ``[B, T, 1, 1, head_dim // 2]``
    (broadcast over the q/k axis and heads of ``[B, T, 2, H, Dh/2]``)."""
    cos, sin = rope_angles(positions, head_dim, max_period, dtype)  # [B, 1, T, Dh/2]
    return torch.complex(cos, sin).permute(0, 2, 1, 3)[:, :, None]


def rope_tables(
    positions: torch.Tensor, head_dim: int, max_period: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin ``[B, T, head_dim // 2]`` (contiguous) for :func:`moss_rt.codec.fused.rope_store`; the
    same values :func:`rope_rotation` packs into complex numbers."""
    cos, sin = rope_angles(positions, head_dim, max_period, torch.float32)
    return cos[:, 0].contiguous(), sin[:, 0].contiguous()


def rotate_pairs(x: torch.Tensor, rot: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Interleaved (GPT-J) RoPE: pairs (x[2i], x[2i+1]) as complex numbers times ``rot`` = e^{i·angle}.

    The complex product is exactly the GPT-J formula (re·cos − im·sin, re·sin + im·cos), computed in the
    accumulation dtype, in 3 kernels instead of ~10 per tensor (launch count bounds streaming decode).

    Args:
        x: ``[..., Dh]`` any float dtype. rot: complex, broadcastable to ``[..., Dh/2]``.
    Returns:
        ``[..., Dh]`` in ``out_dtype``.
    """
    shape = x.shape
    xc = torch.view_as_complex(x.to(acc_dtype(out_dtype)).reshape(*shape[:-1], shape[-1] // 2, 2))
    return torch.view_as_real(xc * rot).to(out_dtype).reshape(shape)


def windowed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context: int, block: int = 1024
) -> torch.Tensor:
    """Whole-sequence causal local attention: query i sees keys j with 0 <= i - j < context.

    Queries are processed in blocks so memory stays O(block * (block + context)) for long clips
    instead of O(T^2).

    Args:
        q, k, v: ``[B, H, T, Dh]`` (positions 0..T-1).
    Returns:
        ``[B, H, T, Dh]``.
    """
    T = q.shape[2]
    out = torch.empty_like(q)
    for s in range(0, T, block):
        e = min(T, s + block)
        ks = max(0, s - context + 1)
        qi = torch.arange(s, e, device=q.device)[:, None]
        kj = torch.arange(ks, e, device=q.device)[None, :]
        delta = qi - kj
        mask = (delta >= 0) & (delta < context)
        out[:, :, s:e] = F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, ks:e], v[:, :, ks:e], attn_mask=mask)
    return out


class LayerScale(nn.Module):
    """Per-channel scale (checkpoint key ``layer_scale_{1,2}.scale``)."""

    def __init__(self, dim: int, init: float) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), init))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


class SelfAttentionWeights(nn.Module):
    """Holds ``self_attn.in_proj`` (d→3d) and ``self_attn.out_proj`` (d→d), both without bias."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.in_proj = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out_proj = nn.Linear(d_model, d_model, bias=False)


class TransformerLayer(nn.Module):
    """Pre-norm layer: ``x += ls1 * Attn(LN1 x)``; ``x += ls2 * FFN(LN2 x)``; FFN = Linear, exact GELU, Linear."""

    def __init__(self, spec: TransformerSpec) -> None:
        super().__init__()
        d = spec.d_model
        self.num_heads = spec.num_heads
        self.head_dim = spec.head_dim
        self.self_attn = SelfAttentionWeights(d)
        self.norm1 = nn.LayerNorm(d, eps=1e-5)
        self.norm2 = nn.LayerNorm(d, eps=1e-5)
        # Indices 0 and 2 so the keys read ffn.0 / ffn.2 as in the checkpoint.
        self.ffn = nn.Sequential(
            nn.Linear(d, spec.dim_feedforward, bias=False), nn.GELU(), nn.Linear(spec.dim_feedforward, d, bias=False)
        )
        init = 1.0 if spec.layer_scale is None else spec.layer_scale
        self.layer_scale_1 = LayerScale(d, init)
        self.layer_scale_2 = LayerScale(d, init)

    @property
    def ffn_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The FFN's two weights (``ffn.0``, ``ffn.2``)."""
        return cast(nn.Linear, self.ffn[0]).weight, cast(nn.Linear, self.ffn[2]).weight

    def qkv(self, x: torch.Tensor, rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """LN1 + in_proj + RoPE. ``x`` ``[B, T, d]`` fp32, ``rot`` from :func:`rope_rotation` →
        q, k, v ``[B, H, T, Dh]`` (strided views) in compute dtype."""
        B, T, _ = x.shape
        H, Dh = self.num_heads, self.head_dim
        w = self.self_attn.in_proj.weight
        h = F.layer_norm(x, self.norm1.normalized_shape, self.norm1.weight, self.norm1.bias, self.norm1.eps)
        qkv = F.linear(h.to(w.dtype), w).view(B, T, 3, H, Dh)
        qk = rotate_pairs(qkv[:, :, :2], rot, w.dtype)  # q and k in one go: [B, T, 2, H, Dh]
        return qk[:, :, 0].transpose(1, 2), qk[:, :, 1].transpose(1, 2), qkv[:, :, 2].transpose(1, 2)

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """out_proj + residual + FFN block. ``attn`` ``[B, H, T, Dh]``; returns ``[B, T, d]`` fp32."""
        B, _, T, _ = attn.shape
        a = attn.transpose(1, 2).reshape(B, T, -1)
        # addcmul promotes the bf16 update to fp32: x + ls * update in one kernel.
        x = torch.addcmul(x, self.layer_scale_1.scale, F.linear(a, self.self_attn.out_proj.weight))
        h = F.layer_norm(x, self.norm2.normalized_shape, self.norm2.weight, self.norm2.bias, self.norm2.eps)
        w1, w2 = self.ffn_weights
        u = F.linear(F.gelu(F.linear(h.to(w1.dtype), w1)), w2)
        return torch.addcmul(x, self.layer_scale_2.scale, u)

    def forward(self, x: torch.Tensor, rot: torch.Tensor, attend: Attend) -> torch.Tensor:
        q, k, v = self.qkv(x, rot)
        return self.finish(x, attend(q, k, v))


# kv_dst(layer_index) -> (k_buf, v_buf, rows [B], ring_idx [B, T], k_scale, v_scale): where rope_store puts the
# chunk's k/v; the scale buffers ([N, H, R] fp32) only for fp8 buffers (moss_rt/codec/kv_quant.py), else None.
KVTarget = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]
KVDest = Callable[[int], KVTarget]
# attend(layer_index, q [B, H, T, Dh]) -> [B, H, T, Dh], after the layer's k/v are stored.
AttendStored = Callable[[int, torch.Tensor], torch.Tensor]


def run_layers_fused(
    layers: Sequence[TransformerLayer], x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    kv_dst: KVDest, attend: AttendStored,
) -> torch.Tensor:
    """The layer stack with the fused kernels of :mod:`moss_rt.codec.fused` (CUDA, fp32 residual stream).

    Same maths as ``layer(x, rot, attend)`` in a loop, in ~10 kernels per layer instead of ~17: each residual
    update is fused with the LayerNorm (and cast) that follows it — LN2 after attention, the next layer's LN1
    after the FFN — and RoPE is fused with the K/V store.

    Args:
        x: ``[B, T, d]`` fp32 residual stream after ``input_proj``. cos, sin: from :func:`rope_tables`.
    Returns:
        the residual stream after the last layer, already in the compute dtype (for ``output_proj``).
    """
    B, T, _ = x.shape
    wdt = layers[0].self_attn.in_proj.weight.dtype
    _, h = fused.residual_norm(x, None, None, layers[0].norm1, wdt)
    for li, layer in enumerate(layers):
        qkv = F.linear(h, layer.self_attn.in_proj.weight)
        k_buf, v_buf, rows, ring_idx, k_scale, v_scale = kv_dst(li)
        q = fused.rope_store(qkv, cos, sin, k_buf, v_buf, rows, ring_idx, layer.num_heads,
                             k_scale=k_scale, v_scale=v_scale, q_dtype=wdt)
        a = attend(li, q).transpose(1, 2).reshape(B, T, -1)
        u = F.linear(a, layer.self_attn.out_proj.weight)
        x, h = fused.residual_norm(x, u, layer.layer_scale_1.scale, layer.norm2, wdt)
        u = gelu_ffn(h, *layer.ffn_weights)
        nxt = layers[li + 1].norm1 if li + 1 < len(layers) else None
        x, h = fused.residual_norm(x, u, layer.layer_scale_2.scale, nxt, wdt)
    return h


FFN_EPILOGUE_SWITCH = "MOSS_RT_CODEC_FFN_EPILOGUE"  # moss_rt/kernel_switch.py's rule; "0": GELU as its own kernel
_EPILOGUE_DTYPES = (torch.bfloat16, torch.float16)


def gelu_ffn(h: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The fused path's FFN, ``Linear(w2)(GELU(Linear(w1)(h)))`` over ``h`` ``[..., d]`` in the compute dtype.

    In bf16/fp16 on CUDA the GELU runs in the first GEMM's epilogue (cuBLASLt's, through ``torch._addmm_activation``
    with a zero bias): the 4x-wide activation is written once instead of written, read, written and read again
    around a GELU kernel of its own, one kernel fewer a layer (full-size decoder on an H200, graphed: the FFNs of a
    128-stream 8-frame call 14.5 -> 12.6 ms, of a one-frame call 2.7 -> 2.3 ms). The epilogue's GELU is the tanh form,
    within 5e-4 of the exact one, and it acts on the fp32 accumulator before the one rounding to bf16, where the plain
    path rounds before and after its exact GELU: against an fp32 reference with the exact GELU it is as close or
    closer (tests/codec/test_codec_cuda.py). fp32 keeps the exact GELU, so the fp32 paths stay equal to the
    reference to ~1e-7.
    """
    epilogue = h.is_cuda and h.dtype in _EPILOGUE_DTYPES and h.numel() > 0  # (an empty call: the plain ops)
    if not (epilogue and kernel_wanted(FFN_EPILOGUE_SWITCH, on_cuda=True)):
        return F.linear(F.gelu(F.linear(h, w1)), w2)
    bias = _zero_bias(w1.shape[0], w1.dtype, h.device)
    wide = torch._addmm_activation(bias, h.reshape(-1, h.shape[-1]), w1.t(), use_gelu=True)
    return F.linear(wide, w2).view(*h.shape[:-1], w2.shape[0])


def _zero_bias(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The epilogue's bias (cuBLASLt's GELU epilogue comes with one), made once per width outside any CUDA graph
    capture: made during one, it would hold zeros only once the graph replayed. Every capture follows warm-up runs of
    its shapes (streaming.py), so a width's first call is never a capture's; if one were, it fails loudly here."""
    key = (n, dtype, device)
    bias = _ZERO_BIASES.get(key)
    if bias is None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"codec FFN: first call of width {n} ({dtype}) inside a CUDA graph capture; "
                               "run it eagerly first (warm-up)")
        bias = _ZERO_BIASES[key] = torch.zeros(n, dtype=dtype, device=device)
    return bias


_ZERO_BIASES: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}


class TransformerStack(nn.Module):
    """Holds ``layers`` (checkpoint key ``<stage>.transformer.layers.<i>``)."""

    def __init__(self, spec: TransformerSpec) -> None:
        super().__init__()
        self.layers = nn.ModuleList(TransformerLayer(spec) for _ in range(spec.num_layers))

    @property
    def blocks(self) -> list[TransformerLayer]:
        """``layers`` as what they are (a ModuleList indexes and iterates like this list)."""
        return cast("list[TransformerLayer]", self.layers)


class ProjectedTransformer(nn.Module):
    """input_proj (no bias) → causal local-window transformer → output_proj (no bias).

    v2 always has both projections, even where dimensions match.
    """

    def __init__(self, spec: TransformerSpec) -> None:
        super().__init__()
        self.spec = spec
        self.input_proj = nn.Linear(spec.input_dimension, spec.d_model, bias=False)
        self.transformer = TransformerStack(spec)
        self.output_proj = nn.Linear(spec.d_model, spec.output_dimension, bias=False)

    def project_in(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, T, input_dimension]`` → ``[B, T, d_model]`` fp32 residual stream."""
        w = self.input_proj.weight
        return F.linear(x.to(w.dtype), w).to(acc_dtype(w.dtype))

    def project_out(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, T, d_model]`` → ``[B, T, output_dimension]`` fp32."""
        w = self.output_proj.weight
        return F.linear(x.to(w.dtype), w).to(acc_dtype(w.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Whole-sequence forward from position 0. ``x`` ``[B, T, in]`` → ``[B, T, out]`` fp32."""
        B, T, _ = x.shape
        pos = torch.arange(T, device=x.device).expand(B, T)
        context = self.spec.context
        h = self.project_in(x)
        if fused.usable(h):
            # One K/V buffer pair [B, H, T, Dh] reused by every layer (row b, "ring" index t: no ring here).
            cos, sin = rope_tables(pos, self.spec.head_dim, self.spec.max_period)
            shape = (B, self.spec.num_heads, T, self.spec.head_dim)
            k, v = (torch.empty(shape, device=h.device, dtype=self.input_proj.weight.dtype) for _ in range(2))
            rows = torch.arange(B, device=h.device)

            def kv_dst(li: int) -> KVTarget:
                return k, v, rows, pos, None, None

            def attend_stored(li: int, q: torch.Tensor) -> torch.Tensor:
                return windowed_attention(q, k, v, context)

            return self.project_out(run_layers_fused(self.transformer.blocks, h, cos, sin, kv_dst, attend_stored))
        rot = rope_rotation(pos, self.spec.head_dim, self.spec.max_period, acc_dtype(self.input_proj.weight.dtype))

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return windowed_attention(q, k, v, context)

        for layer in self.transformer.blocks:
            h = layer(h, rot, attend)
        return self.project_out(h)


def patch_fold(x: torch.Tensor, patch: int) -> torch.Tensor:
    """Encoder patch: ``[B, T, C]`` → ``[B, T / patch, C * patch]``; out[t, c*patch + o] = x[t*patch + o, c]."""
    B, T, C = x.shape
    return x.reshape(B, T // patch, patch, C).permute(0, 1, 3, 2).reshape(B, T // patch, C * patch)


def patch_unfold(x: torch.Tensor, patch: int) -> torch.Tensor:
    """Decoder patch: ``[B, L, C * patch]`` → ``[B, L * patch, C]``; out[l*patch + o, c] = x[l, c*patch + o]."""
    B, L, CP = x.shape
    return x.reshape(B, L, CP // patch, patch).permute(0, 1, 3, 2).reshape(B, L * patch, CP // patch)
