"""The audio formats a take can be delivered in: names, sample rates, media types (sans-I/O).

Every transport (``/v1/audio/speech``, take downloads, the WebSocket ``start``) accepts the same
names, so they are validated here once and refused with the protocol's ``invalid_field`` error.
"""

from __future__ import annotations

from dataclasses import dataclass

from moss_rt.protocol import AUDIO_FORMATS, AUDIO_SAMPLE_RATES, SAMPLE_RATE, ErrorCode, ProtocolError

# OpenAI's response_format names (the wire vocabulary lives in the protocol). ``pcm`` is raw int16
# little-endian, interleaved when stereo.
FORMATS: tuple[str, ...] = AUDIO_FORMATS
DEFAULT_FORMAT = "mp3"
# The codec's own rate, and the two rates speech pipelines usually want (soxr resamples).
SAMPLE_RATES: tuple[int, ...] = AUDIO_SAMPLE_RATES
# Tempo changes the encoders can make (OpenAI's ``speed`` range): FFmpeg's atempo, pitch kept.
MIN_SPEED = 0.25
MAX_SPEED = 4.0

_MEDIA_TYPES = {
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",  # Opus in an Ogg container (RFC 7845), as OpenAI delivers it
    "aac": "audio/aac",  # AAC-LC in ADTS frames: streamable, no container index needed
    "flac": "audio/flac",
    "wav": "audio/wav",
    "pcm": "audio/pcm",
}
_EXTENSIONS = {"mp3": "mp3", "opus": "opus", "aac": "aac", "flac": "flac", "wav": "wav", "pcm": "pcm"}


@dataclass(frozen=True, slots=True)
class AudioFormat:
    """A delivery format: ``name`` from :data:`FORMATS` at ``sample_rate`` Hz.

    The channel count is the take's own (1 or 2); a format does not remix.
    """

    name: str = DEFAULT_FORMAT
    sample_rate: int = SAMPLE_RATE

    @property
    def media_type(self) -> str:
        return _MEDIA_TYPES[self.name]

    @property
    def extension(self) -> str:
        return _EXTENSIONS[self.name]

    @property
    def is_raw_pcm(self) -> bool:
        return self.name == "pcm"

    def to_dict(self) -> dict[str, object]:
        return {"format": self.name, "sample_rate": self.sample_rate}


def parse_audio_format(
    name: object,
    sample_rate: object = None,
    *,
    default_rate: int = SAMPLE_RATE,
    name_field: str = "format",
    rate_field: str = "sample_rate",
) -> AudioFormat:
    """Validate a format name and an optional sample rate (``None`` → ``default_rate``).

    ``name_field``/``rate_field`` name the fields in errors (``response_format`` on /v1).
    """
    if not isinstance(name, str) or name.lower() not in FORMATS:
        shown = name if isinstance(name, str) else type(name).__name__
        raise ProtocolError(
            ErrorCode.INVALID_FIELD,
            f"{name_field!r} must be one of {list(FORMATS)}, got {str(shown)[:40]!r}",
            field=name_field,
        )
    rate = default_rate if sample_rate is None else sample_rate
    # Query strings carry numbers as text; ASCII digits only ("²".isdigit() is true, int("²") raises).
    if isinstance(rate, str) and rate.isascii() and rate.isdigit() and len(rate) <= 9:
        rate = int(rate)
    if isinstance(rate, float) and rate.is_integer():
        rate = int(rate)
    if isinstance(rate, bool) or not isinstance(rate, int) or rate not in SAMPLE_RATES:
        raise ProtocolError(
            ErrorCode.INVALID_FIELD,
            f"{rate_field!r} must be one of {list(SAMPLE_RATES)}, got {str(rate)[:20]!r}",
            field=rate_field,
        )
    return AudioFormat(name.lower(), rate)
