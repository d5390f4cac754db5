"""Takes on their way to an idle engine: a burst gathered into one prefill pass, a lone take started at once.

Takes that arrive together should share one batched prefill pass and then step together (one batch, one codec
call per chunk); a take arriving a round later needs a pass of its own, under the streaming budget. An idle engine
that was handed a take used to wait a short window (3 ms) for more, and another while each window brought some:
so a lone take, which is most takes of a director working alone, paid one window of its first audio for a burst
that never came.

What the engine can know instead is whether more takes are on their way: a submit counts itself in flight from the
moment it is accepted until its take is in the engine's inbox (its prompt rows are built in between, on a helper
thread, and it yields to the event loop once before it lands, so the messages that came with it are read and their
submits counted too). One take with nothing in flight starts at once (:func:`gather_burst`); a burst (more than one
take, or some in flight) is gathered as before, until a whole window brings nothing and nothing is on its way.

Measured on an H200 (bench/RESULTS.md, session 36): a lone take's queue time 3.6-3.9 ms -> 0.4-0.8 ms. Counting in
flight alone, without the window for bursts, split bursts of cached prompts (built on the spot, so never in flight
for long): 64 takes of one line 447x -> 414-416x; the window stays for them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

# An idle engine that has more than one take, or takes on their way, gathers until a window this long brings nothing
# and no submit is in flight, and for at most BURST_MAX_S in all (a prompt built slowly must not hold the takes
# already here).
BURST_WINDOW_S = 0.003
BURST_MAX_S = 0.05


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
    landed: int,
    max_s: float | None = None,
    window_s: float = BURST_WINDOW_S,
) -> int:
    """Move into the engine the rest of a burst (``drain``: the inbox into the scheduler, returning how many);
    ``landed``: the takes it just moved in. Returns how many more it moved.

    One take with nothing in flight is a lone take: it starts at once. Otherwise the engine gathers until a whole
    window brings nothing new while no submit is in flight (woken early by each landing take), at most ``max_s``
    (default BURST_MAX_S)."""
    if landed <= 1 and not in_flight.count:
        return 0
    moved = 0
    deadline = time.monotonic() + (BURST_MAX_S if max_s is None else max_s)
    while (left := deadline - time.monotonic()) > 0:
        wake.clear()
        n = drain()  # what landed before the clear (its wake-up is gone now)
        if n == 0:
            woke = wake.wait(min(window_s, left))
            n = drain()
            if n == 0 and not woke and not in_flight.count:
                break  # a quiet window, nothing on its way: the burst is in
        moved += n
    return moved + drain()
