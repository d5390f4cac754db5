"""Places for script lines in the engine: a share for all renders, a share per client, handed out in turn.

A render fills free capacity with many lines at once, but never all of it: all script renders together hold at
most ``total`` engine slots (the rest, and the engine's queue, stay for interactive takes, which the scheduler
serves first), and one client's renders at most ``per_client``. When a place frees, the clients waiting for one
are served round-robin, so a client with one short script is not stuck behind another's 500 lines.

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
        """Grant free places to waiting clients in turn (each grant sends its client to the back)."""
        progress = True
        while progress and self.in_use < self.total:
            progress = False
            for client in list(self._waiting):
                if self.in_use >= self.total:
                    return
                queue = self._waiting[client]
                while queue and queue[0].done():  # cancelled waiters
                    queue.popleft()
                if not queue:
                    del self._waiting[client]
                    continue
                if self._held.get(client, 0) >= self.per_client:
                    continue
                queue.popleft().set_result(None)
                self._held[client] = self._held.get(client, 0) + 1
                if queue:
                    self._waiting.move_to_end(client)
                else:
                    del self._waiting[client]
                progress = True
