"""Word timing in the sans-I/O directing session: when the transport is asked to settle a take's words, seek by
word, and the words a retake keeps; and the session store's words table (old databases gain it)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from moss_rt.align.base import WordTime
from moss_rt.engine.base import EndReason
from moss_rt.protocol import AppendText, EndOfText, ProtocolError, Seek, StartTake
from moss_rt.session import Admit, FinishWords, SendMessage, WordsCheckpoint
from moss_rt.session_store import SessionStore
from tests.test_directing_session import chunk, make_session, only, stream
from tests.test_session_store import make_take


def words_of(text: str, times: list[tuple[float, float]]) -> list[WordTime]:
    out, at = [], 0
    for word, (start, end) in zip(text.split(), times, strict=True):
        at = text.index(word, at)
        out.append(WordTime(word.strip(".,"), start, end, text=word, chars=(at, at + len(word))))
        at += len(word)
    return out


def test_words_are_settled_before_the_take_is_kept_and_ends() -> None:
    s = make_session()
    s.keep_takes(10)
    (admit,) = s.handle(StartTake(text="Forty ships.", seed=1, words=True))
    actions = stream(s, admit.run)
    kinds = [type(a).__name__ if not isinstance(a, SendMessage) else a.message.type for a in actions]
    assert kinds.index("FinishWords") < kinds.index("Keep") < kinds.index("end")
    (finish,) = only(actions, FinishWords)
    assert finish.complete is True and finish.take.take_id == "t0"


def test_a_cut_take_settles_only_what_was_said_and_a_take_without_words_asks_nothing() -> None:
    s = make_session()
    (admit,) = s.handle(StartTake(text="Forty ships.", words=True))
    (finish,) = only(stream(s, admit.run, reason=EndReason.MAX_FRAMES), FinishWords)
    assert finish.complete is False
    (admit,) = s.handle(StartTake(text="Forty ships."))
    assert only(stream(s, admit.run), FinishWords) == []
    # Replaced before it streamed: still one (final) words message before its end.
    (first,) = s.handle(StartTake(text="a", words=True))
    actions = s.handle(StartTake(text="b"))
    assert [type(a) for a in actions[:3]] == [SendMessage, FinishWords, SendMessage]


def test_fed_text_checkpoints_each_continuation_with_the_text_it_spoke() -> None:
    s = make_session()
    (admit,) = s.handle(StartTake(text="One two. ", stream_text=True, words=True))
    s.handle(AppendText(text="Three. "))
    actions = s.admitted(admit.run) + s.take_event(admit.run, chunk(0))
    from moss_rt.engine.base import TakeFinished

    actions = s.take_event(admit.run, TakeFinished(EndReason.DONE, 2, 1.0))
    (checkpoint,) = only(actions, WordsCheckpoint)
    assert checkpoint.text == "One two. "  # the text that continuation spoke, not what the next one gets
    (nxt,) = only(actions, Admit)
    assert nxt.take.request.text == "One two. Three. "
    s.handle(EndOfText())
    s.admitted(nxt.run)
    s.take_event(nxt.run, chunk(2))
    end = s.take_event(nxt.run, TakeFinished(EndReason.DONE, 4, 1.0))
    assert len(only(end, WordsCheckpoint)) == 1 and only(end, FinishWords)[0].complete


def test_seek_by_word_goes_to_the_frame_where_it_starts_and_keeps_earlier_words() -> None:
    s = make_session()
    (admit,) = s.handle(StartTake(text="Forty ships sailed home.", words=True))
    stream(s, admit.run, frames=40)
    take = s.history.get("t0")
    take.words = words_of(take.request.text, [(0.1, 0.5), (0.6, 1.0), (1.13, 1.6), (1.7, 2.2)])
    actions = s.handle(Seek(take="t0", frame=0, word=2, seed=3))
    (retake,) = only(actions, Admit)
    assert retake.take.branch_frame == 14  # 1.13 s is in frame 14 (1.12 … 1.2)
    assert [w.word for w in retake.take.words] == ["Forty", "ships"]  # both end before 1.12 s
    with pytest.raises(ProtocolError) as err:
        s.history.plan_seek(Seek(take="t0", frame=0, word=4))
    assert err.value.field == "word"
    take.words = None
    with pytest.raises(ProtocolError, match="no word timings"):
        s.history.plan_seek(Seek(take="t0", frame=0, word=0))


def test_retake_with_new_text_keeps_only_the_words_still_in_it() -> None:
    s = make_session()
    (admit,) = s.handle(StartTake(text="Forty ships sailed home.", words=True))
    stream(s, admit.run, frames=40)
    s.history.get("t0").words = words_of("Forty ships sailed home.", [(0.1, 0.5), (0.6, 1.0), (1.1, 1.6), (1.7, 2.2)])
    (retake,) = only(s.handle(Seek(take="t0", frame=25, text="Forty boats sailed home.")), Admit)
    assert [w.word for w in retake.take.words] == ["Forty"]


def test_words_table_is_added_to_an_old_database_and_follows_its_take(tmp_path: Path) -> None:
    root = tmp_path / "sessions"
    root.mkdir()
    old = sqlite3.connect(root / "sessions.sqlite3")  # a database from before word timing
    old.executescript(
        "CREATE TABLE sessions (id TEXT PRIMARY KEY, created REAL NOT NULL, updated REAL NOT NULL);"
        "INSERT INTO sessions VALUES ('s_AAAAAAAAAAAAAAAAAAAAAAAA', 1.0, 1.0);"
    )
    old.close()
    store = SessionStore(root)
    assert store.exists("s_AAAAAAAAAAAAAAAAAAAAAAAA")
    sid = store.create()
    take, codes, pcm = make_take("t_a", 3)
    store.put_take(sid, take, codes, pcm)
    assert store.words(sid, "t_a") is None
    words = [w.to_record() for w in words_of("line of", [(0.1, 0.3), (0.4, 0.6)])]
    store.put_words(sid, "t_a", words, "pocketsphinx")
    store.close()
    store = SessionStore(root)  # after a restart
    assert store.words(sid, "t_a") == words
    assert [WordTime.from_record(r).chars for r in store.words(sid, "t_a")] == [(0, 4), (5, 7)]
    store.put_take(sid, take, codes, pcm)  # storing the take again keeps its words
    assert store.words(sid, "t_a") == words
    store.delete_take(sid, "t_a")
    with pytest.raises(ProtocolError):
        store.words(sid, "t_a")
    store.close()
