"""English number words: ``1250`` → "one thousand two hundred fifty", ``21st`` → "twenty first".

What a speaker says for digits in a script, so the aligner can find them in the audio. Standard library only.
"""

from __future__ import annotations

_ONES = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen"
).split()
_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()
_SCALES = ((10**12, "trillion"), (10**9, "billion"), (10**6, "million"), (10**3, "thousand"))
_ORDINAL_WORDS = {
    "one": "first", "two": "second", "three": "third", "five": "fifth", "eight": "eighth", "nine": "ninth",
    "twelve": "twelfth",
}  # fmt: skip
MAX_CARDINAL = 10**15 - 1  # beyond this, digits are read one by one


def _below_thousand(n: int) -> list[str]:
    words: list[str] = []
    hundreds, rest = divmod(n, 100)
    if hundreds:
        words += [_ONES[hundreds], "hundred"]
    if rest >= 20:
        tens, ones = divmod(rest, 10)
        words.append(_TENS[tens])
        if ones:
            words.append(_ONES[ones])
    elif rest or not words:
        words.append(_ONES[rest])
    return words


def cardinal(n: int) -> list[str]:
    """``n`` as spoken words (negative numbers start with "minus"; huge ones are read digit by digit)."""
    if n < 0:
        return ["minus", *cardinal(-n)]
    if n > MAX_CARDINAL:
        return digits(str(n))
    if n < 1000:
        return _below_thousand(n)
    words: list[str] = []
    for scale, name in _SCALES:
        if n >= scale:
            count, n = divmod(n, scale)
            words += [*_below_thousand(count), name]
    if n:
        words += _below_thousand(n)
    return words


def ordinal(n: int) -> list[str]:
    """``n`` as an ordinal: 1 → "first", 21 → "twenty first", 100 → "one hundredth"."""
    words = cardinal(n)
    last = words[-1]
    if last in _ORDINAL_WORDS:
        last = _ORDINAL_WORDS[last]
    elif last.endswith("y"):
        last = last[:-1] + "ieth"
    else:
        last += "th"
    return [*words[:-1], last]


def year(n: int) -> list[str]:
    """A year as people say it: 1984 → "nineteen eighty four", 2005 → "two thousand five", 1900 → "nineteen hundred"."""
    if 2000 <= n <= 2009 or n % 1000 == 0:
        return cardinal(n)
    high, low = divmod(n, 100)
    if low == 0:
        return [*cardinal(high), "hundred"]
    return [*cardinal(high), *(["oh"] if low < 10 else []), *cardinal(low)]


def digits(text: str) -> list[str]:
    """Each digit on its own: "007" → "zero zero seven"."""
    return [_ONES[int(c)] for c in text if c.isdigit()]
