"""Places for script lines in the engine: a share for all renders, a share per client, handed out in turn.

A render fills free capacity with many lines at once, but never all of it: all script renders together hold at
most ``total`` engine slots (the rest, and the engine's queue, stay for interactive takes, which the scheduler
serves first), and one client's renders at most ``per_client``. A free place goes to the waiting client that holds
the fewest, so a client with one short script is not stuck behind another's 500 lines, and renders side by side
split the places evenly.

Only the event loop touches it (no lock). ``acquire`` is cancel-safe: a waiter cancelled before its grant leaves
the queue; one cancelled right after it gives the place back.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque


class FairShare:
    def __init__(self, total: int, per_client: int) -> None:
        self.total = max(1, total)
        self.per_client = max(1, min(per_client, self.total))
        self._held: dict[str, int] = {}
        self._waiting: OrderedDict[str, deque[asyncio.Future[None]]] = OrderedDict()

    def resize(self, total: int, per_client: int) -> None:
        """New bounds (the engine's slot count became known); places already held are kept."""
        self.total = max(1, total)
        self.per_client = max(1, min(per_client, self.total))
        self._dispatch()

    @property
    def in_use(self) -> int:
        return sum(self._held.values())

    def held(self, client: str) -> int:
        return self._held.get(client, 0)

    def waiting(self, client: str | None = None) -> int:
        if client is not None:
            return len(self._waiting.get(client, ()))
        return sum(len(q) for q in self._waiting.values())

    async def acquire(self, client: str) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(client, deque()).append(future)
        self._dispatch()
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release(client)  # granted, but its holder is gone
            else:
                queue = self._waiting.get(client)
                if queue is not None and future in queue:
                    queue.remove(future)
                    if not queue:
                        del self._waiting[client]
            raise

    def release(self, client: str) -> None:
        count = self._held.get(client, 0) - 1
        if count > 0:
            self._held[client] = count
        else:
            self._held.pop(client, None)
        self._dispatch()

    def _dispatch(self) -> None:
        """Grant free places, each to the waiting client that holds the fewest (the longest waiting among equals),
        so clients rendering side by side converge to equal shares."""
        while self.in_use < self.total:
            best: str | None = None
            for client, queue in list(self._waiting.items()):
                while queue and queue[0].done():  # cancelled waiters
                    queue.popleft()
                if not queue:
                    del self._waiting[client]
                    continue
                held = self._held.get(client, 0)
                if held < self.per_client and (best is None or held < self._held.get(best, 0)):
                    best = client
            if best is None:
                return
            queue = self._waiting[best]
            queue.popleft().set_result(None)
            self._held[best] = self._held.get(best, 0) + 1
            del self._waiting[best]
            if queue:
                self._waiting[best] = queue  # to the back of the line
