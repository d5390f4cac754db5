"""Captions from a take's words: readable cues as SubRip (``.srt``) and WebVTT (``.vtt``).

Cues follow common subtitle practice: at most two lines of ``MAX_LINE_CHARS`` characters, at most ``MAX_CUE_SEC``
on screen, a new cue after a sentence ends or at a pause of ``PAUSE_SEC``, a break after a comma once a cue is a
line long. A cue stays up at least ``MIN_CUE_SEC`` when the next one leaves room. The words keep the text's own
punctuation (``WordTime.text``). Pure Python.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from moss_rt.align.base import WordTime

MAX_LINE_CHARS = 42
MAX_LINES = 2
MAX_CUE_SEC = 6.0
MIN_CUE_SEC = 0.8
PAUSE_SEC = 0.7
SENTENCE_END = (".", "!", "?", "…", "。", "！", "？")
CLAUSE_END = (",", ";", ":", "—", "–", "，", "、")
_CLOSERS = "\"'”’)]»"


@dataclass(frozen=True)
class Cue:
    start: float
    end: float
    lines: tuple[str, ...]


def _text(word: WordTime) -> str:
    return word.text or word.word


def _ends(word: WordTime, marks: tuple[str, ...]) -> bool:
    return _text(word).rstrip(_CLOSERS).endswith(marks)


def _lines(texts: Sequence[str]) -> tuple[str, ...]:
    """Words into at most two lines, the break where the two come out most even (within the line length)."""
    whole = " ".join(texts)
    if len(whole) <= MAX_LINE_CHARS or len(texts) < 2:
        return (whole,)
    best = min(
        range(1, len(texts)),
        key=lambda k: max(len(" ".join(texts[:k])), len(" ".join(texts[k:]))),
    )
    return (" ".join(texts[:best]), " ".join(texts[best:]))


def group_cues(words: Sequence[WordTime]) -> list[Cue]:
    """The words grouped into cues, in order."""
    groups: list[list[WordTime]] = []
    current: list[WordTime] = []
    for word in words:
        if current:
            lines = _lines([_text(w) for w in [*current, word]])
            too_long = any(len(line) > MAX_LINE_CHARS for line in lines) or word.end - current[0].start > MAX_CUE_SEC
            pause = word.start - current[-1].end >= PAUSE_SEC
            after_clause = _ends(current[-1], CLAUSE_END) and len(" ".join(_text(w) for w in current)) >= MAX_LINE_CHARS
            if too_long or pause or after_clause or _ends(current[-1], SENTENCE_END):
                groups.append(current)
                current = []
        current.append(word)
    if current:
        groups.append(current)
    cues: list[Cue] = []
    for i, group in enumerate(groups):
        start, end = group[0].start, group[-1].end
        if end - start < MIN_CUE_SEC:
            limit = groups[i + 1][0].start if i + 1 < len(groups) else end + MIN_CUE_SEC
            end = max(end, min(start + MIN_CUE_SEC, limit))
        cues.append(Cue(start, end, _lines([_text(w) for w in group])))
    return cues


def _stamp(seconds: float, sep: str) -> str:
    ms = max(0, int(round(seconds * 1000)))
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    secs, ms = divmod(ms, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{sep}{ms:03d}"


def to_srt(words: Sequence[WordTime]) -> str:
    """SubRip: numbered cues, ``HH:MM:SS,mmm --> HH:MM:SS,mmm``."""
    blocks = [
        f"{n}\n{_stamp(c.start, ',')} --> {_stamp(c.end, ',')}\n" + "\n".join(c.lines)
        for n, c in enumerate(group_cues(words), start=1)
    ]
    return "\n\n".join(blocks) + ("\n" if blocks else "")


def to_vtt(words: Sequence[WordTime]) -> str:
    """WebVTT: the ``WEBVTT`` header, then cues ``HH:MM:SS.mmm --> HH:MM:SS.mmm`` (text escaped)."""
    blocks = ["WEBVTT"]
    for c in group_cues(words):
        text = "\n".join(line.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;") for line in c.lines)
        blocks.append(f"{_stamp(c.start, '.')} --> {_stamp(c.end, '.')}\n{text}")
    return "\n\n".join(blocks) + "\n"
