"""The service's recent takes: every connection's takes by id, in memory, bounded per client."""

from __future__ import annotations

from collections import Counter, OrderedDict

from moss_rt.session.records import TakeRecord, TakeStatus

DEFAULT_CAPACITY = 1024  # takes held across all clients


class RecentTakes:
    """The service's recent takes (by id), in memory and bounded, shared by every connection: what downloads,
    replays and retakes find by take id.

    Past ``capacity`` takes a take is evicted from the client that holds the most (its oldest that is not running;
    a running take is never evicted), and never from a client holding fewer takes than the one adding. So a
    client that adds takes in bulk (many resumed sessions, a burst of requests) pushes out its own, never the
    takes of a client that holds fewer: eviction is per client, and a victim's download cannot be made to
    vanish by somebody else's traffic. (When only running takes are left to evict, the store stays over its
    cap by them until they end.)
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self._takes: OrderedDict[str, TakeRecord] = OrderedDict()
        self.capacity = capacity
        self._client_of: dict[str, str] = {}  # take id -> the client that added it ("" when unknown)
        self._counts: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._takes)

    def held_by(self, client: str) -> int:
        return self._counts.get(client, 0)

    def add(self, take: TakeRecord, client: str | None = None) -> None:
        self._forget_owner(take.take_id)
        self._takes[take.take_id] = take
        owner = client or ""
        self._client_of[take.take_id] = owner
        self._counts[owner] += 1
        self._evict(owner)

    def get(self, take_id: str) -> TakeRecord | None:
        return self._takes.get(take_id)

    def discard(self, take_id: str) -> None:
        take = self._takes.get(take_id)
        if take is not None and take.status is not TakeStatus.RUNNING:
            self._drop(take_id)

    def _drop(self, take_id: str) -> None:
        del self._takes[take_id]
        self._forget_owner(take_id)

    def _forget_owner(self, take_id: str) -> None:
        owner = self._client_of.pop(take_id, None)
        if owner is not None:
            self._counts[owner] -= 1
            if self._counts[owner] <= 0:
                del self._counts[owner]

    def _evict(self, adder: str) -> None:
        while len(self._takes) > self.capacity:
            floor = self._counts.get(adder, 0)
            for owner, held in self._counts.most_common():
                if held < floor:
                    return  # everyone left holds fewer takes than the adder: not theirs to give up
                victim = next(
                    (
                        take_id
                        for take_id, take in self._takes.items()
                        if self._client_of.get(take_id) == owner and take.status is not TakeStatus.RUNNING
                    ),
                    None,
                )
                if victim is not None:
                    self._drop(victim)
                    break
            else:
                return  # only running takes are left over the cap
