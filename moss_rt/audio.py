"""Pure PCM helpers (numpy only): float → int16, channel layout for clients, WAV bytes."""

from __future__ import annotations

import io
import wave

import numpy as np


def to_int16_pcm(audio: np.ndarray, channels: int) -> bytes:
    """Codec output float32 [2, S] in [-1, 1] → int16 little-endian bytes.

    ``channels=1``: the average of the two channels (what legacy clients expect);
    ``channels=2``: interleaved L, R.
    """
    if audio.ndim != 2 or audio.shape[0] != 2:
        raise ValueError(f"expected [2, S] audio, got {audio.shape}")
    if channels == 1:
        mixed = audio.mean(axis=0)
    elif channels == 2:
        mixed = audio.T.reshape(-1)
    else:
        raise ValueError(f"channels must be 1 or 2, got {channels}")
    scaled = np.clip(np.rint(mixed * 32767.0), -32768, 32767)
    return scaled.astype("<i2").tobytes()


def wav_bytes(pcm: bytes, sample_rate: int, channels: int) -> bytes:
    """A complete 16-bit PCM WAV file around raw int16 samples."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(pcm)
    return buf.getvalue()
