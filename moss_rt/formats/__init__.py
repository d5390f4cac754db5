"""Audio formats for clients: what a take's audio can be delivered as, and the encoders that make it.

``spec`` names the formats and sample rates (pure, no I/O; re-exported here); ``encoder`` turns
the service's 48 kHz int16 PCM, chunk by chunk as a take streams, into a format's bytes (soxr to
resample, FFmpeg's encoders and muxers through PyAV). The encoder is imported from
``moss_rt.formats.encoder`` explicitly, so that validating a format name never loads FFmpeg.
"""

from moss_rt.formats.spec import (
    DEFAULT_FORMAT,
    FORMATS,
    MAX_SPEED,
    MIN_SPEED,
    SAMPLE_RATES,
    AudioFormat,
    parse_audio_format,
)

__all__ = [
    "DEFAULT_FORMAT",
    "FORMATS",
    "MAX_SPEED",
    "MIN_SPEED",
    "SAMPLE_RATES",
    "AudioFormat",
    "parse_audio_format",
]
