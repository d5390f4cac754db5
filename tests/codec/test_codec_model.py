"""Building blocks and whole-clip behaviour of our codec, checked against naive definitions."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from moss_rt.codec import CodecModel
from moss_rt.codec.modules import patch_fold, patch_unfold, rope_rotation, rotate_pairs, windowed_attention


def test_patch_fold_is_channel_major_and_unfold_inverts_it() -> None:
    x = torch.arange(2 * 12 * 3, dtype=torch.float32).view(2, 12, 3)  # [B, T, C]
    y = patch_fold(x, 4)
    assert y.shape == (2, 3, 12)
    # folded channel c*patch + o at step t holds time step t*patch + o of channel c
    for t in range(3):
        for c in range(3):
            for o in range(4):
                assert y[1, t, c * 4 + o] == x[1, t * 4 + o, c]
    assert torch.equal(patch_unfold(y, 4), x)


def test_rope_is_interleaved_gptj() -> None:
    torch.manual_seed(0)
    B, T, H, D = 2, 5, 3, 8
    x = torch.randn(B, T, 2, H, D)  # the [B, T, (q, k), H, Dh] layout the layer rotates
    pos = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]])
    y = rotate_pairs(x, rope_rotation(pos, D, 10000.0), torch.float32)
    assert y.shape == x.shape
    for b in range(B):
        for t in range(T):
            p = float(pos[b, t])
            for i in range(D // 2):
                theta = p * 10000.0 ** (-2 * i / D)
                for qk in range(2):
                    re, im = float(x[b, t, qk, 1, 2 * i]), float(x[b, t, qk, 1, 2 * i + 1])
                    assert math.isclose(float(y[b, t, qk, 1, 2 * i]), re * math.cos(theta) - im * math.sin(theta),
                                        abs_tol=1e-5)
                    assert math.isclose(float(y[b, t, qk, 1, 2 * i + 1]),
                                        re * math.sin(theta) + im * math.cos(theta), abs_tol=1e-5)
    # a half-split (NeoX) rotation would differ: the pairing matters
    assert not torch.allclose(y[0, 3], x[0, 3], atol=1e-3)


def test_windowed_attention_matches_dense_local_mask_across_blocks() -> None:
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, 50, 4) for _ in range(3))
    ctx = 7
    i = torch.arange(50)[:, None]
    j = torch.arange(50)[None, :]
    mask = (i - j >= 0) & (i - j < ctx)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    got = windowed_attention(q, k, v, ctx, block=8)  # several query blocks
    assert torch.allclose(got, ref, atol=1e-6)
    # a plain causal (unwindowed) attention is different: the window matters
    assert not torch.allclose(F.scaled_dot_product_attention(q, k, v, is_causal=True), ref, atol=1e-3)


def test_decode_shape_and_causality(tiny_codec: CodecModel) -> None:
    rng = np.random.default_rng(3)
    codes = torch.from_numpy(rng.integers(0, 1024, (1, 10, 12)))
    a = tiny_codec.decode(codes)
    assert a.shape == (1, 2, 10 * 3840) and a.dtype == torch.float32
    changed = codes.clone()
    changed[0, 6] = (changed[0, 6] + 1) % 1024
    b = tiny_codec.decode(changed)
    # no look-ahead: frames before 6 are untouched, frame 6 onwards changes
    assert torch.equal(a[..., : 6 * 3840], b[..., : 6 * 3840])
    assert not torch.allclose(a[..., 6 * 3840 :], b[..., 6 * 3840 :])


def test_encode_length_is_floor_of_frames_and_channels_are_interleaved(tiny_codec: CodecModel) -> None:
    rng = np.random.default_rng(4)
    wav = torch.from_numpy(rng.standard_normal((1, 2, 3840 * 3 + 100)).astype(np.float32) * 0.1)
    codes = tiny_codec.encode(wav)
    assert codes.shape == (1, 3, 12) and codes.dtype == torch.int64
    # swapping L/R changes the interleaved stream, so the codes change
    swapped = tiny_codec.encode(wav.flip(1))
    assert not torch.equal(codes, swapped)


def test_deinterleave_even_samples_are_left(tiny_codec: CodecModel) -> None:
    x = torch.arange(8, dtype=torch.float32).view(1, 8, 1)
    y = tiny_codec.deinterleave(x)
    assert y.tolist() == [[[0, 2, 4, 6], [1, 3, 5, 7]]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_ffn_off_cuda_is_the_exact_gelu_ffn(dtype: torch.dtype) -> None:
    """The fused path's FFN keeps the exact GELU wherever its epilogue form does not run (CPU, any dtype; fp32
    anywhere): the same ops as the layer's plain FFN, bit for bit. On CUDA in bf16: tests/codec/test_codec_cuda.py."""
    from moss_rt.codec.modules import gelu_ffn

    g = torch.Generator().manual_seed(0)
    h, w1, w2 = (torch.randn(*s, generator=g).to(dtype) for s in ((2, 5, 16), (64, 16), (16, 64)))
    plain = F.linear(F.gelu(F.linear(h, w1)), w2)
    assert torch.equal(gelu_ffn(h, w1, w2), plain)
