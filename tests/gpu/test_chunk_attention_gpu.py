"""Prefill attention through SDPA's fused kernels on CUDA (chunk_attention): equal to the plain path for the shapes
of a batched prefill pass (GQA 32/8, head_dim 128, bf16 and fp32), causal and masked with offsets. On the CPU the
same body runs SDPA through the ``interpret`` switch."""

from __future__ import annotations

import pytest
import torch

from moss_rt.model import chunk_attention
from moss_rt.model.layers import grouped_attention
from tests.gpu.conftest import DEVICES


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_chunk_attention_equals_the_plain_path(device, dtype, monkeypatch) -> None:
    if device == "cpu":
        monkeypatch.setenv("MOSS_RT_CHUNK_SDPA", "interpret")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert chunk_attention.available(torch.zeros(1, device=device))
    g = torch.Generator(device="cpu").manual_seed(3)
    batch, tq, hq, hkv, dim = 3, 40, 32, 8, 128

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    q, k, v = rand(batch, tq, hq, dim), rand(batch, hkv, tq, dim), rand(batch, hkv, tq, dim)
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype is torch.bfloat16 else {"rtol": 1e-4, "atol": 1e-5}
    causal = torch.ones(tq, tq, dtype=torch.bool, device=device).tril()[None].expand(batch, tq, tq)
    want = grouped_attention(q, k, v, causal, dim**-0.5).float()
    got = chunk_attention.chunk_attention(q, k, v, causal, dim**-0.5, causal=True).float()
    torch.testing.assert_close(got, want, **tol)
    # a later chunk: 10 rows at offsets 30 and 5 of a 40-key window
    starts = torch.tensor([30, 5, 0], device=device)
    positions = starts[:, None] + torch.arange(10, device=device)[None, :]
    mask = torch.arange(tq, device=device)[None, None, :] <= positions[:, :, None]
    q10 = q[:, :10].contiguous()
    want = grouped_attention(q10, k, v, mask, dim**-0.5).float()
    got = chunk_attention.chunk_attention(q10, k, v, mask, dim**-0.5, causal=False).float()
    torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("device", DEVICES)
def test_packed_pieces_equal_the_plain_path_of_each_piece(device, monkeypatch) -> None:
    """chunk_attention.packed_causal_attention: on CUDA flash attention's variable-length forward (bf16), pieces with
    openings of different lengths packed end to end, each causal aligned to its last key (bottom right), GQA 32/8 read
    as it is; equal to the plain path piece by piece. On the CPU the reference path (``interpret``) runs."""
    monkeypatch.setenv("MOSS_RT_PACKED_PREFILL", "1" if device == "cuda" else "interpret")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    assert chunk_attention.packed_available(torch.zeros(1, device=device, dtype=dtype))
    g = torch.Generator(device="cpu").manual_seed(5)
    hq, hkv, dim, rows = 32, 8, 128, 48
    starts = [147, 0, 300, 5]

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    qs = [rand(rows, hq, dim) for _ in starts]
    ks = [rand(s + rows, hkv, dim) for s in starts]
    vs = [rand(s + rows, hkv, dim) for s in starts]
    cu_q = torch.arange(len(starts) + 1, dtype=torch.int32, device=device) * rows
    cu_k = torch.tensor([0, *torch.tensor([s + rows for s in starts]).cumsum(0).tolist()], dtype=torch.int32,
                        device=device)
    spare = rand(64, hkv, dim)  # a packed buffer is longer than its pieces: the tail is never read
    got = chunk_attention.packed_causal_attention(
        torch.cat(qs), torch.cat([*ks, spare]), torch.cat([*vs, spare]), cu_q, cu_k, rows, max(starts) + rows + 64,
        dim**-0.5,
    ).float()
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype is torch.bfloat16 else {"rtol": 1e-4, "atol": 1e-5}
    for i, s in enumerate(starts):
        mask = torch.arange(s + rows, device=device)[None, :] <= (s + torch.arange(rows, device=device))[:, None]
        want = grouped_attention(qs[i][None], ks[i].transpose(0, 1)[None], vs[i].transpose(0, 1)[None], mask[None],
                                 dim**-0.5).float()
        torch.testing.assert_close(got[i * rows : (i + 1) * rows].reshape(rows, -1), want[0], **tol)
