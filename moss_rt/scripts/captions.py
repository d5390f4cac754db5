"""Captions of a script's mix as SRT and WebVTT (sans-I/O): by line, and by word where word timing exists.

A caption source is anything that yields :class:`Caption` (seconds in the mix, text, speaker): :func:`line_captions`
makes one per line from the timeline; :func:`word_captions` groups the words of each line's take (timed from the
take's sample 0, as the word-timing component stores them) into readable cues and moves them to the line's place
in the mix. The writers take either.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from moss_rt.generation import SAMPLE_RATE
from moss_rt.scripts.timeline import Timeline

MAX_CUE_CHARS = 42  # a caption line people can read (the usual broadcast guideline)
MAX_CUE_SEC = 5.0
SENTENCE_END = (".", "!", "?", "…", "。", "！", "？")


@dataclass(frozen=True)
class Word:
    """One spoken word, in seconds from its take's sample 0."""

    text: str
    start: float
    end: float

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> Word:
        """The stored form ``{"word", "start", "end"}`` (issue 25's word list)."""
        return cls(str(obj["word"]), float(obj["start"]), float(obj["end"]))


@dataclass(frozen=True)
class Caption:
    start: float
    end: float
    text: str
    speaker: str = ""


def line_captions(timeline: Timeline) -> list[Caption]:
    """One caption per line, spanning its audio in the mix."""
    return [Caption(p.start / SAMPLE_RATE, p.end / SAMPLE_RATE, p.cue.text, p.cue.who) for p in timeline.placed]


def word_captions(timeline: Timeline, words: Mapping[int, Sequence[Word]]) -> list[Caption]:
    """Each line's words (by cue number) grouped into cues of at most :data:`MAX_CUE_CHARS` characters and
    :data:`MAX_CUE_SEC` seconds, a sentence's end closing a cue; lines without words keep one cue of their own."""
    out: list[Caption] = []
    for placed in timeline.placed:
        offset = placed.start / SAMPLE_RATE
        end_of_line = placed.end / SAMPLE_RATE
        line_words = words.get(placed.cue.number)
        if not line_words:
            out.append(Caption(offset, end_of_line, placed.cue.text, placed.cue.who))
            continue
        for group in group_words(line_words):
            start = min(offset + group[0].start, end_of_line)
            end = min(max(offset + group[-1].end, start), end_of_line)
            out.append(Caption(start, end, " ".join(w.text for w in group), placed.cue.who))
    return out


def group_words(words: Sequence[Word]) -> list[list[Word]]:
    """Words in readable groups: a group closes at a sentence's end, or before it would pass
    :data:`MAX_CUE_CHARS` characters or :data:`MAX_CUE_SEC` seconds."""
    groups: list[list[Word]] = []
    group: list[Word] = []
    for word in words:
        if group:
            text_len = sum(len(w.text) + 1 for w in group) + len(word.text)
            if text_len > MAX_CUE_CHARS or word.end - group[0].start > MAX_CUE_SEC:
                groups.append(group)
                group = []
        group.append(word)
        if word.text.endswith(SENTENCE_END):
            groups.append(group)
            group = []
    if group:
        groups.append(group)
    return groups


def _stamp(seconds: float, sep: str) -> str:
    ms = max(0, int(round(seconds * 1000)))
    h, rest = divmod(ms, 3_600_000)
    m, rest = divmod(rest, 60_000)
    s, ms = divmod(rest, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{sep}{ms:03d}"


def _one_line(text: str) -> str:
    # A blank line ends a cue in both formats: caption text never holds one.
    return " ".join(text.split())


def to_srt(captions: Iterable[Caption]) -> str:
    """SubRip: numbered cues, ``HH:MM:SS,mmm``; the speaker leads the text (``KEEPER: …``)."""
    blocks = []
    for n, c in enumerate(captions, 1):
        text = _one_line(f"{c.speaker}: {c.text}" if c.speaker else c.text)
        blocks.append(f"{n}\n{_stamp(c.start, ',')} --> {_stamp(c.end, ',')}\n{text}\n")
    return "\n".join(blocks)


def _vtt_escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def to_vtt(captions: Iterable[Caption]) -> str:
    """WebVTT: ``HH:MM:SS.mmm`` cues, the speaker as a voice span (``<v KEEPER>``)."""
    blocks = ["WEBVTT\n"]
    for c in captions:
        text = _vtt_escape(_one_line(c.text))
        if c.speaker:
            text = f"<v {_vtt_escape(_one_line(c.speaker))}>{text}"
        blocks.append(f"{_stamp(c.start, '.')} --> {_stamp(c.end, '.')}\n{text}\n")
    return "\n".join(blocks)
