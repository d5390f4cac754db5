"""Scripts, sans-I/O: both forms parse to the same script, every malformed case names where it is, the mix is laid
out to the sample, captions are well formed, the fair share and the event log keep their rules."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from moss_rt.align.base import WordTime
from moss_rt.captions import to_srt, to_vtt
from moss_rt.protocol import ErrorCode, Limits
from moss_rt.scripts.events import LISTENER_QUEUE, EventLog
from moss_rt.scripts.fairness import FairShare
from moss_rt.scripts.format import CastMember, Pause, SceneBreak, ScriptError, parse_json_script, parse_text_script
from moss_rt.scripts.timeline import LineAudio, Placed, Silence, cue_sheet_csv, layout, line_captions, word_captions
from moss_rt.web.scripts_api import parse_script_body

LIMITS = Limits()

TEXT = """\
@title The Lighthouse
@gap 0.4s
@scene_gap 1500ms
@cast KEEPER voice=ref_0123abcd instruction="gruff, weathered" language=English
@cast MARA voice=alice

# Scene one
KEEPER: (quietly) The light's been out three nights.
[pause 1.5s]
mara: Then we go up tonight.


KEEPER: Morning came grey.
NARRATOR: (low) And so it ended.
"""

JSON_FORM = {
    "title": "The Lighthouse",
    "cast": {
        "KEEPER": {"voice": "ref_0123abcd", "instruction": "gruff, weathered", "language": "English"},
        "MARA": {"voice": "alice"},
    },
    "lines": [
        {"who": "KEEPER", "text": "The light's been out three nights.", "instruction": "quietly"},
        {"pause": 1.5},
        {"who": "mara", "text": "Then we go up tonight."},
        {"scene": True},
        {"who": "KEEPER", "text": "Morning came grey."},
        {"who": "NARRATOR", "text": "And so it ended.", "instruction": "low"},
    ],
    "gap_sec": 0.4,
    "scene_gap_sec": 1.5,
}


def test_both_forms_parse_to_the_same_script() -> None:
    text = parse_text_script(TEXT, LIMITS)
    from_json = parse_json_script(JSON_FORM, LIMITS)
    assert text.to_dict() == from_json.to_dict()
    assert text.title == "The Lighthouse" and (text.gap_sec, text.scene_gap_sec) == (0.4, 1.5)
    cues = text.cues
    assert [c.number for c in cues] == [1, 2, 3, 4]
    assert [c.who for c in cues] == ["KEEPER", "MARA", "KEEPER", "NARRATOR"]  # the cast's spelling
    assert isinstance(text.items[1], Pause) and text.items[1].seconds == 1.5
    assert isinstance(text.items[3], SceneBreak)
    assert text.scene_of() == {1: 1, 2: 1, 3: 2, 4: 2}
    # The character's direction, then the line's; a character missing from the cast has none of its own.
    assert text.instruction_for(cues[0]) == "gruff, weathered. quietly"
    assert text.instruction_for(cues[2]) == "gruff, weathered"
    assert text.member("NARRATOR") == CastMember() and text.instruction_for(cues[3]) == "low"
    # The canonical form (what is stored) reads back to itself.
    assert parse_json_script(text.to_dict(), LIMITS).to_dict() == text.to_dict()


def test_a_cast_given_alongside_wins_over_the_header() -> None:
    alongside = {"keeper": CastMember("ref_ffff", "young, eager", "French"), "NARRATOR": CastMember("bob")}
    script = parse_text_script(TEXT, LIMITS, cast=alongside)
    assert script.member("keeper") == CastMember("ref_ffff", "young, eager", "French")
    assert script.member("MARA") == CastMember("alice")
    assert script.cues[0].who == "keeper" and script.instruction_for(script.cues[0]) == "young, eager. quietly"
    assert script.member("NARRATOR").voice == "bob"


def test_blank_lines_comments_and_json_extras() -> None:
    script = parse_text_script("\n\n# c\nA: one\n\n\n\n# c\nB: two\n\n\n", LIMITS)
    assert [type(i).__name__ for i in script.items] == ["Cue", "SceneBreak", "Cue"]
    obj = {"lines": [{"who": "A", "text": "x", "seed": 7, "tokens": 30, "max_new_tokens": 40}], "max_new_tokens": 50}
    parsed = parse_json_script(obj, LIMITS)
    cue = parsed.cues[0]
    assert (cue.seed, cue.tokens, cue.max_new_tokens, parsed.max_new_tokens) == (7, 30, 40, 50)
    assert parse_text_script("@max_new_tokens 64\nA: x", LIMITS).max_new_tokens == 64


@pytest.mark.parametrize(
    ("text", "where", "says"),
    [
        ("KEEPER (hi)", "line 1", "expected a cue"),
        ("A: fine\nno colon here", "line 2", "expected a cue"),
        ("(x): hi", "line 1", "expected a cue"),
        ("A: (quietly the light", "line 1", "never closed"),
        ("A: () words", "line 1", "empty delivery cue"),
        ("A:    ", "line 1", "no words"),
        ("A: (only a cue)", "line 1", "no words"),
        ("A: x\n[pause]", "line 2", "[pause 1.5s]"),
        ("A: x\n[pause -1s]", "line 2", "[pause 1.5s]"),
        ("A: x\n[pause 0s]", "line 2", "more than 0"),
        ("A: x\n[pause 61s]", "line 2", "at most 60"),
        ("A: x\n[scene 2]", "line 2", "[pause 1.5s]"),
        ("A: x\n@cast B", "line 2", "belongs in the header"),
        ("@cast", "line 1", "needs a name"),
        ("@cast A voice", "line 1", "key=value"),
        ("@cast A colour=red", "line 1", "key=value"),
        ("@cast A voice=x voice=y", "line 1", "given twice"),
        ('@cast A instruction="open', "line 1", "No closing quotation"),
        ("@cast A\n@cast a", "line 2", "already in the cast"),
        ("@cast A:B", "line 1", "character name"),
        ("@title\n@gap 11s\nA: x", "line 2", "at most 10"),
        ("@gap soon\nA: x", "line 1", "duration"),
        ("@max_new_tokens 0\nA: x", "line 1", "whole number"),
        ("@colour red\nA: x", "line 1", "unknown header line"),
        ("# nothing\n\n", "", "no lines to speak"),
        ("A: " + "x" * 4001, "line 1", "at most 4000"),
        ("@cast A instruction=" + "y" * 5001 + "\nA: x", "line 1", "at most 5000"),
        ("@cast A instruction=" + "y" * 4000 + "\nA: (" + "z" * 1000 + ") x", "line 2", "together"),
        ("X" * 65 + ": words", "line 1", "at most 64"),
    ],
)
def test_malformed_text_scripts_name_the_line(text: str, where: str, says: str) -> None:
    with pytest.raises(ScriptError) as info:
        parse_text_script(text, LIMITS)
    err = info.value
    assert err.code == ErrorCode.INVALID_FIELD and err.field == "script"
    assert err.where == where, err.message
    assert err.message.startswith(f"{where}: " if where else "") and says in err.message, err.message


def test_too_many_lines_names_the_first_one_over() -> None:
    with pytest.raises(ScriptError) as info:
        parse_text_script("# x\n" + "A: hello\n" * 4, Limits(max_script_lines=3))
    assert info.value.where == "line 5" and "at most 3 lines" in info.value.message


def _line(**fields: Any) -> dict[str, Any]:
    return {"lines": [{"who": "A", "text": "words", **fields}]}


@pytest.mark.parametrize(
    ("obj", "where", "says"),
    [
        ([1, 2], "", "is an object"),
        ({"lines": [], "colour": 1}, "", "unknown key"),
        ({}, "lines", "needs 'lines'"),
        ({"lines": "A: hi"}, "lines", "needs 'lines'"),
        ({"lines": []}, "", "no lines to speak"),
        ({"lines": [{"who": "A", "text": "x"}, 3]}, "lines[1]", "is an object"),
        ({"lines": [{"text": "x"}]}, "lines[0]", "'who'"),
        ({"lines": [{"who": 3, "text": "x"}]}, "lines[0]", "'who'"),
        ({"lines": [{"who": "A", "text": "  "}]}, "lines[0]", "no words"),
        ({"lines": [{"who": "A"}]}, "lines[0]", "no words"),
        ({"lines": [{"who": "A:", "text": "x"}]}, "lines[0]", "character name"),
        (_line(seed=-1), "lines[0].seed", "'seed' = -1 is out of range"),
        (_line(seed="7"), "lines[0].seed", "integer"),
        (_line(tokens=0), "lines[0].tokens", "out of range"),
        (_line(max_new_tokens=5000), "lines[0].max_new_tokens", "out of range"),
        (_line(instruction=5), "lines[0]", "must be text"),
        (_line(emotion="sad"), "lines[0]", "unknown key"),
        ({"lines": [{"pause": 0}]}, "lines[0].pause", "more than 0"),
        ({"lines": [{"pause": 61}]}, "lines[0].pause", "seconds from 0 to 60"),
        ({"lines": [{"pause": "1s"}]}, "lines[0].pause", "seconds"),
        ({"lines": [{"pause": 1, "who": "A"}]}, "lines[0]", "alone"),
        ({"lines": [{"scene": 3}]}, "lines[0]", "'scene' is true"),
        ({**_line(), "gap_sec": 11}, "gap_sec", "seconds from 0 to 10"),
        ({**_line(), "scene_gap_sec": -1}, "scene_gap_sec", "seconds"),
        ({**_line(), "title": 5}, "title", "must be text"),
        ({**_line(), "title": "t" * 201}, "title", "at most 200"),
        ({**_line(), "cast": ["A"]}, "cast", "object of characters"),
        ({**_line(), "cast": {"A": "alice"}}, "cast.A", "is an object"),
        ({**_line(), "cast": {"A": {"voice": 1}}}, "cast.A", "must be text"),
        ({**_line(), "cast": {"A": {"accent": "x"}}}, "cast.A", "unknown key"),
        ({**_line(), "cast": {"A": {}, "a": {}}}, "cast.a", "twice"),
        ({**_line(), "cast": {"A[1]": {}}}, "cast.A[1]", "character name"),
        ({**_line(), "cast": {"A": {"voice": "v" * 129}}}, "cast.A", "at most 128"),
        ({**_line(), "cast": {"A": {"language": "l" * 65}}}, "cast.A", "at most 64"),
        ({**_line(), "max_new_tokens": 0}, "max_new_tokens", "out of range"),
    ],
)
def test_malformed_json_scripts_name_the_entry(obj: Any, where: str, says: str) -> None:
    with pytest.raises(ScriptError) as info:
        parse_json_script(obj, LIMITS)
    assert info.value.where == where, info.value.message
    assert says in info.value.message, info.value.message


@pytest.mark.parametrize(
    ("body", "media_type", "code", "says"),
    [
        (b"A: \xff", "text/plain", ErrorCode.BAD_MESSAGE, "not UTF-8"),
        (b"<script/>", "application/xml", ErrorCode.UNSUPPORTED_MEDIA_TYPE, "text/plain or application/json"),
        (b'{"lines": [\n  {"who": "A",\n  "text": }]}', "application/json", ErrorCode.BAD_JSON, "line 3 column"),
        (b"[]", None, ErrorCode.BAD_MESSAGE, "object"),
        (b'{"script": 3}', None, ErrorCode.INVALID_FIELD, "plain-text script"),
        (b'{"script": "A: x", "lines": []}', None, ErrorCode.INVALID_FIELD, "unknown key 'lines'"),
        (b'{"script": "A: x", "gap_sec": 99}', None, ErrorCode.INVALID_FIELD, "gap_sec"),
        (b'{"script": "A: x", "session": 5}', None, ErrorCode.INVALID_FIELD, "session id"),
    ],
)
def test_request_bodies(body: bytes, media_type: str | None, code: ErrorCode, says: str) -> None:
    from moss_rt.protocol import ProtocolError

    with pytest.raises(ProtocolError) as info:
        parse_script_body(body, media_type, LIMITS)
    assert info.value.code == code and says in info.value.message, info.value.message


def test_request_body_forms() -> None:
    script, session = parse_script_body(TEXT.encode(), "text/plain", LIMITS)
    assert session is None and len(script.cues) == 4
    wrapped = {"script": TEXT, "cast": {"MARA": {"voice": "bob"}}, "session": "s_x", "title": "Renamed", "gap_sec": 1}
    script, session = parse_script_body(json.dumps(wrapped).encode(), "application/json", LIMITS)
    assert session == "s_x" and script.title == "Renamed" and script.gap_sec == 1.0
    assert script.member("MARA").voice == "bob" and script.member("KEEPER").voice == "ref_0123abcd"
    script, _ = parse_script_body(json.dumps(JSON_FORM).encode(), None, LIMITS)
    assert script.to_dict() == parse_text_script(TEXT, LIMITS).to_dict()


# --------------------------------------------------------------------------- the mix, to the sample


def test_layout_places_lines_with_gaps_pauses_and_scene_gaps() -> None:
    script = parse_text_script("[pause 0.5s]\nA: one\n[pause 1s]\nB: two\n\nA: three\nB: four\n[pause 2s]", LIMITS)
    audio = {1: LineAudio("t1", 1, 1000), 2: LineAudio("t2", 2, 2000), 3: LineAudio("t3", 3, 3000),
             4: LineAudio("t4", 4, 4000)}  # fmt: skip
    timeline = layout(script, audio)
    gap, scene_gap = round(0.4 * 48000), round(1.2 * 48000)
    expect = [
        Silence(24000), ("t1", 1000), Silence(48000 + gap), ("t2", 2000), Silence(scene_gap), ("t3", 3000),
        Silence(gap), ("t4", 4000), Silence(96000),
    ]  # fmt: skip
    got = [(s.audio.take_id, s.audio.samples) if isinstance(s, Placed) else s for s in timeline.segments]
    assert got == expect
    assert timeline.total_samples == sum(s.samples if isinstance(s, Silence) else s[1] for s in expect)
    starts = [p.start for p in timeline.placed]
    assert starts == [24000, 24000 + 1000 + 48000 + gap, 24000 + 3000 + 48000 + gap + scene_gap,
                      24000 + 6000 + 48000 + 2 * gap + scene_gap]  # fmt: skip
    csv_text = cue_sheet_csv(timeline, "wav")
    assert csv_text.splitlines()[0].startswith("line,scene,character,start,end,take,seed")
    assert csv_text.splitlines()[3].startswith(f"3,2,A,{starts[2] / 48000},")


def test_layout_leaves_out_lines_without_audio_with_one_gap() -> None:
    script = parse_text_script("A: one\nB: two\nA: three", LIMITS)
    timeline = layout(script, {1: LineAudio("t1", 1, 100), 3: LineAudio("t3", 3, 100)})
    assert [c.number for c in timeline.missing] == [2]
    assert timeline.segments == (timeline.placed[0], Silence(round(0.4 * 48000)), timeline.placed[1])


def test_captions_by_line_and_by_word() -> None:
    script = parse_text_script("A: Hello there. How are you?\nB: Fine <thanks> & you", LIMITS)
    timeline = layout(script, {1: LineAudio("t1", 1, 48000 * 3), 2: LineAudio("t2", 2, 48000)})
    srt = to_srt(line_captions(timeline))
    assert srt.startswith("1\n00:00:00,000 --> 00:00:03,000\nA: Hello there. How are you?\n\n2\n00:00:03,400 -->")
    vtt = to_vtt(line_captions(timeline))
    assert vtt.startswith("WEBVTT\n\n00:00:00.000 --> 00:00:03.000\n<v A>Hello there. How are you?\n")
    assert "<v B>Fine &lt;thanks&gt; &amp; you" in vtt
    words = {1: [said("Hello", 0.1, 0.4), said("there.", 0.45, 0.8), said("How", 1.0, 1.2), said("are", 1.2, 1.4),
                 said("you?", 1.4, 1.9)]}  # fmt: skip
    cues = word_captions(timeline, words)
    # A short cue stays up 0.8 s when the next leaves room (the caption writer's rule): "Hello there." to 0.9.
    assert [(c.text, round(c.start, 3), round(c.end, 3)) for c in cues] == [
        ("Hello there.", 0.1, 0.9), ("How are you?", 1.0, 1.9), ("Fine <thanks> & you", 3.4, 4.4),
    ]  # fmt: skip
    assert [c.speaker for c in cues] == ["A", "A", "B"]
    assert WordTime.from_record({"word": "x", "start": 1, "end": 2}) == WordTime("x", 1.0, 2.0, text="x")


def said(text: str, start: float, end: float) -> WordTime:
    return WordTime(text.strip(".,!?"), start, end, text=text)


def test_captions_by_word_stay_within_their_line() -> None:
    script = parse_text_script("A: Yes.\nB: No way out.\nC: Fine.", LIMITS)
    timeline = layout(script, {n: LineAudio(f"t{n}", n, 48000) for n in (1, 2, 3)})  # 1 s each, 0.4 s gaps
    words = {
        1: [said("Yes.", 0.1, 0.3)],
        # "out." runs past the take's end and a word after it is beyond the audio: cut and left out.
        2: [said("No", 0.0, 0.2), said("way", 0.3, 0.5), said("out.", 0.6, 1.4), said("again", 1.2, 1.3)],
    }
    cues = word_captions(timeline, words)
    assert [(c.speaker, c.text, round(c.start, 3), round(c.end, 3)) for c in cues] == [
        ("A", "Yes.", 0.1, 0.9),  # stays up 0.8 s, into the gap after the line
        ("B", "No way out.", 1.4, 2.4),
        ("C", "Fine.", 2.8, 3.8),  # no words: the line's own cue
    ]
    short = {1: [said("Yes.", 0.9, 0.95)]}
    assert round(word_captions(timeline, short)[0].end, 3) == 1.4  # held at most until the next line starts


# --------------------------------------------------------------------------- fair shares


def test_fair_share_bounds_each_client_and_serves_clients_in_turn() -> None:
    async def scenario() -> None:
        share = FairShare(total=4, per_client=3)
        granted: list[str] = []

        async def take(client: str) -> None:
            await share.acquire(client)
            granted.append(client)

        a = [asyncio.create_task(take("a")) for _ in range(6)]
        await asyncio.sleep(0)
        assert granted == ["a", "a", "a"] and share.held("a") == 3  # its share, not the whole total
        b = [asyncio.create_task(take("b")) for _ in range(3)]
        await asyncio.sleep(0)
        assert granted[3:] == ["b"] and share.in_use == 4
        for _ in range(3):
            share.release("a")
            await asyncio.sleep(0)
        # Freed places go to the waiting clients in turn, each within its share.
        assert sorted(granted[4:]) == ["a", "a", "b"] and share.held("a") == 2 and share.held("b") == 2
        b[2].cancel()  # a granted waiter whose task is cancelled gives its place back
        waiting = [t for t in a if not t.done()]
        assert len(waiting) == 1
        waiting[0].cancel()
        await asyncio.sleep(0)
        assert share.waiting() == 0
        for task in a + b:
            if not task.done():
                task.cancel()

    asyncio.run(scenario())


def test_fair_share_cancelled_waiter_leaves_the_queue() -> None:
    async def scenario() -> None:
        share = FairShare(total=1, per_client=1)
        await share.acquire("a")
        waiter = asyncio.create_task(share.acquire("b"))
        await asyncio.sleep(0)
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        assert share.waiting() == 0
        share.release("a")
        assert share.in_use == 0

    asyncio.run(scenario())


# --------------------------------------------------------------------------- event log


def test_event_log_replays_what_a_reconnect_missed() -> None:
    async def scenario() -> None:
        log = EventLog(kept=4)
        first = log.emit("progress", {"n": 1})
        listener, missed = log.subscribe(None)
        assert missed is None  # no id: a snapshot goes first
        for n in range(2, 7):
            log.emit("line", {"n": n})
        assert [(await listener.next(1)).data["n"] for _ in range(5)] == [2, 3, 4, 5, 6]  # type: ignore[union-attr]
        _, missed = log.subscribe(f"{log.last_id.split('-')[0]}-4")
        assert missed is not None and [e.data["n"] for e in missed] == [5, 6]
        assert log.subscribe(log.last_id)[1] == []
        assert log.subscribe(first.id)[1] is None  # older than what is kept
        assert log.subscribe("other-3")[1] is None and log.subscribe("garbage")[1] is None
        assert log.snapshot_event({}).id == log.last_id
        log.close()
        assert listener.ended and await listener.next(1) is None

    asyncio.run(scenario())


def test_a_listener_that_falls_behind_is_let_go() -> None:
    log = EventLog()
    listener, _ = log.subscribe(None)
    for n in range(LISTENER_QUEUE + 1):
        log.emit("line", {"n": n})
    assert listener.ended and listener.lagged and log.listeners == 0
