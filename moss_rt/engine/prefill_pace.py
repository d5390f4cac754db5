"""How many prompt rows one prefill pass may hold while other takes stream (chunked prefill under load).

A prefill pass is one unit: running streams wait for all of it before their next frame. Bounded only by
``prefill_max_rows`` (8,192 padded rows: 20 prompts of 400 rows, about 120 ms on an H200), a burst of arrivals
would hold every running stream for well over a frame at each pass. While takes stream, the scheduler instead
runs one pass per round of at most ``stream_rows`` padded rows, so a burst's prompts go in as chunks interleaved
with frames and a running stream's step-to-step time stays within one 80 ms frame.

``stream_rows`` is fixed for the life of the engine (``prefill_stream_rows``, or sized once at warm-up from two
timed passes to fit ``prefill_budget_ms``), never re-sized from timings while serving: which chunks share a pass
decides the pass's float rounding, so a take's codes must not depend on how fast an earlier pass happened to run.
Alone on the device (nothing streaming) passes stay as large as ``prefill_max_rows`` allows: fewest passes,
earliest first audio.

**Graph-sized passes.** ``stream_rows`` (3,480 padded rows on an H200) is far past what the prefill graphs hold
(model/prefill_graphs: a lone piece up to 512 rows, or 2-16 pieces of at most 256 rows and 1,024 padded rows), so a
pass filled to it always ran eagerly: ~50 ms for ~190 rows at full size, launch-bound, where a graphed pass costs
6-20 ms. While interactive takes are about and others stream (a director's burst of retakes, a render's lines while
directors work), the scheduler cuts each pass to what one graph holds (:func:`largest_graphed_piece`, asking the
runner by shape): every pass is short, and cancels and admissions come between passes. The cut depends only on
the pieces' sizes and starts, never on timings or on which graphs are captured yet.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# Below this a pass is mostly fixed cost (36 layers' launches); a 64-row chunk of one take always fits.
MIN_ROWS_PER_PASS = 64


@dataclass(frozen=True)
class PrefillCost:
    """A pass's time as ``fixed_s + per_row_s * padded rows`` (measured where passes are large enough to be
    compute-bound: small ones cost about the same whatever their size)."""

    fixed_s: float
    per_row_s: float

    def rows_within(self, budget_s: float, max_rows: int) -> int:
        """Padded rows of a pass that should take about ``budget_s``, within [MIN_ROWS_PER_PASS, max_rows]."""
        floor = min(MIN_ROWS_PER_PASS, max_rows)
        if self.per_row_s <= 0:  # no measurable growth with size: rows are not what costs here
            return max_rows
        fits = int((budget_s - self.fixed_s) / self.per_row_s + 1e-6)  # + 1e-6: 0.04 / 2e-5 is 1999.999...
        return max(floor, min(max_rows, fits))


def measure_prefill_cost(
    run_pass: Callable[[int], None], small: int, large: int, rows_per_chunk: int, repeats: int = 2
) -> PrefillCost:
    """Time ``run_pass(n)`` (one batched pass of n chunks of ``rows_per_chunk`` rows, waited for) at two sizes, best
    of ``repeats`` after one untimed run each (first-use costs), and fit the line through them.
    ``large`` > ``small`` >= 1."""

    def best(n: int) -> float:
        run_pass(n)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            run_pass(n)
            times.append(time.perf_counter() - t0)
        return min(times)

    t_small, t_large = best(small), best(large)
    per_row = (t_large - t_small) / ((large - small) * rows_per_chunk)
    return PrefillCost(fixed_s=max(0.0, t_small - per_row * small * rows_per_chunk), per_row_s=per_row)


def largest_graphed_piece(
    fits: Callable[[Sequence[int], Sequence[int]], bool],
    widths: Sequence[int],
    starts: Sequence[int],
    start: int,
    rows: int,
) -> int:
    """The most rows (at most ``rows``) of a piece starting at ``start`` that a pass already holding pieces of
    ``widths`` rows at ``starts`` can take and still have a graph shape (``fits``: the runner's prefill_graph_fits);
    0 when not even one row fits. A shape's buckets only grow with a piece's rows, so the largest fit is found by
    bisection."""
    if fits([*widths, rows], [*starts, start]):
        return rows  # the common case: one question
    if rows <= 1 or not fits([*widths, 1], [*starts, start]):
        return 0  # no room for it at all (a refused take costs two questions, not a bisection)
    lo, hi = 1, rows - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits([*widths, mid], [*starts, start]):
            lo = mid
        else:
            hi = mid - 1
    return lo
