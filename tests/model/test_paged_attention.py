"""The paged decode-attention kernel (moss_rt/model/paged_attention.py) against the gather path it replaces, and
with each row's key extent (what the step passes) against without it.

The same cases run on CUDA (marked ``gpu``; skipped without a GPU) and, where Triton is installed and there is
no GPU, on CPU tensors through Triton's interpreter (a subprocess: TRITON_INTERPRET is read when the kernel is
built and must not leak into the session). Without either, both skip.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from moss_rt.model.layers import grouped_attention
from tests.kernels import needs_interpreter, run_interpreted


def _cases(device: str, dtype: torch.dtype, shapes: list[tuple[int, int]]) -> list[float]:
    """Max |kernel - gather path| / max |gather path| over random pools, block layouts and masks."""
    from moss_rt.model.paged_attention import available, paged_decode_attention

    gen = torch.Generator().manual_seed(7)
    hq, hkv, dim, block = 16, 4, 64, 16
    pool_blocks = 200
    k = torch.randn(pool_blocks * block, hkv, dim, generator=gen).to(device, dtype)
    v = torch.randn(pool_blocks * block, hkv, dim, generator=gen).to(device, dtype)
    errors = []
    for batch, keys in shapes:
        q = (torch.randn(batch, hq, dim, generator=gen) * 2).to(device, dtype)
        # Each row's keys through its own shuffled block table, as SlotState.pool_index resolves them.
        table = torch.stack([torch.randperm(pool_blocks, generator=gen)[: -(-keys // block)] for _ in range(batch)])
        s = torch.arange(keys)
        positions = (table[:, s // block] * block + s % block).to(device)
        lengths = torch.randint(1, keys + 1, (batch,), generator=gen)
        mask = s[None, :] < lengths[:, None]  # a decode row: its prefix
        mask[0] = True  # a row that is not advanced: every key visible
        if batch > 2:
            mask[2] &= torch.rand(keys, generator=gen) < 0.5  # holes (a shared, partly hidden prefix)
            mask[2, 0] = True
        mask = mask.to(device)
        assert available(q)
        out = paged_decode_attention(q, k, v, positions, mask, dim**-0.5)
        read = positions[:, None, :] * hkv + torch.arange(hkv, device=device)[None, :, None]
        ref = grouped_attention(q[:, None], k.view(-1, dim)[read], v.view(-1, dim)[read], mask[:, None], dim**-0.5)
        assert out.shape == (batch, hq * dim) and out.dtype == dtype
        errors.append(((out.float() - ref[:, 0].float()).abs().max() / ref.float().abs().max()).item())
        # Each row's extent (its keys end there; row 0 is not advanced: 0) skips only masked tiles: the same values
        # to the bit, and zeros for row 0, whatever the key splits of this batch size.
        extent = lengths.to(device, torch.int32)
        extent[0] = 0
        bounded = paged_decode_attention(q, k, v, positions, mask, dim**-0.5, extent).view(batch, hq, dim)
        unbounded = out.view(batch, hq, dim)
        assert torch.equal(bounded[1:], unbounded[1:]), (batch, keys)
        assert not bounded[0].any(), (batch, keys)
    return errors


SHAPES = [(1, 1), (1, 17), (3, 64), (5, 130), (8, 1000), (64, 300)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_the_gather_path_on_cuda(dtype: torch.dtype) -> None:
    errors = _cases("cuda", dtype, SHAPES + [(128, 1000)])
    # fp32: rounding order only; bf16: the gather path rounds scores and probabilities to bf16, the kernel not.
    assert max(errors) < (1e-5 if dtype == torch.float32 else 2e-2), errors


_SCRIPT = r"""
import torch
from tests.model.test_paged_attention import _cases
torch.set_num_threads(1)
f32 = _cases("cpu", torch.float32, [(1, 1), (3, 64), (5, 130)])
bf16 = _cases("cpu", torch.bfloat16, [(1, 17), (3, 70)])
assert max(f32) < 1e-5, f32
assert max(bf16) < 2e-2, bf16
print("ok", f32, bf16)
"""


@needs_interpreter
def test_kernel_equals_the_gather_path_through_the_interpreter() -> None:
    run_interpreted(_SCRIPT, "MOSS_RT_DECODE_KERNEL", timeout=600)


def test_the_cpu_keeps_the_gather_path() -> None:
    from moss_rt.model.paged_attention import available

    if os.environ.get("MOSS_RT_DECODE_KERNEL") == "interpret":
        pytest.skip("the interpreter mode runs the kernel on CPU on purpose")
    assert not available(torch.zeros(1, 4, 64))
