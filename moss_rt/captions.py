"""The project's one caption writer (sans-I/O): timed words or whole lines → readable cues → SubRip or WebVTT.

Every caption the service makes goes through here: a take's captions (``GET /api/takes/{id}.srt|.vtt``, the
session-take routes, ``moss-rt say --srt/--vtt``) and a script export's (captions by line and by word).

**Cues** (:func:`group_cues`) follow common subtitle practice: at most two lines of ``MAX_LINE_CHARS`` characters
(a speaker's label counts on the first), at most ``MAX_CUE_SEC`` on screen, a new cue after a sentence ends or at a
pause of ``PAUSE_SEC``, a break after a comma once a cue is a line long. A cue stays up at least ``MIN_CUE_SEC``
when the next one (or ``hold_until``) leaves room. Words keep the text's own punctuation
(:attr:`~moss_rt.align.base.WordTime.text`). A line without word timing is one cue (:func:`line_cue`), its text
wrapped the same way.

**Files** (:func:`to_srt`, :func:`to_vtt`): timestamps to the millisecond (``HH:MM:SS,mmm`` / ``HH:MM:SS.mmm``,
never negative); whitespace in a text collapses to single spaces, since a blank line ends a cue in both formats;
WebVTT escapes ``&``, ``<`` and ``>`` (so its ``-->`` can never appear in a text) and names the speaker with a
voice span (``<v KEEPER>``); SubRip, which has no escapes, leads with the speaker (``KEEPER: …``) and writes a
text's ``-->`` as ``->`` so no reader takes it for a timing line.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from moss_rt.align.base import WordTime

MAX_LINE_CHARS = 42  # a caption line people can read (the usual broadcast guideline)
MAX_LINES = 2
MAX_CUE_SEC = 6.0
MIN_CUE_SEC = 0.8
PAUSE_SEC = 0.7
SENTENCE_END = (".", "!", "?", "…", "。", "！", "？")
CLAUSE_END = (",", ";", ":", "—", "–", "，", "、")
_CLOSERS = "\"'”’)]»"


@dataclass(frozen=True)
class Cue:
    """One caption on screen from ``start`` to ``end`` (seconds): its text lines and who says it (may be empty)."""

    start: float
    end: float
    lines: tuple[str, ...]
    speaker: str = ""

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


# --------------------------------------------------------------------------- cues


def _word_text(word: WordTime) -> str:
    return word.text or word.word


def _ends(word: WordTime, marks: tuple[str, ...]) -> bool:
    return _word_text(word).rstrip(_CLOSERS).endswith(marks)


def _label_len(speaker: str) -> int:
    """What the speaker's label adds to a cue's first line (``KEEPER: ``)."""
    return len(_one_line(speaker)) + 2 if speaker else 0


def _wrap(texts: Sequence[str], lead: int = 0) -> tuple[str, ...]:
    """Words into lines: one when it fits, else two broken where they come out most even, else (a line too long
    for two) as many full lines as it takes. ``lead`` characters come before the first line (a speaker's label)."""
    whole = " ".join(texts)
    if lead + len(whole) <= MAX_LINE_CHARS or len(texts) < 2:
        return (whole,)
    best = min(
        range(1, len(texts)),
        key=lambda k: max(lead + len(" ".join(texts[:k])), len(" ".join(texts[k:]))),
    )
    two = (" ".join(texts[:best]), " ".join(texts[best:]))
    if lead + len(two[0]) <= MAX_LINE_CHARS and len(two[1]) <= MAX_LINE_CHARS:
        return two
    lines: list[str] = []
    current = ""
    for text in texts:
        room = MAX_LINE_CHARS - (lead if not lines else 0)
        if current and len(current) + 1 + len(text) > room:
            lines.append(current)
            current = text
        else:
            current = f"{current} {text}" if current else text
    lines.append(current)
    return tuple(lines)


def _fits(lines: tuple[str, ...], lead: int) -> bool:
    return len(lines) <= MAX_LINES and all(
        len(line) + (lead if i == 0 else 0) <= MAX_LINE_CHARS for i, line in enumerate(lines)
    )


def group_cues(words: Sequence[WordTime], *, speaker: str = "", hold_until: float | None = None) -> list[Cue]:
    """The words, in order, grouped into readable cues (module docstring). The last cue may stay up until
    ``hold_until`` to last ``MIN_CUE_SEC`` (default: as long as that takes); no cue ever overlaps the next."""
    lead = _label_len(speaker)
    groups: list[list[WordTime]] = []
    current: list[WordTime] = []
    for word in words:
        if current:
            lines = _wrap([_word_text(w) for w in [*current, word]], lead)
            too_long = not _fits(lines, lead) or word.end - current[0].start > MAX_CUE_SEC
            pause = word.start - current[-1].end >= PAUSE_SEC
            one_line = lead + len(" ".join(_word_text(w) for w in current)) >= MAX_LINE_CHARS
            after_clause = _ends(current[-1], CLAUSE_END) and one_line
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
            if i + 1 < len(groups):
                limit = groups[i + 1][0].start
            else:
                limit = end + MIN_CUE_SEC if hold_until is None else hold_until
            end = max(end, min(start + MIN_CUE_SEC, limit))
        cues.append(Cue(start, end, _wrap([_word_text(w) for w in group], lead), speaker))
    return cues


def line_cue(start: float, end: float, text: str, speaker: str = "") -> Cue:
    """A whole line as one cue (a line without word timing), its text wrapped like a word cue's."""
    return Cue(start, end, _wrap(text.split(), _label_len(speaker)), speaker)


# --------------------------------------------------------------------------- files


def _stamp(seconds: float, sep: str) -> str:
    ms = max(0, int(round(seconds * 1000)))
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    secs, ms = divmod(ms, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{sep}{ms:03d}"


def _one_line(text: str) -> str:
    # A blank line ends a cue in both formats, and a line break inside a text line would start a new line.
    return " ".join(text.split())


def _visible(cue: Cue) -> list[str]:
    return [line for line in (_one_line(line) for line in cue.lines) if line]


def _srt_text(text: str) -> str:
    return text.replace("-->", "->")


def _vtt_escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def to_srt(cues: Iterable[Cue]) -> str:
    """SubRip: numbered cues, ``HH:MM:SS,mmm --> HH:MM:SS,mmm``, the speaker leading the text (``KEEPER: …``).
    No cues: an empty file."""
    blocks: list[str] = []
    for cue in cues:
        lines = [_srt_text(line) for line in _visible(cue)]
        if not lines:
            continue
        if cue.speaker:
            lines[0] = f"{_srt_text(_one_line(cue.speaker))}: {lines[0]}"
        stamps = f"{_stamp(cue.start, ',')} --> {_stamp(max(cue.end, cue.start), ',')}"
        blocks.append(f"{len(blocks) + 1}\n{stamps}\n" + "\n".join(lines))
    return "\n\n".join(blocks) + ("\n" if blocks else "")


def to_vtt(cues: Iterable[Cue]) -> str:
    """WebVTT: the ``WEBVTT`` header, then cues ``HH:MM:SS.mmm --> HH:MM:SS.mmm``, text escaped, the speaker as a
    voice span (``<v KEEPER>``)."""
    blocks = ["WEBVTT"]
    for cue in cues:
        lines = [_vtt_escape(line) for line in _visible(cue)]
        if not lines:
            continue
        if cue.speaker:
            lines[0] = f"<v {_vtt_escape(_one_line(cue.speaker))}>{lines[0]}"
        stamps = f"{_stamp(cue.start, '.')} --> {_stamp(max(cue.end, cue.start), '.')}"
        blocks.append(f"{stamps}\n" + "\n".join(lines))
    return "\n\n".join(blocks) + "\n"


__all__ = ["Cue", "group_cues", "line_cue", "to_srt", "to_vtt"]
