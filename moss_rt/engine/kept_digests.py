"""The keys an engine's prompt cache keeps, readable from another thread as deltas (for a cluster's router).

A cluster front end routes a new take to the replica that already keeps the longest run of its prompt blocks
(docs/cluster.md). It learns what each replica keeps by polling: it hands back the cursor of its last answer
(``epoch``, ``seq``) and gets the keys added and removed since, or, when its cursor is too old or from another
epoch (the replica restarted, or its cache was cleared), everything kept. Keys are the prompt cache's own
(:func:`moss_rt.engine.prompt_cache.prompt_keys`): 16-byte digests, no rows, no tensors.

The prompt cache records into this on the engine's worker thread; the replica reads it on its event loop, so
every method takes one lock (held for a set operation or a walk over the changes since a poll).
"""

from __future__ import annotations

import threading
import uuid
from collections import deque
from dataclasses import dataclass

# Changes remembered for deltas. A poller that fell further behind gets a full snapshot instead; at two polls a
# second this covers far more churn than a replica can make (a few thousand blocks a second at most).
MAX_CHANGES = 65536


@dataclass(frozen=True)
class DigestDelta:
    """What changed since a cursor. ``full``: ``added`` is every key kept now (forget what you knew)."""

    epoch: str
    seq: int
    full: bool
    added: tuple[bytes, ...]
    removed: tuple[bytes, ...] = ()


class KeptDigests:
    def __init__(self, max_changes: int = MAX_CHANGES) -> None:
        self._lock = threading.Lock()
        self._epoch = uuid.uuid4().hex[:12]
        self._seq = 0
        self._held: set[bytes] = set()
        self._changes: deque[tuple[int, bytes, bool]] = deque(maxlen=max_changes)  # (seq, key, added)

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def add(self, key: bytes) -> None:
        with self._lock:
            if key not in self._held:
                self._held.add(key)
                self._record(key, True)

    def discard(self, key: bytes) -> None:
        with self._lock:
            if key in self._held:
                self._held.discard(key)
                self._record(key, False)

    def clear(self) -> None:
        """Everything dropped: a new epoch, so every poller takes the (empty) snapshot."""
        with self._lock:
            self._held.clear()
            self._changes.clear()
            self._epoch = uuid.uuid4().hex[:12]
            self._seq = 0

    def since(self, epoch: str = "", seq: int = 0) -> DigestDelta:
        """The changes after cursor (``epoch``, ``seq``), net of each other; a full snapshot when the cursor is
        of another epoch or older than the changes remembered."""
        with self._lock:
            oldest = self._changes[0][0] if self._changes else self._seq + 1
            if epoch != self._epoch or seq > self._seq or seq < oldest - 1:
                return DigestDelta(self._epoch, self._seq, True, tuple(self._held))
            last: dict[bytes, bool] = {}
            for change_seq, key, added in reversed(self._changes):
                if change_seq <= seq:
                    break
                last.setdefault(key, added)  # the newest change of a key is the one that holds
            added_keys = tuple(k for k, a in last.items() if a)
            removed_keys = tuple(k for k, a in last.items() if not a)
            return DigestDelta(self._epoch, self._seq, False, added_keys, removed_keys)

    def _record(self, key: bytes, added: bool) -> None:
        self._seq += 1
        self._changes.append((self._seq, key, added))
