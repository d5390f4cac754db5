"""The caption writer (moss_rt/captions.py): cue grouping, line cues, SRT and WebVTT files."""

from __future__ import annotations

from moss_rt.align.base import WordTime
from moss_rt.captions import MAX_CUE_SEC, MAX_LINE_CHARS, Cue, group_cues, line_cue, to_srt, to_vtt


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
    srt = to_srt(group_cues(words))
    assert srt == "1\n00:00:00,120 --> 00:00:01,000\nForty ships.\n\n2\n00:01:01,000 --> 00:01:01,800\n<Go>\n"
    vtt = to_vtt(group_cues(words))
    assert vtt.startswith("WEBVTT\n\n00:00:00.120 --> 00:00:01.000\nForty ships.\n\n")
    assert "&lt;Go&gt;" in vtt
    assert to_srt([]) == "" and to_vtt([]) == "WEBVTT\n"


def test_timestamps_round_to_the_millisecond_and_never_go_negative() -> None:
    cues = [Cue(-0.2, 0.0004, ("a",)), Cue(3599.9995, 3723.0456, ("b",)), Cue(360000.0, 360001.0, ("c",))]
    srt = to_srt(cues)
    assert "00:00:00,000 --> 00:00:00,000\na" in srt
    assert "01:00:00,000 --> 01:02:03,046\nb" in srt  # 3599.9995 rounds up across the hour
    assert "100:00:00,000 --> 100:00:01,000\nc" in srt  # past 99 hours: more hour digits, never wrapped
    assert "01:00:00.000 --> 01:02:03.046\nb" in to_vtt(cues)


def test_cue_text_is_escaped_for_each_format() -> None:
    cue = Cue(1.0, 2.0, ("Tom & <Jerry> --> out", "  spaced\n\n  out  "), speaker="DR. <X>")
    srt = to_srt([cue])
    # SubRip has no escapes: the text as written, but never a timing arrow or a blank line inside a cue.
    assert srt == "1\n00:00:01,000 --> 00:00:02,000\nDR. <X>: Tom & <Jerry> -> out\nspaced out\n"
    vtt = to_vtt([cue])
    assert vtt == (
        "WEBVTT\n\n00:00:01.000 --> 00:00:02.000\n<v DR. &lt;X&gt;>Tom &amp; &lt;Jerry&gt; --&gt; out\nspaced out\n"
    )
    # A cue with nothing to show is left out (it would end the file's cue list early), and numbering follows.
    srt = to_srt([Cue(0.0, 1.0, ("  ",)), Cue(1.0, 2.0, ("Hi.",))])
    assert srt == "1\n00:00:01,000 --> 00:00:02,000\nHi.\n"


def test_the_speaker_label_counts_on_the_first_line() -> None:
    # 40 characters: one line alone, but not after "NARRATOR: " (the label is on screen too, in SubRip).
    words = evenly("Forty ships sailed home three days late.", step=0.2)
    assert len(group_cues(words)[0].lines) == 1
    cue = group_cues(words, speaker="NARRATOR")[0]
    assert len(cue.lines) == 2 and len("NARRATOR: " + cue.lines[0]) <= MAX_LINE_CHARS
    assert to_srt([cue]).splitlines()[2].startswith("NARRATOR: Forty")
    assert to_vtt([cue]).splitlines()[3].startswith("<v NARRATOR>Forty")


def test_the_last_cue_stays_up_only_until_hold_until() -> None:
    words = said(("Yes.", 1.0, 1.2))
    assert group_cues(words)[0].end == 1.8  # nothing after it: the full minimum
    assert group_cues(words, hold_until=1.5)[0].end == 1.5  # the next line starts there
    assert group_cues(words, hold_until=1.1)[0].end == 1.2  # never shorter than the word itself


def test_a_line_cue_wraps_like_a_word_cue() -> None:
    assert line_cue(0.0, 2.0, "Short  line.").lines == ("Short line.",)
    two = line_cue(0.0, 4.0, "the quick brown fox jumps over the lazy sleeping dog at last")
    assert len(two.lines) == 2 and all(len(line) <= MAX_LINE_CHARS for line in two.lines)
    long = line_cue(0.0, 20.0, " ".join(["word"] * 40), speaker="KEEPER")
    assert len(long.lines) > 2 and all(len(line) <= MAX_LINE_CHARS for line in long.lines)
    assert len("KEEPER: " + long.lines[0]) <= MAX_LINE_CHARS
    assert " ".join(long.lines) == " ".join(["word"] * 40)
