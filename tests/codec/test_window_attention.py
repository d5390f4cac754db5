"""The varlen windowed-attention kernel (moss_rt/codec/window_attention.py) against masked SDPA over each stream's
whole key history, built independently of the ring arithmetic.

The same cases run on CUDA (marked ``gpu``; skipped without a GPU) and, where Triton is installed and there is no
GPU, on CPU tensors through Triton's interpreter (a subprocess: TRITON_INTERPRET is read when the kernel is built
and must not leak into the session).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from tests.kernels import needs_interpreter, run_interpreted

# (tokens per frame, window in tokens, block tokens, ring blocks, key tile) geometries: the second has windows
# longer than one key tile (several tiles and splits) and blocks that do not divide the tile; in the third the tile
# divides the block (one table read a tile), with tiles inside every query's window (no mask) between edge tiles.
GEOMETRIES = [(4, 37, 8, 9, None), (1, 150, 7, 23, None), (4, 37, 16, 5, 16)]


def _case(device: str, dtype: torch.dtype, tpf: int, context: int, block: int, ring_blocks: int, frames: int,
          paged: bool, splits: int | None, gen: torch.Generator, block_n: int | None = None,
          fp8: bool = False) -> float:
    """Max |kernel - reference| / max |reference| for streams of several ages decoding a chunk of ``frames`` frames:
    fresh, young, a window nearly full, and rings wrapped several times. ``fp8``: the pools hold fp8 keys and values
    with a scale per (key, head) (kv_quant.py) and the reference attends over the dequantized history."""
    from moss_rt.codec import kv_quant
    from moss_rt.codec.window_attention import Tiles, block_rows, window_attention

    ages = [0, 3, context // tpf - 2, 3 * block * ring_blocks // tpf + 1]  # frames decoded before the chunk
    B, H, D = len(ages), 2, 16
    tq = frames * tpf
    assert block * ring_blocks >= context + tq - 1
    rows = B + 3
    slots = torch.randperm(rows, generator=gen)[:B]  # out of order, with gaps
    if paged:
        n_blocks = rows * ring_blocks
        table = torch.randperm(n_blocks, generator=gen)[: rows * ring_blocks].view(rows, ring_blocks)
        k_pool = torch.randn(n_blocks, H, block, D, generator=gen)  # stale keys of earlier streams
        ring = (block, ring_blocks)
    else:  # one ring per slot: [rows, H, ring, D], a "block" is the whole ring
        table = torch.arange(rows)[:, None]
        k_pool = torch.randn(rows, H, block * ring_blocks, D, generator=gen)
        ring = (block * ring_blocks, 1)
    v_pool = torch.randn(k_pool.shape, generator=gen)
    kq_pool, ks_pool = kv_quant.quantize(k_pool)
    vq_pool, vs_pool = kv_quant.quantize(v_pool)
    q = torch.randn(B, H, tq, D, generator=gen) * 2
    ref = torch.empty_like(q)
    for b, age in enumerate(ages):
        n = age * tpf + tq  # positions written once the chunk is stored
        keys, vals = torch.randn(H, n, D, generator=gen), torch.randn(H, n, D, generator=gen)
        (kq, ks), (vq, vs) = kv_quant.quantize(keys), kv_quant.quantize(vals)
        if fp8:
            keys, vals = kv_quant.dequantize(kq, ks, torch.float32), kv_quant.dequantize(vq, vs, torch.float32)
        for p in range(n):  # write the history through the table, oldest first (later entries overwrite)
            blk = table[slots[b], (p // ring[0]) % ring[1]]
            k_pool[blk, :, p % ring[0]] = keys[:, p]
            v_pool[blk, :, p % ring[0]] = vals[:, p]
            kq_pool[blk, :, p % ring[0]], ks_pool[blk, :, p % ring[0]] = kq[:, p], ks[:, p]
            vq_pool[blk, :, p % ring[0]], vs_pool[blk, :, p % ring[0]] = vq[:, p], vs[:, p]
        qp = age * tpf + torch.arange(tq)[:, None]
        kp = torch.arange(n)[None, :]
        seen = (qp - kp >= 0) & (qp - kp < context)
        ref[b] = F.scaled_dot_product_attention(q[b], keys, vals, attn_mask=seen)
    dev = torch.device(device)
    # Queries in the fused path's layout: a transposed view of [B, Tq, H, D].
    qd = q.transpose(1, 2).contiguous().transpose(1, 2).to(dev, dtype)
    if fp8:
        pools = {"k_pool": kq_pool.to(dev), "v_pool": vq_pool.to(dev), "k_scale": ks_pool.to(dev),
                 "v_scale": vs_pool.to(dev)}
    else:
        pools = {"k_pool": k_pool.to(dev, dtype), "v_pool": v_pool.to(dev, dtype)}
    out = window_attention(
        qd, table=table.to(dev, torch.int32), slots=slots.to(dev),
        offs=torch.tensor(ages, device=dev), tokens_per_frame=tpf, context=context, block=ring[0],
        ring_blocks=ring[1], scale=D**-0.5, splits=splits, tiles=Tiles(block_rows(tq), block_n) if block_n else None,
        **pools,
    )
    assert out.shape == q.shape and out.dtype == dtype
    return ((out.float().cpu() - ref).abs().max() / ref.abs().max()).item()


def cases(device: str, dtype: torch.dtype, frames: tuple[int, ...] = (1, 5, 8), fp8: bool = False,
          splits_list: tuple[int | None, ...] = (None, 3)) -> list[float]:
    gen = torch.Generator().manual_seed(11)
    errors = []
    for tpf, context, block, ring_blocks, block_n in GEOMETRIES:
        for t in frames:
            for paged in (False, True):
                for splits in splits_list:
                    errors.append(
                        _case(device, dtype, tpf, context, block, ring_blocks, t, paged, splits, gen, block_n, fp8)
                    )
    return errors


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_masked_sdpa_on_cuda(dtype: torch.dtype) -> None:
    errors = cases("cuda", dtype)
    assert max(errors) < (1e-5 if dtype == torch.float32 else 2e-2), errors


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_over_fp8_pools_equals_sdpa_over_their_dequantized_keys_on_cuda(dtype: torch.dtype) -> None:
    errors = cases("cuda", dtype, fp8=True)
    assert max(errors) < (1e-5 if dtype == torch.float32 else 2e-2), errors


_FP8_SCRIPT = r"""
import torch
from tests.codec.test_window_attention import cases
torch.set_num_threads(1)
f32 = cases("cpu", torch.float32, frames=(5,), fp8=True)
bf16 = cases("cpu", torch.bfloat16, frames=(5,), fp8=True, splits_list=(3,))
assert max(f32) < 1e-5, f32
assert max(bf16) < 2e-2, bf16
print("ok", max(f32), max(bf16))
"""


@needs_interpreter
def test_kernel_over_fp8_pools_equals_sdpa_over_their_dequantized_keys_through_the_interpreter() -> None:
    """fp8 pools with their per-(key, head) scales: the kernel equals SDPA over the dequantized keys and values
    (every geometry: unaligned and aligned tiles, masked and whole tiles, split and not)."""
    run_interpreted(_FP8_SCRIPT, "MOSS_RT_CODEC_KERNEL")


_SCRIPT = r"""
import torch
from tests.codec.test_window_attention import cases
torch.set_num_threads(1)
f32 = cases("cpu", torch.float32)
bf16 = cases("cpu", torch.bfloat16, frames=(1, 8))
assert max(f32) < 1e-5, f32
assert max(bf16) < 2e-2, bf16
print("ok", max(f32), max(bf16))
"""


@needs_interpreter
def test_kernel_equals_masked_sdpa_through_the_interpreter() -> None:
    run_interpreted(_SCRIPT, "MOSS_RT_CODEC_KERNEL")


_STREAMING = r"""
import numpy as np, torch
from moss_rt.codec import load_codec, window_attention
from moss_rt.codec.streaming import StreamingDecoder
torch.set_num_threads(1)
codec = load_codec(TINY)
assert window_attention.available(torch.device("cpu"), torch.float32, 16)
n = 72  # many times past every ring (about 10 frames with these 0.16 s windows)
codes = np.random.default_rng(5).integers(0, 1024, (n, 12))
whole = codec.decode(torch.from_numpy(codes)[None])[0].numpy()
dec = StreamingDecoder(codec, device="cpu", dtype=torch.float32, max_streams=4, max_chunk_frames=8)
worst = 0.0
for size, upto in ((1, 24), (5, n), (8, n)):  # one-frame chunks past the later stages' rings only (time)
    st = dec.new_state()
    parts = [dec.decode([st], [codes[i : min(upto, i + size)]])[0] for i in range(0, upto, size)]
    st.close()
    worst = max(worst, float(np.abs(np.concatenate(parts, -1) - whole[:, : upto * 3840]).max()))
# three streams at different ages in one call each time, slots out of order (2, 0, 3 after a gap)
held = [dec.new_state() for _ in range(4)]
held[1].close()
a, b, c = held[2], held[0], held[3]
dec.decode([b], [codes[:3]])
dec.decode([c], [codes[:11]])
pa, pb, pc = [], [dec.decode([b], [codes[3:5]])[0]], []
for i in range(0, 40, 5):
    ra, rb, rc = dec.decode([a, b, c], [codes[i : i + 5], codes[5 + i : 10 + i], codes[11 + i : 16 + i]])
    pa.append(ra); pb.append(rb); pc.append(rc)
worst = max(worst, float(np.abs(np.concatenate(pa, -1) - whole[:, : 40 * 3840]).max()))
worst = max(worst, float(np.abs(np.concatenate(pb, -1) - whole[:, 3 * 3840 : 45 * 3840]).max()))
worst = max(worst, float(np.abs(np.concatenate(pc, -1) - whole[:, 11 * 3840 : 51 * 3840]).max()))
assert worst < 1e-5, worst
print("ok", worst)
"""


@needs_interpreter
def test_streaming_through_the_kernel_equals_whole_clip() -> None:
    """The tiny codec streamed through the kernel, interpreted on CPU (the fused elementwise kernels are off: their
    interpreted per-token programs would take minutes): chunks of 1, 5 and 8
    frames past every ring, and three streams of different ages batched with their slots out of order."""
    from pathlib import Path

    tiny = Path(__file__).resolve().parent.parent / "fixtures" / "codec" / "tiny"
    run_interpreted(f"TINY = {str(tiny)!r}\n" + _STREAMING, "MOSS_RT_CODEC_KERNEL", MOSS_RT_CODEC_FUSED="0")
