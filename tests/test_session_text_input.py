"""A take fed with text (``stream_text``) in the directing session, sans-I/O: continuations, waits, stops."""

from __future__ import annotations

import numpy as np
import pytest

from moss_rt.engine.base import AudioChunk, EndReason, TakeFinished, TakeFirstAudio
from moss_rt.protocol import AppendText, Cancel, EndOfText, ErrorCode, FlushText, ProtocolError, StartTake
from moss_rt.session import Action, Admit, FinishAudio, Phase, SendAudio, TakeLifecycle
from tests.test_directing_session import make_session, only, sent


def chunk(first: int, n: int = 2) -> AudioChunk:
    return AudioChunk(first, np.full((n, 12), first, dtype=np.int64), b"\x01\x00" * 3840 * n)


def speak(s: TakeLifecycle, admit: Admit, frames: int, reason: EndReason = EndReason.DONE) -> list[Action]:
    """The continuation of ``admit`` is admitted, sends ``frames`` frames after its prefix and ends."""
    first = 0 if admit.prefix_codes is None else len(admit.prefix_codes)
    actions = s.admitted(admit.run) + s.take_event(admit.run, TakeFirstAudio(2.0))
    for f in range(first, first + frames, 2):
        actions += s.take_event(admit.run, chunk(f))
    return actions + s.take_event(admit.run, TakeFinished(reason, first + frames, 5.0, 2.0))


def start(s: TakeLifecycle, text: str = "", **fields: object) -> list[Action]:
    return s.handle(StartTake(text=text, stream_text=True, seed=3, **fields))  # type: ignore[arg-type]


def test_continuations_follow_the_text() -> None:
    s = make_session()
    assert start(s) == [] and s.phase is Phase.WAITING  # nothing to say yet, nothing sent
    assert s.handle(AppendText(text="Hello there")) == []  # no sentence end yet
    (first,) = s.handle(AppendText(text=". How are"))
    assert isinstance(first, Admit) and s.phase is Phase.ADMITTING
    spec = first.spec(None)
    assert (spec.take_id, spec.text, spec.prefix_codes, spec.seed) == ("t0", "Hello there. ", None, 3)
    actions = speak(s, first, 4)
    assert sent(actions)[:3] == [("start", "t0"), ("pcm",), ("pcm",)]
    assert s.phase is Phase.WAITING  # "How are" is not a sentence yet
    # More text arrives while nothing generates: the next continuation picks up after frame 4.
    (second,) = s.handle(AppendText(text=" you? Fine"))
    spec = second.spec(None)
    assert spec.take_id == "t0.1" and spec.parent_take == "t0" and spec.text == "Hello there. How are you? "
    assert np.array_equal(spec.prefix_codes, s.history.get("t0").codes) and len(spec.prefix_codes) == 4
    assert spec.max_frames == 4096 - 4
    actions = speak(s, second, 2)
    assert sent(actions) == [("pcm",)] and s.phase is Phase.WAITING  # one take: no second start
    (third,) = s.handle(EndOfText())
    assert third.spec(None).text == "Hello there. How are you? Fine"
    actions = speak(s, third, 2)
    assert isinstance(actions[-2], FinishAudio) and s.phase is Phase.IDLE
    end = actions[-1].message.to_dict()
    assert (end["type"], end["reason"], end["n_frames"]) == ("end", "done", 8)
    assert (end["continuations"], end["text_waits"], end["gpu_total_ms"]) == (3, 2, 15.0)
    record = s.history.get("t0")
    assert record.request.text == "Hello there. How are you? Fine" and record.status == "ended"


def test_text_faster_than_speech_is_spoken_by_the_next_continuation_at_once() -> None:
    s = make_session()
    (first,) = start(s, "One. ")
    for piece in ("Two. ", "Three. ", "Four"):
        assert s.handle(AppendText(text=piece)) == []  # a continuation is generating: kept for the next
    s.handle(EndOfText())
    actions = speak(s, first, 2)
    (second,) = only(actions, Admit)  # admitted the moment the first ended: no wait, no gap
    assert second.spec(None).text == "One. Two. Three. Four" and s.phase is Phase.ADMITTING
    actions = speak(s, second, 2)
    end = actions[-1].message.to_dict()
    assert end["reason"] == "done" and (end["continuations"], end["text_waits"]) == (2, 0)


def test_flush_speaks_what_has_arrived() -> None:
    s = make_session()
    start(s, "no sentence end")
    (admit,) = s.handle(FlushText())
    assert admit.spec(None).text == "no sentence end"


@pytest.mark.parametrize("while_", ["waiting", "generating"])
def test_cancel_ends_the_take_with_one_end(while_: str) -> None:
    s = make_session()
    (first,) = start(s, "First. ")
    actions = speak(s, first, 2)
    if while_ == "generating":
        (second,) = s.handle(AppendText(text="Second. "))
        s.admitted(second.run)
        (stop,) = s.handle(Cancel())
        actions = s.take_event(second.run, TakeFinished(EndReason.CANCELLED, 2, 1.0))
    else:
        actions = s.handle(Cancel())  # nothing in flight: it ends here and now
    assert isinstance(actions[0], FinishAudio)
    assert sent(actions) == [("end", "t0", "cancelled")] and s.phase is Phase.IDLE
    with pytest.raises(ProtocolError) as exc:
        s.handle(AppendText(text="late"))
    assert exc.value.code.value == "not_found" and exc.value.field == "take"


def test_a_continuation_that_finishes_while_stopping_ends_the_take() -> None:
    s = make_session()
    (first,) = start(s, "First. Second. ")
    s.admitted(first.run)
    s.handle(Cancel())
    actions = s.take_event(first.run, TakeFinished(EndReason.DONE, 0, 1.0))  # it had ended anyway
    assert sent(actions) == [("start", "t0"), ("end", "t0", "cancelled")] and not only(actions, Admit)


def test_a_start_replaces_a_waiting_take_and_text_can_go_to_a_pending_one() -> None:
    s = make_session()
    start(s, "Waiting for the rest")
    actions = s.handle(StartTake(text="Something else."))
    assert sent(actions) == [("start", "t0"), ("end", "t0", "replaced")] and isinstance(actions[-1], Admit)
    # A streamed take started right behind a stopping one gets its text while it waits to begin.
    s.admitted(actions[-1].run)
    s.handle(StartTake(text="", stream_text=True))  # replaces t1 (streaming): t2 is pending
    assert s.phase is Phase.STOPPING
    s.handle(AppendText(text="Kept. "))
    actions = s.take_event(actions[-1].run, TakeFinished(EndReason.REPLACED, 0, 1.0))
    (admit,) = only(actions, Admit)
    assert admit.take.take_id == "t2" and admit.spec(None).text == "Kept. "


def test_budget_and_errors() -> None:
    s = make_session()
    (first,) = start(s, "One. Two. ", max_new_tokens=4)
    s.handle(AppendText(text="Three. "))
    actions = speak(s, first, 4)  # the whole budget: the rest cannot be spoken
    assert sent(actions)[-1] == ("end", "t0", "max_frames")
    # A later continuation's admission fails: the take that was under way gets an error and its end.
    s2 = make_session()
    (first,) = start(s2, "One. ")
    speak(s2, first, 2)
    (second,) = s2.handle(AppendText(text="Two. "))
    actions = s2.admission_failed(second.run, ProtocolError(ErrorCode.BUSY, "full"))
    assert sent(actions) == [("error", "t0"), ("end", "t0", "error")]


def test_text_for_no_fed_take_is_not_found() -> None:
    s = make_session()
    s.handle(StartTake(text="A plain take."))
    for msg in (AppendText(text="x"), FlushText(), EndOfText()):
        with pytest.raises(ProtocolError) as exc:
            s.handle(msg)
        assert exc.value.code.value == "not_found"
    assert not only(s.handle(Cancel()), SendAudio)
