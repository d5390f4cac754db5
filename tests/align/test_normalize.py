"""The spoken words of a take's text: cues out, numbers as words, punctuation and case."""

from __future__ import annotations

import pytest

from moss_rt.align.normalize import cue_spans, spoken_words, strip_cues, tokenize
from moss_rt.align.numbers import cardinal, ordinal, year


def words(text: str) -> list[str]:
    return [t.word for t in tokenize(text)]


def test_cues_in_brackets_and_stars_are_not_words() -> None:
    text = "Forty ships, (a soft laugh) sailed [pause] on {whispers} <sigh> *beat* home."
    assert words(text) == ["Forty", "ships", "sailed", "on", "home"]
    assert strip_cues("a (b (c) d) e") == "a           e"
    assert words("(laughs)") == [] and words("[pause] ... !") == []


def test_unbalanced_brackets_are_read_as_written() -> None:
    assert words("well (maybe not") == ["well", "maybe", "not"]
    assert words("oops) yes") == ["oops", "yes"]
    assert cue_spans("x) (y)") == [(3, 6)]


def test_punctuation_and_case() -> None:
    tokens = tokenize('He said, "Don’t!" — then left...')
    assert [t.word for t in tokens] == ["He", "said", "Don’t", "then", "left"]
    assert [t.spoken for t in tokens][2] == ("don't",)
    assert tokens[1].written == "said,"
    text = 'He said, "Don’t!"'
    assert [text[t.start : t.end] for t in tokenize(text)] == ["He", "said,", '"Don’t!"']


@pytest.mark.parametrize(
    ("written", "spoken"),
    [
        ("40", "forty"),
        ("1,250", "one thousand two hundred fifty"),
        ("1984", "nineteen eighty four"),
        ("2005", "two thousand five"),
        ("21st", "twenty first"),
        ("3rd", "third"),
        ("$5", "five dollars"),
        ("$1", "one dollar"),
        ("50%", "fifty percent"),
        ("3.5", "three point five"),
        ("-3", "minus three"),
        ("3:05", "three oh five"),
        ("7:00", "seven o'clock"),
        ("1990s", "nineteen nineties"),
        ("007", "zero zero seven"),
        ("well-known", "well known"),
        ("MP3", "mp three"),
        ("Café", "café"),
    ],
)
def test_what_is_said_for_a_written_word(written: str, spoken: str) -> None:
    assert " ".join(spoken_words(written)) == spoken


def test_number_words() -> None:
    assert cardinal(0) == ["zero"]
    assert " ".join(cardinal(1_000_001)) == "one million one"
    assert cardinal(10**15) == ["one"] + ["zero"] * 15  # beyond trillions: digit by digit
    assert ordinal(12) == ["twelfth"] and ordinal(40) == ["fortieth"] and ordinal(101) == ["one", "hundred", "first"]
    assert year(1900) == ["nineteen", "hundred"] and year(1905) == ["nineteen", "oh", "five"]


def test_scripts_without_spaces_are_one_word_per_character() -> None:
    assert words("你好 world") == ["你", "好", "world"]


def test_separators_split_words() -> None:
    assert words("yes—no and/or wait...what") == ["yes", "no", "and", "or", "wait", "what"]
    assert [t.spoken for t in tokenize("rock & roll")][1] == ("and",)


def test_latin_letters_against_ideographs_are_words_of_their_own() -> None:
    """A run of Latin letters touching ideographs ("a漢b", as a fuzzer sent to POST /api/align) is split into words,
    not handed back to itself forever (a RecursionError, a 500)."""
    assert [(t.word, t.start, t.end) for t in tokenize("a漢b ok 東京tower")] == [
        ("a", 0, 1), ("漢", 1, 2), ("b", 2, 3), ("ok", 4, 6), ("東", 7, 8), ("京", 8, 9), ("tower", 9, 14),
    ]
    assert len(tokenize("x" + "漢y" * 3000)) == 6001
