"""The store of streamed PCM that replays and downloads send (sans-I/O)."""

from __future__ import annotations

from moss_rt.heard_audio import HeardAudio

FRAME = 4  # bytes per frame in these tests


def frames(first: int, count: int) -> bytes:
    return b"".join(bytes([(first + i) % 256]) * FRAME for i in range(count))


def test_a_take_is_held_as_streamed() -> None:
    heard = HeardAudio(1024)
    heard.begin("a", FRAME)
    heard.append("a", 0, frames(0, 3))
    heard.append("a", 3, frames(3, 2))
    assert heard.get("a", 5, FRAME) == frames(0, 5)
    assert heard.get("a", 2, FRAME) == frames(0, 2)
    assert heard.get("a", 6, FRAME) is None  # not all of it: render instead
    assert heard.get("a", 5, 2 * FRAME) is None  # other channel count
    assert heard.nbytes == 5 * FRAME


def test_a_gap_stops_holding_the_take() -> None:
    heard = HeardAudio(1024)
    heard.begin("a", FRAME)
    heard.append("a", 0, frames(0, 2))
    heard.append("a", 3, frames(3, 1))  # frame 2 never came
    assert "a" not in heard and heard.nbytes == 0
    heard.append("a", 4, frames(4, 1))  # ignored from now on
    assert heard.get("a", 0, FRAME) is None


def test_a_retake_starts_from_the_parents_heard_prefix() -> None:
    heard = HeardAudio(1024)
    heard.begin("a", FRAME)
    heard.append("a", 0, frames(0, 6))
    heard.begin("b", FRAME, parent="a", branch_frame=4)
    heard.append("b", 4, frames(100, 3))
    assert heard.get("b", 7, FRAME) == frames(0, 4) + frames(100, 3)
    # A parent that is gone (or too short) leaves the retake unheld: its audio will be rendered.
    heard.begin("c", FRAME, parent="gone", branch_frame=2)
    heard.begin("d", FRAME, parent="a", branch_frame=9)
    heard.append("c", 2, frames(0, 1))
    assert "c" not in heard and "d" not in heard


def test_least_recently_used_takes_leave_first_within_the_budget() -> None:
    heard = HeardAudio(10 * FRAME)
    for name in "abc":
        heard.begin(name, FRAME)
        heard.append(name, 0, frames(0, 3))
    assert heard.get("a", 3, FRAME) is not None  # "a" is now the most recently used
    heard.begin("d", FRAME)
    heard.append("d", 0, frames(0, 3))  # 12 frames > 10: "b" (least recent) goes
    assert "b" not in heard and all(name in heard for name in "acd")
    assert heard.nbytes <= 10 * FRAME


def test_a_take_larger_than_the_budget_is_not_held() -> None:
    heard = HeardAudio(4 * FRAME)
    heard.begin("small", FRAME)
    heard.append("small", 0, frames(0, 2))
    heard.begin("big", FRAME)
    heard.append("big", 0, frames(0, 5))
    assert "big" not in heard
    assert heard.get("small", 2, FRAME) == frames(0, 2)  # nothing was evicted for it


def test_zero_budget_holds_nothing() -> None:
    heard = HeardAudio(0)
    heard.begin("a", FRAME)
    heard.append("a", 0, frames(0, 1))
    assert heard.get("a", 1, FRAME) is None and heard.nbytes == 0


def test_beginning_again_replaces_the_take() -> None:
    heard = HeardAudio(1024)
    heard.begin("a", FRAME)
    heard.append("a", 0, frames(0, 2))
    heard.begin("a", FRAME)
    assert heard.nbytes == 0 and heard.get("a", 0, FRAME) == b""


def test_reads_between_appends_see_everything_streamed_so_far() -> None:
    """Chunks are kept as streamed and joined when read: a reader holding an earlier buffer keeps its frames."""
    heard = HeardAudio(1024)
    heard.begin("a", FRAME)
    heard.append("a", 0, frames(0, 2))
    early = heard.buffer("a", 2, FRAME)
    assert early is not None and bytes(early) == frames(0, 2)
    heard.append("a", 2, bytearray(frames(2, 3)))  # a mutable chunk is copied, not kept by reference
    assert heard.get("a", 5, FRAME) == frames(0, 5)
    heard.append("a", 5, frames(5, 1))
    assert heard.get("a", 6, FRAME) == frames(0, 6) and bytes(early) == frames(0, 2)
    assert heard.nbytes == 6 * FRAME
