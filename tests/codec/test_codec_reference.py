"""Reference-voice encoding: decode, resample, channel handling, loudness, cache, errors."""

from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile as sf
import torch

from moss_rt.codec import CodecModel
from moss_rt.codec.reference import (
    InvalidAudio,
    ReferenceCache,
    decode_audio_bytes,
    encode_reference,
    loudness_normalize,
    prepare_reference,
)


def _encode_file(data: np.ndarray, sr: int, fmt: str = "WAV", subtype: str | None = None) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, data, sr, format=fmt, subtype=subtype)
    return buf.getvalue()


def _tone(seconds: float, sr: int, freq: float = 440.0, amp: float = 0.1) -> np.ndarray:
    t = np.arange(int(seconds * sr)) / sr
    return (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def _dbfs(x: np.ndarray) -> float:
    return 10 * np.log10(np.mean(np.square(x, dtype=np.float64)) + 1e-9)


@pytest.mark.parametrize("level_db, expected_gain_db", [(-20.0, 0.0), (-21.5, 1.5), (-30.0, 3.0), (-8.0, -3.0)])
def test_loudness_gain_is_clamped_to_3_db(level_db: float, expected_gain_db: float) -> None:
    x = np.random.default_rng(0).standard_normal((2, 48000)).astype(np.float32)
    x *= np.float32(10 ** (level_db / 20) / np.sqrt(np.mean(x.astype(np.float64) ** 2)))
    y = loudness_normalize(x)
    assert _dbfs(y) - _dbfs(x) == pytest.approx(expected_gain_db, abs=1e-3)
    assert y.dtype == np.float32


def test_near_silence_gets_at_most_3_db_and_stays_finite() -> None:
    x = np.full((2, 100), 1e-4, np.float32)  # -80 dBFS
    assert np.allclose(loudness_normalize(x), x * 10 ** (3 / 20), rtol=1e-6)
    assert np.isfinite(loudness_normalize(np.zeros((2, 10), np.float32))).all()


def test_mono_is_duplicated_and_resampled_to_48k() -> None:
    mono = _tone(1.0, 16000)[None]
    out = prepare_reference(mono, 16000)
    assert out.shape == (2, 48000)
    assert np.array_equal(out[0], out[1])
    # the tone survives resampling: spectral peak at 440 Hz
    spec = np.abs(np.fft.rfft(out[0]))
    assert abs(np.argmax(spec) * 48000 / out.shape[1] - 440.0) < 2.0


def test_more_than_two_channels_keep_the_first_two() -> None:
    x = np.stack([_tone(0.5, 48000, f) for f in (300.0, 500.0, 700.0, 900.0)])
    out = prepare_reference(x, 48000)
    assert out.shape == (2, 24000)
    gain = out[0, 1000] / x[0, 1000]
    assert np.allclose(out, x[:2] * gain, atol=1e-6)


def test_encode_reference_resamples_and_matches_direct_encode(tiny_codec: CodecModel) -> None:
    left, right = _tone(1.0, 24000, 220.0, 0.2), _tone(1.0, 24000, 330.0, 0.05)
    data = _encode_file(np.stack([left, right], axis=1), 24000, subtype="FLOAT")
    codes, dur = encode_reference(tiny_codec, data, cache=ReferenceCache())
    assert codes.shape == (12, 12) and codes.dtype == np.int64  # floor(1.0 s * 12.5)
    assert dur == pytest.approx(1.0)
    wav = prepare_reference(np.stack([left, right]), 24000)
    direct = tiny_codec.encode(torch.from_numpy(wav)[None], 12)[0].numpy()
    assert np.array_equal(codes, direct)


def test_cache_hits_by_content_and_is_bounded(tiny_codec: CodecModel, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = ReferenceCache(max_entries=2)
    clips = [_encode_file(_tone(0.3, 48000, f), 48000) for f in (200.0, 300.0, 400.0)]
    calls = []
    real = tiny_codec.encode
    monkeypatch.setattr(tiny_codec, "encode", lambda *a, **k: calls.append(1) or real(*a, **k))
    a1, _ = encode_reference(tiny_codec, clips[0], cache=cache)
    a2, _ = encode_reference(tiny_codec, bytes(clips[0]), cache=cache)  # same content, new object
    assert len(calls) == 1 and cache.hits == 1 and np.array_equal(a1, a2)
    a2[0, 0] = -1  # callers get copies
    assert encode_reference(tiny_codec, clips[0], cache=cache)[0][0, 0] != -1
    encode_reference(tiny_codec, clips[1], cache=cache)
    encode_reference(tiny_codec, clips[2], cache=cache)
    assert len(cache) == 2
    encode_reference(tiny_codec, clips[0], cache=cache)  # evicted (least recently used) → encoded again
    assert len(calls) == 4


def test_ogg_vorbis_upload_decodes() -> None:
    if "OGG" not in sf.available_formats():
        pytest.skip("libsndfile without OGG")
    data = _encode_file(_tone(0.5, 44100), 44100, fmt="OGG", subtype="VORBIS")
    audio, sr = decode_audio_bytes(data)
    assert sr == 44100 and audio.shape[0] == 1 and abs(audio.shape[1] - 22050) < 2048


def test_mp3_upload_decodes() -> None:
    if "MP3" not in sf.available_formats():
        pytest.skip("libsndfile without MP3")
    data = _encode_file(_tone(0.5, 48000), 48000, fmt="MP3", subtype="MPEG_LAYER_III")
    audio, sr = decode_audio_bytes(data)
    assert sr == 48000 and audio.shape[0] == 1 and abs(audio.shape[1] - 24000) < 4096


@pytest.mark.parametrize(
    "data, match",
    [
        (b"", "empty"),
        (b"this is not audio at all" * 10, "could not decode"),
        (b"RIFF\x00\x00\x00\x00WAVEfmt ", "could not decode"),
    ],
)
def test_invalid_uploads(tiny_codec: CodecModel, data: bytes, match: str) -> None:
    with pytest.raises(InvalidAudio, match=match):
        encode_reference(tiny_codec, data, cache=ReferenceCache())
    assert issubclass(InvalidAudio, ValueError)


def test_too_short_empty_and_too_long(tiny_codec: CodecModel) -> None:
    with pytest.raises(InvalidAudio, match="no samples"):
        encode_reference(tiny_codec, _encode_file(np.zeros(0, np.float32), 48000), cache=ReferenceCache())
    with pytest.raises(InvalidAudio, match="shorter than one codec frame"):
        encode_reference(tiny_codec, _encode_file(_tone(0.05, 48000), 48000), cache=ReferenceCache())
    with pytest.raises(InvalidAudio, match="limit"):
        encode_reference(tiny_codec, _encode_file(_tone(1.0, 8000), 8000), max_seconds=0.5, cache=ReferenceCache())


def test_non_finite_samples_are_refused() -> None:
    x = _tone(0.2, 48000)
    x[100] = np.nan
    with pytest.raises(InvalidAudio, match="NaN"):
        decode_audio_bytes(_encode_file(x, 48000, subtype="FLOAT"))
