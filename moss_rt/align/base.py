"""What every aligner is: words of a text in audio → when each one is said.

An aligner is handed :class:`AlignJob` s (mono float32 audio at its own ``sample_rate``, the spoken words to find
in it, lowercase) and answers one :class:`AlignResult` per job: a time span per word, or ``None`` for a word it
could not place. It never raises for what is in the audio: noise, silence, another language or an unknown word
just leave words unplaced, and the caller fills those in (:mod:`moss_rt.align.place`).

``free_end`` is for audio that is still arriving: the words need not all be in it, and the result covers only the
words reached so far (a prefix). Jobs run on the aligner's worker threads (:class:`moss_rt.align.service.AlignService`),
never on the event loop; one call may carry several takes' jobs, which a GPU aligner runs as one batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from moss_rt.align.normalize import tokenize

# A word whose time is estimated from its neighbours (the aligner could not place it).
INTERPOLATED = "interpolated"


@dataclass(frozen=True, slots=True)
class WordTime:
    """One word of a take and when it is said, in seconds from the take's sample 0."""

    word: str  # as written, without surrounding punctuation ("Forty")
    start: float
    end: float
    flags: tuple[str, ...] = ()
    text: str = ""  # as written with its punctuation ("Forty,"); captions use it
    chars: tuple[int, int] | None = None  # offsets of ``text`` in the take's text

    def to_dict(self) -> dict[str, Any]:
        """The wire form (``words`` message, ``GET /api/takes/{id}/words``)."""
        out: dict[str, Any] = {"word": self.word, "start": round(self.start, 3), "end": round(self.end, 3)}
        if self.flags:
            out["flags"] = list(self.flags)
        return out

    def to_record(self) -> dict[str, Any]:
        """The stored form: the wire form plus what captions need."""
        out = self.to_dict()
        out["text"] = self.text or self.word
        if self.chars is not None:
            out["chars"] = list(self.chars)
        return out

    @classmethod
    def from_record(cls, obj: dict[str, Any]) -> WordTime:
        chars = obj.get("chars")
        return cls(
            word=str(obj["word"]),
            start=float(obj["start"]),
            end=float(obj["end"]),
            flags=tuple(str(f) for f in obj.get("flags", ())),
            text=str(obj.get("text") or obj["word"]),
            chars=(int(chars[0]), int(chars[1])) if isinstance(chars, list | tuple) and len(chars) == 2 else None,
        )

    def shifted(self, seconds: float) -> WordTime:
        return WordTime(self.word, self.start + seconds, self.end + seconds, self.flags, self.text, self.chars)


@dataclass(frozen=True)
class AlignJob:
    """Find ``words`` (spoken words, lowercase) in ``audio`` (mono float32 at the aligner's rate)."""

    audio: np.ndarray
    words: tuple[str, ...]
    free_end: bool = False


Span = tuple[float, float] | None


@dataclass
class AlignResult:
    """Per word, in order, its (start, end) in seconds from the job's first sample, or None if not placed.

    A fixed-end job answers one entry per word. A free-end job answers the words reached (a prefix of them); the
    last of those may still be going on at the end of the audio.
    """

    spans: list[Span] = field(default_factory=list)
    # Free end: how many of the words the path has left behind for good (their ends will not move with more
    # audio). None: all but the last word reached (an aligner that cannot tell).
    settled: int | None = None


class Aligner(Protocol):
    name: str  # "pocketsphinx", "ctc:<source>"
    sample_rate: int  # of the audio in its jobs
    device: str
    workers: int  # threads that may call align_batch at once (each its own batch)
    max_batch: int  # jobs per align_batch call
    # How long a worker holding one job waits for more to join its batch (seconds; 0: run at once). A device model
    # costs about the same per call whatever the batch (launch-bound at these sizes), so a short wait buys fewer calls.
    gather_sec: float
    demo: bool  # random weights (a test or benchmark model): its times mean nothing

    def load(self) -> None:
        """Load models (blocking; called once, on a worker thread, before the first job)."""

    def align_batch(self, jobs: Sequence[AlignJob]) -> list[AlignResult]:
        """Align several jobs (blocking). Must not raise for anything in the audio or the words."""

    def close(self) -> None:
        """Release what ``load`` started (worker processes); the service calls it once at shutdown."""


def kept_words(words: Sequence[WordTime], text: str, branch_sec: float) -> list[WordTime]:
    """The parent's words a retake from ``branch_sec`` keeps: those that end before the branch point and are the
    same words at the same place in the retake's ``text`` (a retake may change the text after them)."""
    kept: list[WordTime] = []
    for word, token in zip(words, tokenize(text), strict=False):
        if word.end > branch_sec or word.chars != (token.start, token.end) or (word.text or word.word) != token.written:
            break
        kept.append(word)
    return kept
