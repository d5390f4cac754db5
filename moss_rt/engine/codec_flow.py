"""How far the model may run ahead of the codec's bulk lane: the rule that keeps a scheduling round from ever blocking
on the codec.

During a script render the codec is the busier side (on an H200, 66 streams: ~17 ms of codec a step for ~11 ms of
model). The scheduler used to hand a round's bulk chunks over with a blocking call, so once the bulk lane held its
``max_pending`` hand-overs the engine's thread sat inside the round's flush until the codec finished one, and a
director who arrived meanwhile waited for that (its queue time) before anyone even looked at its take.

Now a bulk hand-over that finds its lane full is *parked* behind it (codec_worker: it keeps its place and order, and
joins the lane as soon as there is room) and the round goes on: cancels, admissions and prefill passes (interactive
first) all run. What bounds the codec's lag instead is the next model step: while ``limit`` bulk hand-overs are
parked, a step that would make another bulk chunk due is held back (every stream or none, so the steps, their
batches and every take's chunks are exactly those of a round that had waited; see :func:`step_held`), except for
directors' takes in their ramp, which step on alone (:func:`ramp_while_held`: their chunks go in the priority lane).
A round with nothing else to do then returns "no work" and the engine's thread waits on its wake-up event, which the
codec worker sets whenever a call is done, and a new take, a cancel or a job sets too: it waits for codec room OR new
work, never for a fixed time.

Per stream nothing changes: its chunks are cut as before, handed over in order (a parked hand-over never lets a later
call on its streams pass it), and a cancelled take's parked chunks give its stream up like queued ones.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moss_rt.engine.metrics import EngineMetrics
    from moss_rt.engine.slots import Take

# Bulk hand-overs that may be parked behind a full bulk lane before the next step that would add one is held back:
# with max_pending queued or running, the codec is then at most max_pending + 1 hand-overs behind the model, as when
# the round blocked for room.
PARKED_HANDOVERS = 1
# ...while a director's take is starting (waiting, preparing, or in its ramp): one more, so its first frames do not
# wait for codec room behind a render's chunks (they go in the priority lane anyway). Still a fixed bound.
STARTING_PARKED_HANDOVERS = 2


def step_held(runnable: Iterable[Take], next_step: int, parked: int, *, starting: bool) -> bool:
    """Whether the round's step waits for codec room: ``parked`` bulk hand-overs are at the bound and stepping would
    make another bulk chunk due (a round whose step adds no bulk chunk steps anyway: the model runs up to the cadence).
    Every runnable take or none: holding only some would change the steps' batches and the takes' chunk phases, and
    with them what the codec decodes, by timing."""
    limit = STARTING_PARKED_HANDOVERS if starting else PARKED_HANDOVERS
    return parked >= limit and any(take.bulk_chunk_after_step(next_step) for take in runnable)


def ramp_while_held(runnable: Iterable[Take]) -> list[Take]:
    """The takes that still step while the step is held for codec room: directors' takes in the first frames of their
    ramp (Take.in_first_frames), whose chunks go in the priority lane and add nothing to the bulk lane the hold waits
    for. A director arriving during a
    script render hears its first frames without waiting for the render's chunks (measured on an H200: its first
    frame came 136 ms after its prefill at p95 during a render, 16 ms alone, with a third of the steps held). The
    others keep their frames and their chunks' cadence; they step again with everyone once there is room."""
    return [take for take in runnable if not take.batch and take.in_first_frames]


class HoldClock:
    """Times how long steps were held back for codec room (moss_rt_codec_wait_seconds, with the waits of blocking
    hand-overs, and moss_rt_steps_held_total): from the first held round to the step that finally ran."""

    def __init__(self, metrics: EngineMetrics) -> None:
        self.metrics = metrics
        self.since: float | None = None

    def held(self) -> None:
        self.metrics.steps_held.inc()
        if self.since is None:
            self.since = time.perf_counter()

    def released(self) -> None:
        """A step runs (or nothing is left to step): the hold, if any, is over."""
        if self.since is not None:
            self.metrics.codec_wait.observe(time.perf_counter() - self.since)
            self.since = None
