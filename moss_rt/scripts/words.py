"""Word timing of a script's lines: aligned as each line is rendered, read back (or aligned on demand) for an export.

A line's words are its take's, kept with the take in the session store (``take_words``) and timed from the take's
sample 0, exactly as the export places the take's stored audio in the mix (a retake from a frame is stored whole:
its parent's kept frames, then its own, and so are its words: the parent's that end before the branch, then its
own). So the export's captions by word are the stored words moved to the line's place
(:func:`~moss_rt.scripts.timeline.word_captions`).

- **At render**: once a line's take is stored (and its engine place given back), its words are aligned from the
  stored audio and kept; the line's render ends after that, so a script that is ``done`` exports at once. A take
  accepted for a line is aligned in the background if it has no words yet.
- **At export**: every placed line's stored words; a line whose take has none (made before the server had an
  aligner, accepted a moment ago, or its render stopped by a restart before its words) is aligned on demand. The
  export waits ``EXPORT_WAIT_SEC`` at most: lines not aligned by then get one caption cue each in this export, and
  their alignments go on, so the next export has them.
- **No aligner** (``--aligner none``): no words; captions by word fall back to one cue per line.

Every alignment here goes through :func:`~moss_rt.web.words.stored_take_words` (the session take routes' own: the
aligner's workers, once per take), at most ``max(2, aligner workers)`` at once for all scripts together, so batch
renders never crowd the aligner's queue that streaming takes share. Tasks started here are the service's
(``spawn``), cancelled when it closes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from moss_rt.align.base import WordTime
from moss_rt.protocol import ProtocolError
from moss_rt.scripts.timeline import Placed
from moss_rt.session_records import short_id
from moss_rt.session_store import SessionStore
from moss_rt.web.state import ServiceState
from moss_rt.web.words import read_stored_words, stored_take_words

log = logging.getLogger(__name__)

EXPORT_WAIT_SEC = 30.0  # an export waits this long at most for lines aligned on demand (they go on afterwards)
MIN_ALIGNING = 2

Spawn = Callable[[Coroutine[Any, Any, Any], str], "asyncio.Task[Any]"]


class LineWords:
    def __init__(self, state: ServiceState, sessions: SessionStore, spawn: Spawn) -> None:
        self._state = state
        self._sessions = sessions
        self._spawn = spawn
        workers = state.aligner.aligner.workers if state.aligner is not None else 1
        self._slots = asyncio.Semaphore(max(MIN_ALIGNING, workers))
        self._aligning: dict[str, asyncio.Task[list[WordTime] | None]] = {}  # by take id: one per take

    @property
    def enabled(self) -> bool:
        return self._state.aligner is not None

    async def after_render(self, session_id: str, take_id: str) -> None:
        """Align and keep the words of a line's take just stored. Never fails the line: without words its
        export aligns it on demand."""
        if self.enabled:
            await self._task(session_id, take_id)  # the one alignment of the take, should an export want it too

    def in_background(self, session_id: str, take_id: str) -> None:
        """Align a line's take (one accepted for it) without anyone waiting; a no-op when it has words."""
        if self.enabled:
            self._task(session_id, take_id)

    async def of_lines(self, session_id: str, placed: Sequence[Placed]) -> dict[int, list[WordTime]]:
        """The words of each placed line's take, by line number: stored, else aligned now (see the module
        docstring). Lines left without words are not in the answer."""
        takes = {p.cue.number: p.audio.take_id for p in placed}
        out = await asyncio.to_thread(self._read_all, session_id, takes)
        missing = {n: take_id for n, take_id in takes.items() if n not in out}
        if not missing or not self.enabled:
            return out
        tasks = {n: self._task(session_id, take_id) for n, take_id in missing.items()}
        await asyncio.wait(tasks.values(), timeout=EXPORT_WAIT_SEC)
        late = 0
        for number, task in tasks.items():
            if not task.done():
                late += 1
            elif not task.cancelled() and task.exception() is None and (words := task.result()) is not None:
                out[number] = words
        if late:
            log.warning(
                "export of session %s: %d line(s) not aligned within %.0f s get line cues this time",
                short_id(session_id), late, EXPORT_WAIT_SEC,
            )  # fmt: skip
        return out

    # ------------------------------------------------------------------ internals

    def _read_all(self, session_id: str, takes: dict[int, str]) -> dict[int, list[WordTime]]:
        out: dict[int, list[WordTime]] = {}
        for number, take_id in takes.items():
            try:
                words = read_stored_words(self._sessions, session_id, take_id)
            except ProtocolError:  # deleted since the export checked it: the line keeps its line cue
                continue
            if words is not None:
                out[number] = words
        return out

    def _task(self, session_id: str, take_id: str) -> asyncio.Task[list[WordTime] | None]:
        task = self._aligning.get(take_id)
        if task is None:
            task = self._spawn(self._align(session_id, take_id), f"line-words-{take_id}")
            self._aligning[take_id] = task
            task.add_done_callback(lambda _t: self._aligning.pop(take_id, None))
        return task

    async def _align(self, session_id: str, take_id: str) -> list[WordTime] | None:
        """The take's words (aligned and kept when they were not), or None when that could not be done."""
        try:
            async with self._slots:
                take = await asyncio.to_thread(self._sessions.get_take, session_id, take_id)
                return await stored_take_words(self._state, session_id, take)
        except asyncio.CancelledError:
            raise
        except ProtocolError as err:  # the take or the session was deleted meanwhile, or the aligner went away
            log.info("words of take %s: %s", take_id, err.message)
        except Exception:  # words are an extra: a failure here must never cost the line or the export
            log.exception("words of take %s could not be aligned", take_id)
        return None
