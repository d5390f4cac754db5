"""A trace of the scheduler's rounds, one JSON line each, for diagnosing where a burst's time went (``--round-trace``).

Why: ``/metrics`` has each round part's time summed and bucketed, which says how much but not when. A burst of 64
retakes waits ~70 ms in the engine's queue on an H200 (bench/RESULTS.md, sessions 13-14) and nothing says which rounds
that was: a long admission, a prefill pass, a step held for the codec, a collection of the garbage collector. With a
trace, a bench lines its own timestamps (seek sent, first audio) up with the rounds that ran meanwhile.

Each line: ``t`` (the round's start, ``time.perf_counter()`` seconds: the same clock as a bench's on the same host),
``ms`` (the round), ``parts`` (part -> [wall ms, engine-thread CPU ms]), the takes ``waiting`` / ``preparing`` /
``running`` after it, and what the round did: ``steps`` (0 or 1), ``batch`` (the step's takes), ``admitted``,
``passes`` and ``rows`` (prefill), ``held`` (the step held back for the codec), ``parked`` (bulk codec hand-overs
parked behind a full lane) and ``gc_ms`` (the garbage collector's time on any thread during the round).

Off unless asked for. The file is written on the engine's thread a line at a time (one small write a round, a few
microseconds beside a round's milliseconds: a bench reads the rounds as soon as they ran), and at most ``max_bytes``
are written (the trace then stops, with a last line saying so), so a forgotten trace never fills the disk.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 256 << 20


class RoundTrace:
    def __init__(self, path: str | Path, max_bytes: int = DEFAULT_MAX_BYTES,
                 gc_seconds: Callable[[], float] | None = None) -> None:
        self.path = Path(path)
        self.max_bytes = int(max_bytes)
        self._gc_seconds = gc_seconds  # the collector's total time so far (GcPauses.total_s)
        self._gc_last = gc_seconds() if gc_seconds is not None else 0.0
        self.written = 0
        self._file: IO[str] | None = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8", buffering=1)  # line-buffered
        except OSError as exc:  # a diagnosis aid: the engine serves without it
            log.warning("round trace: cannot write %s (%s); no trace", self.path, exc)
        else:
            log.info("round trace: every scheduling round to %s", self.path)

    @property
    def active(self) -> bool:
        return self._file is not None

    def record(self, line: dict[str, Any]) -> None:
        if self._file is None:
            return
        if self._gc_seconds is not None:
            now = self._gc_seconds()
            line["gc_ms"] = round(1000.0 * (now - self._gc_last), 3)
            self._gc_last = now
        text = json.dumps(line, separators=(",", ":")) + "\n"
        if self.written + len(text) > self.max_bytes:
            self._file.write(json.dumps({"stopped": f"the trace reached {self.max_bytes} bytes"}) + "\n")
            self.close()
            return
        self._file.write(text)
        self.written += len(text)

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:  # pragma: no cover - a full disk at the last flush
                log.warning("round trace: closing %s failed", self.path, exc_info=True)
            self._file = None


def read_trace(path: str | Path) -> list[dict[str, Any]]:
    """The rounds of a trace file (a bench's side), skipping a torn last line."""
    rounds = []
    for text in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            line = json.loads(text)
        except json.JSONDecodeError:
            continue
        if "t" in line:
            rounds.append(line)
    return rounds
