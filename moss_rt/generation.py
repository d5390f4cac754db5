"""What one take of generation is made of, shared by every layer: the codec's audio format and the
sampling parameters with their defaults and ranges.

Dependency-free on purpose (standard library only): the model, codec and engine own these values,
and the wire protocol, the web layer and the studio (through ``hello``) read them from here, so
each is written exactly once.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any

# --------------------------------------------------------------------------- audio format
SAMPLE_RATE = 48000  # MOSS-Audio-Tokenizer-v2 output, Hz
FRAME_SAMPLES = 3840  # samples per channel per 80 ms codec frame
N_CODEBOOKS = 12  # codes per frame (the first 12 of the codec's 32 levels)
CODEBOOK_SIZE = 1024  # codes per codebook: every code lies in [0, 1024) (the model's audio_vocab_size)
FRAME_RATE = SAMPLE_RATE / FRAME_SAMPLES  # 12.5 frames per second


def frame_at_time(time_sec: float) -> int:
    """The index of the 80 ms frame that contains the instant ``time_sec``.

    The instant is first snapped to the nearest sample, so ``frame_at_time(n * 0.08) == n`` for
    every n despite binary floating point (``int(2.32 * 12.5)`` would give 28, not 29).
    """
    return round(time_sec * SAMPLE_RATE) // FRAME_SAMPLES


class EndReason(enum.StrEnum):
    """Why a take ended (the ``reason`` of the server's ``end`` message)."""

    DONE = "done"
    CANCELLED = "cancelled"
    MAX_FRAMES = "max_frames"
    REPLACED = "replaced"
    SHUTDOWN = "shutdown"
    ERROR = "error"
    # A take fed with text (stream_text) that waited for text while the socket stayed idle for the idle timeout.
    TIMEOUT = "timeout"


# --------------------------------------------------------------------------- sampling


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-take sampling of the audio codebooks and of the text/stop head.

    The defaults are the original playground's (the upstream browser app's values).
    """

    audio_temperature: float = 1.7
    audio_top_p: float = 0.8
    audio_top_k: int = 25
    audio_repetition_penalty: float = 1.0
    text_temperature: float = 1.0
    text_top_p: float = 1.0
    text_top_k: int = 50

    def replace(self, **overrides: Any) -> SamplingParams:
        """A copy with the given fields changed; ``None`` means "keep"."""
        return dataclasses.replace(self, **{k: v for k, v in overrides.items() if v is not None})

    def to_dict(self) -> dict[str, float | int]:
        return dataclasses.asdict(self)


@dataclass(frozen=True, slots=True)
class Range:
    """The accepted values of one sampling field: ``[minimum, maximum]`` (or ``(minimum, …`` when
    ``exclusive_minimum``), of ``kind`` int or float."""

    kind: str
    minimum: float
    maximum: float
    exclusive_minimum: bool = False

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


SAMPLING_DEFAULTS: dict[str, float | int] = SamplingParams().to_dict()

SAMPLING_RANGES: dict[str, Range] = {
    "audio_temperature": Range("float", 0.0, 10.0),
    "audio_top_p": Range("float", 0.0, 1.0, exclusive_minimum=True),
    "audio_top_k": Range("int", 0, 1024),
    "audio_repetition_penalty": Range("float", 0.0, 10.0, exclusive_minimum=True),
    "text_temperature": Range("float", 0.0, 10.0),
    "text_top_p": Range("float", 0.0, 1.0, exclusive_minimum=True),
    "text_top_k": Range("int", 0, 1024),
}

MAX_SEED = 2**63 - 1

__all__ = [
    "FRAME_RATE",
    "FRAME_SAMPLES",
    "MAX_SEED",
    "N_CODEBOOKS",
    "CODEBOOK_SIZE",
    "SAMPLE_RATE",
    "SAMPLING_DEFAULTS",
    "SAMPLING_RANGES",
    "EndReason",
    "Range",
    "SamplingParams",
    "frame_at_time",
]
