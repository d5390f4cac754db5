"""Where a take goes: pure routing rules over the replicas' last reported state (no Ray, no I/O).

- A new take goes to the routable replica with the most free places (slots + queue, minus what
  this front end sent it since its last report); ties go round the replicas in turn.
- A retake goes to the replica that holds its parent's cache (same process incarnation) while it
  is routable and has room: the engine there truncates the parent's cache. Otherwise it goes to
  the best other replica, which rebuilds the cache from the stored codes (prompt + kept frames,
  teacher-forced): ``rebuilt`` is then True and the seek acknowledgement says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    name: str
    incarnation: str
    routable: bool  # answered its last status poll, engine ready, not known dead
    free: int  # places left (may be stale by one poll)


@dataclass(frozen=True)
class Route:
    name: str
    rebuilt: bool


def plan_routes(
    candidates: Sequence[Candidate],
    *,
    retake: bool = False,
    holder: tuple[str, str] | None = None,
    turn: int = 0,
) -> list[Route]:
    """Replicas to try, best first. For a retake, ``holder`` is (name, incarnation) of the replica
    that cached its parent, when known; ``turn`` rotates ties so equal replicas share new takes."""
    n = len(candidates)
    usable = [c for c in candidates if c.routable]
    # Most free first; among equals, the one after the previous pick (stable rotation by index).
    index = {c.name: i for i, c in enumerate(candidates)}
    usable.sort(key=lambda c: (-c.free, (index[c.name] - turn) % max(n, 1)))
    if not retake:
        return [Route(c.name, rebuilt=False) for c in usable]
    if holder is None:  # parent cached nowhere we know of (another front end's, or forgotten)
        return [Route(c.name, rebuilt=True) for c in usable]
    name, incarnation = holder
    home = next((c for c in usable if c.name == name and c.incarnation == incarnation), None)
    others = [Route(c.name, rebuilt=True) for c in usable if c is not home]
    if home is None:
        return others
    if home.free > 0:
        return [Route(home.name, rebuilt=False), *others]
    # Full (as far as we know): rebuild elsewhere first; the holder is still worth a last try.
    return [*others, Route(home.name, rebuilt=False)]
