"""A script's events for its server-sent-event listeners: numbered, in order, replayable for a while.

Every event gets the next id of its log (``<log>-<n>``; the log's own token changes when the job is loaded again,
e.g. after a restart). The last :data:`KEPT_EVENTS` are kept, so a listener that reconnects with ``Last-Event-ID``
gets what it missed, in order; one whose id is unknown (too old, another server life) gets a ``state`` snapshot
first instead. Each listener has a bounded queue: one that does not keep up is let go (its stream ends, and its
reconnect resumes from its last id), never buffered without bound.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections import deque
from dataclasses import dataclass
from typing import Any

KEPT_EVENTS = 1024
LISTENER_QUEUE = 256


@dataclass(frozen=True)
class Event:
    id: str
    kind: str  # progress | line | done | error | state
    data: dict[str, Any]

    def encode(self) -> bytes:
        """The event in the text/event-stream format (one ``data:`` line: the JSON has no newline)."""
        body = json.dumps(self.data, separators=(",", ":"), ensure_ascii=False)
        return f"id: {self.id}\nevent: {self.kind}\ndata: {body}\n\n".encode()


class Listener:
    """One stream's view of the log: events to send, in order; ``ended`` once the log closed or it fell behind."""

    def __init__(self, log: EventLog) -> None:
        self._log = log
        self._queue: deque[Event] = deque()
        self._wake = asyncio.Event()
        self.ended = False
        self.lagged = False

    def push(self, event: Event) -> None:
        if self.ended:
            return
        if len(self._queue) >= LISTENER_QUEUE:
            self.lagged = True
            self.end()
            return
        self._queue.append(event)
        self._wake.set()

    def end(self) -> None:
        self.ended = True
        self._wake.set()

    async def next(self, wait_sec: float) -> Event | None:
        """The next event; None when ``wait_sec`` passed first (time for a keep-alive) or the listener ended."""
        while not self._queue:
            if self.ended:
                return None
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), wait_sec)
            except TimeoutError:
                return None
        return self._queue.popleft()

    def close(self) -> None:
        self.end()
        self._log.unsubscribe(self)


class EventLog:
    def __init__(self, kept: int = KEPT_EVENTS) -> None:
        self._token = secrets.token_hex(4)
        self._seq = 0
        self._kept: deque[Event] = deque(maxlen=kept)
        self._listeners: set[Listener] = set()
        self.closed = False

    @property
    def last_id(self) -> str:
        return f"{self._token}-{self._seq}"

    @property
    def listeners(self) -> int:
        return len(self._listeners)

    def emit(self, kind: str, data: dict[str, Any]) -> Event:
        self._seq += 1
        event = Event(f"{self._token}-{self._seq}", kind, data)
        self._kept.append(event)
        for listener in list(self._listeners):
            listener.push(event)
            if listener.ended:
                self._listeners.discard(listener)
        return event

    def snapshot_event(self, data: dict[str, Any]) -> Event:
        """A ``state`` event carrying the current id (not a new one): a reconnect after it resumes from here."""
        return Event(self.last_id, "state", data)

    def subscribe(self, last_event_id: str | None) -> tuple[Listener, list[Event] | None]:
        """A new listener and the events after ``last_event_id`` (None when they are not all kept: send a
        snapshot instead). Call it with the snapshot taken in the same step (no await in between)."""
        listener = Listener(self)
        if self.closed:
            listener.end()
        else:
            self._listeners.add(listener)
        return listener, self._since(last_event_id)

    def unsubscribe(self, listener: Listener) -> None:
        self._listeners.discard(listener)

    def close(self) -> None:
        """No more events (the script was deleted, or the service is stopping): every stream ends."""
        self.closed = True
        for listener in list(self._listeners):
            listener.end()
        self._listeners.clear()

    def _since(self, last_event_id: str | None) -> list[Event] | None:
        if not last_event_id:
            return None
        token, _, seq_text = last_event_id.strip().partition("-")
        if token != self._token or not seq_text.isdigit():
            return None
        seq = int(seq_text)
        if seq > self._seq:
            return None
        if seq == self._seq:
            return []
        oldest = self._seq - len(self._kept) + 1  # id of the oldest kept event
        if seq + 1 < oldest:
            return None
        return [e for e in self._kept if int(e.id.rsplit("-", 1)[1]) > seq]
