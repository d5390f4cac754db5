"""Streaming text input (pure unit): which pieces of arriving text are ready to be spoken."""

from __future__ import annotations

import pytest

from moss_rt.protocol import ProtocolError
from moss_rt.text_feed import TextFeed


def test_a_sentence_is_ready_once_what_follows_it_arrives() -> None:
    feed = TextFeed(1000)
    for word in ("Hello", " there", "."):
        feed.append(word)
        assert feed.take_ready() is None  # "there." could still become "there.com"
    feed.append(" How")
    assert feed.take_ready() == "Hello there. "
    assert feed.spoken == "Hello there. " and feed.pending == "How"
    feed.append(" are you?\nFine")
    assert feed.take_ready() == "How are you?\n"
    assert feed.text == "Hello there. How are you?\nFine"


def test_everything_ready_is_handed_out_at_once() -> None:
    """Text faster than speech: the next continuation takes all the sentences that arrived meanwhile."""
    feed = TextFeed(1000)
    feed.append("One. Two! Three? Four")
    assert feed.take_ready() == "One. Two! Three? "
    assert feed.take_ready() is None


def test_flush_and_end_of_text() -> None:
    feed = TextFeed(1000)
    feed.append("No full stop yet")
    feed.flush()
    assert feed.take_ready() == "No full stop yet"
    feed.append(", and more")
    assert not feed.finished and feed.take_ready() is None
    feed.end()
    assert feed.take_ready() == ", and more"
    assert feed.finished and feed.take_ready() is None
    with pytest.raises(ProtocolError) as exc:
        feed.append("late")
    assert exc.value.field == "text"


def test_quotes_cjk_and_whitespace_only() -> None:
    feed = TextFeed(1000)
    feed.append('He said "Stop." Then')
    assert feed.take_ready() == 'He said "Stop." '
    feed.end()
    assert feed.take_ready() == "Then"
    cjk = TextFeed(1000, "你好。今天")
    assert cjk.take_ready() == "你好。"
    blank = TextFeed(1000, "   ")
    blank.end()
    assert blank.take_ready() is None and blank.finished


def test_the_whole_text_is_bounded() -> None:
    feed = TextFeed(10, "12345")
    feed.append("67890")
    with pytest.raises(ProtocolError) as exc:
        feed.append("x")
    assert "limit is 10" in exc.value.message
