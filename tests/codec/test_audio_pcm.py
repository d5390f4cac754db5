"""moss_rt.audio: int16 conversion, mono mix, stereo interleave, clipping, WAV bytes."""

from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile as sf

from moss_rt.audio import to_int16_pcm, wav_bytes


def _i16(b: bytes) -> np.ndarray:
    return np.frombuffer(b, dtype="<i2")


def test_stereo_is_interleaved_left_right() -> None:
    a = np.array([[0.5, -0.25, 0.0], [0.1, 0.2, -1.0]], np.float32)
    out = _i16(to_int16_pcm(a, 2))
    assert out.tolist() == [16384, 3277, -8192, 6553, 0, -32767]


def test_mono_is_the_average_of_both_channels() -> None:
    a = np.array([[0.5, 1.0], [0.0, -1.0]], np.float32)
    assert _i16(to_int16_pcm(a, 1)).tolist() == [8192, 0]


def test_clipping_and_non_finite() -> None:
    a = np.array([[2.0, -3.0, np.nan, np.inf], [2.0, -3.0, np.nan, -np.inf]], np.float32)
    assert _i16(to_int16_pcm(a, 2)).tolist() == [32767, 32767, -32768, -32768, 0, 0, 32767, -32767]


def test_bad_shapes_and_channels() -> None:
    with pytest.raises(ValueError):
        to_int16_pcm(np.zeros((1, 4), np.float32), 1)
    with pytest.raises(ValueError):
        to_int16_pcm(np.zeros((2, 4), np.float32), 3)
    with pytest.raises(ValueError):
        wav_bytes(b"\x00\x00\x00", 48000, 1)


@pytest.mark.parametrize("channels", [1, 2])
def test_wav_roundtrip(channels: int) -> None:
    rng = np.random.default_rng(0)
    a = (rng.random((2, 480)) * 1.8 - 0.9).astype(np.float32)
    pcm = to_int16_pcm(a, channels)
    data = wav_bytes(pcm, 48000, channels)
    assert data[:4] == b"RIFF" and data[8:12] == b"WAVE"
    back, sr = sf.read(io.BytesIO(data), dtype="int16", always_2d=True)
    assert sr == 48000 and back.shape == (480, channels)
    assert np.array_equal(back.reshape(-1), _i16(pcm))
