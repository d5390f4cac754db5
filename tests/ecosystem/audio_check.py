"""Decoding delivered audio back (FFmpeg through PyAV) to check its length, rate and channels."""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Decoded:
    samples: int  # per channel
    sample_rate: int
    channels: int


def decode(data: bytes, fmt: str, *, pcm_rate: int = 24000, pcm_channels: int = 1) -> Decoded:
    """What a player gets from ``data`` (raw ``pcm`` is int16 at the rate the request asked for)."""
    if fmt == "pcm":
        assert len(data) % (2 * pcm_channels) == 0, "raw PCM must hold whole samples"
        return Decoded(len(data) // (2 * pcm_channels), pcm_rate, pcm_channels)
    import av  # here, not at the top: modules that only decode pcm or wav do not need PyAV

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        samples = sum(frame.samples for frame in container.decode(stream))
        return Decoded(samples, stream.codec_context.sample_rate, stream.codec_context.channels)


def decode_samples(data: bytes, fmt: str, *, pcm_rate: int = 24000, pcm_channels: int = 1) -> np.ndarray:
    """The decoded audio as int16 [samples, channels] (``pcm_rate`` is only needed for raw pcm)."""
    if fmt == "pcm":
        return np.frombuffer(data, dtype="<i2").reshape(-1, pcm_channels)
    import av

    parts: list[np.ndarray] = []
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        resampler = av.AudioResampler(format="s16", layout=stream.codec_context.layout.name)
        for frame in container.decode(stream):
            for out in resampler.resample(frame):
                parts.append(out.to_ndarray().reshape(-1, stream.codec_context.channels))
        for out in resampler.resample(None):
            parts.append(out.to_ndarray().reshape(-1, stream.codec_context.channels))
    return np.concatenate(parts, axis=0)


def opus_input_rate(data: bytes) -> int:
    """The "input sample rate" of an Ogg Opus header (RFC 7845 §5.1); Opus itself always decodes at 48 kHz."""
    at = data.index(b"OpusHead")
    return int(struct.unpack_from("<I", data, at + 12)[0])


def assert_length(decoded: Decoded, fmt: str, expected: int) -> None:
    """Decoded length within the codec's slack (priming + one frame, ``DECODE_SLACK``) of the PCM that went in.

    ``expected`` counts samples per channel at the decoded rate.
    """
    from moss_rt.formats.encoder import DECODE_SLACK

    assert expected <= decoded.samples <= expected + DECODE_SLACK[fmt], (fmt, decoded.samples, expected)
