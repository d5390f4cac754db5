"""The spoken words of a take's text: what the aligner looks for in the audio, and what the client is shown.

A take's ``text`` mixes what is said with how it is said: delivery cues in brackets (``(a soft laugh)``,
``[pause]``, ``{whispers}``, ``<sigh>``, ``*beat*``) are direction, never spoken, so they are not words. The rest is
split into :class:`Token` s, one per written word as a reader sees it (``Forty,`` → ``Forty``; ``1,250`` stays one
token), each with the lowercase words a speaker says for it (``1,250`` → one thousand two hundred fifty; ``21st`` →
twenty first; ``$5`` → five dollars; ``well-known`` → well known). Character offsets point into the original text, so
captions keep its punctuation and a client can highlight the text itself.

Pure Python (standard library only).
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

from moss_rt.align.numbers import cardinal, digits, ordinal, year

# Direction cues: balanced bracket pairs (nested ones inside the outer one), and *stage directions*.
_OPENERS = {"(": ")", "[": "]", "{": "}", "<": ">"}
_STARRED = re.compile(r"\*[^*\n]{1,200}\*")
_CHUNK = re.compile(r"\S+")
# Inside a chunk: dashes, slashes and ellipses separate words ("wait...what", "yes—no", "and/or").
_SEPARATORS = re.compile(r"(?:—|–|--+|/|…|\.\.\.+)")
# One ideograph or kana is one word (these scripts put no spaces between words).
_CJK_RANGES = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
_CJK = re.compile(f"[{_CJK_RANGES}]")
_CJK_OR_WORD = re.compile(f"[{_CJK_RANGES}]|[^\\W_{_CJK_RANGES}]+")
_APOSTROPHES = str.maketrans({"\u2019": "'", "\u2018": "'", "\u02bc": "'", "`": "'"})
_CURRENCY = {"$": ("dollar", "dollars"), "£": ("pound", "pounds"), "€": ("euro", "euros"), "¥": ("yen", "yen")}
_SYMBOL_WORDS = {"&": ("and",), "+": ("plus",), "%": ("percent",), "@": ("at",)}
_NUMBER = re.compile(r"^(?P<sign>[+-]?)(?P<int>\d{1,3}(?:,\d{3})+|\d+)(?:\.(?P<frac>\d+))?$")
_ORDINAL = re.compile(r"^(\d+)(st|nd|rd|th)$", re.IGNORECASE)
_CLOCK = re.compile(r"^(\d{1,2}):(\d{2})$")
_DECADE = re.compile(r"^'?(\d{2}|\d{4})'?s$")
_RUNS = re.compile(r"\d+|[^\W\d_]+(?:'[^\W\d_]+)*", re.UNICODE)


@dataclass(frozen=True, slots=True)
class Token:
    """One written word of the text and what is said for it."""

    word: str  # as the reader sees it, without surrounding punctuation: "Forty", "1,250", "don't"
    written: str  # with the punctuation around it, as in the text: "Forty," (for captions)
    spoken: tuple[str, ...]  # what a speaker says, lowercase: ("forty",)
    start: int  # character offsets of ``written`` in the text
    end: int


def cue_spans(text: str) -> list[tuple[int, int]]:
    """Character ranges [start, end) of the delivery cues in ``text``: bracketed or *starred* direction."""
    spans: list[tuple[int, int]] = []
    stack: list[tuple[str, int]] = []
    for i, ch in enumerate(text):
        if ch in _OPENERS:
            stack.append((ch, i))
        elif stack and ch == _OPENERS[stack[-1][0]]:
            _, opened = stack.pop()
            if not stack:
                spans.append((opened, i + 1))
        elif ch in ")]}>" and stack:
            # A closer that matches no open bracket: unbalanced text is read as written, not as a cue.
            stack.clear()
    spans += [(m.start(), m.end()) for m in _STARRED.finditer(text)]
    spans.sort()
    merged: list[tuple[int, int]] = []
    for start, end in spans:
        if merged and start < merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return merged


def strip_cues(text: str) -> str:
    """``text`` with every delivery cue blanked out (same length, so offsets still point into the original)."""
    chars = list(text)
    for start, end in cue_spans(text):
        chars[start:end] = " " * (end - start)
    return "".join(chars)


def tokenize(text: str) -> list[Token]:
    """The spoken words of ``text``, in order, cues left out. Empty when nothing in it is spoken."""
    tokens: list[Token] = []
    for chunk in _CHUNK.finditer(strip_cues(text)):
        pos = chunk.start()
        for piece in _SEPARATORS.split(chunk.group()):
            at = text.index(piece, pos) if piece else pos
            pos = at + len(piece)
            tokens += _piece_tokens(piece, at)
    return tokens


def _piece_tokens(piece: str, at: int) -> list[Token]:
    if not piece:
        return []
    if _CJK.search(piece):
        out = []
        # One CJK character, or a run of other word characters (never holding a CJK one: each run is a word of
        # its own, so the recursion below always gets a piece without CJK and ends).
        for m in _CJK_OR_WORD.finditer(piece):
            out += _piece_tokens(m.group(), at + m.start()) if not _CJK.fullmatch(m.group()) else [
                Token(m.group(), m.group(), (m.group(),), at + m.start(), at + m.end())
            ]
        return out
    core_start, core_end = _core_bounds(piece)
    core = piece[core_start:core_end]
    if not core:
        symbol = piece.strip()
        if symbol in _SYMBOL_WORDS:
            return [Token(symbol, piece, _SYMBOL_WORDS[symbol], at, at + len(piece))]
        return []
    spoken = spoken_words(core)
    if not spoken:
        return []
    return [Token(core, piece, spoken, at, at + len(piece))]


def _core_bounds(piece: str) -> tuple[int, int]:
    """Where the word itself starts and ends in a chunk: surrounding punctuation off; a leading currency sign or
    number sign and a trailing percent sign stay (they are said)."""
    start, end = 0, len(piece)
    while start < end and not piece[start].isalnum():
        ch = piece[start]
        rest = piece[start + 1 : start + 2]
        if (ch in _CURRENCY or ch in "+-") and rest.isdigit():
            break
        start += 1
    while end > start and not piece[end - 1].isalnum():
        if piece[end - 1] == "%" and end - 1 > start and piece[end - 2].isdigit():
            break
        end -= 1
    return start, end


def spoken_words(core: str) -> tuple[str, ...]:
    """What a speaker says for one written word (already stripped of surrounding punctuation)."""
    word = unicodedata.normalize("NFKC", core).translate(_APOSTROPHES)
    unit: tuple[str, str] | None = None
    if word[0] in _CURRENCY:
        unit, word = _CURRENCY[word[0]], word[1:]
    percent = word.endswith("%")
    if percent:
        word = word[:-1]
    words = _number_words(word)
    if words is None:
        words = []
        for part in re.split(r"[-_.,:;]+", word):
            for run in _RUNS.findall(part):
                words += cardinal(int(run)) if run.isdigit() and len(run) <= 4 and run[0] != "0" else (
                    digits(run) if run.isdigit() else [run.lower()]
                )
    if unit is not None:
        number = _NUMBER.match(word)
        one = number is not None and number.group("int") == "1" and not number.group("frac")
        words.append(unit[0] if one else unit[1])
    if percent:
        words.append("percent")
    return tuple(w for w in words if w)


def _number_words(word: str) -> list[str] | None:
    """Numbers, ordinals, clock times and decades; None for anything else."""
    m = _NUMBER.match(word)
    if m:
        sign = ["minus"] if m.group("sign") == "-" else []
        raw = m.group("int")
        value = int(raw.replace(",", ""))
        if "," not in raw and not m.group("frac") and not sign and (1100 <= value <= 1999 or 2010 <= value <= 2099):
            whole = year(value)
        elif len(raw) > 1 and raw[0] == "0":
            whole = digits(raw)  # 007, zip codes
        else:
            whole = cardinal(value)
        frac = m.group("frac")
        return [*sign, *whole, *(["point", *digits(frac)] if frac else [])]
    m = _ORDINAL.match(word)
    if m:
        return ordinal(int(m.group(1)))
    m = _CLOCK.match(word)
    if m:
        hours, minutes = int(m.group(1)), int(m.group(2))
        if minutes == 0:
            return [*cardinal(hours), "o'clock"]
        return [*cardinal(hours), *(["oh"] if minutes < 10 else []), *cardinal(minutes)]
    m = _DECADE.match(word)
    if m:
        value = int(m.group(1))
        said = year(value) if value >= 1000 else cardinal(value)
        last = said[-1]
        said[-1] = last[:-1] + "ies" if last.endswith("y") else last + "s"
        return said
    return None
