"""Our codec against golden outputs recorded from the upstream v2 code (docs/codec_golden.md)."""

from __future__ import annotations

import numpy as np
import torch

from bench.codec_record_golden import fixed_codes, fixed_waveform
from moss_rt.codec import CodecModel

from .conftest import GOLDEN


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_golden_inputs_are_the_recorded_ones() -> None:
    g = np.load(GOLDEN)
    assert np.array_equal(g["codes"], fixed_codes())


def test_decode_matches_upstream(tiny_codec: CodecModel) -> None:
    g = np.load(GOLDEN)
    audio = tiny_codec.decode(torch.from_numpy(g["codes"])[None])[0].numpy()
    assert audio.shape == g["audio"].shape == (2, 12 * 3840)
    assert _rel(audio, g["audio"]) < 1e-4


def test_encode_matches_upstream(tiny_codec: CodecModel) -> None:
    g = np.load(GOLDEN)
    wav = torch.from_numpy(fixed_waveform())[None]
    codes = tiny_codec.encode(wav, 12)[0].numpy()
    assert np.array_equal(codes, g["enc_codes"])
    # the pre-quantizer latent too (finer than the codes)
    x = wav
    B, _, S = x.shape
    x = torch.nn.functional.pad(x, (0, (-S) % 3840)).transpose(1, 2).reshape(B, -1, 1)
    for m in tiny_codec.encoder:
        x = m(x)
    hidden = x[0, : codes.shape[0]].numpy()
    assert _rel(hidden, g["enc_hidden"]) < 1e-4
