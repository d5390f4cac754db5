"""Pure PCM helpers (numpy only): float → int16, channel layout for clients, WAV bytes."""

from __future__ import annotations

import io
import struct
import wave

import numpy as np

__all__ = ["to_int16_pcm", "wav_bytes", "wav_header"]


def to_int16_pcm(audio: np.ndarray, channels: int) -> bytes:
    """Codec output float32 ``[2, S]`` (nominally in [-1, 1]) → int16 little-endian bytes.

    ``channels=1``: the average of the two channels (what legacy clients expect), S samples;
    ``channels=2``: interleaved L, R, 2·S samples. Values are scaled by 32767, rounded, and clipped to
    the int16 range; NaN becomes 0 (a decoder glitch must not turn into full-scale noise).
    """
    if audio.ndim != 2 or audio.shape[0] != 2:
        raise ValueError(f"expected [2, S] audio, got {audio.shape}")
    x = audio.astype(np.float32, copy=False)
    if channels == 1:
        mixed = x.mean(axis=0)
    elif channels == 2:
        mixed = x.T.reshape(-1)
    else:
        raise ValueError(f"channels must be 1 or 2, got {channels}")
    mixed = np.nan_to_num(mixed, nan=0.0, posinf=1.0, neginf=-1.0)
    scaled = np.clip(np.rint(mixed * 32767.0), -32768, 32767)
    pcm: bytes = scaled.astype("<i2").tobytes()
    return pcm


def wav_bytes(pcm: bytes, sample_rate: int, channels: int) -> bytes:
    """A complete 16-bit PCM WAV file around raw int16 little-endian samples (interleaved if stereo)."""
    if channels not in (1, 2):
        raise ValueError(f"channels must be 1 or 2, got {channels}")
    if len(pcm) % (2 * channels):
        raise ValueError(f"{len(pcm)} PCM bytes is not a whole number of {channels}-channel int16 frames")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(pcm)
    return buf.getvalue()


def wav_header(pcm_bytes: int, sample_rate: int, channels: int) -> bytes:
    """The 44-byte header of a 16-bit PCM WAV whose data chunk holds ``pcm_bytes`` bytes.

    Lets a download send the header first and stream the samples after it (the length is known
    up front); ``wav_header(len(pcm), …) + pcm`` equals :func:`wav_bytes` byte for byte.
    """
    if channels not in (1, 2):
        raise ValueError(f"channels must be 1 or 2, got {channels}")
    if pcm_bytes % (2 * channels) or not 0 <= pcm_bytes <= 0xFFFFFFFF - 36:
        raise ValueError(f"{pcm_bytes} is not a valid PCM byte count for {channels}-channel int16 WAV")
    block_align = 2 * channels
    return (
        b"RIFF"
        + struct.pack("<I", 36 + pcm_bytes)
        + b"WAVE"
        + b"fmt "
        + struct.pack("<IHHIIHH", 16, 1, channels, sample_rate, sample_rate * block_align, block_align, 16)
        + b"data"
        + struct.pack("<I", pcm_bytes)
    )
