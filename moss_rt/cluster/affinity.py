"""Which prompt blocks a replica holds, as far as one front end knows (pure bookkeeping: no Ray, no I/O).

Two sources, because neither alone is enough:

- **reported**: the replica's engine journals every prompt block its cache keeps or gives back
  (engine/kept_digests.py); the router's status poll fetches the changes since its last poll. This is what
  the replica really holds, whichever front end sent the takes, and it forgets evicted blocks.
- **expected**: a take routed here a moment ago is not prefilled (let alone reported) yet, but the next line
  of the same voice should follow it: its keys count as held for a while (:data:`EXPECT_SEC`), until a report
  says otherwise or they expire (the take may have been cancelled before it computed anything).
"""

from __future__ import annotations

import time
from collections import OrderedDict

from moss_rt.engine.kept_digests import DigestDelta
from moss_rt.engine.prompt_cache import PromptKeys
from moss_rt.engine.prompt_names import NamedPrompt

EXPECT_SEC = 30.0  # a queued take may wait this long for a slot before its blocks exist
MAX_EXPECTED = 16384  # keys of takes sent and not yet reported, per replica (oldest forgotten first)


class HeldPrompts:
    def __init__(self) -> None:
        self.epoch = ""
        self.seq = 0
        self.reported: set[bytes] = set()
        self._expected: OrderedDict[bytes, float] = OrderedDict()  # key -> when it stops counting

    @property
    def cursor(self) -> tuple[str, int]:
        """What to hand the replica's next poll (``since(epoch, seq)``)."""
        return self.epoch, self.seq

    def apply(self, delta: DigestDelta) -> None:
        """A poll's answer: the changes since our cursor, or everything it holds now."""
        if delta.full:
            self.reported = set(delta.added)
        else:
            self.reported.difference_update(delta.removed)
            self.reported.update(delta.added)
        for key in delta.added:
            self._expected.pop(key, None)  # reported now: held for as long as reports say so
        for key in delta.removed:
            self._expected.pop(key, None)
        self.epoch, self.seq = delta.epoch, delta.seq

    def expect(self, keys: PromptKeys, now: float | None = None) -> list[bytes]:
        """A take with these prompt keys is being sent here (counted from before its admission, so the next
        line of a burst follows it). Returns the keys this made expected, for :meth:`unexpect`."""
        until = (time.monotonic() if now is None else now) + EXPECT_SEC
        added = []
        for key in (*keys.full, *((keys.whole,) if keys.whole is not None else ())):
            if key not in self.reported:
                if key not in self._expected:
                    added.append(key)
                self._expected[key] = until
                self._expected.move_to_end(key)
        while len(self._expected) > MAX_EXPECTED:
            self._expected.popitem(last=False)
        return added

    def unexpect(self, keys: list[bytes]) -> None:
        """The take :meth:`expect` was told of did not go here after all (refused, or the replica was lost)."""
        for key in keys:
            self._expected.pop(key, None)

    def forget(self) -> None:
        """The replica restarted: its cache is empty, and its journal has a new epoch."""
        self.epoch, self.seq = "", 0
        self.reported.clear()
        self._expected.clear()

    def __len__(self) -> int:
        return len(self.reported)

    def specific_rows(self, prompt: NamedPrompt, now: float | None = None) -> int:
        """Rows of the prompt's longest held run beyond its generic opening (0: nothing that sets it apart)."""
        now = time.monotonic() if now is None else now
        keys = prompt.keys
        run = 0
        for key in keys.full:
            if not self._holds(key, now):
                break
            run += 1
        rows = run * prompt.block_size
        if run == len(keys.full) and keys.whole is not None and self._holds(keys.whole, now):
            rows = keys.length
        return max(0, rows - prompt.generic_blocks * prompt.block_size)

    def _holds(self, key: bytes, now: float) -> bool:
        if key in self.reported:
            return True
        until = self._expected.get(key)
        if until is None:
            return False
        if until < now:
            del self._expected[key]
            return False
        return True
