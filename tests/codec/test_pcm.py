"""int16 PCM made on the decoder's device (codec/pcm.py) is audio.to_int16_pcm's, bit for bit: mono and stereo in one
batch, values on rounding ties, out of range, NaN and infinities."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moss_rt.audio import to_int16_pcm
from moss_rt.codec.pcm import int16_pcm


def _audio(seed: int, samples: int = 3840) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.normal(0.0, 0.6, size=(2, samples)).astype(np.float32)  # some beyond [-1, 1]: clipped
    x[0, :8] = np.array([0.5, -0.5, 1.5, -1.5, 2.5, 3.5, -2.5, 0.0], dtype=np.float32) / 32767.0  # ties
    x[:, 8:12] = np.array([[np.nan, np.inf, -np.inf, np.inf], [0.2, 0.1, 0.3, -np.inf]], dtype=np.float32)
    return x


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy: inf + -inf
def test_batched_device_pcm_equals_the_numpy_conversion() -> None:
    audio = [_audio(s) for s in range(5)]
    channels = [1, 2, 1, 1, 2]
    got = int16_pcm([torch.from_numpy(a) for a in audio], channels)
    assert got == [to_int16_pcm(a, c) for a, c in zip(audio, channels, strict=True)]
    assert len(got[0]) == 3840 * 2 and len(got[1]) == 3840 * 2 * 2


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy: inf + -inf
def test_bf16_views_and_empty_batches() -> None:
    a = torch.from_numpy(_audio(7)).to(torch.bfloat16)
    assert int16_pcm([a], [1]) == [to_int16_pcm(a.float().numpy(), 1)]
    assert int16_pcm([], []) == []


def test_bad_channel_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="channels must be 1 or 2"):
        int16_pcm([torch.zeros(2, 4)], [3])
    with pytest.raises(ValueError, match="2 streams but 1"):
        int16_pcm([torch.zeros(2, 4), torch.zeros(2, 4)], [1])
