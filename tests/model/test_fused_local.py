"""The fused local transformer (moss_rt/model/fused_local.py) against the torch code it replaces.

Kernel by kernel (residual add + LayerNorm; RoPE + k/v buffer write + attention over positions 0..pos), a whole
multi-layer local transformer stepped through all n_vq positions, and the tiny checkpoint's greedy decode with the
fused local step equal to the torch path (``MOSS_RT_FUSED_LOCAL=0``). On CUDA (marked ``gpu``) and, where Triton is
installed and there is no GPU, on CPU tensors through Triton's interpreter (a subprocess: TRITON_INTERPRET is read
when the kernels are built and must not leak into the session).
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from moss_rt.model.config import LocalConfig
from moss_rt.model.layers import grouped_attention, rope_tables_interleaved, rotate_interleaved
from tests.kernels import HAS_TRITON, kernel_switch, needs_interpreter, run_interpreted
from tests.model.test_fused_layers import FRAMES, _rel, model_errors, model_run

N_VQ = 12


def _randomise(module: nn.Module, gen: torch.Generator) -> None:
    with torch.no_grad():
        for name, p in module.named_parameters():
            scale = 0.3 if name.endswith("weight") and p.ndim == 1 else 0.15
            base = 1.0 if name.endswith("weight") and p.ndim == 1 else 0.0
            p.copy_(torch.randn(p.shape, generator=gen) * scale + base)


def kernel_errors(device: str, dtype: torch.dtype, dims: tuple[int, ...] = (16, 80)) -> dict[str, float]:
    """Max relative error of each kernel, and of whole local steps, against the torch reference."""
    from moss_rt.model import fused_local
    from moss_rt.model.network import LocalTransformer

    gen = torch.Generator().manual_seed(5)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(device, dtype)

    errors: dict[str, float] = {}

    def note(name: str, err: float) -> None:
        errors[name] = max(errors.get(name, 0.0), err)

    for rows, hidden in ((1, 200), (5, 256)):
        norm = nn.LayerNorm(hidden, eps=1e-6).to(device, dtype)
        _randomise(norm, gen)
        x, delta = rand(rows, hidden, scale=3) + 0.5, rand(rows, hidden)
        res, out = fused_local.add_layernorm(x, delta, norm.weight, norm.bias, norm.eps)
        note("add", _rel(res, x + delta))
        note("add_layernorm", _rel(out, norm(x + delta)))
        res, out = fused_local.add_layernorm(x, None, norm.weight, norm.bias, norm.eps)
        assert res is x
        note("layernorm", _rel(out, norm(x)))

    for dim in dims:
        batch, heads = 3, 2
        embed = heads * dim
        cos_t, sin_t = rope_tables_interleaved(N_VQ, dim, 1e6, torch.device(device), dtype)
        scale = dim**-0.5
        k_buf = torch.full((batch, heads, N_VQ, dim), float("nan"), device=device, dtype=dtype)  # unread garbage
        v_buf = k_buf.clone()
        k_ref, v_ref = k_buf.clone(), v_buf.clone()
        for pos in range(N_VQ):
            qkv = rand(batch, 3 * embed, scale=2)
            out = fused_local.rope_write_attention(qkv, cos_t[pos], sin_t[pos], k_buf, v_buf, pos, heads, scale)
            q, k, v = (t.view(batch, 1, heads, dim) for t in qkv.split(embed, dim=-1))
            q = q * cos_t[pos] + rotate_interleaved(q) * sin_t[pos]
            k = k * cos_t[pos] + rotate_interleaved(k) * sin_t[pos]
            k_ref[:, :, pos], v_ref[:, :, pos] = k[:, 0], v[:, 0]
            want = grouped_attention(q, k_ref[:, :, : pos + 1], v_ref[:, :, : pos + 1], None, scale)[:, 0]
            assert out.shape == (batch, embed) and out.dtype == dtype
            note("attention", _rel(out, want))
            note("k_write", _rel(k_buf[:, :, pos], k_ref[:, :, pos]))
            assert torch.equal(v_buf[:, :, pos], v_ref[:, :, pos])  # a copy

    # Whole steps: two blocks (the residual add folded into the next block's LayerNorm), D = 80 as in the release.
    for cfg in (
        LocalConfig(n_embd=160, n_layer=2, n_head=2, n_inner=320, activation_function="gelu_new"),
        LocalConfig(n_embd=64, n_layer=1, n_head=4, n_inner=128, scale_attn_by_inverse_layer_idx=True),
    ):
        local = LocalTransformer(cfg).to(device, dtype)
        _randomise(local, gen)
        cos_t, sin_t = rope_tables_interleaved(N_VQ, cfg.head_dim, cfg.rope_base, torch.device(device), dtype)
        bufs = {m: local.new_buffers(2, N_VQ, torch.device(device), dtype) for m in ("1", "0")}
        for pos in range(N_VQ):
            x = rand(2, cfg.n_embd, scale=2)
            outs = {}
            for m in ("1", "0"):
                mode = os.environ.get("MOSS_RT_FUSED_LOCAL", "1") if m == "1" else "0"
                with kernel_switch("MOSS_RT_FUSED_LOCAL", mode):
                    assert fused_local.available(x) == (m == "1")
                    outs[m] = local.step(x, cos_t[pos], sin_t[pos], bufs[m], pos)
            note("step", _rel(outs["1"], outs["0"]))
            for a, b in zip(bufs["1"], bufs["0"], strict=True):
                note("step_buffers", _rel(a[:, :, : pos + 1], b[:, :, : pos + 1]))
    return errors


def local_model_errors(device: str, fused_mode: str, frames: int = FRAMES, **options: object) -> float:
    """The tiny checkpoint's prefill + ``frames`` greedy frames with the fused local step vs the torch one (backbone:
    torch). Every frame runs the local step through all n_vq positions: a few frames exercise all of it."""
    from moss_rt.model import fused_local

    with kernel_switch("MOSS_RT_FUSED_LOCAL", fused_mode):
        assert fused_local.available(torch.zeros(1, device=device))
        fused = model_run(device, "0", frames, **options)
    with kernel_switch("MOSS_RT_FUSED_LOCAL", "0"):
        plain = model_run(device, "0", frames, **({"use_cuda_graphs": False} if device == "cuda" else {}))
    return model_errors(fused, plain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
def test_local_kernels_equal_the_torch_reference_on_cuda(dtype: torch.dtype) -> None:
    errors = kernel_errors("cuda", dtype)
    # fp32: summation order only; bf16: that can flip one rounding of a bf16 value, which the steps compound.
    assert max(errors.values()) < (1e-5 if dtype == torch.float32 else 5e-2), errors


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
def test_fused_local_model_equals_the_torch_path_on_cuda() -> None:
    # Fused local through CUDA graphs vs the torch local step eager: the same greedy codes and caches.
    assert local_model_errors("cuda", "1", use_cuda_graphs=True) < 1e-4


_SCRIPT = r"""
import torch
from tests.model.test_fused_local import kernel_errors, local_model_errors
torch.set_num_threads(1)
f32 = kernel_errors("cpu", torch.float32)
bf16 = kernel_errors("cpu", torch.bfloat16, dims=(80,))
assert max(f32.values()) < 1e-5, f32
assert max(bf16.values()) < 6e-2, bf16  # the interpreter rounds bf16 casts toward zero: a few ulp compound
err = local_model_errors("cpu", "interpret", frames=8)  # every frame steps all 12 positions (24 on CUDA)
assert err < 1e-5, err
print("ok", f32, bf16, err)
"""


@needs_interpreter
def test_fused_local_kernels_and_model_equal_the_torch_path_through_the_interpreter() -> None:
    run_interpreted(_SCRIPT, "MOSS_RT_FUSED_LOCAL")


def test_the_cpu_and_the_switch_keep_the_torch_local_path() -> None:
    from moss_rt.model import fused_local

    if os.environ.get("MOSS_RT_FUSED_LOCAL") == "interpret":
        pytest.skip("the interpreter mode runs the kernels on CPU on purpose")
    assert not fused_local.available(torch.zeros(1))
    with kernel_switch("MOSS_RT_FUSED_LOCAL", "0"):
        assert not fused_local.available(torch.zeros(1))

