"""Per-connection and per-client admission guards: rate limiters and a take counter."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from moss_rt.protocol import ErrorCode, ProtocolError


class TokenBucket:
    """``rate`` tokens per second, at most ``burst`` banked; one message costs one token."""

    def __init__(self, rate: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._rate = max(0.0, rate)
        self._burst = max(1, burst)
        self._tokens = float(self._burst)
        self._clock = clock
        self._last = clock()

    def take(self) -> bool:
        if self._rate <= 0:  # 0 disables the limit
            return True
        now = self._clock()
        self._tokens = min(self._burst, self._tokens + (now - self._last) * self._rate)
        self._last = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False

    @property
    def retry_after_sec(self) -> float:
        return 0.0 if self._rate <= 0 else max(0.0, (1.0 - self._tokens) / self._rate)


class ClientTakes:
    """Concurrent takes per remote address, across all of its connections and both transports.

    Only the event loop touches it (no lock needed); entries vanish when their count is zero, so
    it never grows with the number of addresses seen.
    """

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._running: dict[str, int] = {}

    def running(self, client: str) -> int:
        return self._running.get(client, 0)

    def acquire(self, client: str, *, replacing: bool = False) -> None:
        """One more take of ``client``; ``replacing``: it replaces one of the client's takes that is ending (never
        refused for that one: the client's count is back to what it was once that one ends)."""
        count = self._running.get(client, 0)
        if self._limit > 0 and count >= self._limit + (1 if replacing else 0):
            raise ProtocolError(
                ErrorCode.RATE_LIMITED,
                f"this client already runs {count} takes (limit {self._limit}); wait for one to end",
            )
        self._running[client] = count + 1

    def release(self, client: str) -> None:
        count = self._running.get(client, 0) - 1
        if count > 0:
            self._running[client] = count
        else:
            self._running.pop(client, None)

    @contextmanager
    def hold(self, client: str) -> Iterator[None]:
        self.acquire(client)
        try:
            yield
        finally:
            self.release(client)


class ClientRequestRate:
    """A :class:`TokenBucket` per client address for HTTP requests that cost work.

    Bounded: at most ``max_clients`` buckets, the least recently seen forgotten first (a forgotten
    client starts again with a full burst, which only ever errs on the side of letting it in).
    """

    def __init__(
        self, rate: float, burst: int, *, max_clients: int = 10_000, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._rate = rate
        self._burst = burst
        self._max_clients = max(1, max_clients)
        self._clock = clock
        self._buckets: OrderedDict[str, TokenBucket] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self._rate > 0

    def admit(self, client: str) -> float | None:
        """None if the request may go ahead, else the seconds until it may be retried."""
        if not self.enabled:
            return None
        bucket = self._buckets.get(client)
        if bucket is None:
            bucket = self._buckets[client] = TokenBucket(self._rate, self._burst, self._clock)
            if len(self._buckets) > self._max_clients:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(client)
        return None if bucket.take() else bucket.retry_after_sec

    def __len__(self) -> int:
        return len(self._buckets)


class ClientConnections:
    """HTTP requests in progress per client address (a WebSocket counts for as long as it is open).

    A client that opens connections and then stalls (a body that never arrives, a download it never
    reads) holds one entry each until its timeout; the cap keeps one address from holding them all.
    Only the event loop touches it; entries vanish at zero, so it never grows with addresses seen.
    """

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._open: dict[str, int] = {}

    def open(self, client: str) -> int:
        return self._open.get(client, 0)

    def try_acquire(self, client: str) -> bool:
        count = self._open.get(client, 0)
        if self._limit > 0 and count >= self._limit:
            return False
        self._open[client] = count + 1
        return True

    def release(self, client: str) -> None:
        count = self._open.get(client, 0) - 1
        if count > 0:
            self._open[client] = count
        else:
            self._open.pop(client, None)


class ArchiveSlots:
    """Session imports (or exports, or splices being built) in progress: at most ``limit`` at once, one per client
    address.

    Each unpacks or packs whole takes on a worker thread; unbounded, a burst of them would hold every thread
    the event loop hands blocking work to (and the disk) while other clients wait. Refused at once rather than
    queued: ``busy`` (503) when all slots are taken, ``rate_limited`` (429) when the client already has one.
    Only the event loop touches it.
    """

    def __init__(
        self, limit: int, *, doing: str = "imports or exports a session", work: str = "session imports or exports"
    ) -> None:
        self._limit = max(1, limit)
        self._clients: set[str] = set()
        self._doing = doing  # what a client holding a slot does
        self._work = work  # what the slots are for, in the plural

    def __len__(self) -> int:
        return len(self._clients)

    @contextmanager
    def hold(self, client: str) -> Iterator[None]:
        if client in self._clients:
            raise ProtocolError(ErrorCode.RATE_LIMITED, f"this client already {self._doing}; wait for it to finish")
        if len(self._clients) >= self._limit:
            raise ProtocolError(ErrorCode.BUSY, f"{self._limit} {self._work} are in progress; retry shortly")
        self._clients.add(client)
        try:
            yield
        finally:
            self._clients.discard(client)
