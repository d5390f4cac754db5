"""An idle engine's wait for a burst (engine/arrivals): only while submits are on their way, never for a lone take."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from moss_rt.engine.arrivals import SubmitsInFlight, gather_burst


class CountingEvent(threading.Event):
    """A wake-up event that records how often the engine waited on it; ``on_first_wait`` runs (on another thread)
    when the engine first waits, so what it does comes while the engine waits, however slow the machine."""

    def __init__(self, on_first_wait: Callable[[], None] | None = None) -> None:
        super().__init__()
        self.waits = 0
        self.on_first_wait = on_first_wait

    def wait(self, timeout: float | None = None) -> bool:
        self.waits += 1
        if self.waits == 1 and self.on_first_wait is not None:
            threading.Thread(target=self.on_first_wait).start()
        return super().wait(timeout)


class Inbox:
    """Takes that landed, moved out by ``drain`` (as the engine moves its inbox into the scheduler)."""

    def __init__(self) -> None:
        self.landed = 0
        self.moved = 0
        self.lock = threading.Lock()

    def land(self) -> None:
        with self.lock:
            self.landed += 1

    def drain(self) -> int:
        with self.lock:
            n, self.moved = self.landed - self.moved, self.landed
            return n


def test_a_lone_take_is_not_held_for_a_burst_that_is_not_coming() -> None:
    inbox, wake = Inbox(), CountingEvent()
    inbox.land()
    assert inbox.drain() == 1  # the engine moved it in when it woke
    assert gather_burst(SubmitsInFlight(), inbox.drain, wake, landed=1, max_s=30.0) == 0
    assert wake.waits == 0  # the old rule waited one 3 ms window here, on every lone take's first audio


def test_takes_on_their_way_are_waited_for_and_moved_in_as_they_land() -> None:
    started, release = threading.Barrier(3), threading.Event()
    submits, inbox, wake = SubmitsInFlight(), Inbox(), CountingEvent(on_first_wait=release.set)

    def submit() -> None:
        with submits.one():
            started.wait(5)
            release.wait(5)
            inbox.land()  # in the inbox inside the count, the wake-up after it (as Engine.submit does)
        wake.set()

    threads = [threading.Thread(target=submit) for _ in range(2)]
    for t in threads:
        t.start()
    started.wait(5)  # both counted in flight
    assert submits.count == 2
    moved = gather_burst(submits, inbox.drain, wake, landed=1, max_s=30.0)
    for t in threads:
        t.join(5)
    assert moved == 2 and submits.count == 0
    assert wake.waits >= 1


def test_a_submit_that_never_lands_holds_the_engine_for_max_s_at_most() -> None:
    submits, inbox, wake = SubmitsInFlight(), Inbox(), CountingEvent()
    with submits.one():  # a prompt still being built when the wait runs out
        t0 = time.monotonic()
        assert gather_burst(submits, inbox.drain, wake, landed=1, max_s=0.05, window_s=0.01) == 0
        assert time.monotonic() - t0 < 5.0  # bounded (not a timing measurement: it would hang otherwise)
        assert wake.waits >= 1


def test_takes_that_landed_together_wait_for_a_quiet_window_for_the_rest() -> None:
    """Two takes already in (a burst whose prompts were built on the spot, never in flight for long): the engine
    still waits one whole window for more, and moves in one that lands meanwhile."""

    def straggler() -> None:
        inbox.land()
        wake.set()

    inbox, wake = Inbox(), CountingEvent(on_first_wait=straggler)
    for _ in range(2):
        inbox.land()
    assert inbox.drain() == 2
    assert gather_burst(SubmitsInFlight(), inbox.drain, wake, landed=2, max_s=30.0, window_s=0.3) == 1
    assert wake.waits >= 2  # woken by the straggler, then one quiet window


def test_a_refused_submit_stops_counting() -> None:
    submits = SubmitsInFlight()
    with pytest.raises(RuntimeError), submits.one():
        assert submits.count == 1
        raise RuntimeError("busy")
    assert submits.count == 0
