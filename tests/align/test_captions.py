"""Cue grouping for SRT and WebVTT captions."""

from __future__ import annotations

from moss_rt.align.base import WordTime
from moss_rt.align.captions import MAX_CUE_SEC, MAX_LINE_CHARS, group_cues, to_srt, to_vtt


def said(*items: tuple[str, float, float]) -> list[WordTime]:
    return [WordTime(text.strip(".,!?"), start, end, text=text) for text, start, end in items]


def evenly(text: str, start: float = 0.0, step: float = 0.3) -> list[WordTime]:
    return said(*[(w, start + i * step, start + i * step + 0.25) for i, w in enumerate(text.split())])


def test_a_sentence_end_starts_a_new_cue() -> None:
    cues = group_cues(evenly("Where were you? I waited."))
    assert [c.lines for c in cues] == [("Where were you?",), ("I waited.",)]


def test_a_pause_starts_a_new_cue() -> None:
    words = said(("Wait", 0.0, 0.3), ("for", 0.35, 0.5), ("it", 1.5, 1.7))
    assert [c.lines for c in group_cues(words)] == [("Wait for",), ("it",)]


def test_long_text_is_cut_into_readable_cues() -> None:
    text = " ".join(["word"] * 60)
    cues = group_cues(evenly(text, step=0.2))
    assert len(cues) > 1
    for cue in cues:
        assert len(cue.lines) <= 2
        assert all(len(line) <= MAX_LINE_CHARS for line in cue.lines)
        assert cue.end - cue.start <= MAX_CUE_SEC + 0.3
    assert sum(len(" ".join(c.lines).split()) for c in cues) == 60


def test_two_lines_break_evenly() -> None:
    cue = group_cues(evenly("the quick brown fox jumps over the lazy sleeping dog at last"))[0]
    assert len(cue.lines) == 2
    assert abs(len(cue.lines[0]) - len(cue.lines[1])) <= 10


def test_short_cue_stays_up_a_moment_without_overlapping_the_next() -> None:
    words = said(("Hi.", 0.0, 0.2), ("Yes.", 0.5, 0.7))
    first, second = group_cues(words)
    assert first.end == 0.5 and second.end >= 0.7 + 0.5


def test_srt_and_vtt_files() -> None:
    words = said(("Forty", 0.12, 0.48), ("ships.", 0.5, 1.0), ("<Go>", 61.0, 61.5))
    srt = to_srt(words)
    assert srt == "1\n00:00:00,120 --> 00:00:01,000\nForty ships.\n\n2\n00:01:01,000 --> 00:01:01,800\n<Go>\n"
    vtt = to_vtt(words)
    assert vtt.startswith("WEBVTT\n\n00:00:00.120 --> 00:00:01.000\nForty ships.\n\n")
    assert "&lt;Go&gt;" in vtt
    assert to_srt([]) == "" and to_vtt([]) == "WEBVTT\n"
