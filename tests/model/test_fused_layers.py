"""The fused backbone (moss_rt/model/fused_layers.py) against the torch layer code it replaces.

Kernel by kernel (add + RMSNorm, q/k norm + RoPE + paged cache write, SiLU * up) and as a whole model: a batched
prefill and a few dozen greedy decode steps of the tiny checkpoint with the fused path equal the torch path
(``MOSS_RT_FUSED_BACKBONE=0``). The checks run on CUDA (marked ``gpu``; skipped without a GPU) and, where Triton
is installed and there is no GPU, on CPU tensors through Triton's interpreter (a subprocess: TRITON_INTERPRET is
read when the kernels are built and must not leak into the session). Without either, both skip.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from moss_rt.generation import SamplingParams
from moss_rt.model.layers import RMSNorm, rotate_half_split
from tests.kernels import HAS_TRITON, kernel_switch, needs_interpreter, run_interpreted

GREEDY = SamplingParams(audio_temperature=0.0, text_temperature=0.0)
FRAMES = 24


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30)).item()


def kernel_errors(device: str, dtype: torch.dtype, dims: tuple[int, ...] = (24, 128)) -> dict[str, float]:
    """Max relative error of each kernel against the torch reference over a few shapes."""
    from moss_rt.model import fused_layers

    gen = torch.Generator().manual_seed(3)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(device, dtype)

    errors: dict[str, float] = {}

    def note(name: str, err: float) -> None:
        errors[name] = max(errors.get(name, 0.0), err)

    for rows, hidden in ((1, 200), (7, 256)):
        norm = RMSNorm(hidden, 1e-6).to(device, dtype)
        norm.weight.data = rand(hidden, scale=0.5) + 1
        x, delta = rand(rows, hidden, scale=3), rand(rows, hidden)
        res, out = fused_layers.add_rmsnorm(x, delta, norm.weight, norm.eps)
        note("add", _rel(res, x + delta))
        note("add_rmsnorm", _rel(out, norm(x + delta)))
        res, out = fused_layers.add_rmsnorm(x, None, norm.weight, norm.eps)
        assert res is x
        note("rmsnorm", _rel(out, norm(x)))

    for dim in dims:
        heads, kv_heads, rows, pool = 4, 2, 5, 40
        q_norm, k_norm = RMSNorm(dim, 1e-6).to(device, dtype), RMSNorm(dim, 1e-6).to(device, dtype)
        q_norm.weight.data, k_norm.weight.data = rand(dim, scale=0.3) + 1, rand(dim, scale=0.3) + 1
        qkv = rand(rows, (heads + 2 * kv_heads) * dim, scale=2)
        angles = torch.rand(rows, dim // 2, generator=gen) * 50
        cos, sin = torch.cat([angles, angles], -1).cos().to(device, dtype), torch.cat([angles, angles], -1).sin().to(
            device, dtype
        )
        write = torch.randperm(pool, generator=gen)[:rows].to(device)
        k_cache = torch.zeros(pool, kv_heads, dim, device=device, dtype=dtype)
        v_cache = torch.zeros_like(k_cache)
        q = fused_layers.qk_norm_rope_write(
            qkv, cos, sin, q_norm.weight, k_norm.weight, 1e-6, write, k_cache, v_cache, heads, kv_heads
        )
        q_ref, k_ref, v_ref = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        q_ref = q_norm(q_ref.reshape(rows, heads, dim))
        k_ref = k_norm(k_ref.reshape(rows, kv_heads, dim))
        c, s = cos[:, None], sin[:, None]
        q_ref = q_ref * c + rotate_half_split(q_ref) * s
        k_ref = k_ref * c + rotate_half_split(k_ref) * s
        k_want, v_want = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
        k_want[write], v_want[write] = k_ref, v_ref.reshape(rows, kv_heads, dim)
        assert q.shape == (rows, heads, dim) and q.dtype == dtype
        note("q_rope", _rel(q, q_ref))
        note("k_rope_write", _rel(k_cache, k_want))
        assert torch.equal(v_cache, v_want)  # a copy

    for rows, inner in ((1, 300), (3, 2500)):
        gate_up = rand(rows, 2 * inner, scale=3)
        out = fused_layers.silu_mul(gate_up)
        note("silu_mul", _rel(out, F.silu(gate_up[:, :inner]) * gate_up[:, inner:]))
    return errors


def model_run(
    device: str, mode: str, frames: int = FRAMES, prompt_rows: int | None = None, **options: object
) -> dict[str, object]:
    """Tiny checkpoint fp32: a batched prefill of two prompts (one pass, T > 1), then ``frames`` greedy steps of
    both slots (T == 1). Returns codes [2,frames,12] and each slot's cache (keys, values, hidden).

    ``prompt_rows``: prefill only the last rows of each prompt (the longer one this many, the other fewer). Through
    Triton's interpreter every row of the prefill is one program per kernel and layer: whole prompts (hundreds of
    rows) cost seconds there and check no code path a few dozen rows do not."""
    from moss_rt.model import ModelRunner, fused_layers, load_model
    from moss_rt.model.runner import PrefillRequest
    from tests.model.conftest import TINY

    loaded = load_model(TINY, device=device, dtype=torch.float32)
    with kernel_switch("MOSS_RT_FUSED_BACKBONE", mode):
        assert fused_layers.available(torch.zeros(1, device=device)) == (mode != "0")
        runner = ModelRunner(
            loaded.model, loaded.tokenizer, loaded.config, max_slots=2, max_seq_len=192, device=device,
            dtype=torch.float32, **options,  # type: ignore[arg-type]
        )
        prompts = [
            runner.build_prompt(text="The night is long.", instruction="Whisper."),
            runner.build_prompt(text="Hi.", instruction=""),
        ]
        if prompt_rows is not None:
            prompts = [prompts[0][-prompt_rows:], prompts[1][-(prompt_rows // 2 + 3) :]]
        slots = [runner.alloc_slot() for _ in prompts]
        assert runner.prefill_batch([PrefillRequest(s, p) for s, p in zip(slots, prompts, strict=True)]) == 1
        prefill_cache = [runner.slot_cache(s, runner.slot_length(s)) for s in slots]
        codes = []
        for s in slots:
            runner.set_sampling(s, GREEDY, seed=0)
        for _ in range(frames):
            result = runner.step(slots)
            assert not result.stop.any()
            codes.append(result.codes)
        cache = [runner.slot_cache(s, runner.slot_length(s)) for s in slots]
    return {"codes": np.stack(codes, axis=1), "prefill": prefill_cache, "cache": cache}


def model_errors(fused: dict[str, object], plain: dict[str, object]) -> float:
    np.testing.assert_array_equal(fused["codes"], plain["codes"])
    err = 0.0
    for key in ("prefill", "cache"):
        for a, b in zip(fused[key], plain[key], strict=True):  # type: ignore[call-overload]
            for x, y in zip(a, b, strict=True):
                assert x.shape == y.shape
                err = max(err, _rel(x, y))
    return err


GPU = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not HAS_TRITON, reason="needs Triton"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
def test_kernels_equal_the_torch_reference_on_cuda(dtype: torch.dtype) -> None:
    errors = kernel_errors("cuda", dtype)
    # fp32: the order of the sum of squares only; bf16: that can flip one rounding of a bf16 value (~4e-3).
    assert max(errors.values()) < (1e-5 if dtype == torch.float32 else 1.6e-2), errors


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
def test_fused_model_equals_the_torch_path_on_cuda() -> None:
    # Fused through CUDA graphs vs the torch backbone eager: the prefill, every decode step and the greedy codes.
    fused = model_run("cuda", "1", use_cuda_graphs=True)
    plain = model_run("cuda", "0", use_cuda_graphs=False)
    assert model_errors(fused, plain) < 1e-4


_SCRIPT = r"""
import torch
from tests.model.test_fused_layers import kernel_errors, model_errors, model_run
torch.set_num_threads(1)
f32 = kernel_errors("cpu", torch.float32)
bf16 = kernel_errors("cpu", torch.bfloat16, dims=(24,))
assert max(f32.values()) < 1e-5, f32
assert max(bf16.values()) < 3e-2, bf16  # the interpreter rounds bf16 casts toward zero: a few ulp compound
err = model_errors(model_run("cpu", "interpret", prompt_rows=40), model_run("cpu", "0", prompt_rows=40))
assert err < 1e-5, err
print("ok", f32, bf16, err)
"""


@needs_interpreter
def test_fused_kernels_and_model_equal_the_torch_path_through_the_interpreter() -> None:
    run_interpreted(_SCRIPT, "MOSS_RT_FUSED_BACKBONE")


def test_the_cpu_and_the_switch_keep_the_torch_path() -> None:
    from moss_rt.model import fused_layers

    if os.environ.get("MOSS_RT_FUSED_BACKBONE") == "interpret":
        pytest.skip("the interpreter mode runs the kernels on CPU on purpose")
    assert not fused_layers.available(torch.zeros(1))
    with kernel_switch("MOSS_RT_FUSED_BACKBONE", "0"):
        assert not fused_layers.available(torch.zeros(1))
