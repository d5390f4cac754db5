"""Where a take goes: pure routing rules over the replicas' last reported state (no Ray, no I/O).

- A new take goes to the routable replica with the most free places (slots + queue, minus what
  this front end sent it since its last report); ties go round the replicas in turn.
- **Cache-aware** (``cached`` and ``margin`` given): among the replicas with a slot free whose load
  (active + queued + sent since the last report) is at most ``margin`` above the least loaded one, a new
  take goes to the one holding the longest run of its prompt blocks (rows beyond the opening every prompt shares; see
  engine/prompt_names.py), when any holds some. A hot replica thus keeps the lines of its voices until
  it is ``margin`` takes busier than the least loaded one; then they spill over (and the other replica
  starts keeping them too).
- A retake goes to the replica that holds its parent's cache (same process incarnation) while it
  is routable and has room: the engine there truncates the parent's cache. Otherwise it goes to
  the best other replica (by the rules above), which rebuilds the cache from the stored codes
  (prompt + kept frames, teacher-forced): ``rebuilt`` is then True and the seek acknowledgement says so.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    name: str
    incarnation: str
    routable: bool  # answered its last status poll, engine ready, not known dead
    free: int  # places left (may be stale by one poll)
    load: int = 0  # takes active, queued and sent since the last poll
    idle: int | None = None  # slots free to start a take now (None: unknown, ``free`` counts)


@dataclass(frozen=True)
class Route:
    name: str
    rebuilt: bool
    cached_rows: int = 0  # prompt rows (beyond the generic opening) the replica is known to hold


def plan_routes(
    candidates: Sequence[Candidate],
    *,
    retake: bool = False,
    holder: tuple[str, str] | None = None,
    turn: int = 0,
    cached: Mapping[str, int] | None = None,
    margin: int = -1,
) -> list[Route]:
    """Replicas to try, best first. For a retake, ``holder`` is (name, incarnation) of the replica
    that cached its parent, when known; ``turn`` rotates ties so equal replicas share new takes;
    ``cached`` (replica name -> prompt rows it holds) with ``margin`` >= 0 makes it cache-aware."""
    n = len(candidates)
    usable = [c for c in candidates if c.routable]
    # Most free first; among equals, the one after the previous pick (stable rotation by index).
    index = {c.name: i for i, c in enumerate(candidates)}
    usable.sort(key=lambda c: (-c.free, (index[c.name] - turn) % max(n, 1)))
    rows = dict(cached or {})
    if margin >= 0 and rows:
        usable = prefer_cached(usable, rows, margin)
    if not retake:
        return [Route(c.name, False, rows.get(c.name, 0)) for c in usable]
    if holder is None:  # parent cached nowhere we know of (another front end's, or forgotten)
        return [Route(c.name, True, rows.get(c.name, 0)) for c in usable]
    name, incarnation = holder
    home = next((c for c in usable if c.name == name and c.incarnation == incarnation), None)
    others = [Route(c.name, True, rows.get(c.name, 0)) for c in usable if c is not home]
    if home is None:
        return others
    if home.free > 0:
        return [Route(home.name, False), *others]
    # Full (as far as we know): rebuild elsewhere first; the holder is still worth a last try.
    return [*others, Route(home.name, False)]


def prefer_cached(order: list[Candidate], cached: Mapping[str, int], margin: int) -> list[Candidate]:
    """``order`` (best by load first) with the replica holding the most of the prompt moved to the front, if
    it has a slot free (a take queued behind others would lose more time than the prefill it saves) and its
    load is within ``margin`` of the least loaded; unchanged when none qualifies."""
    if not order:
        return order
    least = min(c.load for c in order)
    eligible = [
        c
        for c in order
        if (c.free if c.idle is None else c.idle) > 0 and c.load - least <= margin and cached.get(c.name, 0) > 0
    ]
    if not eligible:
        return order
    # The longest run; among equal runs the first in load order (max keeps the first of equals).
    best = max(eligible, key=lambda c: cached[c.name])
    return [best, *(c for c in order if c is not best)]
