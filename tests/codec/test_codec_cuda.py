"""CUDA-only checks (``make test-gpu``): graphs and bf16 on the device. Skipped without a GPU."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from moss_rt.codec import load_codec
from moss_rt.codec.streaming import StreamingDecoder

# Self-contained (no conftest fixtures) so it also runs with --noconftest on a bare GPU machine.
TINY = Path(__file__).resolve().parent.parent / "fixtures" / "codec" / "tiny"

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("attention", ["kernel", "sdpa", "matmul"])
def test_cuda_graph_streaming_equals_whole(attention: str) -> None:
    codec = load_codec(TINY, device="cuda")
    if attention == "kernel":
        from moss_rt.codec import window_attention

        assert window_attention.available(torch.device("cuda"), torch.float32, 16), "window kernel not in use"
    codes = np.random.default_rng(0).integers(0, 1024, (40, 12))
    whole = codec.decode(torch.from_numpy(codes).cuda()[None])[0].cpu().numpy()
    dec = StreamingDecoder(codec, device="cuda", dtype=torch.float32, max_streams=3, max_chunk_frames=8,
                           cuda_graphs=True, attention=attention)
    a, b = dec.new_state(), dec.new_state()
    dec.decode([a], [codes[:3]])
    pa, pb = [], []
    for k, i in enumerate(range(0, 35, 5)):
        order = [(b, codes[i : i + 5], pb), (a, codes[3 + i : 8 + i], pa)]
        if k % 2 == 0:
            order.reverse()  # alternate contiguous and gathered slot order
        outs = dec.decode([o[0] for o in order], [o[1] for o in order])
        for (_, _, acc), out in zip(order, outs, strict=True):
            acc.append(out)
    assert np.abs(np.concatenate(pa, -1) - whole[:, 3 * 3840 : 38 * 3840]).max() < 1e-5
    assert np.abs(np.concatenate(pb, -1) - whole[:, : 35 * 3840]).max() < 1e-5


def test_bf16_streaming_is_close_to_fp32() -> None:
    ref = load_codec(TINY, device="cuda")
    codes = np.random.default_rng(1).integers(0, 1024, (20, 12))
    whole = ref.decode(torch.from_numpy(codes).cuda()[None])[0].cpu().numpy()
    dec = StreamingDecoder(load_codec(TINY, device="cuda"), device="cuda", dtype=torch.bfloat16,
                           cuda_graphs=True)
    st = dec.new_state()
    got = np.concatenate([dec.decode([st], [codes[i : i + 5]])[0] for i in range(0, 20, 5)], -1)
    assert np.abs(got - whole).max() / np.abs(whole).max() < 0.1


def test_fused_kernels_match_plain_path() -> None:
    """The Triton path (RoPE + ring write, residual + LayerNorm + cast) equals the plain PyTorch ops, whole-clip
    and streamed through graphs, fp32 (the chunked == whole tests above run the fused path on both sides)."""
    from moss_rt.codec import fused

    codec = load_codec(TINY, device="cuda")
    assert fused.usable(torch.zeros(1, device="cuda")), "Triton fused kernels not in use on CUDA"
    codes = np.random.default_rng(2).integers(0, 1024, (24, 12))
    c = torch.from_numpy(codes).cuda()[None]
    with fused.disabled():
        plain = codec.decode(c)[0].cpu().numpy()
    assert np.abs(codec.decode(c)[0].cpu().numpy() - plain).max() < 1e-5
    dec = StreamingDecoder(codec, device="cuda", dtype=torch.float32, max_streams=2, max_chunk_frames=5,
                           cuda_graphs=True)
    st = dec.new_state()
    got = np.concatenate([dec.decode([st], [codes[i : i + 3]])[0] for i in range(0, 24, 3)], -1)
    assert np.abs(got - plain).max() < 1e-5


def test_ffn_epilogue_is_in_use_and_as_close_to_fp32_as_the_plain_ffn() -> None:
    """bf16 on CUDA: the FFN's GELU in the first GEMM's epilogue (tanh form, one rounding) is at least as close to an
    fp32 FFN with the exact GELU as the plain bf16 path (rounding, exact GELU, rounding), and differs from it (it is
    the path in use)."""
    from moss_rt.codec.modules import FFN_EPILOGUE_SWITCH, gelu_ffn
    from tests.kernels import kernel_switch

    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(4, 96, 768, device="cuda", generator=g)
    w1 = torch.randn(3072, 768, device="cuda", generator=g) * 768**-0.5
    w2 = torch.randn(768, 3072, device="cuda", generator=g) * 3072**-0.5
    ref = F.linear(F.gelu(F.linear(h, w1)), w2)
    bf = (h.bfloat16(), w1.bfloat16(), w2.bfloat16())
    epilogue = gelu_ffn(*bf).float()
    with kernel_switch(FFN_EPILOGUE_SWITCH, "0"):
        plain = gelu_ffn(*bf).float()
    assert epilogue.shape == plain.shape == ref.shape
    assert not torch.equal(epilogue, plain)
    err, plain_err = (epilogue - ref).abs(), (plain - ref).abs()
    assert err.mean() <= 1.02 * plain_err.mean() and err.max() <= 1.5 * plain_err.max(), (err, plain_err)


def test_bf16_streaming_with_the_ffn_epilogue_graph_equals_eager_and_stays_as_close_to_fp32() -> None:
    """The bf16 streaming decode (fused path, the FFN epilogue on): graph replays equal eager calls exactly, and
    against the fp32 whole-clip decode it is as close as the same decode with the GELU as its own kernel."""
    from moss_rt.codec.modules import FFN_EPILOGUE_SWITCH
    from tests.kernels import kernel_switch

    codes = np.random.default_rng(3).integers(0, 1024, (30, 12))
    ref = load_codec(TINY, device="cuda").decode(torch.from_numpy(codes).cuda()[None])[0].cpu().numpy()

    def streamed(graphs: bool) -> np.ndarray:
        dec = StreamingDecoder(load_codec(TINY, device="cuda"), device="cuda", dtype=torch.bfloat16,
                               max_streams=2, max_chunk_frames=5, cuda_graphs=graphs)
        a, b = dec.new_state(), dec.new_state()
        dec.decode([b], [codes[:2]])
        parts = [dec.decode([a, b], [codes[i : i + 5], codes[2 + i : 7 + i]])[0] for i in range(0, 20, 5)]
        return np.concatenate(parts, -1)

    eager, graphed = streamed(False), streamed(True)
    with kernel_switch(FFN_EPILOGUE_SWITCH, "0"):
        plain = streamed(False)
    np.testing.assert_array_equal(graphed, eager)
    assert not np.array_equal(eager, plain)
    err, plain_err = np.abs(eager - ref[:, : eager.shape[-1]]), np.abs(plain - ref[:, : plain.shape[-1]])
    assert err.mean() <= 1.1 * plain_err.mean(), (err.mean(), plain_err.mean())
    assert err.max() / np.abs(ref).max() < 0.1
