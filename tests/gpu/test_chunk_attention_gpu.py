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
