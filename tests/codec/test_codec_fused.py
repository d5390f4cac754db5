"""The fused Triton kernels on CPU through Triton's interpreter (only where Triton is installed; CI's CPU wheels
have none, and on CUDA ``test_codec_cuda.py`` covers them). Slow, so the clip is short."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TINY = Path(__file__).resolve().parent.parent / "fixtures" / "codec" / "tiny"

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("triton") is None or torch.cuda.is_available(),
        reason="needs Triton (interpreter) and no GPU",
    ),
    pytest.mark.slow,  # Triton's interpreter: started first in parallel runs
]


_SCRIPT = r"""
import numpy as np, torch
from moss_rt.codec import fused, load_codec
from moss_rt.codec.streaming import StreamingDecoder
torch.set_num_threads(1)
assert fused.usable(torch.zeros(1))
codec = load_codec(TINY)
codes = np.random.default_rng(3).integers(0, 1024, (6, 12))
c = torch.from_numpy(codes)[None]
with fused.disabled():
    plain = codec.decode(c)[0].numpy()
assert np.abs(codec.decode(c)[0].numpy() - plain).max() < 1e-5
dec = StreamingDecoder(codec, device="cpu", dtype=torch.float32, max_streams=2, max_chunk_frames=5)
a, b = dec.new_state(), dec.new_state()
dec.decode([b], [codes[:1]])
ra, rb = dec.decode([a, b], [codes[:1], codes[1:2]])  # batched, b one frame older
pa, pb = [ra, dec.decode([a], [codes[1:6]])[0]], [rb]
assert np.abs(np.concatenate(pa, -1) - plain).max() < 1e-5
assert np.abs(np.concatenate(pb, -1) - plain[:, 3840 : 2 * 3840]).max() < 1e-5
print("ok")
"""


def test_fused_interpreted_equals_plain() -> None:
    # A subprocess: Triton reads TRITON_INTERPRET when its kernels are defined, which must not leak into
    # (or depend on) the rest of the session.
    env = dict(os.environ, TRITON_INTERPRET="1", MOSS_RT_CODEC_FUSED="interpret", PYTHONPATH=os.pathsep.join(sys.path))
    script = f"TINY = {str(TINY)!r}\n" + _SCRIPT
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
