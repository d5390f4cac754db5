"""The script format, sans-I/O: a cast and a list of cues, written as JSON or as plain text.

Both forms parse into one :class:`Script`; every malformed input raises :class:`ScriptError` (``invalid_field``,
HTTP 422) whose message starts with where the fault is: ``line 7: …`` in a plain-text script, ``lines[3]: …`` or
``cast.MARA: …`` in a JSON one, ``line 2, column 5`` for JSON that does not parse (docs/scripts.md).

Plain text, one cue per line::

    @title The Lighthouse
    @gap 0.4s
    @cast KEEPER voice=ref_0123abcd instruction="gruff, weathered" language=English
    @cast MARA voice=alice
    # a comment
    KEEPER: (quietly) The light's been out three nights.
    [pause 1.5s]
    MARA: Then we go up tonight.

    KEEPER: (a blank line above is a scene break) Morning came grey.

``@`` lines form the header (before the first cue); ``NAME: (delivery cue) spoken words`` is a cue whose delivery
cue is added to the character's direction; ``[pause 1.5s]`` is a silence; a blank line is a scene break.

JSON: ``{"title", "cast": {"NAME": {"voice", "instruction", "language"}}, "lines": [{"who", "text",
"instruction", "seed", "tokens", "max_new_tokens"} | {"pause": 1.5} | {"scene": true}], "gap_sec", "scene_gap_sec",
"max_new_tokens"}``. A character missing from the cast speaks with no reference voice and no added direction.
Character names match the cast case-insensitively and take the cast's spelling.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from moss_rt.generation import MAX_SEED
from moss_rt.protocol import ErrorCode, Limits, ProtocolError
from moss_rt.protocol.schema import Field, coerce, short_repr

DEFAULT_GAP_SEC = 0.4  # silence between two lines in the mix
DEFAULT_SCENE_GAP_SEC = 1.2  # silence at a scene break (instead of the gap)
MAX_CAST = 256  # characters one cast may declare
MAX_NAME_CHARS = 64
MAX_TITLE_CHARS = 200
MAX_VOICE_CHARS = 128  # as the protocol's ``reference``
MAX_LANGUAGE_CHARS = 64  # as the protocol's ``language``

# A character name: starts with a letter, digit or underscore; no colon, brackets or parentheses (they delimit
# cues), no control characters. "DR. SMITH", "Mara", "NARRATOR 2" and "老人" are names.
_NAME = r"[^\W][^:()\[\]\x00-\x1f\x7f]*?"
_NAME_RE = re.compile(rf"^{_NAME}$")
_CUE_RE = re.compile(rf"^(?P<name>{_NAME})\s*:(?P<rest>.*)$")
_PAUSE_RE = re.compile(r"^\[\s*pause\s+(?P<value>\d+(?:\.\d+)?|\.\d+)\s*(?P<unit>s|sec|secs|seconds?|ms)?\s*\]$", re.I)
_DURATION_RE = re.compile(r"^(?P<value>\d+(?:\.\d+)?|\.\d+)\s*(?P<unit>s|sec|secs|seconds?|ms)?$", re.I)
_CAST_KEYS = ("voice", "instruction", "language")
_LINE_KEYS = ("who", "text", "instruction", "seed", "tokens", "max_new_tokens")
_SCRIPT_KEYS = ("title", "cast", "lines", "gap_sec", "scene_gap_sec", "max_new_tokens")


class ScriptError(ProtocolError):
    """A malformed script: ``where`` (``line 7``, ``lines[3]``, ``cast.MARA``) starts the message."""

    def __init__(self, where: str, message: str) -> None:
        super().__init__(ErrorCode.INVALID_FIELD, f"{where}: {message}" if where else message, field="script")
        self.where = where


@dataclass(frozen=True)
class CastMember:
    """How a character speaks: a reference voice (a built-in id, an uploaded ref_id, or none), direction, language."""

    voice: str = "none"
    instruction: str = ""
    language: str = ""

    def to_dict(self) -> dict[str, str]:
        return {"voice": self.voice, "instruction": self.instruction, "language": self.language}


@dataclass(frozen=True)
class Cue:
    """One spoken line: ``number`` counts cues from 1 (the line number of the API, files and cue sheets)."""

    number: int
    who: str
    text: str
    instruction: str = ""  # the line's own direction (a delivery cue), added to the character's
    seed: int | None = None
    tokens: int | None = None  # duration hint in 80 ms frames
    max_new_tokens: int | None = None  # frame cap of this line (else the script's, else the service's)
    source: str = ""  # where it was written ("line 7", "lines[3]"), for messages

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"who": self.who, "text": self.text}
        for name in ("instruction", "seed", "tokens", "max_new_tokens"):
            value = getattr(self, name)
            if value not in (None, ""):
                out[name] = value
        return out


@dataclass(frozen=True)
class Pause:
    """A silence of ``seconds`` in the mix, where it is written."""

    seconds: float
    source: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"pause": self.seconds}


@dataclass(frozen=True)
class SceneBreak:
    """A scene break: the next line follows after ``scene_gap_sec`` instead of ``gap_sec``; scenes count from 1."""

    source: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"scene": True}


Item = Cue | Pause | SceneBreak


@dataclass(frozen=True)
class Script:
    title: str
    cast: dict[str, CastMember]
    items: tuple[Item, ...]
    gap_sec: float = DEFAULT_GAP_SEC
    scene_gap_sec: float = DEFAULT_SCENE_GAP_SEC
    max_new_tokens: int | None = None

    @property
    def cues(self) -> list[Cue]:
        return [item for item in self.items if isinstance(item, Cue)]

    def member(self, who: str) -> CastMember:
        """The character's voice and direction; a character missing from the cast gets none."""
        return self.cast.get(who, CastMember())

    def instruction_for(self, cue: Cue) -> str:
        """The take's instruction: the character's direction, then the line's own (as a new sentence)."""
        return join_direction(self.member(cue.who).instruction, cue.instruction)

    def scene_of(self) -> dict[int, int]:
        """Cue number → scene number (from 1)."""
        scene, out = 1, {}
        for item in self.items:
            if isinstance(item, SceneBreak):
                scene += 1
            elif isinstance(item, Cue):
                out[item.number] = scene
        return out

    def to_dict(self) -> dict[str, Any]:
        """The canonical JSON form (what is stored, and what :func:`parse_json_script` reads back)."""
        out: dict[str, Any] = {
            "title": self.title,
            "cast": {name: m.to_dict() for name, m in self.cast.items()},
            "lines": [item.to_dict() for item in self.items],
            "gap_sec": self.gap_sec,
            "scene_gap_sec": self.scene_gap_sec,
        }
        if self.max_new_tokens is not None:
            out["max_new_tokens"] = self.max_new_tokens
        return out

    def with_cast(self, cast: Mapping[str, CastMember]) -> Script:
        """This script with ``cast`` laid over its own (entries given alongside win per character)."""
        merged = dict(self.cast)
        for name, member in cast.items():
            known = _find(merged, name)
            if known is not None:
                del merged[known]
            merged[name] = member
        return _canonical_names(replace(self, cast=merged))


def join_direction(character: str, line: str) -> str:
    a, b = character.strip(), line.strip()
    if not a or not b:
        return a or b
    return a + (" " if a[-1] in ".!?;:," else ". ") + b


# --------------------------------------------------------------------------- plain text


def parse_text_script(text: str, limits: Limits, *, cast: Mapping[str, CastMember] | None = None) -> Script:
    """A plain-text script (see the module docstring); ``cast`` given alongside wins over the header's."""
    if text.startswith("\ufeff"):
        text = text[1:]
    title = ""
    gap, scene_gap = DEFAULT_GAP_SEC, DEFAULT_SCENE_GAP_SEC
    max_new_tokens: int | None = None
    members: dict[str, CastMember] = {}
    items: list[Item] = []
    in_header = True
    blank_at: str | None = None  # a blank line after a cue: a scene break once another cue follows
    for number, raw in enumerate(text.splitlines(), 1):
        where = f"line {number}"
        line = raw.strip()
        if not line:
            if not in_header and blank_at is None:
                blank_at = where
            continue
        if line.startswith("#"):
            continue
        if line.startswith("@"):
            if not in_header:
                raise ScriptError(where, f"{line.split()[0][:20]!r} belongs in the header, before the first cue")
            directive, _, value = line[1:].partition(" ")
            directive, value = directive.lower(), value.strip()
            if directive == "title":
                title = _text(where, "@title", value, MAX_TITLE_CHARS)
            elif directive == "gap":
                gap = _duration(where, "@gap", value, limits.max_gap_sec)
            elif directive in ("scene_gap", "scene-gap"):
                scene_gap = _duration(where, "@scene_gap", value, limits.max_gap_sec)
            elif directive in ("max_new_tokens", "max-new-tokens"):
                max_new_tokens = _int(where, "@max_new_tokens", value, 1, limits.max_new_tokens)
            elif directive == "cast":
                name, member = _cast_directive(where, value, limits)
                if _find(members, name) is not None:
                    raise ScriptError(where, f"{name!r} is already in the cast")
                members[name] = member
                if len(members) > MAX_CAST:
                    raise ScriptError(where, f"a cast has at most {MAX_CAST} characters")
            else:
                raise ScriptError(
                    where,
                    f"unknown header line '@{directive[:20]}' (known: @title, @gap, @scene_gap, @max_new_tokens,"
                    " @cast)",
                )
            continue
        in_header = False
        if blank_at is not None and items and not isinstance(items[-1], SceneBreak):
            items.append(SceneBreak(blank_at))
        blank_at = None
        if line.startswith("["):
            items.append(Pause(_pause(where, line, limits), where))
            continue
        items.append(_cue_line(where, line, len([i for i in items if isinstance(i, Cue)]) + 1, limits))
    if items and isinstance(items[-1], SceneBreak):
        items.pop()
    script = Script(title, members, tuple(items), gap, scene_gap, max_new_tokens)
    if cast:
        script = script.with_cast(cast)
    return _finish(script, limits)


def _cue_line(where: str, line: str, number: int, limits: Limits) -> Cue:
    match = _CUE_RE.match(line)
    if match is None:
        raise ScriptError(
            where,
            "expected a cue 'NAME: (delivery cue) words', a comment '# …', a pause '[pause 1.5s]', a header line"
            f" '@…' or a blank line; got {short_repr(line, 40)}",
        )
    name = match["name"].strip()
    if len(name) > MAX_NAME_CHARS:
        raise ScriptError(where, f"a character name has at most {MAX_NAME_CHARS} characters")
    rest = match["rest"].strip()
    instruction = ""
    if rest.startswith("("):
        close = rest.find(")")
        if close < 0:
            raise ScriptError(where, "the delivery cue's '(' is never closed")
        instruction = rest[1:close].strip()
        if not instruction:
            raise ScriptError(where, "an empty delivery cue '()'; write the cue or leave the parentheses out")
        rest = rest[close + 1 :].strip()
    if not rest:
        raise ScriptError(where, f"{name} has no words to speak")
    return Cue(number, name, _spoken(where, rest, limits), _direction(where, instruction, limits), source=where)


def _pause(where: str, line: str, limits: Limits) -> float:
    match = _PAUSE_RE.match(line)
    if match is None:
        raise ScriptError(where, f"a silence is written '[pause 1.5s]' (or 500ms); got {short_repr(line, 40)}")
    return _seconds(where, "a pause", match["value"], match["unit"], limits.max_pause_sec)


def _cast_directive(where: str, value: str, limits: Limits) -> tuple[str, CastMember]:
    try:
        tokens = shlex.split(value)
    except ValueError as exc:
        raise ScriptError(where, f'@cast: {exc} (quote values with spaces: instruction="calm, low")') from None
    if not tokens:
        raise ScriptError(where, "@cast needs a name: '@cast NAME voice=… instruction=\"…\" language=…'")
    name = _name(where, tokens[0])
    fields: dict[str, str] = {}
    for token in tokens[1:]:
        key, sep, val = token.partition("=")
        key = key.strip().lower()
        if not sep or key not in _CAST_KEYS:
            raise ScriptError(
                where, f"@cast {name}: expected key=value with a key of {list(_CAST_KEYS)}, got {short_repr(token, 30)}"
            )
        if key in fields:
            raise ScriptError(where, f"@cast {name}: {key} is given twice")
        fields[key] = val
    return name, _member(where, fields, limits)


# --------------------------------------------------------------------------- JSON


def parse_json_script(obj: Any, limits: Limits, *, cast: Mapping[str, CastMember] | None = None) -> Script:
    """A JSON script (already decoded; see the module docstring)."""
    if not isinstance(obj, dict):
        raise ScriptError("", f"a JSON script is an object, got {type(obj).__name__}")
    unknown = sorted(str(k) for k in obj if k not in _SCRIPT_KEYS)
    if unknown:
        raise ScriptError("", f"unknown key {short_repr(unknown[0], 30)} (a script has {list(_SCRIPT_KEYS)})")
    title = _text("title", "title", _opt(obj, "title", ""), MAX_TITLE_CHARS)
    gap = _number("gap_sec", obj.get("gap_sec"), DEFAULT_GAP_SEC, limits.max_gap_sec)
    scene_gap = _number("scene_gap_sec", obj.get("scene_gap_sec"), DEFAULT_SCENE_GAP_SEC, limits.max_gap_sec)
    max_new_tokens = _json_int("max_new_tokens", obj.get("max_new_tokens"), 1, limits.max_new_tokens)
    members = parse_cast(obj.get("cast"), limits)
    lines = obj.get("lines")
    if not isinstance(lines, list):
        raise ScriptError("lines", "a script needs 'lines': a list of cues")
    items: list[Item] = []
    cues = 0
    for index, entry in enumerate(lines):
        where = f"lines[{index}]"
        if not isinstance(entry, dict):
            raise ScriptError(where, f"a line is an object, got {type(entry).__name__}")
        if "pause" in entry or "scene" in entry:
            if len(entry) != 1:
                raise ScriptError(where, 'a pause is {"pause": seconds} and a scene break {"scene": true}, alone')
            if "pause" in entry:
                items.append(
                    Pause(_number(where + ".pause", entry["pause"], None, limits.max_pause_sec, positive=True), where)
                )
            elif entry["scene"] is not False:
                if not (entry["scene"] is True or isinstance(entry["scene"], str)):
                    raise ScriptError(where, "'scene' is true (or a scene's name)")
                if items and not isinstance(items[-1], SceneBreak):
                    items.append(SceneBreak(where))
            continue
        unknown = sorted(str(k) for k in entry if k not in _LINE_KEYS)
        if unknown:
            raise ScriptError(where, f"unknown key {short_repr(unknown[0], 30)} (a line has {list(_LINE_KEYS)})")
        who = entry.get("who")
        if not isinstance(who, str):
            raise ScriptError(where, "'who' (the character's name) is required")
        text = entry.get("text")
        if not isinstance(text, str) or not text.strip():
            raise ScriptError(where, f"{who.strip()[:MAX_NAME_CHARS]} has no words to speak ('text')")
        cues += 1
        items.append(
            Cue(
                cues,
                _name(where, who.strip()),
                _spoken(where, text.strip(), limits),
                _direction(where, _opt(entry, "instruction", "", where), limits),
                seed=_json_int(where + ".seed", entry.get("seed"), 0, MAX_SEED),
                tokens=_json_int(where + ".tokens", entry.get("tokens"), 1, limits.max_new_tokens),
                max_new_tokens=_json_int(
                    where + ".max_new_tokens", entry.get("max_new_tokens"), 1, limits.max_new_tokens
                ),
                source=where,
            )
        )
    if items and isinstance(items[-1], SceneBreak):
        items.pop()
    script = Script(title, members, tuple(items), gap, scene_gap, max_new_tokens)
    if cast:
        script = script.with_cast(cast)
    return _finish(script, limits)


def parse_cast(obj: Any, limits: Limits) -> dict[str, CastMember]:
    """A JSON cast ``{"NAME": {"voice", "instruction", "language"}}`` (None: empty)."""
    if obj is None:
        return {}
    if not isinstance(obj, dict):
        raise ScriptError("cast", f"the cast is an object of characters, got {type(obj).__name__}")
    if len(obj) > MAX_CAST:
        raise ScriptError("cast", f"a cast has at most {MAX_CAST} characters")
    members: dict[str, CastMember] = {}
    for raw_name, entry in obj.items():
        where = f"cast.{str(raw_name)[:MAX_NAME_CHARS]}"
        name = _name(where, str(raw_name).strip())
        if _find(members, name) is not None:
            raise ScriptError(where, f"{name!r} is in the cast twice (names match whatever their case)")
        if entry is None:
            entry = {}
        if not isinstance(entry, dict):
            raise ScriptError(
                where, f"a cast entry is an object {{voice, instruction, language}}, got {type(entry).__name__}"
            )
        unknown = sorted(str(k) for k in entry if k not in _CAST_KEYS)
        if unknown:
            raise ScriptError(where, f"unknown key {short_repr(unknown[0], 30)} (a cast entry has {list(_CAST_KEYS)})")
        fields: dict[str, str] = {}
        for key in _CAST_KEYS:
            value = entry.get(key)
            if value is None:
                continue
            if not isinstance(value, str):
                raise ScriptError(where, f"{key!r} must be text, got {type(value).__name__}")
            fields[key] = value
        members[name] = _member(where, fields, limits)
    return members


# --------------------------------------------------------------------------- shared checks


def _finish(script: Script, limits: Limits) -> Script:
    """Whole-script checks, and every cue's name in the cast's spelling."""
    script = _canonical_names(script)
    cues = script.cues
    if not cues:
        raise ScriptError("", "the script has no lines to speak")
    if len(cues) > limits.max_script_lines:
        raise ScriptError(
            cues[limits.max_script_lines].source,
            f"a script has at most {limits.max_script_lines} lines (max_script_lines)",
        )
    for cue in cues:
        instruction = script.instruction_for(cue)
        if len(instruction) > limits.max_instruction_chars:
            raise ScriptError(
                cue.source,
                f"the character's and the line's direction together are "
                f"{len(instruction)} characters; at most {limits.max_instruction_chars}",
            )
    return script


def _canonical_names(script: Script) -> Script:
    items: list[Item] = []
    for item in script.items:
        if isinstance(item, Cue):
            known = _find(script.cast, item.who)
            if known is not None and known != item.who:
                item = replace(item, who=known)
        items.append(item)
    return replace(script, items=tuple(items))


def _find(members: Mapping[str, Any], name: str) -> str | None:
    folded = name.casefold()
    return next((known for known in members if known.casefold() == folded), None)


def _name(where: str, name: str) -> str:
    if not name or len(name) > MAX_NAME_CHARS or not _NAME_RE.match(name):
        raise ScriptError(
            where,
            f"a character name is 1-{MAX_NAME_CHARS} characters, starts with a letter or digit and has no ':',"
            f" brackets or parentheses; got {short_repr(name, 40)}",
        )
    return name


def _member(where: str, fields: Mapping[str, str], limits: Limits) -> CastMember:
    voice = fields.get("voice", "none").strip() or "none"
    if len(voice) > MAX_VOICE_CHARS:
        raise ScriptError(where, f"'voice' has at most {MAX_VOICE_CHARS} characters")
    language = fields.get("language", "").strip()
    if len(language) > MAX_LANGUAGE_CHARS:
        raise ScriptError(where, f"'language' has at most {MAX_LANGUAGE_CHARS} characters")
    return CastMember(voice, _direction(where, fields.get("instruction", ""), limits), language)


def _spoken(where: str, text: str, limits: Limits) -> str:
    if len(text) > limits.max_text_chars:
        raise ScriptError(where, f"the words are {len(text)} characters; a line has at most {limits.max_text_chars}")
    return text


def _direction(where: str, text: str, limits: Limits) -> str:
    text = text.strip()
    if len(text) > limits.max_instruction_chars:
        raise ScriptError(where, f"the direction is {len(text)} characters; at most {limits.max_instruction_chars}")
    return text


def _text(where: str, name: str, value: Any, limit: int) -> str:
    if not isinstance(value, str):
        raise ScriptError(where, f"{name!r} must be text, got {type(value).__name__}")
    if len(value.strip()) > limit:
        raise ScriptError(where, f"{name!r} has at most {limit} characters")
    return value.strip()


def _opt(obj: dict[str, Any], key: str, default: str, where: str = "") -> Any:
    value = obj.get(key)
    if value is None:
        return default
    if not isinstance(value, str):
        raise ScriptError(where or key, f"{key!r} must be text, got {type(value).__name__}")
    return value


def _seconds(where: str, what: str, value: str, unit: str | None, maximum: float) -> float:
    seconds = float(value) / (1000.0 if (unit or "").lower() == "ms" else 1.0)
    if not 0 < seconds <= maximum:
        raise ScriptError(where, f"{what} is more than 0 and at most {maximum:g} s; got {seconds:g} s")
    return round(seconds, 6)


def _duration(where: str, name: str, value: str, maximum: float) -> float:
    match = _DURATION_RE.match(value)
    if match is None:
        raise ScriptError(where, f"{name} takes a duration like 0.4s or 400ms; got {short_repr(value, 30)}")
    seconds = float(match["value"]) / (1000.0 if (match["unit"] or "").lower() == "ms" else 1.0)
    if not 0 <= seconds <= maximum:
        raise ScriptError(where, f"{name} is at most {maximum:g} s; got {seconds:g} s")
    return round(seconds, 6)


def _int(where: str, name: str, value: str, minimum: int, maximum: int) -> int:
    if not value.isdigit() or not minimum <= int(value) <= maximum:
        raise ScriptError(where, f"{name} is a whole number from {minimum} to {maximum}; got {short_repr(value, 30)}")
    return int(value)


def _number(where: str, value: Any, default: float | None, maximum: float, *, positive: bool = False) -> float:
    if value is None:
        if default is None:
            raise ScriptError(where, "a number of seconds is required")
        return default
    try:
        seconds = float(coerce(where.rsplit(".", 1)[-1], Field("float", None, 0.0, maximum), value))
    except ProtocolError as err:
        raise ScriptError(where, f"seconds from 0 to {maximum:g} ({err.message})") from None
    if positive and seconds <= 0:
        raise ScriptError(where, f"a pause is more than 0 s; got {seconds:g}")
    return round(seconds, 6)


def _json_int(where: str, value: Any, minimum: int, maximum: int) -> int | None:
    if value is None:
        return None
    try:
        return int(coerce(where.rsplit(".", 1)[-1], Field("int", None, minimum, maximum), value))
    except ProtocolError as err:
        raise ScriptError(where, err.message) from None


def line_take_title(cue: Cue) -> str:
    """The title a line's take gets in the director's session (the studio shows it)."""
    return f"Line {cue.number} · {cue.who}"[:80]


__all__ = [
    "DEFAULT_GAP_SEC",
    "DEFAULT_SCENE_GAP_SEC",
    "CastMember",
    "Cue",
    "Item",
    "Pause",
    "SceneBreak",
    "Script",
    "ScriptError",
    "join_direction",
    "line_take_title",
    "parse_cast",
    "parse_json_script",
    "parse_text_script",
]
