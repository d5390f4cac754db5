"""Takes on their way to an idle engine: a burst gathered into one prefill pass, a lone take started at once.

Takes that arrive together should share one batched prefill pass and then step together (one batch, one codec
call per chunk); a take arriving a round later needs a pass of its own, under the streaming budget. An idle engine
that was handed a take used to wait a short window (3 ms) for more, and another while each window brought some:
so a lone take, which is most takes of a director working alone, paid one window of its first audio for a burst
that never came.

What the engine can know instead is whether more takes are on their way: a submit counts itself in flight from the
moment it is accepted until its take is in the engine's inbox (its prompt rows are built in between, on a helper
thread, for about a millisecond). :func:`gather_burst` waits only while some are in flight, woken as each lands,
and never past ``max_s``; with none in flight it returns at once. A burst's takes all reach the server's event loop
before the first one's prompt is built (the loop reads every message while that build runs on its thread), so they
are counted in flight when the engine looks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

# An idle engine waits for takes in flight at most this long in all (a prompt built slowly must not hold the ones
# already here), and looks again at least this often (a submit refused on its way lands nothing and wakes nobody).
BURST_MAX_S = 0.05
BURST_POLL_S = 0.003


class SubmitsInFlight:
    """How many submits are between acceptance and the engine's inbox (any thread may count, any may read)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0

    @property
    def count(self) -> int:
        return self._count

    @contextmanager
    def one(self) -> Iterator[None]:
        """One submit on its way for the body's length: it must put its take in the inbox *inside* the body and
        wake the engine only after (a wake-up seen before the count drops would send the engine back to wait)."""
        with self._lock:
            self._count += 1
        try:
            yield
        finally:
            with self._lock:
                self._count -= 1


def gather_burst(
    in_flight: SubmitsInFlight,
    drain: Callable[[], int],
    wake: threading.Event,
    *,
    max_s: float | None = None,
    poll_s: float = BURST_POLL_S,
) -> int:
    """Move into the engine the takes of a burst that are still on their way (``drain``: the inbox into the
    scheduler, returning how many); returns how many it moved. Waits only while submits are in flight, woken by
    each landing one, and at most ``max_s`` (default BURST_MAX_S)."""
    moved = 0
    deadline = time.monotonic() + (BURST_MAX_S if max_s is None else max_s)
    while in_flight.count and time.monotonic() < deadline:
        wake.clear()
        if in_flight.count:  # looked at after clear(): a landing take's set() is never lost
            wake.wait(min(poll_s, max(0.0, deadline - time.monotonic())))
        moved += drain()
    return moved + drain()
