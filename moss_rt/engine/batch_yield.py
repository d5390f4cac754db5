"""Batch work stands aside while a director waits for a take's first frame, within a share of the steps.

A script render's lines (batch work) step together with the directors' takes: one batched step of ~80 streams
costs ~15 ms on an H200 where a director's take alone costs ~6, and every round a director's prefill pass waits
for it. Measured during a 200-line render (bench/RESULTS.md, session 11) a director's first audio took 218 ms at
p95 against 61 ms with no render running, 136 ms of it between its prefill and its first frame. Issue 26 asks
for at most 1.5x.

So while a director's take waits with a slot free for it, is being prefilled, or has yet to make its first frame,
the step leaves batch takes out: the director's pass and first step run without the render's step before them.
Batch work has no listener waiting, so standing aside costs it only time, and that is bounded: of any run of step
rounds it stands aside in at most ``share`` of them plus ``burst`` rounds, so a stream of directors' starts slows
a render down by at most half and never stops it. The bound counts rounds, not seconds: no decision of a round
reads the clock (docs/architecture.md), so the same arrivals give the same steps. On the CPU a step's codes do not
depend on its batch (docs/model.md); on a GPU they are equal to float rounding, as with any change of batch.
"""

from __future__ import annotations

# Batch work stands aside in at most this share of the step rounds (a render at least half its pace while directors
# start one take after another)...
BATCH_YIELD_SHARE = 0.5
# ...plus at most this many rounds in a row: a director's admission, prefill pass and first step take two or three,
# a burst of directors' starts a few of each.
BATCH_YIELD_BURST_ROUNDS = 8


class BatchYield:
    """Whether a round's step leaves batch work out: a credit of rounds that grows by ``share`` every step round and
    is spent, one a round, while batch work stands aside, at most ``burst``. Of any N step rounds it stands aside in
    at most ``share * N + burst``."""

    def __init__(self, share: float = BATCH_YIELD_SHARE, burst: int = BATCH_YIELD_BURST_ROUNDS) -> None:
        self.share = share
        self.burst = float(burst)
        self.credit = float(burst)

    def decide(self, wanted: bool) -> bool:
        """Called once every step round: whether batch work stands aside in it (``wanted``: a director waits)."""
        self.credit = min(self.burst, self.credit + self.share)
        aside = wanted and self.credit >= 1.0
        if aside:
            self.credit -= 1.0
        return aside
